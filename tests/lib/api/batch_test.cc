// The contracts of hsap.h around batches: what a batch keeps of its layout, the order of
// destruction, ranks of weight 0, and the head-dim rule at every creation entry point.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/dtype.h"
#include "attention/kernel.h"
#include "attention/layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

// A causal, a sliding-window and a prefix-LM document: cuts through every kind of band.
Layout MixedLayout() {
  absl::StatusOr<Layout> layout = Layout::FromDocuments(
      std::vector<int64_t>{0, 70, 150, 200},
      std::vector<MaskKind>{MaskKind::kCausal, MaskKind::kSlidingWindow, MaskKind::kPrefixLM},
      std::vector<int64_t>{0, 24, 13});
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *layout;
}

AttentionDims DimsOf(const testing::DistCase& c) {
  AttentionDims dims;
  dims.heads_q = c.heads_q;
  dims.heads_kv = c.heads_kv;
  dims.head_dim = c.head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  return dims;
}

TEST(ApiBatchTest, LayoutMayBeDestroyedOnceTheBatchesExist) {
  const Layout layout = MixedLayout();
  testing::DistCase c;
  c.ranks = 3;
  hsapLayout_t handle = testing::ToCLayout(layout);
  hsapLayout_t decoy = nullptr;
  std::barrier all_created(c.ranks);
  c.after_create = [&](int rank) {
    all_created.arrive_and_wait();
    if (rank == 0) {
      EXPECT_EQ(hsapLayoutDestroy(handle), hsapSuccess);
      // Likely to reuse the freed memory, so that a batch still reading the layout would
      // see another mask.
      const int64_t cu[] = {0, 200};
      const hsapMaskKind_t kinds[] = {hsapMaskFull};
      EXPECT_EQ(hsapLayoutCreate(&decoy, cu, 1, kinds, nullptr), hsapSuccess);
    }
    all_created.arrive_and_wait();
  };
  testing::RowInputs in(c, layout.num_tokens(), 17);
  const testing::RowOutputs got = testing::RunDistributed(handle, c, in);
  hsapLayoutDestroy(decoy);
  for (int r = 0; r < c.ranks; ++r) {
    ASSERT_EQ(got.results[r], hsapSuccess) << "rank " << r << ": " << got.errors[r];
  }
  testing::ExpectMatchesReference(layout, in.Reference(DimsOf(c), c.dtype), in.dout.bytes.data(),
                                  got, /*backward=*/true);
}

TEST(ApiBatchTest, RankOfWeightZeroHoldsNoTokenAndResultsMatch) {
  const Layout layout = MixedLayout();
  for (const std::vector<double>& weights :
       {std::vector<double>{1, 0, 2}, std::vector<double>{0, 1}, std::vector<double>{0, 3, 0, 1}}) {
    SCOPED_TRACE(::testing::Message() << weights.size() << " ranks, rank 0 weight " << weights[0]);
    testing::DistCase c;
    c.ranks = static_cast<int>(weights.size());
    c.weights = weights;
    c.dtype = DType::kBF16;
    const testing::RowOutputs got = testing::CheckAgainstReference(layout, c, 23);
    ASSERT_TRUE(got.ok());
    for (int r = 0; r < c.ranks; ++r) {
      if (weights[r] == 0) {
        EXPECT_EQ(got.local_tokens[r], 0) << "rank " << r;
        EXPECT_TRUE(got.ranges[r].empty()) << "rank " << r;
      } else {
        EXPECT_GT(got.local_tokens[r], 0) << "rank " << r;
      }
    }
  }
}

TEST(ApiBatchTest, AllWeightsZeroIsAnInvalidArgument) {
  hsapLayout_t layout = testing::ToCLayout(MixedLayout());
  hsapPartition_t partition = nullptr;
  const double weights[] = {0, 0};
  EXPECT_EQ(hsapPartitionCreate(&partition, layout, 2, weights), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("every weight is 0"));
  const double negative[] = {1, -1};
  EXPECT_EQ(hsapPartitionCreate(&partition, layout, 2, negative), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("weights[1]"));
  hsapLayoutDestroy(layout);
}

