// Batches of different masks over one partition (hsapPartitionCreateForLayouts,
// hsapBatchCreateWithPartition): the layers of a hybrid model (full, sliding-window, ...)
// hold the same tokens on every rank, and each mask's batch keeps the guarantees of
// hsapBatchCreate: results within the tolerance rule of the fp64 reference, every K/V row
// delivered exactly once to each rank that needs it, bitwise the results of hsapBatchCreate
// when the partition is the one it would choose.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attention/layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/comm/communicator.h"
#include "lib/exec/batch.h"
#include "lib/sched/partition.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/random_layouts.h"
#include "tests/support/traffic_bound.h"

namespace hsap {
namespace {

using ::hsap::testing::DistCase;
using ::hsap::testing::RowInputs;
using ::hsap::testing::RowOutputs;
using ::testing::HasSubstr;

// The layers of a hybrid model over one row of documents: causal, a sliding window longer
// than most documents (clamped per document) and full.
std::vector<Layout> HybridLayers(const std::vector<int64_t>& cu, int64_t window) {
  const size_t n = cu.size() - 1;
  return {*Layout::FromDocuments(cu),
          *Layout::FromDocuments(cu, std::vector<MaskKind>(n, MaskKind::kSlidingWindow),
                                 std::vector<int64_t>(n, window)),
          *Layout::FromDocuments(cu, std::vector<MaskKind>(n, MaskKind::kFull))};
}

hsapPartition_t SharedPartition(const std::vector<hsapLayout_t>& layouts, int ranks,
                                const std::vector<double>& weights) {
  hsapPartition_t partition = nullptr;
  EXPECT_EQ(
      hsapPartitionCreateForLayouts(&partition, layouts.data(), static_cast<int>(layouts.size()),
                                    ranks, weights.empty() ? nullptr : weights.data()),
      hsapSuccess)
      << hsapGetLastError();
  return partition;
}

std::vector<int64_t> RangesOf(hsapPartition_t p, int rank) {
  int64_t n = 0;
  EXPECT_EQ(hsapPartitionGetRanges(p, rank, nullptr, &n, nullptr), hsapSuccess);
  std::vector<int64_t> ranges(2 * n);
  EXPECT_EQ(hsapPartitionGetRanges(p, rank, ranges.data(), &n, nullptr), hsapSuccess);
  return ranges;
}

void ExpectEveryMaskOverTheSharedPartition(const std::vector<int64_t>& cu, DistCase c,
                                           uint64_t seed) {
  const std::vector<Layout> layers = HybridLayers(cu, 40);
  std::vector<hsapLayout_t> handles;
  for (const Layout& l : layers) handles.push_back(testing::ToCLayout(l));
  c.partition = SharedPartition(handles, c.ranks, c.weights);
  ASSERT_NE(c.partition, nullptr);
  for (size_t i = 0; i < layers.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "mask " << i);
    RowInputs in(c, layers[i].num_tokens(), seed + i);
    const RowOutputs got = testing::RunDistributed(handles[i], c, in);
    for (int r = 0; r < c.ranks; ++r) {
      ASSERT_EQ(got.results[r], hsapSuccess) << "rank " << r << ": " << got.errors[r];
      // Every mask's batch holds the partition's tokens.
      EXPECT_EQ(got.ranges[r], RangesOf(c.partition, r)) << "rank " << r;
    }
    AttentionDims dims;
    dims.heads_q = c.heads_q;
    dims.heads_kv = c.heads_kv;
    dims.head_dim = c.head_dim;
    dims.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    testing::ExpectMatchesReference(layers[i], in.Reference(dims, c.dtype), in.dout.bytes.data(),
                                    got, /*backward=*/true);
    const testing::Expected bound = testing::LowerBound(layers[i], got, c);
    for (int r = 0; r < c.ranks; ++r) {
      SCOPED_TRACE(::testing::Message() << "rank " << r);
      EXPECT_EQ(got.traffic[r].forwardBytesSent, bound.per_rank[r].forwardBytesSent);
      EXPECT_EQ(got.traffic[r].forwardBytesReceived, bound.per_rank[r].forwardBytesReceived);
      EXPECT_EQ(got.traffic[r].backwardBytesSent, bound.per_rank[r].backwardBytesSent);
      EXPECT_EQ(got.traffic[r].backwardBytesReceived, bound.per_rank[r].backwardBytesReceived);
    }
  }
  hsapPartitionDestroy(c.partition);
  for (hsapLayout_t h : handles) hsapLayoutDestroy(h);
}

TEST(SharedPartitionTest, HybridLayersMatchTheReferenceAndDeliverExactlyOnce) {
  // One long document (cut across ranks), many shorter than the window, a 1-token one.
  std::vector<int64_t> cu = {0, 1};
  for (int64_t len : {230, 9, 33, 17, 60, 5, 41}) cu.push_back(cu.back() + len);
  DistCase c;
  c.ranks = 3;
  c.heads_q = 4;
  c.heads_kv = 2;
  ExpectEveryMaskOverTheSharedPartition(cu, c, 31);
  c.ranks = 4;
  c.weights = {3, 1, 2, 2};
  c.dtype = DType::kBF16;
  ExpectEveryMaskOverTheSharedPartition(cu, c, 31);
}

TEST(SharedPartitionTest, RanksAsProcesses) {
  const std::vector<int64_t> cu = {0, 150, 170, 171, 260};
  DistCase c;
  c.ranks = 3;
  c.processes = true;
  ExpectEveryMaskOverTheSharedPartition(cu, c, 52);
  // One rank, fp32: the JIT host forward once formed the lse in base 2 from pre-scaled
  // queries, |lse| ulps away from the backward's e^(s * scale - lse); on this input dq
  // exceeded the rule by 11 % (2.84e-6 against 2.56e-6).
  c.ranks = 1;
  ExpectEveryMaskOverTheSharedPartition(cu, c, 31);
}

// Over the partition hsapBatchCreate would choose, a batch computes the same bits.
TEST(SharedPartitionTest, SamePartitionGivesTheBitsOfBatchCreate) {
  const Layout layout = testing::RandomLayout(400, testing::DocMix::kLongTail, 3, false);
  DistCase c;
  c.ranks = 3;
  c.weights = {1, 2, 1};
  c.dtype = DType::kBF16;
  hsapLayout_t handle = testing::ToCLayout(layout);
  RowInputs in(c, layout.num_tokens(), 8);
  const RowOutputs own = testing::RunDistributed(handle, c, in);
  ASSERT_TRUE(own.ok()) << own.errors[0];
  ASSERT_EQ(hsapPartitionCreate(&c.partition, handle, c.ranks, c.weights.data()), hsapSuccess);
  const RowOutputs shared = testing::RunDistributed(handle, c, in);
  ASSERT_TRUE(shared.ok()) << shared.errors[0];
  EXPECT_EQ(shared.out.bytes, own.out.bytes);
  EXPECT_EQ(shared.dq.bytes, own.dq.bytes);
  EXPECT_EQ(shared.dk.bytes, own.dk.bytes);
  EXPECT_EQ(shared.dv.bytes, own.dv.bytes);
  EXPECT_EQ(shared.lse, own.lse);
  hsapPartitionDestroy(c.partition);
  hsapLayoutDestroy(handle);
}

// Ranks that pass different partitions fail together; a partition of another row or rank
// count is an invalid argument on the rank that passed it.
TEST(SharedPartitionTest, MismatchesFailOnEveryRank) {
  const std::vector<int64_t> cu = {0, 100, 140};
  hsapLayout_t layout = nullptr, other_row = nullptr;
  ASSERT_EQ(hsapLayoutCreate(&layout, cu.data(), 2, nullptr, nullptr), hsapSuccess);
  const int64_t longer[] = {0, 100, 141};
  ASSERT_EQ(hsapLayoutCreate(&other_row, longer, 2, nullptr, nullptr), hsapSuccess);
  hsapPartition_t equal = nullptr, uneven = nullptr, three = nullptr, wrong_row = nullptr;
  const double weights[] = {1, 3};
  ASSERT_EQ(hsapPartitionCreate(&equal, layout, 2, nullptr), hsapSuccess);
  ASSERT_EQ(hsapPartitionCreate(&uneven, layout, 2, weights), hsapSuccess);
  ASSERT_EQ(hsapPartitionCreate(&three, layout, 3, nullptr), hsapSuccess);
  ASSERT_EQ(hsapPartitionCreate(&wrong_row, other_row, 2, nullptr), hsapSuccess);

  struct Case {
    hsapPartition_t rank0, rank1;
    hsapResult_t expect0, expect1;
    std::string message0, message1;
  };
  const std::vector<Case> cases = {
      {equal, uneven, hsapInvalidUsage, hsapInvalidUsage, "partition differs", "partition differs"},
      {equal, three, hsapInvalidUsage, hsapInvalidArgument, "rejected its arguments",
       "partition is for 3 ranks"},
      {wrong_row, equal, hsapInvalidArgument, hsapInvalidUsage, "row of 141 tokens",
       "rejected its arguments"},
      {equal, nullptr, hsapInvalidUsage, hsapInvalidArgument, "rejected its arguments",
       "partition is null"},
  };
  for (const Case& k : cases) {
    hsapComm_t comms[2];
    ASSERT_EQ(hsapCommInitAll(comms, 2, nullptr), hsapSuccess);
    hsapResult_t results[2];
    std::string messages[2];
    testing::OnEveryRank(2, [&](int r) {
      hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
      bc.dtype = hsapFloat32;
      bc.numHeadsQ = 2;
      bc.numHeadsKV = 1;
      bc.headDim = 32;
      hsapBatch_t batch = nullptr;
      results[r] =
          hsapBatchCreateWithPartition(&batch, comms[r], layout, r == 0 ? k.rank0 : k.rank1, &bc);
      messages[r] = hsapGetLastError();
      hsapBatchDestroy(batch);
    });
    EXPECT_EQ(results[0], k.expect0) << messages[0];
    EXPECT_EQ(results[1], k.expect1) << messages[1];
    EXPECT_THAT(messages[0], HasSubstr(k.message0));
    EXPECT_THAT(messages[1], HasSubstr(k.message1));
    for (hsapComm_t comm : comms) hsapCommDestroy(comm);
  }
  for (hsapPartition_t p : {equal, uneven, three, wrong_row}) hsapPartitionDestroy(p);
  hsapLayoutDestroy(layout);
  hsapLayoutDestroy(other_row);
}

// hsapBatchCreateManyWithPartition: a step's masks and dtypes made at once compute the bits
// of the batches made one by one (hsapBatchCreateWithPartition, checked against the
// reference above), and hold the partition's tokens.
TEST(SharedPartitionTest, ManyAtOnceGiveTheBitsOfOneByOne) {
  constexpr int R = 3;
  const std::vector<int64_t> cu = {0, 90, 91, 200, 260};
  const std::vector<Layout> layers = HybridLayers(cu, 30);
  std::vector<hsapLayout_t> handles;
  for (const Layout& l : layers) handles.push_back(testing::ToCLayout(l));
  hsapPartition_t partition = SharedPartition(handles, R, {});
  ASSERT_NE(partition, nullptr);
  // Batch i: mask i % 3, fp32 then bf16.
  std::vector<hsapLayout_t> layouts;
  std::vector<hsapBatchConfig_t> configs;
  for (hsapDataType_t dtype : {hsapFloat32, hsapBFloat16}) {
    for (hsapLayout_t l : handles) {
      hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
      bc.dtype = dtype;
      bc.numHeadsQ = 4;
      bc.numHeadsKV = 2;
      bc.headDim = 32;
      layouts.push_back(l);
      configs.push_back(bc);
    }
  }
  const int n = static_cast<int>(layouts.size());
  hsapComm_t comms[R];
  ASSERT_EQ(hsapCommInitAll(comms, R, nullptr), hsapSuccess);
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE(::testing::Message() << "batch " << i);
    DistCase c;
    c.ranks = R;
    c.dtype = configs[i].dtype == hsapFloat32 ? DType::kF32 : DType::kBF16;
    c.heads_q = 4;
    c.heads_kv = 2;
    RowInputs in(c, layers[0].num_tokens(), 20 + i);
    auto q = testing::ScatterRow(partition, R, in.q), k = testing::ScatterRow(partition, R, in.k),
         v = testing::ScatterRow(partition, R, in.v),
         dout = testing::ScatterRow(partition, R, in.dout);
    testing::OnEveryRank(R, [&](int r) {
      std::vector<hsapBatch_t> many(n, nullptr);
      ASSERT_EQ(hsapBatchCreateManyWithPartition(many.data(), n, comms[r], layouts.data(),
                                                 partition, configs.data()),
                hsapSuccess)
          << hsapGetLastError();
      hsapBatch_t one = nullptr;
      ASSERT_EQ(hsapBatchCreateWithPartition(&one, comms[r], layouts[i], partition, &configs[i]),
                hsapSuccess)
          << hsapGetLastError();
      int64_t rows = 0;
      ASSERT_EQ(hsapBatchGetLocalTokens(many[i], &rows), hsapSuccess);
      hsapPartition_t own = nullptr;
      ASSERT_EQ(hsapBatchGetPartition(many[i], &own), hsapSuccess);
      EXPECT_EQ(RangesOf(own, r), RangesOf(partition, r));
      const size_t es = DTypeSize(c.dtype);
      std::vector<std::vector<uint8_t>> res;  // out, dq, dk, dv, lse of `many`, then `one`
      for (hsapBatch_t b : {many[i], one}) {
        std::vector<uint8_t> out(rows * 4 * 32 * es + 1), dq(out.size()),
            dk(rows * 2 * 32 * es + 1), dv(dk.size()), lse((rows * 4 + 1) * sizeof(float));
        auto t = [&](std::vector<uint8_t>& x, int heads) {
          return hsapTensor_t{x.data(), configs[i].dtype, rows, heads, 32};
        };
        hsapTensor_t tq = t(q[r], 4), tk = t(k[r], 2), tv = t(v[r], 2), td = t(dout[r], 4),
                     to = t(out, 4), tdq = t(dq, 4), tdk = t(dk, 2), tdv = t(dv, 2);
        float* l = reinterpret_cast<float*>(lse.data());
        ASSERT_EQ(hsapAttentionForward(b, &tq, &tk, &tv, &to, l), hsapSuccess)
            << hsapGetLastError();
        ASSERT_EQ(hsapAttentionBackward(b, &td, &tq, &tk, &tv, &to, l, &tdq, &tdk, &tdv),
                  hsapSuccess)
            << hsapGetLastError();
        for (auto* x : {&out, &dq, &dk, &dv, &lse}) res.push_back(std::move(*x));
      }
      for (int j = 0; j < 5; ++j) EXPECT_EQ(res[j], res[j + 5]) << "rank " << r << " tensor " << j;
      for (hsapBatch_t b : many) EXPECT_EQ(hsapBatchDestroy(b), hsapSuccess);
      EXPECT_EQ(hsapBatchDestroy(one), hsapSuccess);
    });
  }
  for (hsapComm_t comm : comms) hsapCommDestroy(comm);
  hsapPartitionDestroy(partition);
  for (hsapLayout_t l : handles) hsapLayoutDestroy(l);
}

