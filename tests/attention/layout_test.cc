#include "attention/layout.h"

#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/attention_test_util.h"

namespace hsap {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(MaskSliceTest, ConstructorsSetTheBand) {
  const MaskSlice full = MaskSlice::Full(1, 5, 2, 9);
  EXPECT_TRUE(full.IsFull());
  EXPECT_EQ(full.VisiblePairs(), 4 * 7);
  const MaskSlice causal = MaskSlice::Causal(0, 4, 0, 4);
  EXPECT_EQ(causal.diag_hi, 0);
  EXPECT_EQ(causal.VisiblePairs(), 10);
  EXPECT_EQ(causal.VisibleKeys(2), 3);
  EXPECT_EQ(causal.VisibleKeys(4), 0);
  const MaskSlice window = MaskSlice::Causal(0, 6, 0, 6, 2);
  EXPECT_EQ(window.diag_lo, -1);
  EXPECT_EQ(window.VisiblePairs(), 1 + 5 * 2);
  EXPECT_TRUE(window.Visible(3, 2));
  EXPECT_FALSE(window.Visible(3, 1));
}

TEST(LayoutTest, CompilesEachKind) {
  // causal [0,3), empty, full [3,8), prefix-LM(2) [8,12), sliding(3) [12,20).
  const std::vector<int64_t> cu = {0, 3, 3, 8, 12, 20};
  const std::vector<MaskKind> kinds = {MaskKind::kCausal, MaskKind::kPrefixLM, MaskKind::kFull,
                                       MaskKind::kPrefixLM, MaskKind::kSlidingWindow};
  const std::vector<int64_t> params = {0, 99 /* ignored: empty */, 0, 2, 3};
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds, params);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->num_tokens(), 20);
  EXPECT_EQ(layout->documents().size(), 5u);
  EXPECT_THAT(layout->slices(),
              ElementsAre(MaskSlice::Causal(0, 3, 0, 3), MaskSlice::Full(3, 8, 3, 8),
                          MaskSlice::Full(8, 12, 8, 10), MaskSlice::Causal(10, 12, 10, 12),
                          MaskSlice::Causal(12, 20, 12, 20, 3)));
  // Prefix-LM edge cases: prefix 0 is causal, prefix = length is full.
  absl::StatusOr<Layout> edges = Layout::FromDocuments(
      std::vector<int64_t>{0, 4, 8},
      std::vector<MaskKind>{MaskKind::kPrefixLM, MaskKind::kPrefixLM}, std::vector<int64_t>{0, 4});
  ASSERT_TRUE(edges.ok()) << edges.status();
  EXPECT_THAT(edges->slices(),
              ElementsAre(MaskSlice::Causal(0, 4, 0, 4), MaskSlice::Full(4, 8, 4, 8)));
  // kinds empty: all causal.
  absl::StatusOr<Layout> causal = Layout::FromDocuments(std::vector<int64_t>{0, 2, 5});
  ASSERT_TRUE(causal.ok());
  EXPECT_THAT(causal->slices(),
              ElementsAre(MaskSlice::Causal(0, 2, 0, 2), MaskSlice::Causal(2, 5, 2, 5)));
  // No document at all.
  absl::StatusOr<Layout> empty = Layout::FromDocuments(std::vector<int64_t>{0});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->num_tokens(), 0);
  EXPECT_TRUE(empty->slices().empty());
}

