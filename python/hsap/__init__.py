"""hsap: sequence-aware distributed attention over packed rows, from Python.

The core (Layout, Comm, Batch, Plan, the numpy calls) binds libhsap.so through ctypes and
needs only numpy; `hsap.attention`, `hsap.attention_local` and `Comm.from_process_group`
import torch when first used (they live in hsap.torch). See hsap._lib for how libhsap.so is
found ($HSAP_LIBRARY, the copy installed in this package, the system's).
"""

from __future__ import annotations

from typing import Any

from hsap._core import (
    AbortedError,
    Batch,
    Comm,
    CompileError,
    HsapError,
    HsapMemoryError,
    HsapSystemError,
    HsapTimeoutError,
    InternalError,
    InvalidArgumentError,
    InvalidUsageError,
    Layout,
    Partition,
    Plan,
    Slice,
    Traffic,
    UnsupportedError,
    attention_backward_local,
    attention_forward_local,
    get_unique_id,
)
from hsap._lib import library_path, lib as _load

__version__ = "0.1.0"

__all__ = [
    "AbortedError", "Batch", "Comm", "CompileError", "HsapError", "HsapMemoryError",
    "HsapSystemError", "HsapTimeoutError", "InternalError", "InvalidArgumentError",
    "InvalidUsageError", "Layout", "Partition", "Plan", "Slice", "Traffic", "UnsupportedError",
    "attention", "attention_backward_local", "attention_forward_local", "attention_local",
    "get_unique_id", "library_path", "StepKey", "current_key", "cu_seqlens_from_position_ids",
    "mask_spec", "varlen_attention", "sdpa_varlen", "shard",
]

_load()  # find libhsap.so and check its ABI version at import

_TORCH_NAMES = ("attention", "attention_local", "sdpa_varlen", "shard")
_STEP_NAMES = ("StepKey", "current_key", "cu_seqlens_from_position_ids", "mask_spec")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from hsap import torch as _torch

        return getattr(_torch, name)
    if name in _STEP_NAMES:
        from hsap import step as _step

        return getattr(_step, name)
    if name == "varlen_attention":
        from hsap.varlen import varlen_attention

        return varlen_attention
    raise AttributeError(f"module 'hsap' has no attribute {name!r}")