// Many batches at once cost the collective rounds of one: the host runners are made before
// the one agreement (RunnerFactory::PreparesLocally), which covers them all.
TEST(SharedPartitionTest, ManyAtOnceTakeTheRoundsOfOne) {
  constexpr int R = 3;
  const std::vector<Layout> layers = HybridLayers({0, 50, 120, 121}, 16);
  auto partition = std::make_shared<const Partition>(
      *Partition::Create(std::vector<const Layout*>{&layers[0], &layers[1], &layers[2]}, R, {}));
  CommOptions options;
  options.num_threads = 1;
  auto world = Communicator::CreateHostWorld(R, options);
  ASSERT_TRUE(world.ok()) << world.status();
  BatchOptions bo;
  bo.dtype = DType::kF32;
  bo.heads_q = 2;
  bo.heads_kv = 1;
  bo.head_dim = 32;
  std::vector<uint64_t> one(R), many(R);
  testing::OnEveryRank(R, [&](int r) {
    Communicator& comm = *(*world)[r];
    std::unique_ptr<RunnerFactory> runners = HostRunners(HandWrittenKernels());
    uint64_t before = comm.transport().counters().messages_sent;
    auto single = Batch::CreateWithPartition(comm, layers[1], partition, bo, *runners);
    ASSERT_TRUE(single.ok()) << single.status();
    one[r] = comm.transport().counters().messages_sent - before;
    std::vector<const Layout*> ls;
    std::vector<BatchOptions> os;
    std::vector<RunnerFactory*> fs;
    for (const Layout& l : layers) {
      for (DType d : {DType::kF32, DType::kBF16}) {
        ls.push_back(&l);
        os.push_back(bo);
        os.back().dtype = d;
        fs.push_back(runners.get());
      }
    }
    before = comm.transport().counters().messages_sent;
    auto made = Batch::CreateManyWithPartition(comm, ls, partition, os, fs);
    ASSERT_TRUE(made.ok()) << made.status();
    many[r] = comm.transport().counters().messages_sent - before;
    EXPECT_EQ(made->size(), 6u);
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_GT(one[r], 0u) << "rank " << r;
    EXPECT_EQ(many[r], one[r]) << "rank " << r;
  }
}

// Ranks whose batch lists differ -- in length, in one batch's dtype or layout, or a bad
// argument on one rank -- fail together, naming what differs, instead of waiting.
TEST(SharedPartitionTest, ManyAtOnceMismatchesFailOnEveryRank) {
  const std::vector<Layout> layers = HybridLayers({0, 60, 100}, 8);
  std::vector<hsapLayout_t> handles;
  for (const Layout& l : layers) handles.push_back(testing::ToCLayout(l));
  hsapPartition_t partition = SharedPartition(handles, 2, {});
  hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
  bc.dtype = hsapFloat32;
  bc.numHeadsQ = 2;
  bc.numHeadsKV = 1;
  bc.headDim = 32;
  hsapBatchConfig_t bf16 = bc;
  bf16.dtype = hsapBFloat16;
  hsapBatchConfig_t bad = bc;
  bad.headDim = 30;
  struct Side {
    std::vector<hsapLayout_t> layouts;
    std::vector<hsapBatchConfig_t> configs;
  };
  struct Case {
    Side rank0, rank1;
    hsapResult_t expect0, expect1;
    std::string message0, message1;
  };
  const Side two{{handles[0], handles[1]}, {bc, bc}};
  const std::vector<Case> cases = {
      {two, Side{{handles[0], handles[1], handles[2]}, {bc, bc, bc}}, hsapInvalidUsage,
       hsapInvalidUsage, "rank 1 created 3 batches together but rank 0 2", "but rank 0 2"},
      {two, Side{{handles[0], handles[1]}, {bc, bf16}}, hsapInvalidUsage, hsapInvalidUsage,
       "rank 1's dtype (of one of the 2 batches", "rank 1's dtype"},
      {two, Side{{handles[0], handles[2]}, {bc, bc}}, hsapInvalidUsage, hsapInvalidUsage,
       "rank 1's layout", "rank 1's layout"},
      {two, Side{{handles[0], handles[1]}, {bc, bad}}, hsapInvalidUsage, hsapInvalidArgument,
       "rank 1 rejected its arguments", "head_dim = 30"},
      {two, Side{{handles[0], nullptr}, {bc, bc}}, hsapInvalidUsage, hsapInvalidArgument,
       "rank 1 rejected its arguments", "layouts[1] is null"},
  };
  for (const Case& k : cases) {
    hsapComm_t comms[2];
    ASSERT_EQ(hsapCommInitAll(comms, 2, nullptr), hsapSuccess);
    hsapResult_t results[2];
    std::string messages[2];
    testing::OnEveryRank(2, [&](int r) {
      const Side& side = r == 0 ? k.rank0 : k.rank1;
      std::vector<hsapBatch_t> batches(side.layouts.size(), nullptr);
      results[r] = hsapBatchCreateManyWithPartition(
          batches.data(), static_cast<int>(batches.size()), comms[r], side.layouts.data(),
          partition, side.configs.data());
      messages[r] = hsapGetLastError();
      for (hsapBatch_t b : batches) EXPECT_EQ(b, nullptr);
    });
    EXPECT_EQ(results[0], k.expect0) << messages[0];
    EXPECT_EQ(results[1], k.expect1) << messages[1];
    EXPECT_THAT(messages[0], HasSubstr(k.message0));
    EXPECT_THAT(messages[1], HasSubstr(k.message1));
    for (hsapComm_t comm : comms) hsapCommDestroy(comm);
  }
  hsapPartitionDestroy(partition);
  for (hsapLayout_t l : handles) hsapLayoutDestroy(l);
}

TEST(SharedPartitionTest, CreateForLayoutsRejectsBadArguments) {
  const int64_t cu[] = {0, 10}, cu2[] = {0, 11};
  hsapLayout_t a = nullptr, b = nullptr;
  ASSERT_EQ(hsapLayoutCreate(&a, cu, 1, nullptr, nullptr), hsapSuccess);
  ASSERT_EQ(hsapLayoutCreate(&b, cu2, 1, nullptr, nullptr), hsapSuccess);
  hsapPartition_t p = nullptr;
  const hsapLayout_t both[] = {a, b}, with_null[] = {a, nullptr};
  EXPECT_EQ(hsapPartitionCreateForLayouts(&p, both, 2, 2, nullptr), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("layouts[1] has 11 tokens"));
  EXPECT_EQ(hsapPartitionCreateForLayouts(&p, with_null, 2, 2, nullptr), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("layouts[1] is null"));
  EXPECT_EQ(hsapPartitionCreateForLayouts(&p, both, 0, 2, nullptr), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("numLayouts = 0"));
  EXPECT_EQ(hsapPartitionCreateForLayouts(&p, nullptr, 1, 2, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapPartitionCreateForLayouts(&p, both, 1, 0, nullptr), hsapInvalidArgument);
  EXPECT_EQ(p, nullptr);
  hsapLayoutDestroy(a);
  hsapLayoutDestroy(b);
}

}  // namespace
}  // namespace hsap
