"""Trains a small decoder-only transformer on packed rows of variable-length documents, with
hsap context parallelism over torch.distributed processes, and checks it against the same
model trained in one process with PyTorch's own attention (per-document SDPA).

    torchrun --nproc-per-node 4 examples/train_packed.py   # hsap over 4 CPU processes, then
                                                          # the reference on rank 0, the PNG
    python examples/train_packed.py                       # the reference alone

The task has a known answer: each document is BOS x1..xn SEP x1..xn with n in [3, 12]
distinct symbols; the model is scored on predicting the copy (x1..xn after SEP), which is
fully determined by the document, so a trained model reaches 100% on it. Documents never see
each other (causal mask per document); positions (RoPE) restart at each document.

Context parallelism: every process builds the same packed row, hsap.Batch partitions it by
attention work, each process runs embeddings, MLPs, norms and the loss on its own token
shard only, attention runs through hsap.attention (K/V moves between the processes), and
the gradients of the replicated weights are summed with torch.distributed.all_reduce. The
loss is the mean over the row's answer tokens, so the sum of the shards' gradients is the
gradient of the whole row: the two runs compute the same function, and their loss curves
agree up to floating-point rounding (summation order, the attention kernels).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from pngplot import plot_losses  # noqa: E402  (the PNG writer docs/figures share)

try:
    import hsap  # installed: pip install ./python
except ImportError:  # a source checkout: python/ and the library of scripts/build.sh
    _root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(_root / "python"))
    if (_root / "build" / "libhsap.so").exists():
        os.environ.setdefault("HSAP_LIBRARY", str(_root / "build" / "libhsap.so"))
    import hsap

BOS, SEP, NUM_SYMBOLS = 0, 1, 30
VOCAB = NUM_SYMBOLS + 2


# ---- data ------------------------------------------------------------------------------


def packed_row(rng: np.random.Generator, row_tokens: int):
    """One packed row of whole documents, at most row_tokens tokens: (ids, targets,
    cu_seqlens, positions). targets[t] is the token after t where it is part of a copy,
    else -1 (not scored)."""
    ids, targets, positions, cu = [], [], [], [0]
    while True:
        n = int(rng.integers(3, 13))
        if cu[-1] + 2 * n + 2 > row_tokens:
            break
        symbols = (rng.permutation(NUM_SYMBOLS)[:n] + 2).tolist()
        doc = [BOS] + symbols + [SEP] + symbols
        ids += doc
        targets += [-1] * (n + 1) + symbols + [-1]  # position of SEP predicts x1, ...
        positions += list(range(len(doc)))
        cu.append(cu[-1] + len(doc))
    return (torch.tensor(ids), torch.tensor(targets), np.array(cu, dtype=np.int64),
            torch.tensor(positions))


# ---- model -----------------------------------------------------------------------------


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [tokens, heads, dim] by each token's position in its document."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, d_model: int, heads_q: int, heads_kv: int):
        super().__init__()
        self.hq, self.hkv, self.dim = heads_q, heads_kv, d_model // heads_q
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, (heads_q + 2 * heads_kv) * self.dim, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x, positions, attend):
        t = x.shape[0]
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([self.hq * self.dim, self.hkv * self.dim, self.hkv * self.dim], -1)
        q = rope(q.reshape(t, self.hq, self.dim), positions)
        k = rope(k.reshape(t, self.hkv, self.dim), positions)
        v = v.reshape(t, self.hkv, self.dim)
        x = x + self.proj(attend(q, k, v).reshape(t, -1))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """A decoder-only transformer over [tokens] of a packed row (or a shard of one)."""

    def __init__(self, d_model=128, layers=2, heads_q=4, heads_kv=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads_q, heads_kv) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, ids, positions, attend):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.head(self.norm(x))


# ---- training --------------------------------------------------------------------------


def train(args, dist_rank: int | None, world: int) -> dict:
    """Trains one model; with dist_rank set, on this process's shard through hsap."""
    torch.manual_seed(args.seed)
    model = Decoder(args.d_model, args.layers, args.heads_q, args.heads_kv)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    comm = None
    if dist_rank is not None:
        import torch.distributed as dist

        comm = hsap.Comm.from_process_group(num_threads=1)
    losses, accs, kv_bytes = [], [], []
    tokens, start = 0, time.perf_counter()
    head_dim = args.d_model // args.heads_q
    for step in range(args.steps):
        # Linear warm-up over 20 steps, then cosine decay to a tenth.
        decay = 0.55 + 0.45 * math.cos(math.pi * step / max(args.steps - 1, 1))
        lr = args.lr * min(1.0, (step + 1) / 20) * decay
        for group in opt.param_groups:
            group["lr"] = lr
        ids, targets, cu, positions = packed_row(rng, args.row_tokens)
        scored = int((targets >= 0).sum())
        if comm is None:
            def attend(q, k, v):
                return hsap.sdpa_varlen(q, k, v, cu)  # causal per document

            logits = model(ids, positions, attend)
            mine = targets
        else:
            with hsap.Layout(cu) as layout:
                batch = hsap.Batch(comm, layout, args.heads_q, args.heads_kv, head_dim,
                                   torch.float32)
            index = torch.from_numpy(batch.local_index())
            logits = model(ids[index], positions[index],
                           lambda q, k, v: hsap.attention(q, k, v, batch))
            mine = targets[index]
        keep = mine >= 0
        loss = F.cross_entropy(logits[keep], mine[keep], reduction="sum") / scored
        correct = (logits[keep].argmax(-1) == mine[keep]).sum()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        stats = torch.stack([loss.detach(), correct.float()])
        if comm is not None:
            # The replicated weights: every shard's gradient is part of the row's.
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            t = batch.traffic
            # One batch serves every layer with the same schedule: each layer's attention
            # moves what the last call moved. K/V (and dK/dV partials) sent by all ranks:
            moved = torch.tensor([float(args.layers * (t.forward_sent + t.backward_sent))])
            dist.all_reduce(stats)
            dist.all_reduce(moved)
            kv_bytes.append(int(moved.item()))
            batch.close()
        opt.step()
        losses.append(stats[0].item())
        accs.append(stats[1].item() / scored)
        tokens += len(ids)
        if (dist_rank in (None, 0)) and (step % args.log_every == 0 or step == args.steps - 1):
            extra = f"  K/V bytes/step {kv_bytes[-1]:,}" if kv_bytes else ""
            print(f"[{'hsap' if comm else 'sdpa'}] step {step:4d}  loss {losses[-1]:.4f}  "
                  f"copy accuracy {accs[-1]:.3f}{extra}", flush=True)
    elapsed = time.perf_counter() - start
    if comm is not None:
        comm.close()
    return {"loss": losses, "accuracy": accs, "kv_bytes": kv_bytes,
            "tokens_per_s": tokens / elapsed, "seconds": elapsed}


