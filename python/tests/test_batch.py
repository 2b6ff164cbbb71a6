"""hsap.attention on a multi-rank batch: ranks are threads of this process (Comm.init_all),
each rank in its own Python thread (ctypes releases the GIL during the calls)."""

import threading

import numpy as np
import pytest
import torch

import hsap
from conftest import assert_close, random_documents


def run_ranks(nranks, body, timeout_ms=120000):
    """Runs body(comm) on every rank's thread; returns the results in rank order and
    re-raises the first exception. Comms are closed afterwards."""
    comms = hsap.Comm.init_all(nranks, timeout_ms=timeout_ms)
    results, errors = [None] * nranks, [None] * nranks

    def worker(r):
        try:
            results[r] = body(comms[r])
        except BaseException as e:  # reported to the test's thread
            errors[r] = e

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in comms:
        c.close()
    return results, errors


def _rank_step(comm, layout, q, k, v, g, hq, hkv, dtype, weights=None, plan=None):
    with hsap.Batch(comm, layout, hq, hkv, q.shape[2], dtype, weights=weights, plan=plan) as batch:
        qs, ks, vs, gs = [hsap.shard(t, batch).requires_grad_(t is not g) for t in (q, k, v, g)]
        out = hsap.attention(qs, ks, vs, batch)
        out.backward(gs)
        index = batch.local_index()
        assert batch.local_tokens == len(index)
        return index, out.detach(), qs.grad, ks.grad, vs.grad, batch.traffic


def _unshard(results, which, like):
    full = torch.zeros_like(like)
    for r in results:
        full[torch.from_numpy(r[0])] = r[which]
    return full


