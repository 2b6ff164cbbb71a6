// Inputs with a NaN or +inf planted in q or k, what a naive fp64 softmax makes of them, and
// the checks that a kernel's outputs are NaN exactly where the naive ones are (hsap.h, "NaN
// and infinity"): one set of cases for every kernel family.
#ifndef HSAP_TESTS_SUPPORT_NONFINITE_H_
#define HSAP_TESTS_SUPPORT_NONFINITE_H_

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention/kernel.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "gtest/gtest.h"

namespace hsap::testing {

enum class Plant { kNanInQ, kNanInK, kInfInQ };
inline constexpr Plant kAllPlants[] = {Plant::kNanInQ, Plant::kNanInK, Plant::kInfInQ};
inline const char* PlantName(Plant p) {
  return p == Plant::kNanInQ ? "NaN in q" : p == Plant::kNanInK ? "NaN in k" : "+inf in q";
}

// Tokens that get the plant: the middle of a causal document (rows before it do not see a
// key planted there) and of a sliding-window one (only the window after it does); the
// bidirectional document between them stays clean.
inline constexpr int64_t kPlantTokens[] = {20, 110};

// A causal document [0, 50), a bidirectional one [50, 90) and a window of 8 over [90, 130);
// without band masks, three bidirectional documents.
inline Layout NonFiniteLayout(bool band_masks = true) {
  const std::vector<int64_t> cu = {0, 50, 90, 130};
  if (!band_masks) return *Layout::FromDocuments(cu, std::vector<MaskKind>(3, MaskKind::kFull));
  const std::vector<MaskKind> kinds = {MaskKind::kCausal, MaskKind::kFull,
                                       MaskKind::kSlidingWindow};
  return *Layout::FromDocuments(cu, kinds, {0, 0, 8});
}

// Plants `what` at dim 1 of every head of the planted tokens of q ([T, heads_q, D]) or k
// ([T, heads_kv, D]).
inline void PlantNonFinite(Plant what, const AttentionDims& dims, std::vector<float>* q,
                           std::vector<float>* k) {
  const bool in_q = what != Plant::kNanInK;
  std::vector<float>& x = in_q ? *q : *k;
  const int heads = in_q ? dims.heads_q : dims.heads_kv;
  const float value = what == Plant::kInfInQ ? std::numeric_limits<float>::infinity()
                                             : std::numeric_limits<float>::quiet_NaN();
  for (int64_t t : kPlantTokens) {
    for (int h = 0; h < heads; ++h) x[(t * heads + h) * dims.head_dim + 1] = value;
  }
}

struct NaiveOutputs {
  std::vector<double> out;  // [T, Hq, D]
  std::vector<double> lse;  // [Hq, T]
};

// Softmax attention in fp64 with no special case for NaN or infinity: the max of a row's
// scores is NaN when one is, and s - max, exp and the sums then do what they do.
inline NaiveOutputs NaiveFp64Forward(const Layout& layout, const AttentionDims& dims,
                                     const std::vector<float>& q, const std::vector<float>& k,
                                     const std::vector<float>& v) {
  const int64_t T = layout.num_tokens();
  const int hq = dims.heads_q, hkv = dims.heads_kv, D = dims.head_dim;
  NaiveOutputs r;
  r.out.assign(T * hq * D, 0.0);
  r.lse.assign(hq * T, -std::numeric_limits<double>::infinity());
  for (int h = 0; h < hq; ++h) {
    const int kvh = dims.KvHead(h);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int64_t> keys;
      std::vector<double> s;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < T; ++j) {
        if (!layout.Visible(t, j)) continue;
        double dot = 0;
        for (int d = 0; d < D; ++d) {
          dot += double{q[(t * hq + h) * D + d]} * k[(j * hkv + kvh) * D + d];
        }
        dot *= dims.scale;
        keys.push_back(j);
        s.push_back(dot);
        m = std::isnan(dot) || std::isnan(m) ? std::nan("") : std::max(m, dot);
      }
      if (keys.empty()) continue;
      double l = 0;
      std::vector<double> o(D, 0.0);
      for (size_t i = 0; i < keys.size(); ++i) {
        const double w = std::exp(s[i] - m);
        l += w;
        for (int d = 0; d < D; ++d) o[d] += w * v[(keys[i] * hkv + kvh) * D + d];
      }
      r.lse[h * T + t] = m + std::log(l);
      for (int d = 0; d < D; ++d) r.out[(t * hq + h) * D + d] = o[d] / l;
    }
  }
  return r;
}