# ---- main ------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--row-tokens", type=int, default=512, help="tokens per packed row (max)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads-q", type=int, default=4)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--out-dir", default="examples/out", help="loss curves (JSON) and the PNG")
    p.add_argument("--target-accuracy", type=float, default=0.99,
                   help="copy accuracy the run must reach (mean of the last 10 steps)")
    p.add_argument("--loss-rtol", type=float, default=5e-3,
                   help="every step: |loss_hsap - loss_sdpa| <= rtol * loss_sdpa + atol")
    p.add_argument("--loss-atol", type=float, default=2e-4)
    p.add_argument("--early-rtol", type=float, default=1e-5,
                   help="the first 50 steps: |loss_hsap - loss_sdpa| <= early_rtol * loss_sdpa")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1 if world > 1 else max(torch.get_num_threads(), 1))

    if world == 1:
        ref = train(args, None, 1)
        print(f"[sdpa] {ref['tokens_per_s']:,.0f} tokens/s ({ref['seconds']:.1f} s)")
        (out_dir / "loss_sdpa.json").write_text(json.dumps(ref))
        return 0 if np.mean(ref["accuracy"][-10:]) >= args.target_accuracy else 1

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run = train(args, rank, world)
    ok = True
    if rank == 0:
        print(f"[hsap] {world} processes: {run['tokens_per_s']:,.0f} tokens/s "
              f"({run['seconds']:.1f} s), K/V bytes per step (all ranks, all layers) "
              f"mean {np.mean(run['kv_bytes']):,.0f}")
        # The reference: the same model, data and seed in this one process.
        ref = train(args, None, 1)
        print(f"[sdpa] 1 process: {ref['tokens_per_s']:,.0f} tokens/s ({ref['seconds']:.1f} s)")
        # Both runs compute the same function; they differ by fp32 rounding (attention
        # kernels, summation order), which training amplifies slowly: at rounding level
        # early, within a small tolerance over the whole run.
        a, b = np.asarray(run["loss"]), np.asarray(ref["loss"])
        diff = np.abs(a - b)
        rel = diff / np.abs(b)
        early_ok = bool((rel[:50] <= args.early_rtol).all())
        all_ok = bool((diff <= args.loss_rtol * np.abs(b) + args.loss_atol).all())
        acc = float(np.mean(run["accuracy"][-10:]))
        print(f"loss curves: first 50 steps max relative difference {rel[:50].max():.1e} "
              f"(rule <= {args.early_rtol:.0e}: {'ok' if early_ok else 'FAILED'}); all "
              f"{len(a)} steps max |difference| {diff.max():.1e} (step {diff.argmax()}), max "
              f"relative {rel.max():.1e} (rule <= {args.loss_rtol:.0e} * loss + "
              f"{args.loss_atol:.0e}: {'ok' if all_ok else 'FAILED'})")
        print(f"copy accuracy (last 10 steps): hsap {acc:.4f}, sdpa "
              f"{np.mean(ref['accuracy'][-10:]):.4f}, target {args.target_accuracy}")
        ok = early_ok and all_ok and acc >= args.target_accuracy
        (out_dir / "loss_hsap.json").write_text(json.dumps(run))
        (out_dir / "loss_sdpa.json").write_text(json.dumps(ref))
        png = out_dir / "loss_curves.png"
        plot_losses(png, [("PYTORCH SDPA, 1 PROCESS", ref["loss"], (230, 120, 20)),
                          (f"HSAP, {world} PROCESSES", run["loss"], (20, 60, 200))],
                    f"TRAINING LOSS (LOG), {args.layers} LAYERS, GQA {args.heads_q}/{args.heads_kv}")
        print(f"wrote {png}; {'OK' if ok else 'FAILED'}")
    flag = torch.tensor([1 if ok else 0])
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
