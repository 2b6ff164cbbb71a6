"""What a training step's key costs from Python, beside the step's attention: the ranks as
processes of one machine (the host backend, as under torchrun on CPUs), a new packed row each
step. A step's key is hsap.StepKey (the row's layouts, the partition shared by its masks, the
index maps) and StepKey.prepare (every mask's batch in one collective call); the attention is
a forward and a backward of every mask's batch (one layer per mask) through hsap's autograd
function. A phase's time runs from the moment the last rank began it to the moment the last
rank ended it; the median and 90th percentile over the steps are printed (after a warm-up
step that compiles the kernels). bench/hsap_step_key_perf.cc measures the same in C with
ranks as threads.

    python bench/step_key_perf.py --ranks 4 --docs 64 --tokens 1024 --steps 30
"""

import argparse
import multiprocessing as mp
import time

import numpy as np


def _row(rng, tokens, docs):
    w = rng.lognormal(0.0, 1.0, docs)
    lengths = 1 + np.floor(w / w.sum() * (tokens - docs)).astype(np.int64)
    lengths[-1] += tokens - lengths.sum()
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _rank(rank, args, uid, barrier, results):
    import torch

    import hsap

    torch.set_num_threads(1)
    comm = hsap.Comm.init_rank(args.ranks, uid, rank, backend="host", num_threads=1)
    masks = ["causal"] + [("sliding_window", args.window)] * (args.window > 0)
    rng = np.random.default_rng(args.seed)  # the same rows on every rank
    gen = torch.Generator().manual_seed(rank)
    spans = []
    for _ in range(args.steps + 1):
        cu = _row(rng, args.tokens, args.docs)
        barrier.wait()
        t0 = time.perf_counter()
        key = hsap.StepKey(comm, cu, masks)
        key.prepare(args.heads_q, args.heads_kv, args.dim, [torch.float32])
        t1 = time.perf_counter()
        n = key.local_tokens
        q = torch.randn(n, args.heads_q, args.dim, generator=gen, requires_grad=True)
        k = torch.randn(n, args.heads_kv, args.dim, generator=gen, requires_grad=True)
        v = torch.randn(n, args.heads_kv, args.dim, generator=gen, requires_grad=True)
        barrier.wait()
        t2 = time.perf_counter()
        for mask in masks:
            key.attention(q, k, v, mask).sum().backward()
        t3 = time.perf_counter()
        spans.append((t0, t1, t2, t3))
        key.close()
    comm.close()
    results.put((rank, spans))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--window", type=int, default=32, help="sliding-window mask (0: causal only)")
    p.add_argument("--heads-q", type=int, default=4)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    import hsap

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.ranks), ctx.Queue()
    uid = hsap.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, args, uid, barrier, results))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    spans = dict(results.get() for _ in procs)
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"a rank exited with {proc.exitcode}")

    def phase(b, e):  # ms from the last rank's start to the last rank's end, per step
        return [1e3 * (max(spans[r][s][e] for r in spans) - max(spans[r][s][b] for r in spans))
                for s in range(1, args.steps + 1)]

    print(f"# step_key_perf.py: host backend, {args.ranks} processes, {args.docs} documents, "
          f"{args.tokens} tokens, masks causal" + (f" + sliding window {args.window}"
                                                    if args.window else "")
          + f", heads {args.heads_q}/{args.heads_kv}, head dim {args.dim}, fp32, "
          f"{args.steps} steps (+1 warm-up), a new row each step")
    print(f"# {'what':<58} {'median (ms)':>12} {'p90 (ms)':>10}")
    rows = [("key: hsap.StepKey + prepare (every mask's batch, one call)", phase(0, 1)),
            ("attention: forward + backward of every mask's batch", phase(2, 3))]
    for name, ms in rows:
        print(f"  {name:<58} {np.median(ms):12.3f} {np.percentile(ms, 90):10.3f}")
    key, att = np.median(rows[0][1]), np.median(rows[1][1])
    print(f"# key / attention: {100 * key / att:.1f} %; target (issue 27): key < 2 ms for 4 "
          "ranks and 64 documents")


if __name__ == "__main__":
    main()