// `got` is NaN exactly where `ref` is, equal where `ref` is infinite (lse -inf of rows that
// see no key) and within `tol` (relative to 1 + |ref|) elsewhere. Returns the NaN count.
template <typename F>
int64_t ExpectSameNaNPattern(const std::vector<F>& got, const std::vector<double>& ref, double tol,
                             const std::string& name) {
  EXPECT_EQ(got.size(), ref.size()) << name;
  int64_t nans = 0, mismatches = 0, first = -1;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    const double g = got[i];
    bool same;
    if (std::isnan(ref[i])) {
      ++nans;
      same = std::isnan(g);
    } else if (std::isinf(ref[i])) {
      same = g == ref[i];
    } else {
      same = std::abs(g - ref[i]) <= tol * (1 + std::abs(ref[i]));
    }
    if (!same && mismatches++ == 0) first = static_cast<int64_t>(i);
  }
  EXPECT_EQ(mismatches, 0) << name << ": first at [" << first << "]: got "
                           << (first >= 0 ? double{got[first]} : 0.0) << ", naive "
                           << (first >= 0 ? ref[first] : 0.0);
  return nans;
}

// Checks a forward's out [T, Hq, D] and lse [Hq, T] against the naive outputs, and that the
// plant made some rows NaN and left others finite.
template <typename F>
void ExpectForwardNaNPattern(const std::vector<F>& out, const std::vector<float>& lse,
                             const NaiveOutputs& ref, const std::string& name) {
  const int64_t nan_rows = ExpectSameNaNPattern(lse, ref.lse, 1e-4, name + " lse");
  ExpectSameNaNPattern(out, ref.out, 1e-4, name + " out");
  EXPECT_GT(nan_rows, 0) << name;
  EXPECT_LT(nan_rows, static_cast<int64_t>(ref.lse.size())) << name;
}

// Gradients [T, heads, D] that a naive backward makes NaN from NaN forward rows (lse) or NaN
// dout entries: dq of that row, dk and dv of the keys the row sees.
struct NaNGradients {
  std::vector<bool> dq, dk, dv;
};
inline NaNGradients NaiveNaNGradients(const Layout& layout, const AttentionDims& dims,
                                      const std::vector<double>& lse,
                                      const std::vector<float>& dout) {
  const int64_t T = layout.num_tokens();
  const int hq = dims.heads_q, hkv = dims.heads_kv, D = dims.head_dim;
  NaNGradients g{std::vector<bool>(T * hq * D, false), std::vector<bool>(T * hkv * D, false),
                 std::vector<bool>(T * hkv * D, false)};
  for (int h = 0; h < hq; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      // A NaN probability reaches every dim; a NaN dout entry reaches dp = dout . v (so dq
      // and dk) and, in dv, its own dim.
      const bool nan_p = std::isnan(lse[h * T + t]);
      bool nan_dp = nan_p;
      for (int d = 0; d < D; ++d) nan_dp = nan_dp || std::isnan(dout[(t * hq + h) * D + d]);
      if (!nan_dp) continue;
      for (int64_t j = 0; j < T; ++j) {
        if (!layout.Visible(t, j)) continue;
        const int64_t kv = (j * hkv + dims.KvHead(h)) * D;
        for (int d = 0; d < D; ++d) {
          g.dq[(t * hq + h) * D + d] = true;
          g.dk[kv + d] = true;
          g.dv[kv + d] = g.dv[kv + d] || nan_p || std::isnan(dout[(t * hq + h) * D + d]);
        }
      }
    }
  }
  return g;
}

