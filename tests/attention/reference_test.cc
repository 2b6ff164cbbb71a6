#include "attention/reference.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/attention_test_util.h"

namespace hsap {
namespace {

struct Tensors {
  std::vector<float> q, k, v, dout;
};

Tensors RandomTensors(std::mt19937_64& rng, int64_t tokens, const AttentionDims& dims) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Tensors t;
  t.q.resize(tokens * dims.heads_q * dims.head_dim);
  t.k.resize(tokens * dims.heads_kv * dims.head_dim);
  t.v.resize(t.k.size());
  t.dout.resize(t.q.size());
  for (auto* x : {&t.q, &t.k, &t.v, &t.dout})
    for (float& f : *x) f = normal(rng);
  return t;
}

AttentionDims Dims(int hq, int hkv, int dim) {
  AttentionDims d;
  d.heads_q = hq;
  d.heads_kv = hkv;
  d.head_dim = dim;
  d.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  return d;
}

// Forward against a dense softmax over the full (q, k) matrix with -inf for masked pairs.
TEST(ReferenceTest, ForwardMatchesDenseMaskedSoftmax) {
  std::mt19937_64 rng(1);
  // Documents of every kind, an empty one, and a 1-token one; plus a shared prompt.
  const std::vector<Layout> layouts = {
      *Layout::FromDocuments(
          std::vector<int64_t>{0, 5, 5, 6, 14, 20, 27},
          std::vector<MaskKind>{MaskKind::kCausal, MaskKind::kFull, MaskKind::kFull,
                                MaskKind::kPrefixLM, MaskKind::kSlidingWindow, MaskKind::kFull},
          std::vector<int64_t>{0, 0, 0, 3, 2, 0}),
      testing::SharedPromptLayout(4, {3, 5}, 2)};
  for (const Layout& layout : layouts) {
    const AttentionDims dims = Dims(4, 2, 8);
    const int64_t n = layout.num_tokens();
    const Tensors t = RandomTensors(rng, n, dims);
    const ReferenceForwardResult ref =
        ReferenceForward(layout, {dims, DType::kF32, t.q.data(), t.k.data(), t.v.data()});
    for (int h = 0; h < dims.heads_q; ++h) {
      const int g = h / 2;
      for (int64_t i = 0; i < n; ++i) {
        std::vector<double> s(n);
        double m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int d = 0; d < dims.head_dim; ++d)
            dot += double{t.q[(i * 4 + h) * 8 + d]} * t.k[(j * 2 + g) * 8 + d];
          s[j] = layout.Visible(i, j) ? dot * dims.scale : -INFINITY;
          m = std::max(m, s[j]);
        }
        const double lse_ref = ref.lse[h * n + i];
        if (m == -INFINITY) {
          EXPECT_EQ(lse_ref, -INFINITY);
          for (int d = 0; d < 8; ++d) EXPECT_EQ(ref.out[(i * 4 + h) * 8 + d], 0.0);
          continue;
        }
        double z = 0;
        for (double x : s) z += std::exp(x - m);
        EXPECT_NEAR(lse_ref, m + std::log(z), 1e-12);
        for (int d = 0; d < 8; ++d) {
          double o = 0;
          for (int64_t j = 0; j < n; ++j) o += std::exp(s[j] - m) / z * t.v[(j * 2 + g) * 8 + d];
          EXPECT_NEAR(ref.out[(i * 4 + h) * 8 + d], o, 1e-12);
        }
      }
    }
  }
}

