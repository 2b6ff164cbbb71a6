"""One rank of the multi-process tests (test_multiprocess.py), started by torchrun or by
the test itself. Prints "RANK <r> <MODE> OK ..." on success; exits non-zero otherwise.

Modes: ok (forward/backward on this rank's shard against per-document SDPA),
mismatch (ranks pass different layouts: InvalidUsageError on every rank),
death (rank 1 is killed after batch creation: rank 0's forward fails with a timeout or
abort instead of hanging)."""

import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hsap  # noqa: E402
from conftest import assert_close, random_documents  # noqa: E402


def main(mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout_ms = 3000 if mode == "death" else 60000
    comm = hsap.Comm.from_process_group(timeout_ms=timeout_ms, num_threads=1)
    assert (comm.rank, comm.size, comm.is_cuda) == (rank, world, False)
    rng = np.random.default_rng(7)  # the same row on every rank
    cu, kinds, params = random_documents(rng, max_len=60)
    T = int(cu[-1])
    gen = torch.Generator().manual_seed(3)
    q, g = [torch.randn(T, 4, 32, generator=gen) for _ in range(2)]
    k, v = [torch.randn(T, 2, 32, generator=gen) for _ in range(2)]
    if mode == "mismatch":
        if rank != 0:  # the same tokens with other masks: a valid layout, but not rank 0's
            kinds, params = ["full"] * len(kinds), [0] * len(kinds)
        try:
            hsap.Batch(comm, hsap.Layout(cu, kinds, params), 4, 2, 32, torch.float32)
        except hsap.InvalidUsageError as e:
            print(f"RANK {rank} MISMATCH OK {e.message}", flush=True)
            comm.close()
            dist.destroy_process_group()
            return
        raise SystemExit(f"rank {rank}: no error for a layout mismatch")
    layout = hsap.Layout(cu, kinds, params)
    batch = hsap.Batch(comm, layout, 4, 2, 32, torch.float32)
    qs, ks, vs = [hsap.shard(t, batch).requires_grad_(True) for t in (q, k, v)]
    if mode == "death":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            hsap.attention(qs, ks, vs, batch)
        except (hsap.HsapTimeoutError, hsap.AbortedError) as e:
            print(f"RANK {rank} DEATH OK {type(e).__name__}: {e.message}", flush=True)
            os._exit(0)  # the process group has a dead member: leave without its teardown
        raise SystemExit(f"rank {rank}: forward succeeded although rank 1 died")
    out = hsap.attention(qs, ks, vs, batch)
    out.backward(hsap.shard(g, batch))
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref_out = hsap.sdpa_varlen(*ref, cu, kinds, params)
    ref_out.backward(g.double())
    naive = [t.clone().requires_grad_(True) for t in (q, k, v)]
    naive_out = hsap.sdpa_varlen(*naive, cu, kinds, params)
    naive_out.backward(g)
    for name, x, r, n in (("out", out, ref_out, naive_out), ("dq", qs.grad, ref[0].grad, naive[0].grad),
                          ("dk", ks.grad, ref[1].grad, naive[1].grad),
                          ("dv", vs.grad, ref[2].grad, naive[2].grad)):
        assert_close(name, x, hsap.shard(r, batch), hsap.shard(n, batch))
    traffic = batch.traffic
    batch.close()
    comm.close()
    dist.destroy_process_group()
    print(f"RANK {rank} OK OK tokens {len(qs)} received {traffic.forward_received}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
