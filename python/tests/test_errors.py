"""Bad arguments raise hsap.HsapError subclasses carrying hsapGetLastError()."""

import numpy as np
import pytest
import torch

import hsap


def test_layout_errors_name_the_argument():
    with pytest.raises(hsap.InvalidArgumentError, match="cu_seqlens") as info:
        hsap.Layout([0, 5, 3])
    assert info.value.result == 1 and "cu_seqlens" in info.value.message
    assert isinstance(info.value, ValueError)
    with pytest.raises(hsap.InvalidArgumentError, match="window"):
        hsap.Layout([0, 4], "sliding_window", 0)  # a window is at least 1
    with pytest.raises(hsap.InvalidArgumentError, match="prefix"):
        hsap.Layout([0, 4], "prefix_lm", 9)  # a prefix longer than the document
    with pytest.raises(ValueError, match="unknown mask kind"):
        hsap.Layout([0, 4], "diagonal")
    with pytest.raises(ValueError, match="2 mask kinds for 1 documents"):
        hsap.Layout([0, 4], ["causal", "full"])
    with pytest.raises(hsap.InvalidArgumentError):
        hsap.Layout.from_slices(8, [(0, 8, 0, 8, "full"), (0, 4, 0, 4, "causal")])  # overlap


def test_attention_errors():
    layout = hsap.Layout([0, 16])
    q = torch.randn(16, 4, 20)  # head dim 20 is not a multiple of 8
    with pytest.raises(hsap.InvalidArgumentError, match="[Hh]ead"):
        hsap.attention_local(q, q, q, layout)
    q = torch.randn(16, 3, 32)
    k = torch.randn(16, 2, 32)  # 3 query heads over 2 KV heads
    with pytest.raises(hsap.InvalidArgumentError):
        hsap.attention_local(q, k, k, layout)
    q = torch.randn(15, 4, 32)  # one token short of the layout
    with pytest.raises(hsap.InvalidArgumentError):
        hsap.attention_local(q, q, q, layout)
    with pytest.raises(ValueError, match="unsupported dtype"):
        hsap.attention_forward_local(*(np.zeros((16, 4, 32), np.int32),) * 3, layout)


def test_batch_errors_and_handle_lifetimes():
    (comm,) = hsap.Comm.init_all(1)
    layout = hsap.Layout([0, 16])
    with pytest.raises(hsap.InvalidArgumentError, match="head_dim"):
        hsap.Batch(comm, layout, 4, 4, 12, "float32")
    batch = hsap.Batch(comm, layout, 4, 4, 32, "float32")
    with pytest.raises(hsap.InvalidUsageError):
        comm.close()  # a batch still lives on it
    assert not comm.closed
    x = torch.randn(16, 4, 32)
    with pytest.raises(ValueError, match="softmax_scale"):
        hsap.attention(x, x, x, batch, softmax_scale=1.0)
    batch.close()
    batch.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        _ = batch.local_tokens
    comm.close()
    layout.close()
    with pytest.raises(hsap.InvalidArgumentError):
        hsap.Plan.from_json("{not json")


def test_closed_batch_refuses_partition_calls():
    (comm,) = hsap.Comm.init_all(1)
    with hsap.Batch(comm, hsap.Layout([0, 16]), 4, 4, 32, "float32") as batch:
        row = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
        np.testing.assert_array_equal(batch.gather(batch.scatter(row)), row)
    with pytest.raises(ValueError, match="closed"):
        batch.scatter(row)  # the partition belonged to the batch
    comm.close()


def test_core_works_without_importing_torch():
    """The C-level part (layouts, communicators, batches, numpy calls) never imports torch."""
    import subprocess
    import sys

    code = ("import sys, numpy as np, hsap\n"
            "with hsap.Layout([0, 16]) as l:\n"
            "    x = np.ones((16, 4, 32), np.float32)\n"
            "    out, lse = hsap.attention_forward_local(x, x, x, l)\n"
            "    (c,) = hsap.Comm.init_all(1)\n"
            "    with hsap.Batch(c, l, 4, 4, 32, 'float32') as b:\n"
            "        b.forward(x, x, x)\n"
            "    c.close()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    import os
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(hsap.__file__).resolve().parents[1]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