// Every gradient the naive backward makes NaN is NaN. (A NaN may reach more: the tiled
// products multiply the zero probabilities of masked pairs with the NaN row.)
inline void ExpectNoNaNLost(const std::vector<float>& grad, const std::vector<bool>& want_nan,
                            const std::string& name) {
  int64_t lost = 0, wanted = 0;
  for (size_t i = 0; i < grad.size(); ++i) {
    if (!want_nan[i]) continue;
    ++wanted;
    lost += !std::isnan(grad[i]);
  }
  EXPECT_GT(wanted, 0) << name;
  EXPECT_EQ(lost, 0) << name << ": " << lost << " of " << wanted << " NaN gradients lost";
}

// Forward then backward of a KernelSet (fp32, one device, whole-row work list) with each
// plant in q or k, and with a NaN in dout: NaN where the naive forward has it, no NaN lost
// in the gradients.
inline void ExpectKernelSetPropagatesNaN(const KernelSet& kernels, const AttentionDims& dims,
                                         int64_t block_q, const Layout& layout) {
  const int64_t T = layout.num_tokens();
  const int D = dims.head_dim;
  auto work = BuildWorkList(layout, block_q);
  ASSERT_TRUE(work.ok()) << work.status();
  std::mt19937_64 rng(15);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](int64_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = normal(rng);
    return x;
  };
  const std::vector<float> q0 = random(T * dims.heads_q * D), k0 = random(T * dims.heads_kv * D),
                           v = random(T * dims.heads_kv * D), dout0 = random(T * dims.heads_q * D);
  for (int c = 0; c <= 3; ++c) {
    const bool nan_in_dout = c == 3;
    const std::string name = std::string(kernels.name()) + ": " +
                             (nan_in_dout ? "NaN in dout" : PlantName(kAllPlants[c]));
    SCOPED_TRACE(name);
    std::vector<float> q = q0, k = k0, dout = dout0;
    if (nan_in_dout) {
      for (int d = 0; d < D; d += 7) dout[(30 * dims.heads_q) * D + d] = std::nanf("");
    } else {
      PlantNonFinite(kAllPlants[c], dims, &q, &k);
    }
    std::vector<float> out(q.size()), lse(T * dims.heads_q);
    InitPartial(out.data(), lse.data(), T, dims.heads_q, D);
    ForwardArgs fa;
    fa.dims = dims;
    fa.dtype = DType::kF32;
    fa.q = q.data();
    fa.k = k.data();
    fa.v = v.data();
    fa.q_rows = fa.k_rows = T;
    fa.out = out.data();
    fa.lse = lse.data();
    ASSERT_TRUE(kernels.Forward(fa, *work, 2).ok());
    const NaiveOutputs ref = NaiveFp64Forward(layout, dims, q, k, v);
    if (!nan_in_dout) ExpectForwardNaNPattern(out, lse, ref, name);

    std::vector<float> delta(T * dims.heads_q);
    ComputeDelta(DType::kF32, dout.data(), out.data(), T, dims.heads_q, D, delta.data());
    std::vector<float> dq(q.size(), 0.0f), dk(k.size(), 0.0f), dv(k.size(), 0.0f);
    BackwardArgs ba;
    ba.dims = dims;
    ba.dtype = DType::kF32;
    ba.q = q.data();
    ba.k = k.data();
    ba.v = v.data();
    ba.dout = dout.data();
    ba.lse = lse.data();
    ba.delta = delta.data();
    ba.q_rows = ba.k_rows = T;
    ba.dq = dq.data();
    ba.dk = dk.data();
    ba.dv = dv.data();
    ASSERT_TRUE(kernels.Backward(ba, *work, 2).ok());
    const NaNGradients want = NaiveNaNGradients(layout, dims, ref.lse, dout);
    ExpectNoNaNLost(dq, want.dq, name + " dq");
    ExpectNoNaNLost(dk, want.dk, name + " dk");
    ExpectNoNaNLost(dv, want.dv, name + " dv");
  }
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_NONFINITE_H_