// hsapAttentionForwardOnStream / BackwardOnStream on host communicators: NULL computes what
// the plain calls compute (bit for bit); a stream is refused on its rank, with the reason,
// and its peer fails the call too instead of waiting.
TEST(ApiBatchTest, OnStreamCallsOnHostCommunicatorsTakeOnlyNull) {
  constexpr int R = 2;
  hsapComm_t comms[R];
  ASSERT_EQ(hsapCommInitAll(comms, R, nullptr), hsapSuccess) << hsapGetLastError();
  hsapLayout_t layout = testing::ToCLayout(MixedLayout());
  testing::OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = HSAP_BATCH_CONFIG_INITIALIZER;
    config.dtype = hsapFloat32;
    config.numHeadsQ = 2;
    config.numHeadsKV = 1;
    config.headDim = 32;
    hsapBatch_t batch = nullptr;
    ASSERT_EQ(hsapBatchCreate(&batch, comms[r], layout, nullptr, &config), hsapSuccess)
        << hsapGetLastError();
    int64_t n = 0;
    ASSERT_EQ(hsapBatchGetLocalTokens(batch, &n), hsapSuccess);
    auto filled = [&](int heads, float scale) {
      std::vector<float> v(n * heads * 32);
      for (size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>((i * 7 + r) % 13);
      return v;
    };
    std::vector<float> q = filled(2, 0.1f), k = filled(1, 0.2f), v = filled(1, 1.0f),
                       dout = filled(2, 0.3f);
    std::vector<float> out(q.size()), out2(q.size()), lse(2 * n + 1), lse2(2 * n + 1);
    std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
    std::vector<float> dq2(q.size()), dk2(k.size()), dv2(v.size());
    auto t = [&](std::vector<float>& x, int heads) {
      return hsapTensor_t{x.data(), hsapFloat32, n, heads, 32};
    };
    hsapTensor_t tq = t(q, 2), tk = t(k, 1), tv = t(v, 1), tdout = t(dout, 2);
    hsapTensor_t to = t(out, 2), to2 = t(out2, 2);
    hsapTensor_t tdq = t(dq, 2), tdk = t(dk, 1), tdv = t(dv, 1);
    hsapTensor_t tdq2 = t(dq2, 2), tdk2 = t(dk2, 1), tdv2 = t(dv2, 1);
    void* stream = r == 0 ? reinterpret_cast<void*>(uintptr_t{0x1000}) : nullptr;
    const hsapResult_t refused =
        hsapAttentionForwardOnStream(batch, &tq, &tk, &tv, &to, lse.data(), stream);
    if (r == 0) {
      EXPECT_EQ(refused, hsapInvalidArgument);
      EXPECT_THAT(hsapGetLastError(), HasSubstr("cudaStream is not NULL but the batch is on a "
                                                "host communicator"));
    } else {
      EXPECT_EQ(refused, hsapInvalidUsage);
      EXPECT_THAT(hsapGetLastError(), HasSubstr("rank 0 rejected its arguments"));
    }
    ASSERT_EQ(hsapAttentionForward(batch, &tq, &tk, &tv, &to, lse.data()), hsapSuccess)
        << hsapGetLastError();
    ASSERT_EQ(hsapAttentionForwardOnStream(batch, &tq, &tk, &tv, &to2, lse2.data(), nullptr),
              hsapSuccess)
        << hsapGetLastError();
    EXPECT_EQ(out, out2);
    EXPECT_EQ(lse, lse2);
    ASSERT_EQ(
        hsapAttentionBackward(batch, &tdout, &tq, &tk, &tv, &to, lse.data(), &tdq, &tdk, &tdv),
        hsapSuccess)
        << hsapGetLastError();
    ASSERT_EQ(hsapAttentionBackwardOnStream(batch, &tdout, &tq, &tk, &tv, &to, lse.data(), &tdq2,
                                            &tdk2, &tdv2, nullptr),
              hsapSuccess)
        << hsapGetLastError();
    EXPECT_EQ(dq, dq2);
    EXPECT_EQ(dk, dk2);
    EXPECT_EQ(dv, dv2);
    EXPECT_EQ(hsapBatchDestroy(batch), hsapSuccess);
  });
  hsapLayoutDestroy(layout);
  for (hsapComm_t c : comms) EXPECT_EQ(hsapCommDestroy(c), hsapSuccess);
}

