// Communication accounting: the bytes each rank reports (hsapBatchGetTraffic) equal a
// lower bound recomputed here, independently of the schedule, from the partition's ranges
// and brute-force visibility: each K/V row is delivered once to each rank that needs it
// (forward), and in backward once more plus its fp32 dK/dV partial back to its owner.
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/random_layouts.h"
#include "tests/support/traffic_bound.h"

namespace hsap {
namespace {

using ::hsap::testing::DistCase;
using ::hsap::testing::DocMix;
using ::hsap::testing::Expected;
using ::hsap::testing::LowerBound;
using ::hsap::testing::RandomLayout;
using ::hsap::testing::RowInputs;
using ::hsap::testing::RowOutputs;

RowOutputs RunCase(const Layout& layout, const DistCase& c) {
  hsapLayout_t handle = testing::ToCLayout(layout);
  RowInputs in(c, layout.num_tokens(), 4);
  RowOutputs got = testing::RunDistributed(handle, c, in);
  hsapLayoutDestroy(handle);
  return got;
}

void ExpectTrafficIsTheLowerBound(const Layout& layout, const DistCase& c) {
  RowOutputs got = RunCase(layout, c);
  ASSERT_TRUE(got.ok()) << got.errors[0];
  const Expected e = LowerBound(layout, got, c);
  uint64_t total = 0;
  for (int r = 0; r < c.ranks; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    EXPECT_EQ(got.traffic[r].forwardBytesSent, e.per_rank[r].forwardBytesSent);
    EXPECT_EQ(got.traffic[r].forwardBytesReceived, e.per_rank[r].forwardBytesReceived);
    EXPECT_EQ(got.traffic[r].backwardBytesSent, e.per_rank[r].backwardBytesSent);
    EXPECT_EQ(got.traffic[r].backwardBytesReceived, e.per_rank[r].backwardBytesReceived);
    total += got.traffic[r].forwardBytesReceived;
  }
  // A naive ring delivers every K/V row to every other rank.
  const uint64_t ring = static_cast<uint64_t>(layout.num_tokens()) * (c.ranks - 1) * 2 *
                        c.heads_kv * c.head_dim * DTypeSize(c.dtype);
  EXPECT_LE(total, ring);
}

DistCase Case(int ranks, std::vector<double> weights, DType dtype) {
  DistCase c;
  c.ranks = ranks;
  c.weights = std::move(weights);
  c.dtype = dtype;
  c.heads_q = 2;
  c.heads_kv = 1;
  c.head_dim = 32;
  return c;
}

TEST(TrafficTest, EqualsTheLowerBoundOnRandomLayouts) {
  ExpectTrafficIsTheLowerBound(RandomLayout(500, DocMix::kLongTail, 3, false),
                               Case(4, {3, 1, 1, 3}, DType::kBF16));
  ExpectTrafficIsTheLowerBound(RandomLayout(400, DocMix::kSingle, 4, true),
                               Case(3, {}, DType::kF32));
  ExpectTrafficIsTheLowerBound(RandomLayout(600, DocMix::kOneHuge, 5, false),
                               Case(5, {}, DType::kF16));
  ExpectTrafficIsTheLowerBound(testing::RandomSliceLayout(400, 6), Case(3, {}, DType::kF32));
}

TEST(TrafficTest, LocalDocumentsMoveZeroBytes) {
  // Eight causal documents of 60 tokens on four ranks: two whole documents per rank.
  std::vector<int64_t> cu;
  for (int i = 0; i <= 8; ++i) cu.push_back(60 * i);
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu);
  ASSERT_TRUE(layout.ok());
  RowOutputs got = RunCase(*layout, Case(4, {}, DType::kBF16));
  ASSERT_TRUE(got.ok());
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(got.traffic[r].forwardBytesSent, 0u);
    EXPECT_EQ(got.traffic[r].forwardBytesReceived, 0u);
    EXPECT_EQ(got.traffic[r].backwardBytesSent, 0u);
    EXPECT_EQ(got.traffic[r].backwardBytesReceived, 0u);
  }
}

TEST(TrafficTest, SlidingWindowMovesOnlyTheHalo) {
  // One sliding-window document (window 16) cut in contiguous pieces over 4 ranks: each
  // rank needs only the 15 keys before its piece.
  absl::StatusOr<Layout> layout = Layout::FromDocuments(
      std::vector<int64_t>{0, 800}, std::vector<MaskKind>{MaskKind::kSlidingWindow},
      std::vector<int64_t>{16});
  ASSERT_TRUE(layout.ok());
  const DistCase c = Case(4, {}, DType::kF32);
  RowOutputs got = RunCase(*layout, c);
  ASSERT_TRUE(got.ok());
  const uint64_t kv_row = 2ull * c.heads_kv * c.head_dim * 4;
  uint64_t received = 0;
  for (int r = 0; r < 4; ++r) received += got.traffic[r].forwardBytesReceived;
  EXPECT_EQ(received, 3 * 15 * kv_row);
}

}  // namespace
}  // namespace hsap
