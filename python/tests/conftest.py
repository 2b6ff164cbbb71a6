"""Shared set-up of the hsap Python tests.

libhsap.so: $HSAP_LIBRARY when set, else the checkout's build/libhsap.so when the package
has no copy of its own (running from the source tree), else the installed package's.
JIT kernels are cached in $HSAP_CACHE_DIR (default: build/jit-cache of the checkout).
"""

import importlib.util
import os
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("hsap") is None:  # not installed: the checkout's package
    sys.path.insert(0, str(ROOT / "python"))
_build_lib = ROOT / "build" / "libhsap.so"
if not os.environ.get("HSAP_LIBRARY") and _build_lib.exists():
    spec = importlib.util.find_spec("hsap")
    packaged = spec is not None and spec.origin and Path(spec.origin).with_name("libhsap.so").exists()
    if not packaged:
        os.environ["HSAP_LIBRARY"] = str(_build_lib)
os.environ.setdefault("HSAP_CACHE_DIR", str(ROOT / "build" / "jit-cache"))

KINDS = ("causal", "full", "prefix_lm", "sliding_window")


def random_documents(rng: np.random.Generator, max_len: int = 40):
    """A packed row with every mask kind at least once (so one JIT kernel serves every
    layout of a configuration), in random order, plus a few random documents; params valid
    and random. Returns (cu_seqlens, kinds, params)."""
    kinds = list(KINDS) + [KINDS[i] for i in rng.integers(0, 4, size=rng.integers(0, 4))]
    rng.shuffle(kinds)
    lengths = rng.integers(1, max_len + 1, size=len(kinds))
    params = []
    for kind, length in zip(kinds, lengths):
        if kind == "prefix_lm":
            params.append(int(rng.integers(0, length + 1)))
        elif kind == "sliding_window":
            params.append(int(rng.integers(1, length + 1)))
        else:
            params.append(0)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return cu, kinds, params


@pytest.fixture
def rng(request):
    # A seed per test (stable across runs) so a failure can be reproduced alone.
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def assert_close(name, x, ref64, naive):
    """The project's tolerance rule: |x - ref| <= 2 * max|naive - ref| + a few fp32 rounding
    units of the reference's magnitude, where ref is the float64 reference and naive the
    same computation by PyTorch in the storage precision."""
    import torch

    ref64 = ref64.detach().double()
    err = (x.detach().double() - ref64).abs().max().item()
    naive_err = (naive.detach().double() - ref64).abs().max().item()
    scale = ref64.abs().max().item() + 1.0
    tol = 2.0 * naive_err + 8.0 * torch.finfo(torch.float32).eps * scale
    assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g} (naive {naive_err:.3g})"
