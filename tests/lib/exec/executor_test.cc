// Distributed attention through the C API (one thread per rank) against the single-device
// fp64 reference, under the foundation's rule: error <= 2 x the error of the naive
// computation in the storage precision (NaiveForward/NaiveBackward) + a small floor.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "attention/reference.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/nonfinite.h"
#include "tests/support/random_layouts.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using ::hsap::testing::DistCase;
using ::hsap::testing::DocMix;
using ::hsap::testing::HostTensor;
using ::hsap::testing::RandomLayout;
using ::hsap::testing::RandomSliceLayout;
using ::hsap::testing::RowInputs;
using ::hsap::testing::RowOutputs;

using ::hsap::testing::CheckAgainstReference;

struct Scenario {
  std::string name;
  DocMix mix;
  bool causal_only;
  int64_t tokens;
  DistCase c;
};

void PrintTo(const Scenario& s, std::ostream* os) { *os << s.name; }

class DistributedTest : public ::testing::TestWithParam<Scenario> {};

TEST_P(DistributedTest, MatchesSingleDeviceReference) {
  const Scenario& s = GetParam();
  const Layout layout = RandomLayout(s.tokens, s.mix, 1000 + s.c.ranks, s.causal_only);
  CheckAgainstReference(layout, s.c, 77);
}

DistCase Make(int ranks, std::vector<double> weights, DType dtype, int hq, int hkv, int d) {
  DistCase c;
  c.ranks = ranks;
  c.weights = std::move(weights);
  c.dtype = dtype;
  c.heads_q = hq;
  c.heads_kv = hkv;
  c.head_dim = d;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, DistributedTest,
    ::testing::Values(Scenario{"r1_longtail_fp32", DocMix::kLongTail, false, 300,
                               Make(1, {}, DType::kF32, 2, 1, 32)},
                      Scenario{"r2_onehuge_causal_bf16", DocMix::kOneHuge, true, 500,
                               Make(2, {}, DType::kBF16, 2, 2, 32)},
                      Scenario{"r3_tiny_uneven_fp32", DocMix::kTiny, false, 200,
                               Make(3, {1, 2, 1}, DType::kF32, 1, 1, 32)},
                      Scenario{"r4_longtail_3113_bf16_gqa", DocMix::kLongTail, false, 700,
                               Make(4, {3, 1, 1, 3}, DType::kBF16, 4, 2, 32)},
                      Scenario{"r4_uniform_fp32", DocMix::kUniform, false, 600,
                               Make(4, {}, DType::kF32, 2, 1, 64)},
                      Scenario{"r5_single_causal_fp16", DocMix::kSingle, true, 261,
                               Make(5, {}, DType::kF16, 1, 1, 32)},
                      Scenario{"r5_onehuge_mixed_uneven_fp32", DocMix::kOneHuge, false, 600,
                               Make(5, {2, 1, 1, 1, 2}, DType::kF32, 2, 1, 32)},
                      Scenario{"r8_uniform_mqa_fp32", DocMix::kUniform, false, 640,
                               Make(8, {}, DType::kF32, 4, 1, 32)},
                      Scenario{"r8_longtail_uneven_bf16", DocMix::kLongTail, false, 800,
                               Make(8, {5, 1, 1, 1, 1, 1, 1, 5}, DType::kBF16, 2, 1, 32)}),
    [](const ::testing::TestParamInfo<Scenario>& info) { return info.param.name; });

TEST(DistributedSlicesTest, UserSlicesMatchReference) {
  for (int R : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << R << " ranks");
    CheckAgainstReference(RandomSliceLayout(500, 60 + R), Make(R, {}, DType::kF32, 2, 1, 32), 5);
  }
}

TEST(DistributedMaskKindsTest, EveryKindAsOneDocumentSpanningRanks) {
  // Each kind as a single long document, so that its cuts cross ranks.
  const MaskKind kinds[] = {MaskKind::kCausal, MaskKind::kFull, MaskKind::kPrefixLM,
                            MaskKind::kSlidingWindow};
  for (MaskKind kind : kinds) {
    const int64_t L = 333;
    const int64_t param = kind == MaskKind::kPrefixLM        ? 100
                          : kind == MaskKind::kSlidingWindow ? 45
                                                             : 0;
    absl::StatusOr<Layout> layout = Layout::FromDocuments(
        std::vector<int64_t>{0, L}, std::vector<MaskKind>{kind}, std::vector<int64_t>{param});
    ASSERT_TRUE(layout.ok());
    SCOPED_TRACE(::testing::Message() << "kind " << static_cast<int>(kind));
    CheckAgainstReference(*layout, Make(3, {}, DType::kF32, 2, 1, 32), 9);
  }
}

