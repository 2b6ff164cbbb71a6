"""hsap.attention_local (single device) against PyTorch's per-document SDPA."""

import numpy as np
import pytest
import torch

import hsap
from conftest import assert_close, random_documents


def _inputs(rng, tokens, hq, hkv, dim, dtype):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    q = torch.randn(tokens, hq, dim, generator=gen)
    k = torch.randn(tokens, hkv, dim, generator=gen)
    v = torch.randn(tokens, hkv, dim, generator=gen)
    g = torch.randn(tokens, hq, dim, generator=gen)
    return [t.to(dtype) for t in (q, k, v, g)]


def _grads(fn, q, k, v, g):
    q, k, v = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(q, k, v)
    out.backward(g)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("trial", range(2))
def test_local_matches_sdpa_forward_and_backward(rng, dtype, heads, trial):
    cu, kinds, params = random_documents(rng)
    hq, hkv = heads
    q, k, v, g = _inputs(rng, int(cu[-1]), hq, hkv, 32, dtype)
    with hsap.Layout(cu, kinds, params) as layout:
        got = _grads(lambda a, b, c: hsap.attention_local(a, b, c, layout), q, k, v, g)
    ref = _grads(lambda a, b, c: hsap.sdpa_varlen(a, b, c, cu, kinds, params),
                 *[t.double() for t in (q, k, v, g)])
    naive = _grads(lambda a, b, c: hsap.sdpa_varlen(a, b, c, cu, kinds, params), q, k, v, g)
    for name, x, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        assert x.dtype == dtype
        assert_close(name, x, r, n)


def test_local_softmax_scale_and_noncontiguous_inputs(rng):
    cu, kinds, params = random_documents(rng)
    q, k, v, g = _inputs(rng, int(cu[-1]), 4, 2, 32, torch.float32)
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    assert not q_strided.is_contiguous()
    with hsap.Layout(cu, kinds, params) as layout:
        got = _grads(lambda a, b, c: hsap.attention_local(a, b, c, layout, softmax_scale=0.3),
                     q_strided, k, v, g)
    ref = _grads(lambda a, b, c: hsap.sdpa_varlen(a, b, c, cu, kinds, params, 0.3),
                 *[t.double() for t in (q, k, v, g)])
    naive = _grads(lambda a, b, c: hsap.sdpa_varlen(a, b, c, cu, kinds, params, 0.3), q, k, v, g)
    for name, x, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        assert_close(name, x, r, n)


def test_local_finite_differences_fp32(rng):
    """Directional derivatives of sum(out * g) by central differences agree with the analytic
    backward (the C ABI has no float64, so no gradcheck). A central difference at eps errs by
    O(eps^2) (truncation) besides the fp32 rounding, so each is compared with its like: hsap's
    fp32 difference with the fp64 reference's at the same eps (the same truncation), and the
    analytic derivative with the fp64 reference's difference at eps = 1e-5 (no truncation to
    speak of). The directions come from the test's seed."""
    cu, kinds, params = random_documents(rng, max_len=12)
    q, k, v, g = _inputs(rng, int(cu[-1]), 4, 2, 32, torch.float32)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    with hsap.Layout(cu, kinds, params) as layout:
        def loss(a, b, c):
            return (hsap.attention_local(a, b, c, layout) * g).double().sum().item()

        def loss64(a, b, c):
            a, b, c = (t.double() for t in (a, b, c))
            return (hsap.sdpa_varlen(a, b, c, cu, kinds, params) * g.double()).sum().item()

        def central(f, x, d, eps):
            plus = f(*(t + eps * dt for t, dt in zip(x, d)))
            minus = f(*(t - eps * dt for t, dt in zip(x, d)))
            return (plus - minus) / (2 * eps)

        _, dq, dk, dv = _grads(lambda a, b, c: hsap.attention_local(a, b, c, layout), q, k, v, g)
        x64 = [t.double() for t in (q, k, v)]
        for trial in range(3):
            d = [torch.randn(t.shape, generator=gen) for t in (q, k, v)]
            numeric = central(loss, (q, k, v), d, 1e-2)
            numeric64 = central(loss64, x64, [t.double() for t in d], 1e-2)
            assert abs(numeric - numeric64) <= 2e-3 * (abs(numeric64) + 1.0), (numeric, numeric64)
            exact = central(loss64, x64, [t.double() for t in d], 1e-5)
            analytic = sum((gr.double() * dd.double()).sum().item()
                           for gr, dd in zip((dq, dk, dv), d))
            assert abs(analytic - exact) <= 2e-3 * (abs(exact) + 1.0), (analytic, exact)