// Backward against central finite differences of L = sum(out * dout), in fp64 on fp32
// inputs. The step is taken between the two neighbouring fp32 values actually stored, so
// the quotient is exact up to the O(step^2) truncation (~1e-6 at step ~1e-3) and fp64
// noise (~1e-13 / 1e-3).
TEST(ReferenceTest, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(2);
  const Layout layout = *Layout::FromDocuments(
      std::vector<int64_t>{0, 4, 5, 11},
      std::vector<MaskKind>{MaskKind::kCausal, MaskKind::kFull, MaskKind::kPrefixLM},
      std::vector<int64_t>{0, 0, 2});
  const AttentionDims dims = Dims(2, 1, 4);
  const int64_t n = layout.num_tokens();
  Tensors t = RandomTensors(rng, n, dims);
  auto loss = [&] {
    const ReferenceForwardResult f =
        ReferenceForward(layout, {dims, DType::kF32, t.q.data(), t.k.data(), t.v.data()});
    double l = 0;
    for (size_t i = 0; i < f.out.size(); ++i) l += f.out[i] * t.dout[i];
    return l;
  };
  const ReferenceGradients g = ReferenceBackward(
      layout, {dims, DType::kF32, t.q.data(), t.k.data(), t.v.data()}, t.dout.data());
  auto check = [&](std::vector<float>& x, const std::vector<double>& grad, const char* name) {
    ASSERT_EQ(x.size(), grad.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const float saved = x[i];
      const float plus = saved + 1e-3f, minus = saved - 1e-3f;
      x[i] = plus;
      const double l_plus = loss();
      x[i] = minus;
      const double l_minus = loss();
      x[i] = saved;
      const double fd = (l_plus - l_minus) / (double{plus} - double{minus});
      EXPECT_NEAR(grad[i], fd, 1e-5 * (1 + std::abs(fd))) << name << "[" << i << "]";
    }
  };
  check(t.q, g.dq, "dq");
  check(t.k, g.dk, "dk");
  check(t.v, g.dv, "dv");
}

// The naive computation in fp32 is close to fp64 (sanity of the tolerance yardstick), and in
// bf16 it is clearly worse than in fp32 (the rounding is really applied).
TEST(ReferenceTest, NaiveErrorGrowsAsPrecisionDrops) {
  std::mt19937_64 rng(3);
  const Layout layout = testing::RandomDocumentLayout(rng, 200, 120);
  const AttentionDims dims = Dims(2, 2, 64);
  const Tensors t = RandomTensors(rng, layout.num_tokens(), dims);
  std::vector<uint16_t> q16(t.q.size()), k16(t.k.size()), v16(t.v.size()), do16(t.dout.size());
  auto to_bf16 = [](const std::vector<float>& x, std::vector<uint16_t>& y) {
    for (size_t i = 0; i < x.size(); ++i) y[i] = FloatToBF16(x[i]).bits;
  };
  to_bf16(t.q, q16);
  to_bf16(t.k, k16);
  to_bf16(t.v, v16);
  to_bf16(t.dout, do16);
  auto max_err = [](const std::vector<double>& a, const std::vector<double>& b) {
    double e = 0;
    for (size_t i = 0; i < a.size(); ++i)
      if (std::isfinite(a[i]) || std::isfinite(b[i])) e = std::max(e, std::abs(a[i] - b[i]));
    return e;
  };
  double errors[2][2];  // [dtype][out, dq]
  for (int i = 0; i < 2; ++i) {
    const ReferenceInputs in =
        i == 0 ? ReferenceInputs{dims, DType::kF32, t.q.data(), t.k.data(), t.v.data()}
               : ReferenceInputs{dims, DType::kBF16, q16.data(), k16.data(), v16.data()};
    const void* dout = i == 0 ? static_cast<const void*>(t.dout.data()) : do16.data();
    const ReferenceForwardResult ref = ReferenceForward(layout, in);
    const ReferenceForwardResult naive = NaiveForward(layout, in);
    ASSERT_EQ(max_err(ref.lse, naive.lse) < INFINITY, true);
    errors[i][0] = max_err(ref.out, naive.out);
    errors[i][1] =
        max_err(ReferenceBackward(layout, in, dout).dq, NaiveBackward(layout, in, dout).dq);
  }
  EXPECT_LT(errors[0][0], 1e-5);
  EXPECT_LT(errors[0][1], 1e-4);
  EXPECT_GT(errors[1][0], 50 * errors[0][0]);
  EXPECT_GT(errors[1][1], 50 * errors[0][1]);
  EXPECT_LT(errors[1][0], 0.2);
}

}  // namespace
}  // namespace hsap
