#include "lib/cuda/exec/launch_grid.h"

#include <climits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsap::cuda {
namespace {

using ::testing::HasSubstr;

TEST(AttentionGrid, OneCtaPerQueryBlockAndHead) {
  absl::StatusOr<LaunchGrid> g = AttentionGrid(7, 3);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (LaunchGrid{7, 3}));
  EXPECT_FALSE(g->empty());
}

TEST(AttentionGrid, NoWorkIsAnEmptyGrid) {
  for (auto [blocks, heads] : {std::pair{0LL, 8LL}, {5LL, 0LL}, {0LL, 0LL}}) {
    absl::StatusOr<LaunchGrid> g = AttentionGrid(blocks, heads);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(g->empty()) << blocks << " x " << heads;
  }
}

TEST(AttentionGrid, ReachesTheGridLimitsExactly) {
  absl::StatusOr<LaunchGrid> g = AttentionGrid(kMaxGridX, kMaxGridY);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->x, 2147483647u);
  EXPECT_EQ(g->y, 65535u);
}

// The kernels do not loop over blocks or heads: work beyond the grid is refused, never cut.
TEST(AttentionGrid, WorkBeyondTheGridIsInvalid) {
  for (auto [blocks, heads] : {std::pair{1LL, kMaxGridY + 1},
                               {kMaxGridX + 1, 1LL},
                               {LLONG_MAX, LLONG_MAX},
                               {-1LL, 4LL},
                               {4LL, -1LL}}) {
    absl::StatusOr<LaunchGrid> g = AttentionGrid(blocks, heads);
    ASSERT_FALSE(g.ok()) << blocks << " x " << heads;
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(g.status().message(), HasSubstr("65535"));
  }
}

TEST(HelperGrid, RoundsUpToWholeCtas) {
  EXPECT_EQ(HelperGrid(1, 100), (LaunchGrid{1, 1}));
  EXPECT_EQ(HelperGrid(256, 100), (LaunchGrid{1, 1}));
  EXPECT_EQ(HelperGrid(257, 100), (LaunchGrid{2, 1}));
  EXPECT_EQ(HelperGrid(256 * 37, 100), (LaunchGrid{37, 1}));
}

// No work still launches one CTA, whose grid-stride loop does nothing.
TEST(HelperGrid, NoWorkIsOneCta) {
  EXPECT_EQ(HelperGrid(0, 100), (LaunchGrid{1, 1}));
  EXPECT_EQ(HelperGrid(-5, 100), (LaunchGrid{1, 1}));
}

TEST(HelperGrid, CappedByTheDeviceAndTheGridLimit) {
  EXPECT_EQ(HelperGrid(256 * 1000, 264), (LaunchGrid{264, 1}));
  EXPECT_EQ(HelperGrid(LLONG_MAX, 264), (LaunchGrid{264, 1}));
  EXPECT_EQ(HelperGrid(LLONG_MAX, LLONG_MAX), (LaunchGrid{2147483647u, 1}));
  EXPECT_EQ(HelperGrid(1000, 0), (LaunchGrid{1, 1}));  // a cap below one CTA: one CTA
}

