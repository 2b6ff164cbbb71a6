"""hsap.StepKey (one partition for every mask of a row, batches per mask and dtype,
dispatch/undispatch) with ranks as threads of this process (Comm.init_all), and the
drop-ins that build on it: varlen_attention's flash-attn vocabulary, the Megatron adapter."""

import types

import numpy as np
import pytest
import torch

import hsap
import hsap.integrations.megatron as hsap_megatron
from conftest import assert_close
from hsap.varlen import mask_from_flash_args
from test_batch import run_ranks

CU = np.array([0, 1, 45, 60, 61, 130, 150], dtype=np.int64)  # shorter and longer than 16
MASKS = ["causal", ("sliding_window", 16), "full"]


def test_position_ids_and_labels():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    cu = hsap.cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 4, 8]
    with pytest.raises(ValueError, match=r"position_ids\[2\] = 5"):
        hsap.cu_seqlens_from_position_ids([0, 1, 5, 0])
    with pytest.raises(ValueError, match="start at 0"):
        hsap.cu_seqlens_from_position_ids([1, 2])
    comms = hsap.Comm.init_all(1)
    with hsap.StepKey(comms[0], cu) as key:
        assert key.position_ids().tolist() == pos[0].tolist()
        ids = torch.arange(10, 18).unsqueeze(0)
        # Next token inside each document; the last token of a document predicts nothing.
        assert key.shift_labels(ids).tolist() == [[11, 12, -100, -100, 15, 16, 17, -100]]
        assert key.num_label_tokens() == 5
        assert hsap.current_key() is key
    assert hsap.current_key() is None
    key.close()
    comms[0].close()
    assert hsap.mask_spec(8) == ("sliding_window", 8)
    assert hsap.mask_spec(("prefix_lm", 3)) == ("prefix_lm", 3)
    with pytest.raises(ValueError, match="at least 1"):
        hsap.mask_spec(("sliding_window", 0))
    assert mask_from_flash_args(True, (-1, -1)) == "causal"
    assert mask_from_flash_args(True, (15, 0)) == ("sliding_window", 16)
    assert mask_from_flash_args(False, (-1, -1)) == "full"
    with pytest.raises(NotImplementedError):
        mask_from_flash_args(False, (4, 4))


def _inputs(tokens, seed, hq=4, hkv=2, dim=32):
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(tokens, hq, dim, generator=gen) for _ in range(2)]
            + [torch.randn(tokens, hkv, dim, generator=gen) for _ in range(2)])


def test_every_mask_over_one_partition_matches_sdpa_and_round_trips():
    T = int(CU[-1])
    q, g, k, v = _inputs(T, 5)
    row_ids = torch.arange(T) * 7

    def body(comm):
        key = hsap.StepKey(comm, CU, MASKS)
        local = key.dispatch(row_ids)
        assert torch.equal(local, row_ids[key.global_index])
        results = {}
        for mask in MASKS + [("sliding_window", 1000)]:  # a mask beyond the key's: same tokens
            for dtype in (torch.float32, torch.bfloat16):  # a batch per dtype, one partition
                qs, ks, vs = [key.dispatch(t).to(dtype).requires_grad_(True) for t in (q, k, v)]
                out = key.attention(qs, ks, vs, mask)
                out.backward(key.dispatch(g).to(dtype))
                results[(hsap.mask_spec(mask), dtype)] = (out.detach(), qs.grad, ks.grad, vs.grad)
        batches = key.batches
        assert len(batches) == 8
        assert all(b.local_index().tolist() == key.global_index.tolist() for b in batches)
        info = (key.global_index.clone(), local, results)
        key.close()
        return info

    results, errors = run_ranks(3, body)
    for e in errors:
        if e is not None:
            raise e
    # The ranks' shards tile the row, and every row tensor comes back (gather).
    index = torch.cat([r[0] for r in results])
    assert sorted(index.tolist()) == list(range(T))
    with hsap.Comm.init_all(1)[0] as comm1:
        # The shards' index maps are those of a 3-rank key, computed in any process.
        part = hsap.Partition([hsap.Layout(CU, *(m if isinstance(m, tuple) else (m, 0)))
                               for m in MASKS], 3)
        for r in range(3):
            assert part.local_index(r).tolist() == results[r][0].tolist()
        del comm1
    for (kind, param), dtype in results[0][2]:
        def grads(ts):
            a, b, c = [t.detach().clone().requires_grad_(True) for t in ts[:3]]
            out = hsap.sdpa_varlen(a, b, c, CU, kind, param)
            out.backward(ts[3])
            return out, a.grad, b.grad, c.grad

        ref = grads([t.double() for t in (q, k, v, g)])
        naive = grads([t.to(dtype) for t in (q, k, v, g)])
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = torch.zeros_like(ref[j], dtype=dtype)
            for r in range(3):
                got[results[r][0]] = results[r][2][((kind, param), dtype)][j]
            assert_close(f"{kind} {param} {dtype} {name}", got, ref[j], naive[j])


