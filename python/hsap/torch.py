"""PyTorch pieces of hsap: autograd functions over the C ABI, communicators from
torch.distributed process groups, and PyTorch's own per-document attention as reference.

Tensors are packed rows [tokens, heads, head_dim] (flash_attn_varlen_func's layout). The
calls read and write the tensors' memory in place: contiguous CPU tensors with a host
communicator; CUDA tensors with a CUDA communicator, whose kernels are enqueued on the CUDA
stream current at each call (hsapAttentionForwardOnStream / BackwardOnStream, as NCCL takes a
stream per call; the call returns once enqueued). Non-contiguous inputs are made contiguous
first (a copy).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hsap import _core
from hsap._core import Batch, Comm, Layout, array_ref

__all__ = ["attention", "attention_local", "comm_from_process_group", "sdpa_varlen", "shard"]


def comm_from_process_group(group: Any = None, backend: str | None = None,
                            timeout_ms: int = 0, num_threads: int = 0) -> Comm:
    """See hsap.Comm.from_process_group."""
    import torch.distributed as dist

    group_backend = str(dist.get_backend(group))
    if backend is None:
        backend = "cuda" if group_backend == "nccl" else "host"
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    # The id travels as a uint8 tensor on the group's own device kind (NCCL: CUDA only).
    device = (torch.device("cuda", torch.cuda.current_device()) if group_backend == "nccl"
              else torch.device("cpu"))
    token = torch.zeros(128, dtype=torch.uint8, device=device)
    if rank == 0:
        uid = np.frombuffer(_core.get_unique_id(), dtype=np.uint8)
        token.copy_(torch.from_numpy(uid.copy()))
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(token, src=src, group=group)
    stream = torch.cuda.current_stream().cuda_stream if backend == "cuda" else None
    comm = Comm.init_rank(size, token.cpu().numpy().tobytes(), rank, backend=backend,
                          timeout_ms=timeout_ms, num_threads=num_threads, cuda_stream=stream)
    return comm


def _check_device(tensors: Sequence[torch.Tensor], comm: Comm | None) -> None:
    cuda = tensors[0].is_cuda
    if any(t.is_cuda != cuda or t.device != tensors[0].device for t in tensors):
        raise ValueError("hsap: q, k and v must be on one device")
    if comm is None:
        if cuda:
            raise ValueError("hsap: attention_local runs on the host; pass CPU tensors")
        return
    if cuda != comm.is_cuda:
        raise ValueError(f"hsap: {'CUDA' if cuda else 'CPU'} tensors need a "
                         f"{'CUDA' if cuda else 'host'} communicator")


def _stream_of(t: torch.Tensor) -> int | None:
    """The cudaStream_t of the current stream of a CUDA tensor's device (the call runs on
    it); None for a CPU tensor."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _lse_like(q: torch.Tensor) -> torch.Tensor:
    return torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)