// A window applies per document: longer than a document, it is the whole document (causal),
// clamped to the document's length, so one window serves a row of documents of any lengths.
TEST(LayoutTest, WindowLongerThanADocumentIsTheWholeDocument) {
  const std::vector<int64_t> cu = {0, 1, 4, 12, 12};
  const std::vector<MaskKind> kinds(4, MaskKind::kSlidingWindow);
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds, std::vector<int64_t>(4, 5));
  ASSERT_TRUE(layout.ok()) << layout.status();
  // Documents of 1 and 3 tokens: the window (5) covers them, clamped to 1 and 3; the 8-token
  // document keeps its window of 5; the empty one is skipped.
  EXPECT_THAT(layout->slices(),
              ElementsAre(MaskSlice::Causal(0, 1, 0, 1, 1), MaskSlice::Causal(1, 4, 1, 4, 3),
                          MaskSlice::Causal(4, 12, 4, 12, 5)));
  EXPECT_EQ(layout->documents()[0].param, 1);
  EXPECT_EQ(layout->documents()[1].param, 3);
  EXPECT_EQ(layout->documents()[2].param, 5);
  // Pair by pair it is the causal mask inside the short documents and the window in the
  // long one, and nothing across documents.
  for (int64_t q = 0; q < 12; ++q) {
    for (int64_t k = 0; k < 12; ++k) {
      const int64_t dq = q < 1 ? 0 : q < 4 ? 1 : 2, dk = k < 1 ? 0 : k < 4 ? 1 : 2;
      const bool expect = dq == dk && k <= q && (dq < 2 || k > q - 5);
      EXPECT_EQ(layout->Visible(q, k), expect) << "q " << q << " k " << k;
    }
  }
  // Any window of at least the document's length gives the same mask (and fingerprint).
  absl::StatusOr<Layout> huge = Layout::FromDocuments(
      cu, kinds, std::vector<int64_t>{int64_t{1} << 40, 3, 5, 7});
  ASSERT_TRUE(huge.ok()) << huge.status();
  EXPECT_EQ(huge->slices(), layout->slices());
  EXPECT_EQ(huge->Fingerprint(), layout->Fingerprint());
}

TEST(LayoutTest, FromDocumentsErrorsNameTheArgument) {
  auto error = [](std::vector<int64_t> cu, std::vector<MaskKind> kinds,
                  std::vector<int64_t> params) {
    absl::StatusOr<Layout> l = Layout::FromDocuments(cu, kinds, params);
    EXPECT_FALSE(l.ok());
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(l.status().message());
  };
  EXPECT_THAT(error({}, {}, {}), HasSubstr("cu_seqlens is empty"));
  EXPECT_THAT(error({1, 4}, {}, {}), HasSubstr("cu_seqlens[0]"));
  EXPECT_THAT(error({0, 4, 3}, {}, {}), HasSubstr("cu_seqlens[2]"));
  EXPECT_THAT(error({0, 4}, {MaskKind::kCausal, MaskKind::kCausal}, {}), HasSubstr("kinds"));
  EXPECT_THAT(error({0, 4}, {}, {1, 2}), HasSubstr("params"));
  EXPECT_THAT(error({0, 4}, {static_cast<MaskKind>(7)}, {}), HasSubstr("kinds[0]"));
  EXPECT_THAT(error({0, 4}, {MaskKind::kSlidingWindow}, {}), HasSubstr("params is empty"));
  const std::string window =
      error({0, 2, 5}, {MaskKind::kCausal, MaskKind::kSlidingWindow}, {0, 0});
  EXPECT_THAT(window, HasSubstr("params[1]"));
  EXPECT_THAT(window, HasSubstr("document 1"));
  EXPECT_THAT(error({0, 3}, {MaskKind::kPrefixLM}, {4}), HasSubstr("document 0"));
  EXPECT_THAT(error({0, 3}, {MaskKind::kPrefixLM}, {4}), HasSubstr("longer than the document"));
  EXPECT_THAT(error({0, 3}, {MaskKind::kPrefixLM}, {-1}), HasSubstr("params[0]"));
}

