#include "attention/worklist.h"

#include <chrono>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/attention_test_util.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

// Checks the work list against brute force over the layout: every visible (query, key)
// pair held by both buffers is listed exactly once, nothing else is listed, visible_pairs
// is exact, and the structural promises of the header hold.
void ExpectExactCover(const Layout& layout, const std::vector<TokenRun>& q_runs,
                      const std::vector<TokenRun>& k_runs, int64_t block_q, const WorkList& work) {
  const std::vector<int64_t> q_global = testing::GlobalOfLocal(q_runs);
  const std::vector<int64_t> k_global = testing::GlobalOfLocal(k_runs);
  const int64_t q_rows = q_global.size(), k_rows = k_global.size();
  std::vector<int> listed(q_rows * k_rows, 0);
  int64_t counted = 0;
  int64_t previous_end = 0;
  for (const QueryBlock& b : work.blocks) {
    ASSERT_GE(b.q_begin, previous_end) << "blocks sorted and disjoint";
    ASSERT_LT(b.q_begin, b.q_end);
    ASSERT_LE(b.q_end - b.q_begin, block_q);
    ASSERT_LE(b.q_end, q_rows);
    previous_end = b.q_end;
    // A block never spans two runs: its rows are consecutive global positions.
    for (int64_t r = b.q_begin; r < b.q_end; ++r) {
      ASSERT_GE(q_global[r], 0);
      ASSERT_EQ(q_global[r] - q_global[b.q_begin], r - b.q_begin);
    }
    ASSERT_LT(b.seg_begin, b.seg_end);
    ASSERT_LE(b.seg_end, static_cast<int64_t>(work.segments.size()));
    for (int64_t s = b.seg_begin; s < b.seg_end; ++s) {
      const KeySegment& seg = work.segments[s];
      ASSERT_LT(seg.k_begin, seg.k_end);
      ASSERT_LE(seg.k_end, k_rows);
      ASSERT_LE(seg.diag_lo, seg.diag_hi);
      if (s > b.seg_begin) {
        ASSERT_LE(work.segments[s - 1].k_begin, seg.k_begin);
      }
      int64_t seg_pairs = 0;
      for (int64_t qr = b.q_begin; qr < b.q_end; ++qr) {
        for (int64_t kr = seg.k_begin; kr < seg.k_end; ++kr) {
          if (kr - qr < seg.diag_lo || kr - qr > seg.diag_hi) continue;
          ASSERT_GE(k_global[kr], 0) << "key row not held";
          ASSERT_TRUE(layout.Visible(q_global[qr], k_global[kr]))
              << "invisible pair listed: q " << q_global[qr] << " k " << k_global[kr];
          ++listed[qr * k_rows + kr];
          ++seg_pairs;
        }
      }
      EXPECT_GT(seg_pairs, 0) << "segment without a visible pair";
      counted += seg_pairs;
      // A segment marked full is fully visible (checked above pair by pair); a partial
      // one's key range is clipped so that its first and last keys are seen by some row.
      if (!seg.IsFull()) {
        for (const int64_t kr : {seg.k_begin, seg.k_end - 1}) {
          bool seen = false;
          for (int64_t qr = b.q_begin; qr < b.q_end; ++qr)
            seen |= kr - qr >= seg.diag_lo && kr - qr <= seg.diag_hi;
          EXPECT_TRUE(seen) << "segment range not clipped to the band";
        }
      }
    }
  }
  for (int64_t qr = 0; qr < q_rows; ++qr) {
    for (int64_t kr = 0; kr < k_rows; ++kr) {
      const bool held = q_global[qr] >= 0 && k_global[kr] >= 0;
      const int expected = held && layout.Visible(q_global[qr], k_global[kr]) ? 1 : 0;
      ASSERT_EQ(listed[qr * k_rows + kr], expected)
          << "q " << q_global[qr] << " k " << k_global[kr];
    }
  }
  EXPECT_EQ(work.visible_pairs, counted);
}

TEST(WorkListTest, WholeRowCoversEveryVisiblePairOnce) {
  std::mt19937_64 rng(21);
  for (int trial = 0; trial < 12; ++trial) {
    const Layout layout = testing::RandomDocumentLayout(rng, 100 + 50 * trial, 200);
    const int64_t block_q = trial % 3 == 0 ? 64 : 1 + trial * 5;
    absl::StatusOr<WorkList> work = BuildWorkList(layout, block_q);
    ASSERT_TRUE(work.ok()) << work.status();
    EXPECT_EQ(work->visible_pairs, layout.VisiblePairs());
    const std::vector<TokenRun> whole = {{0, 0, layout.num_tokens()}};
    ExpectExactCover(layout, whole, whole, block_q, *work);
  }
}

