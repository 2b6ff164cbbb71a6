#include "attention/merge.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace hsap {
namespace {

constexpr int kDim = 32;

struct Partial {
  std::vector<float> o = std::vector<float>(kDim, 0.0f);
  float lse = -INFINITY;
};

// Softmax-weighted average of `values` under `scores` restricted to `keys`, in fp64.
Partial Attend(const std::vector<double>& scores, const std::vector<std::vector<double>>& values,
               const std::vector<int>& keys) {
  Partial p;
  if (keys.empty()) return p;
  double m = -INFINITY;
  for (int k : keys) m = std::max(m, scores[k]);
  double sum = 0;
  std::vector<double> o(kDim, 0.0);
  for (int k : keys) {
    const double w = std::exp(scores[k] - m);
    sum += w;
    for (int d = 0; d < kDim; ++d) o[d] += w * values[k][d];
  }
  for (int d = 0; d < kDim; ++d) p.o[d] = static_cast<float>(o[d] / sum);
  p.lse = static_cast<float>(m + std::log(sum));
  return p;
}

Partial Merge(Partial a, const Partial& b) {
  MergePartialRow(a.o.data(), &a.lse, b.o.data(), b.lse, kDim);
  return a;
}

// Relative to magnitudes ~1: fp32 merges of a few partials stay within a few ulps.
void ExpectNear(const Partial& a, const Partial& b, float tol) {
  EXPECT_NEAR(a.lse, b.lse, tol);
  for (int d = 0; d < kDim; ++d) EXPECT_NEAR(a.o[d], b.o[d], tol) << d;
}

class MergeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::normal_distribution<double> normal(0.0, 1.0);
    for (int k = 0; k < 50; ++k) {
      scores_.push_back(3.0 * normal(rng_));
      values_.emplace_back(kDim);
      for (double& v : values_.back()) v = normal(rng_);
    }
  }
  std::mt19937_64 rng_{17};
  std::vector<double> scores_;
  std::vector<std::vector<double>> values_;
};

TEST_F(MergeTest, AnySplitOfTheKeysGivesAttentionOverAll) {
  std::vector<int> all(scores_.size());
  for (size_t k = 0; k < all.size(); ++k) all[k] = static_cast<int>(k);
  const Partial expected = Attend(scores_, values_, all);
  for (int trial = 0; trial < 50; ++trial) {
    const int parts = 1 + trial % 6;
    std::vector<std::vector<int>> split(parts);  // some parts may stay empty
    for (int k : all) split[rng_() % parts].push_back(k);
    Partial merged;  // starts as (0, -inf)
    for (const auto& keys : split) merged = Merge(merged, Attend(scores_, values_, keys));
    ExpectNear(merged, expected, 2e-6f);
  }
}

TEST_F(MergeTest, CommutativeAndAssociativeUpToRounding) {
  const Partial a = Attend(scores_, values_, {0, 1, 2});
  const Partial b = Attend(scores_, values_, {3, 4});
  const Partial c = Attend(scores_, values_, {5, 6, 7, 8});
  const Partial ab = Merge(a, b), ba = Merge(b, a);
  ExpectNear(ab, ba, 1e-6f);
  ExpectNear(Merge(ab, c), Merge(a, Merge(b, c)), 1e-6f);
  ExpectNear(Merge(ab, c), Attend(scores_, values_, {0, 1, 2, 3, 4, 5, 6, 7, 8}), 2e-6f);
}

TEST_F(MergeTest, EmptyPartialsAreExact) {
  const Partial a = Attend(scores_, values_, {4, 9, 11});
  const Partial none;
  for (const Partial& m : {Merge(a, none), Merge(none, a)}) {
    EXPECT_EQ(m.lse, a.lse);
    EXPECT_EQ(0, std::memcmp(m.o.data(), a.o.data(), kDim * sizeof(float)));
  }
  const Partial both = Merge(none, none);
  EXPECT_EQ(both.lse, -INFINITY);
  for (float v : both.o) EXPECT_EQ(v, 0.0f);
}

TEST_F(MergeTest, LargeLseDifferencesStayFinite) {
  Partial a = Attend(scores_, values_, {1});
  Partial b = Attend(scores_, values_, {2});
  b.lse = a.lse + 200.0f;  // exp(200) overflows fp32; the merge must not
  const Partial m = Merge(a, b);
  EXPECT_EQ(m.lse, b.lse);
  for (int d = 0; d < kDim; ++d) EXPECT_EQ(m.o[d], b.o[d]);
}

// A NaN partial (a row whose softmax went NaN) makes the merge NaN in either order, also
// with an empty partial; a NaN value under a negligible weight still reaches the output.
TEST_F(MergeTest, NaNPartialsPropagate) {
  const Partial a = Attend(scores_, values_, {4, 9, 11});
  Partial bad = a;
  bad.lse = std::numeric_limits<float>::quiet_NaN();
  for (float& v : bad.o) v = std::numeric_limits<float>::quiet_NaN();
  for (const Partial& m :
       {Merge(a, bad), Merge(bad, a), Merge(Partial{}, bad), Merge(bad, Partial{})}) {
    EXPECT_TRUE(std::isnan(m.lse));
    for (float v : m.o) EXPECT_TRUE(std::isnan(v));
  }
  Partial nan_value = Attend(scores_, values_, {2});
  nan_value.lse = a.lse - 200.0f;
  nan_value.o[3] = std::numeric_limits<float>::quiet_NaN();
  const Partial m = Merge(a, nan_value);
  EXPECT_EQ(m.lse, a.lse);
  EXPECT_TRUE(std::isnan(m.o[3]));
  EXPECT_FALSE(std::isnan(m.o[2]));
}

TEST_F(MergeTest, MergePartialWorksInPlaceOnStridedBuffers) {
  // 3 rows x 2 heads, merged into rows [1, 4) of a 5-row buffer (lse stride 5).
  const int heads = 2, rows = 3;
  std::vector<float> o1(5 * heads * kDim), lse1(heads * 5), o2(rows * heads * kDim),
      lse2(heads * rows);
  std::vector<Partial> p1, p2;
  for (int h = 0; h < heads; ++h) {
    for (int r = 0; r < 5; ++r) {
      const Partial p = r == 2 && h == 1 ? Partial{} : Attend(scores_, values_, {r, h + 10});
      std::copy(p.o.begin(), p.o.end(), o1.begin() + (r * heads + h) * kDim);
      lse1[h * 5 + r] = p.lse;
      p1.push_back(p);
    }
    for (int r = 0; r < rows; ++r) {
      const Partial p = r == 0 && h == 0 ? Partial{} : Attend(scores_, values_, {20 + r, 30 + h});
      std::copy(p.o.begin(), p.o.end(), o2.begin() + (r * heads + h) * kDim);
      lse2[h * rows + r] = p.lse;
      p2.push_back(p);
    }
  }
  MergePartial(o1.data() + heads * kDim, lse1.data() + 1, o2.data(), lse2.data(), rows, heads, kDim,
               5, rows);
  for (int h = 0; h < heads; ++h) {
    for (int r = 0; r < 5; ++r) {
      Partial expected = p1[h * 5 + r];
      if (r >= 1 && r < 4) expected = Merge(expected, p2[h * rows + r - 1]);
      EXPECT_EQ(lse1[h * 5 + r], expected.lse);
      for (int d = 0; d < kDim; ++d) EXPECT_EQ(o1[(r * heads + h) * kDim + d], expected.o[d]);
    }
  }
}

}  // namespace
}  // namespace hsap