TEST(LayoutTest, FromSlicesErrorsNameTheSlice) {
  auto error = [](int64_t n, std::vector<MaskSlice> slices) {
    absl::StatusOr<Layout> l = Layout::FromSlices(n, std::move(slices));
    EXPECT_FALSE(l.ok());
    return std::string(l.status().message());
  };
  EXPECT_THAT(error(-1, {}), HasSubstr("num_tokens"));
  EXPECT_THAT(error(8, {MaskSlice::Full(0, 9, 0, 4)}), HasSubstr("slices[0]"));
  EXPECT_THAT(error(8, {MaskSlice::Full(0, 2, 0, 2), MaskSlice::Full(3, 3, 0, 4)}),
              HasSubstr("slices[1]"));
  MaskSlice inverted = MaskSlice::Full(0, 4, 0, 4);
  inverted.diag_lo = 2;
  inverted.diag_hi = 1;
  EXPECT_THAT(error(8, {inverted}), HasSubstr("diag_lo > diag_hi"));
  MaskSlice missing = MaskSlice::Full(0, 2, 0, 2);
  missing.diag_lo = 5;
  EXPECT_THAT(error(8, {missing}), HasSubstr("no visible pair"));
  const std::string overlap = error(
      8, {MaskSlice::Full(0, 2, 0, 2), MaskSlice::Causal(4, 8, 0, 8), MaskSlice::Full(6, 8, 3, 5)});
  EXPECT_THAT(overlap, HasSubstr("overlap"));
  EXPECT_THAT(overlap, HasSubstr("slices[1]"));
  EXPECT_THAT(overlap, HasSubstr("slices[2]"));
  // Same rectangle, disjoint bands (lower triangle and strictly upper one): fine.
  MaskSlice upper = MaskSlice::Full(0, 8, 0, 8);
  upper.diag_lo = 1;
  absl::StatusOr<Layout> split = Layout::FromSlices(8, {upper, MaskSlice::Causal(0, 8, 0, 8)});
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->VisiblePairs(), 64);
  // Overlapping rectangles whose bands miss each other inside the intersection: fine.
  // k - q <= -2 (relative to the corner (4, 0): d = k - (q - 4) <= 2), while the window
  // keeps k - q in [-1, 0].
  MaskSlice far = MaskSlice::Full(4, 8, 0, 8);
  far.diag_hi = 2;
  absl::StatusOr<Layout> disjoint = Layout::FromSlices(8, {MaskSlice::Causal(0, 8, 0, 8, 2), far});
  ASSERT_TRUE(disjoint.ok()) << disjoint.status();
  far.diag_hi = 3;  // now k - q = -1 is in both
  EXPECT_THAT(error(8, {MaskSlice::Causal(0, 8, 0, 8, 2), far}), HasSubstr("overlap"));
}

// Brute force: the overlap check agrees with pixel-wise counting on random slice sets.
TEST(LayoutTest, OverlapCheckMatchesBruteForce) {
  std::mt19937_64 rng(7);
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t n = 24;
    std::vector<MaskSlice> slices;
    const int count = std::uniform_int_distribution<int>(1, 6)(rng);
    std::uniform_int_distribution<int64_t> pos(0, n - 1);
    for (int i = 0; i < count; ++i) {
      int64_t q0 = pos(rng), q1 = pos(rng), k0 = pos(rng), k1 = pos(rng);
      if (q0 > q1) std::swap(q0, q1);
      if (k0 > k1) std::swap(k0, k1);
      MaskSlice s = MaskSlice::Full(q0, q1 + 1, k0, k1 + 1);
      switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
        case 0:
          break;
        case 1:
          s.diag_hi = std::uniform_int_distribution<int64_t>(-3, 3)(rng);
          break;
        case 2:
          s.diag_lo = std::uniform_int_distribution<int64_t>(-3, 3)(rng);
          break;
        default:
          s.diag_lo = std::uniform_int_distribution<int64_t>(-6, 0)(rng);
          s.diag_hi = s.diag_lo + std::uniform_int_distribution<int64_t>(0, 4)(rng);
      }
      if (s.VisiblePairs() > 0) slices.push_back(s);
    }
    std::vector<int> cover(n * n, 0);
    bool overlap = false;
    for (const MaskSlice& s : slices)
      for (int64_t q = 0; q < n; ++q)
        for (int64_t k = 0; k < n; ++k)
          if (s.Visible(q, k) && ++cover[q * n + k] > 1) overlap = true;
    absl::StatusOr<Layout> layout = Layout::FromSlices(n, slices);
    ASSERT_EQ(layout.ok(), !overlap) << trial << ": " << layout.status();
    (overlap ? rejected : accepted)++;
  }
  EXPECT_GT(accepted, 50);
  EXPECT_GT(rejected, 50);
}

std::vector<Layout> RandomLayouts() {
  std::mt19937_64 rng(11);
  std::vector<Layout> layouts;
  for (int i = 0; i < 20; ++i) {
    layouts.push_back(testing::RandomDocumentLayout(rng, 50 + 13 * i, 90));
  }
  layouts.push_back(testing::SharedPromptLayout(37, {20, 1, 70}, 9));
  return layouts;
}