// One host rank: creation is collective, but a single rank needs no peer.
class ApiBatchOneRankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(hsapCommInitAll(&comm_, 1, nullptr), hsapSuccess) << hsapGetLastError();
    layout_ = testing::ToCLayout(MixedLayout());
    const int group_sizes[] = {1}, group_ranks[] = {0}, head_counts[] = {2}, heads[] = {0, 1};
    ASSERT_EQ(hsapPlanCreate(&plan_, 1, 2, 1, 1, group_sizes, group_ranks, nullptr, nullptr,
                             head_counts, heads, nullptr),
              hsapSuccess)
        << hsapGetLastError();
    config_.dtype = hsapFloat32;
    config_.numHeadsQ = 2;
    config_.numHeadsKV = 1;
    config_.headDim = 32;
  }
  void TearDown() override {
    hsapPlanDestroy(plan_);
    hsapLayoutDestroy(layout_);
    EXPECT_EQ(hsapCommDestroy(comm_), hsapSuccess) << hsapGetLastError();
  }

  hsapComm_t comm_ = nullptr;
  hsapLayout_t layout_ = nullptr;
  hsapPlan_t plan_ = nullptr;
  hsapBatchConfig_t config_ = HSAP_BATCH_CONFIG_INITIALIZER;
};

TEST_F(ApiBatchOneRankTest, HeadDimOutsideTheRuleIsAnInvalidArgument) {
  for (int bad_dim : {0, 16, 36, 264}) {
    SCOPED_TRACE(::testing::Message() << "headDim " << bad_dim);
    config_.headDim = bad_dim;
    hsapBatch_t batch = nullptr;
    EXPECT_EQ(hsapBatchCreate(&batch, comm_, layout_, nullptr, &config_), hsapInvalidArgument);
    EXPECT_THAT(hsapGetLastError(), HasSubstr("head_dim = " + std::to_string(bad_dim)));
    EXPECT_EQ(batch, nullptr);
    EXPECT_EQ(hsapBatchCreateWithPlan(&batch, comm_, layout_, plan_, &config_),
              hsapInvalidArgument);
    EXPECT_THAT(hsapGetLastError(), HasSubstr("head_dim = " + std::to_string(bad_dim)));
    EXPECT_EQ(batch, nullptr);
  }
}

TEST_F(ApiBatchOneRankTest, CommunicatorOutlivesItsBatches) {
  hsapBatch_t plain = nullptr, planned = nullptr;
  ASSERT_EQ(hsapBatchCreate(&plain, comm_, layout_, nullptr, &config_), hsapSuccess)
      << hsapGetLastError();
  ASSERT_EQ(hsapBatchCreateWithPlan(&planned, comm_, layout_, plan_, &config_), hsapSuccess)
      << hsapGetLastError();
  EXPECT_EQ(hsapCommDestroy(comm_), hsapInvalidUsage);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("comm still has 2 batch(es)"));
  EXPECT_EQ(hsapBatchDestroy(plain), hsapSuccess);
  EXPECT_EQ(hsapCommDestroy(comm_), hsapInvalidUsage);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("comm still has 1 batch(es)"));
  // The communicator stayed valid, and so did the remaining batch.
  int count = 0;
  EXPECT_EQ(hsapCommCount(comm_, &count), hsapSuccess);
  EXPECT_EQ(count, 1);
  int64_t tokens = -1;
  EXPECT_EQ(hsapBatchGetLocalTokens(planned, &tokens), hsapSuccess);
  EXPECT_EQ(tokens, 200);
  EXPECT_EQ(hsapBatchDestroy(planned), hsapSuccess);
  // TearDown destroys the communicator, now without batches.
}

// Attention engines belong to CUDA batches: a host batch says so (and a null out-argument is
// named before that).
TEST_F(ApiBatchOneRankTest, HostBatchesHaveNoAttentionEngines) {
  hsapBatch_t batch = nullptr;
  ASSERT_EQ(hsapBatchCreate(&batch, comm_, layout_, nullptr, &config_), hsapSuccess)
      << hsapGetLastError();
  EXPECT_EQ(hsapBatchGetEngines(batch, nullptr), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("engines"));
  hsapEngines_t engines{};
  EXPECT_EQ(hsapBatchGetEngines(batch, &engines), hsapUnsupported);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("host backend"));
  size_t size = 0;
  EXPECT_EQ(hsapBatchGetEngineReport(batch, nullptr, &size), hsapUnsupported);
  EXPECT_EQ(hsapBatchGetEngineReport(batch, nullptr, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapBatchGetEngines(nullptr, &engines), hsapInvalidArgument);
  EXPECT_EQ(hsapBatchDestroy(batch), hsapSuccess);
}

}  // namespace
}  // namespace hsap
