"""HuggingFace transformers models with attn_implementation="hsap" under torchrun (4
processes, gloo, the host backend): tiny Llama (full causal, GQA), Qwen2 with a hybrid
layer mix (full + sliding window) and with sliding-window layers only, fp32 and bf16
autocast, against one process with PyTorch's per-document SDPA (hf_worker.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from test_multiprocess import _WHY_NOT, _env  # noqa: E402

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
CASES = ["llama", "qwen2_hybrid", "qwen2_sliding", "llama_bf16", "qwen2_hybrid_bf16"]


@pytest.mark.skipif(bool(_WHY_NOT), reason=f"no host ranks in processes: {_WHY_NOT}")
def test_hf_models_match_one_process_reference():
    nproc = 4
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "hf_worker.py"), *CASES]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    for case in CASES:
        for r in range(nproc):
            assert f"RANK {r} HF OK {case} " in proc.stdout, log


@pytest.mark.skipif(bool(_WHY_NOT), reason=f"no host ranks in processes: {_WHY_NOT}")
def test_hybrid_example_runs_a_few_steps(tmp_path):
    """examples/hf_hybrid_cp.py (hf_llama_cp.py with full + sliding-window layers) for 3
    steps on 2 processes: its own check against the one-process run must pass."""
    example = HERE.parents[1] / "examples" / "hf_hybrid_cp.py"
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node=2", str(example), "--steps", "3",
           "--log-every", "0", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "OK" in proc.stdout and "step key" in proc.stdout, log