TEST(LayoutTest, CountsMatchBruteForce) {
  std::mt19937_64 rng(3);
  for (const Layout& layout : RandomLayouts()) {
    const int64_t n = layout.num_tokens();
    const std::vector<int64_t> per_query = layout.VisibleKeysPerQuery();
    ASSERT_EQ(static_cast<int64_t>(per_query.size()), n);
    int64_t total = 0;
    for (int64_t q = 0; q < n; ++q) {
      int64_t keys = 0;
      for (int64_t k = 0; k < n; ++k) keys += layout.Visible(q, k);
      EXPECT_EQ(per_query[q], keys) << "q " << q;
      total += keys;
    }
    EXPECT_EQ(layout.VisiblePairs(), total);
    // VisiblePairsIn over random sub-rectangles, per slice.
    std::uniform_int_distribution<int64_t> pos(0, n);
    for (const MaskSlice& s : layout.slices()) {
      int64_t qb = pos(rng), qe = pos(rng), kb = pos(rng), ke = pos(rng);
      if (qb > qe) std::swap(qb, qe);
      if (kb > ke) std::swap(kb, ke);
      int64_t brute = 0;
      for (int64_t q = qb; q < qe; ++q)
        for (int64_t k = kb; k < ke; ++k) brute += s.Visible(q, k);
      EXPECT_EQ(s.VisiblePairsIn(qb, qe, kb, ke), brute);
    }
  }
}

TEST(LayoutTest, CountPairsInBandMatchesBruteForce) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    std::uniform_int_distribution<int64_t> pos(0, 20), diag(-25, 25);
    int64_t q0 = pos(rng), q1 = pos(rng), k0 = pos(rng), k1 = pos(rng);
    int64_t lo = diag(rng), hi = diag(rng);
    if (trial % 5 == 0) lo = -kNoDiagLimit;
    if (trial % 7 == 0) hi = kNoDiagLimit;
    int64_t brute = 0;
    for (int64_t q = q0; q < q1; ++q)
      for (int64_t k = k0; k < k1; ++k) brute += (k - q >= lo && k - q <= hi);
    EXPECT_EQ(CountPairsInBand(q0, q1, k0, k1, lo, hi), brute);
  }
}

TEST(LayoutTest, FingerprintIdentifiesTheMask) {
  const std::vector<int64_t> cu = {0, 5, 9};
  const Layout a = *Layout::FromDocuments(cu);
  const Layout b = *Layout::FromDocuments(cu);
  const Layout c = *Layout::FromDocuments(std::vector<int64_t>{0, 4, 9});
  const Layout d =
      *Layout::FromDocuments(cu, std::vector<MaskKind>{MaskKind::kCausal, MaskKind::kFull});
  // The same mask spelled as slices has the same fingerprint.
  const Layout e =
      *Layout::FromSlices(9, {MaskSlice::Causal(5, 9, 5, 9), MaskSlice::Causal(0, 5, 0, 5)});
  EXPECT_EQ(a.Fingerprint(), b.Fingerprint());
  EXPECT_EQ(a.Fingerprint(), e.Fingerprint());
  EXPECT_NE(a.Fingerprint(), c.Fingerprint());
  EXPECT_NE(a.Fingerprint(), d.Fingerprint());
}

TEST(LayoutTest, DescribeDiagBandNeverShowsTheSentinel) {
  EXPECT_EQ(DescribeDiagBand(-kNoDiagLimit, kNoDiagLimit), "full");
  EXPECT_EQ(DescribeDiagBand(-kNoDiagLimit, 0), "causal");
  EXPECT_EQ(DescribeDiagBand(-2, 0), "causal, window 3");
  EXPECT_EQ(DescribeDiagBand(0, 0), "causal, window 1");
  EXPECT_EQ(DescribeDiagBand(-kNoDiagLimit, 4), "diag [-inf, 4]");
  EXPECT_EQ(DescribeDiagBand(-1, kNoDiagLimit), "diag [-1, +inf]");
  EXPECT_EQ(DescribeDiagBand(2, 0), "diag [2, 0]");
  EXPECT_EQ(MaskSlice::Causal(0, 4, 0, 4, 2).ToString(), "{q [0, 4), k [0, 4), causal, window 2}");
  EXPECT_EQ(MaskSlice::Full(1, 2, 3, 4).ToString(), "{q [1, 2), k [3, 4), full}");
}

}  // namespace
}  // namespace hsap