// Plan batches (hsapBatchCreateWithPlan): the sequence split over two groups of two ranks,
// the heads split inside each group; each rank holds its rows of the batch's partition.
TEST(DistributedPlanTest, PlanBatchMatchesReference) {
  const int sizes[] = {2, 2}, ranks[] = {0, 1, 2, 3}, counts[] = {2, 2, 2, 2};
  const int heads[] = {0, 1, 2, 3, 0, 1, 2, 3};
  hsapPlan_t plan = nullptr;
  ASSERT_EQ(
      hsapPlanCreate(&plan, 4, 4, 2, 2, sizes, ranks, nullptr, nullptr, counts, heads, nullptr),
      hsapSuccess)
      << hsapGetLastError();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    DistCase c = Make(4, {}, dtype, 4, 2, 32);
    c.plan = plan;
    CheckAgainstReference(RandomLayout(600, DocMix::kLongTail, 31, false), c, 31);
  }
  hsapPlanDestroy(plan);
}

TEST(DistributedDeterminismTest, BackwardIsBitwiseIdenticalAcrossRuns) {
  const Layout layout = RandomLayout(600, DocMix::kOneHuge, 31, /*causal_only=*/false);
  const DistCase c = Make(4, {3, 1, 1, 3}, DType::kBF16, 2, 1, 32);
  hsapLayout_t handle = testing::ToCLayout(layout);
  RowInputs in(c, layout.num_tokens(), 3);
  RowOutputs a = testing::RunDistributed(handle, c, in);
  RowOutputs b = testing::RunDistributed(handle, c, in);
  hsapLayoutDestroy(handle);
  ASSERT_TRUE(a.ok() && b.ok()) << a.errors[0] << b.errors[0];
  EXPECT_EQ(a.out.bytes, b.out.bytes);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.dq.bytes, b.dq.bytes);
  EXPECT_EQ(a.dk.bytes, b.dk.bytes);
  EXPECT_EQ(a.dv.bytes, b.dv.bytes);
}

TEST(DistributedPartitionTest, BatchPartitionMatchesTheDataLoadersPartition) {
  const Layout layout = RandomLayout(400, DocMix::kLongTail, 8, false);
  const DistCase c = Make(3, {2, 1, 1}, DType::kF32, 1, 1, 32);
  hsapLayout_t handle = testing::ToCLayout(layout);
  RowInputs in(c, layout.num_tokens(), 1);
  RowOutputs got = testing::RunDistributed(handle, c, in);
  ASSERT_TRUE(got.ok());
  hsapPartition_t part = nullptr;
  ASSERT_EQ(hsapPartitionCreate(&part, handle, 3, c.weights.data()), hsapSuccess);
  for (int r = 0; r < 3; ++r) {
    int64_t n = 0, tokens = 0;
    ASSERT_EQ(hsapPartitionGetRanges(part, r, nullptr, &n, &tokens), hsapSuccess);
    std::vector<int64_t> ranges(2 * n);
    ASSERT_EQ(hsapPartitionGetRanges(part, r, ranges.data(), &n, nullptr), hsapSuccess);
    EXPECT_EQ(ranges, got.ranges[r]);
    EXPECT_EQ(tokens, got.local_tokens[r]);
  }
  hsapPartitionDestroy(part);
  hsapLayoutDestroy(handle);
}

std::vector<float> Floats(const HostTensor& t) {
  std::vector<float> x(t.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = t.At(i);
  return x;
}

// NaN and infinity as a naive softmax has them (hsap.h) when documents span ranks and their
// partials are merged; no NaN gradient is lost.
TEST(DistributedNaNTest, NaNAndInfinityPropagateLikeANaiveSoftmax) {
  const Layout layout = testing::NonFiniteLayout();
  DistCase c;
  c.ranks = 3;
  AttentionDims dims;
  dims.heads_q = c.heads_q;
  dims.heads_kv = c.heads_kv;
  dims.head_dim = c.head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  for (testing::Plant plant : testing::kAllPlants) {
    SCOPED_TRACE(testing::PlantName(plant));
    RowInputs in(c, layout.num_tokens(), 15);
    std::vector<float> q = Floats(in.q), k = Floats(in.k);
    testing::PlantNonFinite(plant, dims, &q, &k);
    std::memcpy(in.q.bytes.data(), q.data(), q.size() * sizeof(float));
    std::memcpy(in.k.bytes.data(), k.data(), k.size() * sizeof(float));
    hsapLayout_t handle = testing::ToCLayout(layout);
    const RowOutputs got = testing::RunDistributed(handle, c, in);
    hsapLayoutDestroy(handle);
    ASSERT_TRUE(got.ok()) << got.errors[0] << got.errors[1] << got.errors[2];
    const testing::NaiveOutputs ref = testing::NaiveFp64Forward(layout, dims, q, k, Floats(in.v));
    testing::ExpectForwardNaNPattern(Floats(got.out), got.lse, ref, testing::PlantName(plant));
    const testing::NaNGradients want =
        testing::NaiveNaNGradients(layout, dims, ref.lse, Floats(in.dout));
    testing::ExpectNoNaNLost(Floats(got.dq), want.dq, "dq");
    testing::ExpectNoNaNLost(Floats(got.dk), want.dk, "dk");
    testing::ExpectNoNaNLost(Floats(got.dv), want.dv, "dv");
  }
}

}  // namespace
}  // namespace hsap