class _BatchAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: Batch) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = torch.empty_like(q), _lse_like(q)
        batch.forward_raw(array_ref(q, "q"), array_ref(k, "k"), array_ref(v, "v"),
                          array_ref(out, "out"), lse.data_ptr(), _stream_of(q))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.batch = batch
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ctx.batch.backward_raw(array_ref(dout, "dout"), array_ref(q, "q"), array_ref(k, "k"),
                               array_ref(v, "v"), array_ref(out, "out"), lse.data_ptr(),
                               array_ref(dq, "dq"), array_ref(dk, "dk"), array_ref(dv, "dv"),
                               _stream_of(q))
        return dq, dk, dv, None


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout,
                softmax_scale: float | None, num_threads: int) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = torch.empty_like(q), _lse_like(q)
        _core.forward_local_raw(layout, array_ref(q, "q"), array_ref(k, "k"), array_ref(v, "v"),
                                array_ref(out, "out"), lse.data_ptr(), softmax_scale,
                                num_threads)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.softmax_scale, ctx.num_threads = layout, softmax_scale, num_threads
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _core.backward_local_raw(ctx.layout, array_ref(dout, "dout"), array_ref(q, "q"),
                                 array_ref(k, "k"), array_ref(v, "v"), array_ref(out, "out"),
                                 lse.data_ptr(), array_ref(dq, "dq"), array_ref(dk, "dk"),
                                 array_ref(dv, "dv"), ctx.softmax_scale, ctx.num_threads)
        return dq, dk, dv, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch,
              softmax_scale: float | None = None) -> torch.Tensor:
    """Distributed attention of this rank's shard (collective over the batch's ranks, also
    in backward): q [local_tokens, Hq, D], k/v [local_tokens, Hkv, D] -> out like q.

    The softmax scale is the batch's (Batch(..., softmax_scale=)); softmax_scale here may
    only repeat it. Differentiable in q, k, v; saves out and lse for the backward."""
    if softmax_scale is not None and abs(softmax_scale - batch.softmax_scale) > 1e-7 * abs(
            batch.softmax_scale):
        raise ValueError(f"hsap: softmax_scale {softmax_scale} differs from the batch's "
                         f"{batch.softmax_scale}; set it when creating the Batch")
    _check_device([q, k, v], batch.comm)
    return _BatchAttention.apply(q, k, v, batch)


def attention_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout,
                    softmax_scale: float | None = None, num_threads: int = 0) -> torch.Tensor:
    """Single-device attention over a packed row on the host (the CPU analogue of
    flash_attn_varlen_func): q [T, Hq, D], k/v [T, Hkv, D] -> out like q. Differentiable.
    num_threads 0: every hardware thread."""
    _check_device([q, k, v], None)
    return _LocalAttention.apply(q, k, v, layout, softmax_scale, num_threads)


def shard(row: torch.Tensor, batch: Batch, rank: int | None = None) -> torch.Tensor:
    """The tokens of `rank` (default: this rank) of a full packed row [T, ...], in shard
    order (a copy; differentiable)."""
    index = torch.from_numpy(batch.local_index(rank)).to(row.device)
    return row.index_select(0, index)


def _document_mask(kind: str, param: int, length: int, device: Any) -> torch.Tensor:
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    if kind == "causal":
        return j <= i
    if kind == "full":
        return torch.ones(length, length, dtype=torch.bool, device=device)
    if kind == "prefix_lm":
        return (j <= i) | (j < param)
    if kind == "sliding_window":
        return (j <= i) & (j > i - param)
    raise ValueError(f"hsap: unknown mask kind {kind!r}")


def sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Any,
                mask_kinds: Any = None, params: Any = None,
                softmax_scale: float | None = None) -> torch.Tensor:
    """Reference: PyTorch's scaled_dot_product_attention per document of a packed row
    (same arguments as hsap.Layout), in the inputs' dtype. GQA by repeating K/V heads."""
    cu = [int(x) for x in _core._int64_array(cu_seqlens, "cu_seqlens")]
    num_docs = len(cu) - 1
    kinds = ["causal"] * num_docs if mask_kinds is None else (
        [mask_kinds] * num_docs if isinstance(mask_kinds, str) else list(mask_kinds))
    pars = [0] * num_docs if params is None else (
        [int(params)] * num_docs if np.isscalar(params) else [int(p) for p in params])
    group = q.shape[1] // k.shape[1]
    outs = []
    for d in range(num_docs):
        b, e = cu[d], cu[d + 1]
        if e == b:
            continue
        qd = q[b:e].transpose(0, 1)
        kd = k[b:e].transpose(0, 1).repeat_interleave(group, dim=0)
        vd = v[b:e].transpose(0, 1).repeat_interleave(group, dim=0)
        if kinds[d] == "causal":
            od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=softmax_scale)
        else:
            mask = _document_mask(kinds[d], pars[d], e - b, q.device)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=softmax_scale)
        outs.append(od.transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=0)