TEST(WorkListTest, ShardedRunsCoverEveryVisiblePairOnce) {
  std::mt19937_64 rng(22);
  std::vector<Layout> layouts;
  for (int i = 0; i < 8; ++i) layouts.push_back(testing::RandomDocumentLayout(rng, 300, 150));
  layouts.push_back(testing::SharedPromptLayout(40, {30, 1, 64, 90}, 20));
  layouts.push_back(*Layout::FromDocuments(std::vector<int64_t>{0, 257}));
  for (const Layout& layout : layouts) {
    for (int trial = 0; trial < 4; ++trial) {
      const std::vector<TokenRun> q_runs =
          testing::RandomRuns(rng, layout.num_tokens(), 1 + trial * 3, 0.6);
      const std::vector<TokenRun> k_runs =
          testing::RandomRuns(rng, layout.num_tokens(), 2 + trial * 2, 0.7);
      const int64_t block_q = trial % 2 ? 64 : 17;
      absl::StatusOr<WorkList> work = BuildWorkList(layout.slices(), q_runs, k_runs, block_q);
      ASSERT_TRUE(work.ok()) << work.status();
      ExpectExactCover(layout, q_runs, k_runs, block_q, *work);
    }
  }
}

TEST(WorkListTest, SegmentsAreClippedAndMerged) {
  const Layout layout = *Layout::FromDocuments(std::vector<int64_t>{0, 256});
  absl::StatusOr<WorkList> work = BuildWorkList(layout, 64);
  ASSERT_TRUE(work.ok());
  ASSERT_EQ(work->blocks.size(), 4u);
  // Block i sees keys [0, 64 (i + 1)) under the causal bound alone (the lower bound is
  // dropped since no pair needs it); the kernel tells full tiles from partial ones.
  for (int i = 0; i < 4; ++i) {
    const QueryBlock& b = work->blocks[i];
    ASSERT_EQ(b.seg_end - b.seg_begin, 1);
    const KeySegment& seg = work->segments[b.seg_begin];
    EXPECT_EQ(seg.k_begin, 0);
    EXPECT_EQ(seg.k_end, 64 * (i + 1));
    EXPECT_EQ(seg.diag_lo, -kNoDiagLimit);
    EXPECT_EQ(seg.diag_hi, 0);
  }
  // A full document: one full segment per block.
  const Layout full =
      *Layout::FromDocuments(std::vector<int64_t>{0, 100}, std::vector<MaskKind>{MaskKind::kFull});
  absl::StatusOr<WorkList> full_work = BuildWorkList(full, 64);
  ASSERT_TRUE(full_work.ok());
  ASSERT_EQ(full_work->segments.size(), 2u);
  EXPECT_TRUE(full_work->segments[0].IsFull());
  EXPECT_EQ(full_work->segments[1].k_end, 100);
  // Adjacent full documents seen together (user slices) merge into one segment.
  const Layout adjacent =
      *Layout::FromSlices(40, {MaskSlice::Full(0, 40, 0, 20), MaskSlice::Full(0, 40, 20, 40)});
  absl::StatusOr<WorkList> merged = BuildWorkList(adjacent, 64);
  ASSERT_TRUE(merged.ok());
  ASSERT_EQ(merged->segments.size(), 1u);
  EXPECT_EQ(merged->segments[0].k_end, 40);
}

TEST(WorkListTest, RejectsBadArguments) {
  const Layout layout = *Layout::FromDocuments(std::vector<int64_t>{0, 10});
  const std::vector<TokenRun> whole = {{0, 0, 10}};
  EXPECT_THAT(BuildWorkList(layout, 0).status().message(), HasSubstr("block_q"));
  const std::vector<TokenRun> overlap_global = {{0, 0, 5}, {4, 5, 5}};
  EXPECT_THAT(BuildWorkList(layout.slices(), overlap_global, whole, 8).status().message(),
              HasSubstr("q_runs[0] and q_runs[1] overlap in global"));
  const std::vector<TokenRun> overlap_local = {{0, 0, 5}, {5, 3, 5}};
  EXPECT_THAT(BuildWorkList(layout.slices(), whole, overlap_local, 8).status().message(),
              HasSubstr("k_runs[0] and k_runs[1] overlap in local"));
  const std::vector<TokenRun> negative = {{0, 0, -1}};
  EXPECT_THAT(BuildWorkList(layout.slices(), negative, whole, 8).status().message(),
              HasSubstr("q_runs[0]"));
  MaskSlice bad = MaskSlice::Full(5, 2, 0, 1);
  EXPECT_THAT(BuildWorkList(absl::MakeConstSpan(&bad, 1), whole, whole, 8).status().message(),
              HasSubstr("slices[0]"));
  // No runs at all: an empty work list.
  absl::StatusOr<WorkList> empty = BuildWorkList(layout.slices(), {}, whole, 8);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

// A million tokens in 10,000 documents: the build must stay cheap (it runs per rank pair).
// Its time is printed, not asserted; the result's pair count is checked.
TEST(WorkListTest, MillionTokenLayout) {
  std::mt19937_64 rng(99);
  std::vector<int64_t> cu{0};
  for (int i = 0; i < 10000; ++i) cu.push_back(cu.back() + 1 + rng() % 199);
  const Layout layout = *Layout::FromDocuments(cu);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<WorkList> work = BuildWorkList(layout, 64);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(work.ok());
  EXPECT_EQ(work->visible_pairs, layout.VisiblePairs());
  std::printf("BuildWorkList: %lld tokens, %zu blocks, %zu segments in %.2f ms\n",
              static_cast<long long>(layout.num_tokens()), work->blocks.size(),
              work->segments.size(), ms);
}

}  // namespace
}  // namespace hsap