def test_numpy_calls_without_torch_tensors(rng):
    cu, kinds, params = random_documents(rng)
    q, k, v, g = [t.numpy() for t in _inputs(rng, int(cu[-1]), 4, 2, 32, torch.float32)]
    with hsap.Layout(cu, kinds, params) as layout:
        out, lse = hsap.attention_forward_local(q, k, v, layout)
        dq, dk, dv = hsap.attention_backward_local(g, q, k, v, out, lse, layout)
        got_t = _grads(lambda a, b, c: hsap.attention_local(a, b, c, layout),
                       *[torch.from_numpy(x) for x in (q, k, v, g)])
    # The numpy and torch paths call the same kernels: identical bits.
    for x, y in zip((out, dq, dk, dv), got_t):
        np.testing.assert_array_equal(x, y.detach().numpy())
    assert lse.shape == (4, int(cu[-1])) and lse.dtype == np.float32


def test_layout_dense_mask_matches_documented_kinds():
    cu = [0, 6, 10, 17, 22]
    kinds, params = ["causal", "full", "prefix_lm", "sliding_window"], [0, 0, 3, 2]
    with hsap.Layout(cu, kinds, params) as layout:
        mask = layout.dense_mask()
        assert layout.num_tokens == 22
        assert layout.visible_pairs == int(mask.sum())
    expected = np.zeros((22, 22), dtype=bool)
    for d, kind in enumerate(kinds):
        b, e = cu[d], cu[d + 1]
        expected[b:e, b:e] = hsap.torch._document_mask(kind, params[d], e - b, "cpu").numpy()
    np.testing.assert_array_equal(mask, expected)


def test_from_slices_shared_prompt_matches_dense_mask_sdpa(rng):
    """Two answers that both see a shared prompt (a mask no cu_seqlens can express)."""
    slices = [hsap.Slice(0, 16, 0, 16, "causal"), hsap.Slice(16, 28, 0, 16, "full"),
              hsap.Slice(16, 28, 16, 28, "causal"), hsap.Slice(28, 40, 0, 16, "full"),
              (28, 40, 28, 40, "causal")]
    q, k, v, g = _inputs(rng, 40, 4, 2, 32, torch.float32)
    with hsap.Layout.from_slices(40, slices) as layout:
        mask = torch.from_numpy(layout.dense_mask())
        assert layout.visible_pairs == int(mask.sum())
        got = _grads(lambda a, b, c: hsap.attention_local(a, b, c, layout), q, k, v, g)

    def dense(a, b, c):
        o = torch.nn.functional.scaled_dot_product_attention(
            a.transpose(0, 1), b.transpose(0, 1).repeat_interleave(2, 0),
            c.transpose(0, 1).repeat_interleave(2, 0), attn_mask=mask)
        return o.transpose(0, 1)

    ref = _grads(dense, *[t.double() for t in (q, k, v, g)])
    naive = _grads(dense, q, k, v, g)
    for name, x, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        assert_close(name, x, r, n)


def test_window_longer_than_a_document_is_the_whole_document(rng):
    """One window for every document of the row (as a model has): documents shorter than
    the window attend causally to all of themselves; the result is PyTorch's per-document
    SDPA with that window's band, which excludes nothing inside a short document."""
    cu, window = [0, 1, 5, 6, 30, 33], 8
    q, k, v, g = _inputs(rng, 33, 4, 2, 32, torch.float32)
    with hsap.Layout(cu, "sliding_window", window) as layout:
        mask = layout.dense_mask()
        got = _grads(lambda a, b, c: hsap.attention_local(a, b, c, layout), q, k, v, g)
    with hsap.Layout(cu, ["causal", "causal", "causal", "sliding_window", "causal"],
                     [0, 0, 0, window, 0]) as same:
        np.testing.assert_array_equal(mask, same.dense_mask())
    ref = _grads(lambda a, b, c: hsap.sdpa_varlen(a, b, c, cu, "sliding_window", window),
                 *[t.double() for t in (q, k, v, g)])
    naive = _grads(lambda a, b, c: hsap.sdpa_varlen(a, b, c, cu, "sliding_window", window),
                   q, k, v, g)
    for name, x, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        assert_close(name, x, r, n)