def _reference(cu, kinds, params, q, k, v, g, dtype):
    def grads(ts):
        a, b, c = [t.detach().clone().requires_grad_(True) for t in ts[:3]]
        out = hsap.sdpa_varlen(a, b, c, cu, kinds, params)
        out.backward(ts[3])
        return out, a.grad, b.grad, c.grad

    return grads([t.double() for t in (q, k, v, g)]), grads([t.to(dtype) for t in (q, k, v, g)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,weights", [((4, 4), None), ((4, 2), [1.0, 2.0, 0.5])])
def test_batch_matches_sdpa(rng, dtype, heads, weights):
    cu, kinds, params = random_documents(rng, max_len=60)
    hq, hkv = heads
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    T = int(cu[-1])
    q, g = [torch.randn(T, hq, 32, generator=gen).to(dtype) for _ in range(2)]
    k, v = [torch.randn(T, hkv, 32, generator=gen).to(dtype) for _ in range(2)]
    with hsap.Layout(cu, kinds, params) as layout:
        results, errors = run_ranks(3, lambda c: _rank_step(c, layout, q, k, v, g, hq, hkv, dtype,
                                                            weights))
    assert errors == [None] * 3, errors
    assert sorted(np.concatenate([r[0] for r in results]).tolist()) == list(range(T))
    ref, naive = _reference(cu, kinds, params, q, k, v, g, dtype)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        like = q if name in ("out", "dq") else k
        assert_close(name, _unshard(results, i + 1, like), ref[i], naive[i])


def test_plan_batch_matches_sdpa_and_json_round_trip(rng):
    cu, kinds, params = random_documents(rng, max_len=60)
    T, dtype = int(cu[-1]), torch.float32
    gen = torch.Generator().manual_seed(1)
    q, g = [torch.randn(T, 4, 32, generator=gen) for _ in range(2)]
    k, v = [torch.randn(T, 2, 32, generator=gen) for _ in range(2)]
    # Two head-parallel groups of two ranks; uneven, non-contiguous heads in group 1.
    with hsap.Plan.create(4, 2, groups=[[0, 1], [2, 3]], heads=[[0, 1], [2, 3], [0, 2, 3], [1]],
                          sequence_weights=[1.0, 2.0]) as plan:
        assert plan.shape == (4, 4, 2, 2)
        text = plan.to_json()
    with hsap.Plan.from_json(text) as plan, hsap.Layout(cu, kinds, params) as layout:
        assert plan.to_json() == text
        results, errors = run_ranks(4, lambda c: _rank_step(c, layout, q, k, v, g, 4, 2, dtype,
                                                            plan=plan))
    assert errors == [None] * 4, errors
    ref, naive = _reference(cu, kinds, params, q, k, v, g, dtype)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        like = q if name in ("out", "dq") else k
        assert_close(name, _unshard(results, i + 1, like), ref[i], naive[i])
    # Every rank takes part in the all-to-all of its group.
    assert all(r[5].forward_all_to_all_sent > 0 for r in results)


def test_scatter_gather_and_traffic_numpy(rng):
    """The numpy path: scatter a row, forward/backward per rank, gather; ranks that hold a
    piece of a cut document receive K/V."""
    cu = np.array([0, 200], dtype=np.int64)  # one long causal document: cut over ranks
    T = 200
    q = rng.standard_normal((T, 4, 32)).astype(np.float32)
    k = rng.standard_normal((T, 4, 32)).astype(np.float32)
    v = rng.standard_normal((T, 4, 32)).astype(np.float32)
    shared_out = [None, None]
    barrier = threading.Barrier(2)
    with hsap.Layout(cu) as layout:
        local_out, _ = hsap.attention_forward_local(q, k, v, layout)

        def body(comm):
            with hsap.Batch(comm, layout, 4, 4, 32, np.float32) as batch:
                shards = [batch.scatter(x)[comm.rank] for x in (q, k, v)]
                np.testing.assert_array_equal(shards[0], q[batch.local_index()])
                assert batch.ranges == batch.ranges_of(comm.rank)
                shared_out[comm.rank], _ = batch.forward(*shards)
                barrier.wait()
                out = batch.gather(shared_out)
                return out, batch.traffic

        results, errors = run_ranks(2, body)
    assert errors == [None, None], errors
    np.testing.assert_allclose(results[0][0], local_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert sum(r[1].forward_received for r in results) > 0


def test_rank_disagreement_raises_on_every_rank():
    layouts = [hsap.Layout([0, 64]), hsap.Layout([0, 32, 64])]

    def body(comm):
        hsap.Batch(comm, layouts[comm.rank], 4, 4, 32, "float32")

    _, errors = run_ranks(2, body, timeout_ms=20000)
    for e in errors:
        assert isinstance(e, hsap.InvalidUsageError), errors
        assert e.result == 2 and e.message


def test_missing_peer_times_out_naming_it():
    layout = hsap.Layout([0, 64])
    x = torch.randn(64, 4, 32)

    def body(comm):
        with hsap.Batch(comm, layout, 4, 4, 32, torch.float32) as batch:
            if comm.rank == 0:  # rank 1 never calls forward
                s = hsap.shard(x, batch)
                hsap.attention(s, s, s, batch)

    _, errors = run_ranks(2, body, timeout_ms=1500)
    assert isinstance(errors[0], hsap.HsapTimeoutError), errors
    assert isinstance(errors[0], TimeoutError)
    assert "1" in errors[0].message and errors[1] is None


def test_abort_releases_a_waiting_rank():
    comms = hsap.Comm.init_all(2, timeout_ms=60000)
    layout = hsap.Layout([0, 64])
    error = []

    def rank0():
        try:
            # Batch creation is collective: rank 1 never comes, so this waits until aborted.
            hsap.Batch(comms[0], layout, 4, 4, 32, "float32")
        except hsap.HsapError as e:
            error.append(e)

    t = threading.Thread(target=rank0)
    t.start()
    t.join(0.5)
    comms[0].abort()
    t.join(30)
    assert not t.is_alive()
    assert isinstance(error[0], hsap.AbortedError), error
    for c in comms:
        c.close()