def test_prepare_makes_every_batch_in_one_call():
    T = int(CU[-1])
    q, g, k, v = _inputs(T, 11)

    def body(comm):
        lazy, eager = hsap.StepKey(comm, CU, MASKS), hsap.StepKey(comm, CU, MASKS)
        made = eager.prepare(4, 2, 32, (torch.float32, torch.bfloat16))
        assert len(made) == 6 and len(eager.batches) == 6
        assert eager.prepare(4, 2, 32, (torch.bfloat16,)) == made[3:]  # nothing new
        same = []
        for mask in MASKS:
            for dtype in (torch.float32, torch.bfloat16):
                outs = []
                for key in (lazy, eager):
                    qs, ks, vs = [key.dispatch(t).to(dtype).requires_grad_(True)
                                  for t in (q, k, v)]
                    out = key.attention(qs, ks, vs, mask)
                    out.backward(key.dispatch(g).to(dtype))
                    outs.append((out.detach(), qs.grad, ks.grad, vs.grad))
                same.append(all(torch.equal(a, b) for a, b in zip(*outs)))
        assert len(eager.batches) == 6  # the layers found the prepared batches
        # A rank whose list differs makes every rank fail, none waits.
        other = hsap.StepKey(comm, CU, MASKS)
        try:
            other.prepare(4, 2, 32, (torch.float32,) if comm.rank == 0 else (torch.bfloat16,))
            failed = None
        except hsap.HsapError as e:
            failed = str(e)
        for key in (lazy, eager, other):
            key.close()
        return same, failed

    results, errors = run_ranks(3, body)
    for e in errors:
        if e is not None:
            raise e
    for same, failed in results:
        assert all(same)
        assert failed is not None and "dtype" in failed


def test_gather_cache_varlen_and_megatron():
    T = int(CU[-1])
    q, g, k, v = _inputs(T, 9)

    def body(comm):
        key = hsap.StepKey.get(comm, CU, MASKS)
        assert hsap.StepKey.get(comm, CU.tolist(), MASKS) is key  # cached per layout
        shards = [key.dispatch(torch.arange(T) * 3).reshape(-1, 1)]
        qs, ks, vs = [key.dispatch(t) for t in (q, k, v)]
        # flash_attn_varlen_func's vocabulary: window_size=(15, 0) is a window of 16.
        with key:
            a = hsap.varlen_attention(qs, ks, vs, CU, CU, 90, 90, causal=True,
                                      window_size=(15, 0))
        b = key.attention(qs, ks, vs, ("sliding_window", 16))
        params = types.SimpleNamespace(cu_seqlens_q=torch.from_numpy(CU),
                                       cu_seqlens_kv=torch.from_numpy(CU),
                                       cu_seqlens_q_padded=None)
        with key:  # (ranks as threads share the key cache: name this rank's key)
            c = hsap_megatron.attention(qs.unsqueeze(1), ks.unsqueeze(1), vs.unsqueeze(1),
                                        params, mask="causal")
        assert hsap_megatron.cu_seqlens_of(params).tolist() == CU.tolist()
        d = key.attention(qs, ks, vs, "causal")
        with pytest.raises(ValueError, match="dropout"):
            hsap.varlen_attention(qs, ks, vs, CU, CU, causal=True, dropout_p=0.1, key=key)
        info = key.global_index.clone(), shards[0], torch.equal(a, b), torch.equal(c[:, 0], d)
        key.close()
        return info

    results, errors = run_ranks(2, body)
    for e in errors:
        if e is not None:
            raise e
    for index, shard, same_varlen, same_megatron in results:
        assert same_varlen and same_megatron
        assert torch.equal(shard[:, 0], index * 3)
    hsap.StepKey.clear_cache()
