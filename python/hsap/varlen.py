"""hsap.varlen_attention: flash_attn_varlen_func's vocabulary, distributed.

q, k and v are this rank's tokens of the packed row that cu_seqlens describes (every rank
passes the whole row's cu_seqlens), dispatched by the row's step key (hsap.StepKey); the
call finds that key (the current one, `with key:`, or the cached key of this row) or, when
there is none, makes one for the call's mask (then the tokens must already be in its order:
one rank, or a key made earlier). Differentiable; collective in forward and backward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hsap import _core
from hsap.step import StepKey, current_key

__all__ = ["mask_from_flash_args", "varlen_attention"]


def mask_from_flash_args(causal: bool, window_size: tuple[int, int]) -> Any:
    """hsap's mask for flash-attn's (causal, window_size=(left, right)): causal with a left
    window w -> a sliding window of w + 1 tokens (i - w .. i); no window -> causal or full."""
    left, right = (int(x) for x in window_size)
    if causal:
        if right not in (-1, 0):
            raise NotImplementedError(f"hsap: causal attention with window_size right = {right}"
                                      " (only 0 or -1)")
        return "causal" if left < 0 else ("sliding_window", left + 1)
    if left >= 0 or right >= 0:
        raise NotImplementedError("hsap: windows on bidirectional attention (causal=False "
                                  f"with window_size {tuple(window_size)}) are not supported")
    return "full"


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Any,
                     cu_seqlens_k: Any, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, dropout_p: float = 0.0,
                     softmax_scale: float | None = None, causal: bool = False,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     alibi_slopes: Any = None, deterministic: bool = False,
                     return_attn_probs: bool = False, group: Any = None,
                     key: StepKey | None = None) -> torch.Tensor:
    """Distributed flash_attn_varlen_func: q [local, Hq, D], k/v [local, Hkv, D] -> out
    like q. max_seqlen_* and deterministic are accepted and unused (hsap's host backend is
    deterministic); dropout, softcap, ALiBi and returned probabilities are refused."""
    if dropout_p:
        raise ValueError(f"hsap: dropout_p = {dropout_p} is not supported")
    if softcap:
        raise NotImplementedError("hsap: softcap is not supported")
    if alibi_slopes is not None:
        raise NotImplementedError("hsap: ALiBi is not supported")
    if return_attn_probs:
        raise ValueError("hsap: returns no attention probabilities")
    cu = _core._int64_array(cu_seqlens_q, "cu_seqlens_q")
    if not np.array_equal(cu, _core._int64_array(cu_seqlens_k, "cu_seqlens_k")):
        raise NotImplementedError("hsap: cu_seqlens_k differs from cu_seqlens_q; hsap runs "
                                  "self-attention over one packed row")
    mask = mask_from_flash_args(causal, window_size)
    if key is None:
        cur = current_key()
        key = cur if cur is not None and np.array_equal(cur.cu_seqlens, cu) else None
    if key is None:
        comm = StepKey.comm_for(group) if group is not None or _distributed() else None
        key = StepKey.find(comm, cu)
        if key is None:
            if comm is None:
                raise RuntimeError("hsap: no step key for this row and no torch.distributed "
                                   "group; make one with hsap.StepKey.get(comm, cu_seqlens, "
                                   "masks) and dispatch the tokens with it")
            key = StepKey.get(comm, cu, [mask], group=group)
    return key.attention(q, k, v, mask, softmax_scale)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
