"""Megatron-style PackedSeqParams (THD format) with hsap.

Megatron describes a packed row by `cu_seqlens_q` / `cu_seqlens_kv` (and padded variants
for kernels that need per-document padding: hsap needs none, so they are ignored). This
adapter makes the step key from them and runs core attention on THD tensors:

    key = hsap.integrations.megatron.step_key(packed_seq_params, masks=["causal"])
    tokens = key.dispatch(tokens)                   # this rank's tokens
    out = hsap.integrations.megatron.attention(q, k, v, packed_seq_params)   # [T, H, D]

Any object with cu_seqlens_q (and optionally cu_seqlens_kv) works: Megatron is not imported.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from hsap.step import StepKey, current_key

__all__ = ["attention", "cu_seqlens_of", "step_key"]


def cu_seqlens_of(packed_seq_params: Any) -> np.ndarray:
    """The row's cu_seqlens (unpadded; the padded ones are ignored); self-attention only."""
    cu_q = getattr(packed_seq_params, "cu_seqlens_q", None)
    if cu_q is None:
        raise ValueError("hsap: packed_seq_params has no cu_seqlens_q")
    cu_q = np.asarray(cu_q.detach().cpu() if hasattr(cu_q, "detach") else cu_q, dtype=np.int64)
    cu_kv = getattr(packed_seq_params, "cu_seqlens_kv", None)
    if cu_kv is not None:
        cu_kv = np.asarray(cu_kv.detach().cpu() if hasattr(cu_kv, "detach") else cu_kv,
                           dtype=np.int64)
        if not np.array_equal(cu_q, cu_kv):
            raise NotImplementedError("hsap: cu_seqlens_kv differs from cu_seqlens_q; hsap "
                                      "runs self-attention over one packed row")
    return cu_q


def step_key(packed_seq_params: Any, masks: Iterable[Any] = ("causal",), comm: Any = None,
             group: Any = None, weights: Any = None) -> StepKey:
    """The (cached) step key of the row packed_seq_params describes."""
    comm = comm if comm is not None else StepKey.comm_for(group)
    return StepKey.get(comm, cu_seqlens_of(packed_seq_params), masks, weights=weights,
                       group=group)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_seq_params: Any,
              mask: Any = "causal", softmax_scale: float | None = None,
              key: StepKey | None = None) -> torch.Tensor:
    """Core attention of this rank's tokens: q [T, Hq, D] (or [T, 1, Hq, D], sbhd with one
    row), k/v [T, Hkv, D] -> out like q. The key: `key`, else the current one (`with key:`)
    when it is of this row, else the cached key of this row."""
    squeeze = q.dim() == 4
    if squeeze:
        if q.shape[1] != 1:
            raise ValueError(f"hsap: one packed row: q is [T, 1, H, D]; got {tuple(q.shape)}")
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    cu = cu_seqlens_of(packed_seq_params)
    if key is None:
        cur = current_key()
        key = cur if cur is not None and np.array_equal(cur.cu_seqlens, cu) else StepKey.find(
            None, cu)
    if key is None:
        raise RuntimeError("hsap: no step key for this row; make one with "
                           "hsap.integrations.megatron.step_key(packed_seq_params) and "
                           "dispatch the tokens with it")
    out = key.attention(q, k, v, mask, softmax_scale)
    return out.unsqueeze(1) if squeeze else out