TEST(HelperGrid, EachKernelByItsThreadsOfWork) {
  // Delta: a warp per (row, head): 10 rows x 4 heads x 32 = 1280 threads = 5 CTAs.
  EXPECT_EQ(HelperGrid(hsap_dev::DeltaParams{nullptr, nullptr, nullptr, 10, 4}, 100).x, 5u);
  // Init: 4 threads per (row, head): 100 x 8 x 4 = 3200 threads = 12.5 CTAs.
  EXPECT_EQ(HelperGrid(hsap_dev::InitParams{nullptr, nullptr, 100, 8}, 100).x, 13u);
  EXPECT_EQ(HelperGrid(hsap_dev::ConvertParams{nullptr, nullptr, 513}, 100).x, 3u);
  EXPECT_EQ(HelperGrid(hsap_dev::AccumulateParams{nullptr, nullptr, 512}, 100).x, 2u);
  // Chunks: a CTA per chunk; none: nothing to launch.
  EXPECT_EQ(HelperGrid(hsap_dev::ChunksParams{nullptr, nullptr, nullptr, 9}, 100).x, 9u);
  EXPECT_TRUE(HelperGrid(hsap_dev::ChunksParams{nullptr, nullptr, nullptr, 0}, 100).empty());
  EXPECT_EQ(HelperGrid(hsap_dev::ChunksParams{nullptr, nullptr, nullptr, 1LL << 40}, 100).x, 100u);
  // The cuDNN engine's helpers: a warp per (entry row, head) for the merge (40 rows x 4 heads
  // x 32 = 5120 threads = 20 CTAs), a thread per element for the gather (40 x 4) and the add
  // (40 x 256); no entries: nothing to launch.
  hsap_dev::EntryMergeParams merge{};
  merge.total_rows = 40;
  merge.heads = 4;
  merge.num_entries = 3;
  EXPECT_EQ(HelperGrid(merge, 100).x, 20u);
  merge.num_entries = 0;
  EXPECT_TRUE(HelperGrid(merge, 100).empty());
  hsap_dev::StatsGatherParams gather{};
  gather.total_rows = 40;
  gather.heads = 4;
  gather.num_entries = 3;
  EXPECT_EQ(HelperGrid(gather, 100).x, 1u);
  hsap_dev::EntryAddParams add{};
  add.total_rows = 40;
  add.row_elems = 256;
  add.num_entries = 3;
  EXPECT_EQ(HelperGrid(add, 100).x, 40u);
  add.num_entries = 0;
  EXPECT_TRUE(HelperGrid(add, 100).empty());
  // Very large rows stay in range.
  EXPECT_EQ(HelperGrid(hsap_dev::DeltaParams{nullptr, nullptr, nullptr, 1LL << 40, 64}, 132).x,
            132u);
}

std::vector<hsap_dev::FusedStep> Steps(std::vector<int> num_blocks) {
  std::vector<hsap_dev::FusedStep> steps(num_blocks.size());
  for (size_t i = 0; i < steps.size(); ++i) steps[i].num_blocks = num_blocks[i];
  return steps;
}

TEST(FusedForwardGrid, CopyCtasThenComputeForTheLargestStep) {
  // Largest step: 5 blocks x 4 heads = 20 compute CTAs, after 2 copy CTAs.
  absl::StatusOr<LaunchGrid> g = FusedForwardGrid(Steps({3, 5, 1}), 4, 1000, 1, 2);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (LaunchGrid{22, 1}));
}

TEST(FusedForwardGrid, ComputeWithinTheLaunchsPartOfResidency) {
  // 264 resident, 3 ranks sharing: 88 each, 8 of them copy CTAs.
  absl::StatusOr<LaunchGrid> g = FusedForwardGrid(Steps({1000}), 8, 264, 3, 8);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (LaunchGrid{88, 1}));
}

// Steps without work still get one CTA beyond the copy tasks.
TEST(FusedForwardGrid, NoWorkIsOneComputeCta) {
  absl::StatusOr<LaunchGrid> g = FusedForwardGrid(Steps({0, 0}), 4, 100, 1, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (LaunchGrid{2, 1}));
  g = FusedForwardGrid({}, 4, 100, 1, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->empty());
}

TEST(FusedForwardGrid, NoRoomForAComputeCtaIsResourceExhausted) {
  // 5 resident shared by 3 ranks: 1 each, all of it the copy CTA.
  absl::StatusOr<LaunchGrid> g = FusedForwardGrid(Steps({4}), 2, 5, 3, 1);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(g.status().message(), HasSubstr("needs 2 resident CTAs"));
  EXPECT_THAT(g.status().message(), HasSubstr("shared by 3 ranks"));
  EXPECT_FALSE(FusedForwardGrid(Steps({4}), 2, 0, 1, 1).ok());
}

TEST(FusedForwardGrid, VeryLargeResidencyStaysWithinGridX) {
  // The most work items a launch may have (its tickets are 32-bit): 2^31 - 1 tasks in all.
  absl::StatusOr<LaunchGrid> g = FusedForwardGrid(Steps({32767}), 65535, LLONG_MAX, 1, 8);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->x, 32767u * 65535u + 8u);
  EXPECT_LE(g->x, static_cast<unsigned int>(kMaxGridX));
}

// The kernel hands out its tasks by 32-bit ticket: a launch of 2^31 tasks or more is refused.
TEST(FusedForwardGrid, TooManyTasksIsResourceExhausted) {
  absl::StatusOr<LaunchGrid> g = FusedForwardGrid(Steps({INT_MAX}), 65535, LLONG_MAX, 1, 8);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(g.status().message(), HasSubstr("140735340806153 tasks"));
  g = FusedForwardGrid(Steps({32767, 2}), 65535, LLONG_MAX, 1, 8);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted);
}

// The sm_90a fused forward: launch s copies step s into buffer s % 2 and attends step s - 1
// from the other buffer; copy CTAs come first in the grid, one row of them.
TEST(FusedWgmmaLaunches, EachLaunchCopiesOneStepAndAttendsThePrevious) {
  hsap_dev::FusedFwdHead head{};
  char stage[4][64];
  head.stage_k[0] = stage[0];
  head.stage_k[1] = stage[1];
  head.stage_v[0] = stage[2];
  head.stage_v[1] = stage[3];
  head.heads_q = 4;
  head.heads_kv = 2;
  head.ready_timeout_ns = 77;
  std::vector<hsap_dev::FusedStep> steps = Steps({3, 0, 5});
  unsigned int flags[3];
  for (int s = 0; s < 3; ++s) {
    steps[s].k_rows = 10 * (s + 1);
    steps[s].k_src = &flags[s];
    steps[s].ready_value = 100 + s;
  }
  absl::StatusOr<std::vector<FusedWgmmaLaunch>> l = FusedWgmmaLaunches(head, steps, 2, 64, 2);
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_EQ(l->size(), 4u);
  for (int s = 0; s < 4; ++s) {
    SCOPED_TRACE(s);
    const FusedWgmmaLaunch& x = (*l)[s];
    const int copies = s < 3 ? 2 : 0, blocks = s > 0 ? steps[s - 1].num_blocks : 0;
    EXPECT_EQ(x.copy.parts, copies);
    EXPECT_EQ(x.fwd.num_blocks, blocks);
    EXPECT_EQ(x.grid, (LaunchGrid{static_cast<unsigned>(copies + blocks), blocks > 0 ? 4u : 1u}));
    if (s < 3) {
      EXPECT_EQ(x.copy.k_src, &flags[s]);
      EXPECT_EQ(x.copy.k_dst, head.stage_k[s % 2]);
      EXPECT_EQ(x.copy.v_dst, head.stage_v[s % 2]);
      EXPECT_EQ(x.copy.bytes, steps[s].k_rows * 2 * 64 * 2);
      EXPECT_EQ(x.copy.ready_value, 100u + s);
      EXPECT_EQ(x.copy.ready_timeout_ns, 77u);
    }
    if (s > 0) {
      EXPECT_EQ(x.fwd.k, head.stage_k[(s - 1) % 2]);
      EXPECT_EQ(x.fwd.v, head.stage_v[(s - 1) % 2]);
      EXPECT_EQ(x.fwd.k_rows, steps[s - 1].k_rows);
    }
  }
  // Step 1 has no blocks: launch 2 only copies (one row of CTAs).
  EXPECT_EQ((*l)[2].grid, (LaunchGrid{2, 1}));
  EXPECT_TRUE(FusedWgmmaLaunches(head, {}, 2, 64, 2)->empty());
  EXPECT_EQ(FusedWgmmaLaunches(head, steps, 0, 64, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsap::cuda
