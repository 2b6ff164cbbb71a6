// Faults of distributed calls: a rank that never arrives, abort, and ranks that disagree.
// Every failure must reach every rank, quickly, with a message; none may hang.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "tests/support/distributed_harness.h"

namespace hsap {
namespace {

using ::hsap::testing::HostTensor;
using ::hsap::testing::OnEveryRank;
using ::hsap::testing::ToC;
using ::testing::HasSubstr;

constexpr int kHeads = 2, kDim = 32;

hsapLayout_t OneCausalDocument(int64_t tokens) {
  const int64_t cu[] = {0, tokens};
  hsapLayout_t layout = nullptr;
  EXPECT_EQ(hsapLayoutCreate(&layout, cu, 1, nullptr, nullptr), hsapSuccess);
  return layout;
}

std::vector<hsapComm_t> MakeComms(int ranks, int timeout_ms) {
  std::vector<hsapComm_t> comms(ranks, nullptr);
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.timeoutMs = timeout_ms;
  config.numThreads = 1;
  EXPECT_EQ(hsapCommInitAll(comms.data(), ranks, &config), hsapSuccess) << hsapGetLastError();
  return comms;
}

hsapBatchConfig_t Config(int head_dim = kDim) {
  hsapBatchConfig_t c = HSAP_BATCH_CONFIG_INITIALIZER;
  c.dtype = hsapFloat32;
  c.numHeadsQ = kHeads;
  c.numHeadsKV = kHeads;
  c.headDim = head_dim;
  return c;
}

// One rank's tensors for a batch.
struct Shard {
  HostTensor q, k, v, out, dq, dk, dv;
  std::vector<float> lse;
  explicit Shard(int64_t n)
      : q(DType::kF32, n, kHeads, kDim),
        k(DType::kF32, n, kHeads, kDim),
        v(DType::kF32, n, kHeads, kDim),
        out(DType::kF32, n, kHeads, kDim),
        dq(DType::kF32, n, kHeads, kDim),
        dk(DType::kF32, n, kHeads, kDim),
        dv(DType::kF32, n, kHeads, kDim),
        lse(n * kHeads + 1, 0.0f) {}
  hsapResult_t Forward(hsapBatch_t b) {
    hsapTensor_t tq = q.C(), tk = k.C(), tv = v.C(), to = out.C();
    return hsapAttentionForward(b, &tq, &tk, &tv, &to, lse.data());
  }
  hsapResult_t Backward(hsapBatch_t b) {
    hsapTensor_t tq = q.C(), tk = k.C(), tv = v.C(), to = out.C(), tdq = dq.C(), tdk = dk.C(),
                 tdv = dv.C();
    return hsapAttentionBackward(b, &to, &tq, &tk, &tv, &to, lse.data(), &tdq, &tdk, &tdv);
  }
};

struct RankResult {
  hsapResult_t result = hsapSuccess;
  std::string error;
  double seconds = 0;
};

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(FaultsTest, RankThatNeverCallsForwardMakesOthersTimeOut) {
  const int R = 3;
  hsapLayout_t layout = OneCausalDocument(300);
  std::vector<hsapComm_t> comms = MakeComms(R, 300);
  std::vector<RankResult> results(R);
  std::atomic<int> finished{0};
  OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = Config();
    hsapBatch_t batch = nullptr;
    ASSERT_EQ(hsapBatchCreate(&batch, comms[r], layout, nullptr, &config), hsapSuccess)
        << hsapGetLastError();
    int64_t n = 0;
    hsapBatchGetLocalTokens(batch, &n);
    Shard s(n);
    if (r == 2) {
      // Never calls forward; stays alive until the others gave up.
      while (finished.load() < R - 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      results[r].result = s.Forward(batch);
      results[r].error = hsapGetLastError();
      results[r].seconds = Since(t0);
      ++finished;
    }
    hsapBatchDestroy(batch);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].result, hsapTimeout) << results[r].error;
    EXPECT_THAT(results[r].error, HasSubstr("rank 2"));
    EXPECT_THAT(results[r].error, HasSubstr("forward"));
    EXPECT_LT(results[r].seconds, 5.0);
  }
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  hsapLayoutDestroy(layout);
}

TEST(FaultsTest, AbortFromAnotherThreadReleasesEveryone) {
  const int R = 3;
  hsapLayout_t layout = OneCausalDocument(300);
  std::vector<hsapComm_t> comms = MakeComms(R, 60000);
  std::vector<RankResult> results(R);
  std::atomic<int> waiting{0};
  std::thread aborter([&] {
    while (waiting.load() < R - 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(hsapCommAbort(comms[0]), hsapSuccess);
  });
  OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = Config();
    hsapBatch_t batch = nullptr;
    ASSERT_EQ(hsapBatchCreate(&batch, comms[r], layout, nullptr, &config), hsapSuccess);
    int64_t n = 0;
    hsapBatchGetLocalTokens(batch, &n);
    Shard s(n);
    const auto t0 = std::chrono::steady_clock::now();
    if (r == 2) {
      // Arrives only after the abort: its call fails at once too.
      while (waiting.load() < R - 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    } else {
      ++waiting;
    }
    results[r].result = s.Forward(batch);
    results[r].error = hsapGetLastError();
    results[r].seconds = Since(t0);
    hsapBatchDestroy(batch);
  });
  aborter.join();
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(results[r].result, hsapAborted) << "rank " << r << ": " << results[r].error;
    EXPECT_LT(results[r].seconds, 10.0);
  }
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  hsapLayoutDestroy(layout);
}

TEST(FaultsTest, MismatchedLayoutsAreReportedOnEveryRank) {
  const int R = 3;
  hsapLayout_t a = OneCausalDocument(300), b = OneCausalDocument(301);
  std::vector<hsapComm_t> comms = MakeComms(R, 20000);
  std::vector<RankResult> results(R);
  OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = Config();
    hsapBatch_t batch = reinterpret_cast<hsapBatch_t>(0x1);  // must stay untouched
    results[r].result = hsapBatchCreate(&batch, comms[r], r == 2 ? b : a, nullptr, &config);
    results[r].error = hsapGetLastError();
    EXPECT_EQ(batch, reinterpret_cast<hsapBatch_t>(0x1));
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(results[r].result, hsapInvalidUsage) << results[r].error;
    EXPECT_THAT(results[r].error, HasSubstr("rank 2's layout differs from rank 0's"));
  }
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  hsapLayoutDestroy(a);
  hsapLayoutDestroy(b);
}

TEST(FaultsTest, MismatchedConfigsAndWeightsAreReported) {
  const int R = 2;
  hsapLayout_t layout = OneCausalDocument(200);
  std::vector<hsapComm_t> comms = MakeComms(R, 20000);
  std::vector<RankResult> results(R);
  OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = Config(r == 1 ? 64 : 32);
    hsapBatch_t batch = nullptr;
    results[r].result = hsapBatchCreate(&batch, comms[r], layout, nullptr, &config);
    results[r].error = hsapGetLastError();
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(results[r].result, hsapInvalidUsage);
    EXPECT_THAT(results[r].error, HasSubstr("rank 1's headDim differs"));
  }
  OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = Config();
    const double weights[2][2] = {{1, 1}, {1, 2}};
    hsapBatch_t batch = nullptr;
    results[r].result = hsapBatchCreate(&batch, comms[r], layout, weights[r], &config);
    results[r].error = hsapGetLastError();
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(results[r].result, hsapInvalidUsage);
    EXPECT_THAT(results[r].error, HasSubstr("rank 1's weights differs"));
  }
  // One rank with a plan, one without: said as such, not as differing weights.
  std::vector<int> heads(kHeads);
  for (int h = 0; h < kHeads; ++h) heads[h] = h;
  const int group_sizes[] = {1, 1}, group_ranks[] = {0, 1}, head_counts[] = {kHeads, kHeads};
  std::vector<int> both_heads = heads;
  both_heads.insert(both_heads.end(), heads.begin(), heads.end());
  hsapPlan_t plan = nullptr;
  ASSERT_EQ(hsapPlanCreate(&plan, R, kHeads, kHeads, 2, group_sizes, group_ranks, nullptr, nullptr,
                           head_counts, both_heads.data(), nullptr),
            hsapSuccess)
      << hsapGetLastError();
  OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = Config();
    hsapBatch_t batch = nullptr;
    results[r].result = r == 1 ? hsapBatchCreateWithPlan(&batch, comms[r], layout, plan, &config)
                               : hsapBatchCreate(&batch, comms[r], layout, nullptr, &config);
    results[r].error = hsapGetLastError();
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(results[r].result, hsapInvalidUsage);
    EXPECT_THAT(results[r].error,
                HasSubstr("rank 1 created the batch with a plan (hsapBatchCreateWithPlan) but "
                          "rank 0 without a plan (hsapBatchCreate)"));
  }
  hsapPlanDestroy(plan);
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  hsapLayoutDestroy(layout);
}

TEST(FaultsTest, MismatchedCallsAreReportedNotComputed) {
  const int R = 2;
  hsapLayout_t layout = OneCausalDocument(200);
  std::vector<hsapComm_t> comms = MakeComms(R, 20000);
  std::vector<RankResult> results(R);
  OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = Config();
    hsapBatch_t batch = nullptr;
    ASSERT_EQ(hsapBatchCreate(&batch, comms[r], layout, nullptr, &config), hsapSuccess);
    int64_t n = 0;
    hsapBatchGetLocalTokens(batch, &n);
    Shard s(n);
    std::fill(s.dq.bytes.begin(), s.dq.bytes.end(), 0xAB);
    results[r].result = r == 0 ? s.Forward(batch) : s.Backward(batch);
    results[r].error = hsapGetLastError();
    // Outputs are untouched.
    for (uint8_t byte : s.dq.bytes) ASSERT_EQ(byte, 0xAB);
    hsapBatchDestroy(batch);
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(results[r].result, hsapInvalidUsage) << results[r].error;
    EXPECT_THAT(results[r].error, HasSubstr("backward"));
    EXPECT_THAT(results[r].error, HasSubstr("forward"));
  }
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  hsapLayoutDestroy(layout);
}

TEST(FaultsTest, BadArgumentsOnOneRankFailEveryRankPromptly) {
  const int R = 3;
  hsapLayout_t layout = OneCausalDocument(300);
  std::vector<hsapComm_t> comms = MakeComms(R, 60000);
  std::vector<RankResult> results(R);
  OnEveryRank(R, [&](int r) {
    hsapBatchConfig_t config = Config();
    hsapBatch_t batch = nullptr;
    ASSERT_EQ(hsapBatchCreate(&batch, comms[r], layout, nullptr, &config), hsapSuccess);
    int64_t n = 0;
    hsapBatchGetLocalTokens(batch, &n);
    Shard s(n);
    hsapTensor_t tq = s.q.C(), tk = s.k.C(), tv = s.v.C(), to = s.out.C();
    if (r == 1) tk.numHeads = 1;  // wrong shape on one rank
    const auto t0 = std::chrono::steady_clock::now();
    results[r].result = hsapAttentionForward(batch, &tq, &tk, &tv, &to, s.lse.data());
    results[r].error = hsapGetLastError();
    results[r].seconds = Since(t0);
    hsapBatchDestroy(batch);
  });
  EXPECT_EQ(results[1].result, hsapInvalidArgument);
  EXPECT_THAT(results[1].error, HasSubstr("k has 1 heads, expected 2"));
  for (int r : {0, 2}) {
    EXPECT_EQ(results[r].result, hsapInvalidUsage) << results[r].error;
    EXPECT_THAT(results[r].error, HasSubstr("rank 1 rejected its arguments"));
    EXPECT_LT(results[r].seconds, 10.0);
  }
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  hsapLayoutDestroy(layout);
}

TEST(FaultsTest, ArgumentChecksOfThePartitionAndBatchApi) {
  hsapLayout_t layout = OneCausalDocument(100);
  hsapPartition_t part = nullptr;
  EXPECT_EQ(hsapPartitionCreate(nullptr, layout, 2, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapPartitionCreate(&part, nullptr, 2, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapPartitionCreate(&part, layout, 0, nullptr), hsapInvalidArgument);
  const double bad[] = {1.0, -2.0};
  EXPECT_EQ(hsapPartitionCreate(&part, layout, 2, bad), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("weights[1]"));
  EXPECT_EQ(part, nullptr);
  ASSERT_EQ(hsapPartitionCreate(&part, layout, 2, nullptr), hsapSuccess);
  int64_t n = 0;
  EXPECT_EQ(hsapPartitionGetRanges(part, 2, nullptr, &n, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapPartitionGetRanges(part, 0, nullptr, nullptr, nullptr), hsapInvalidArgument);
  ASSERT_EQ(hsapPartitionGetRanges(part, 0, nullptr, &n, nullptr), hsapSuccess);
  int64_t small = 0, ranges[8] = {-7, -7};
  if (n > 0) {
    EXPECT_EQ(hsapPartitionGetRanges(part, 0, ranges, &small, nullptr), hsapInvalidArgument);
    EXPECT_EQ(ranges[0], -7);
  }
  EXPECT_EQ(hsapPartitionScatter(part, nullptr, 4, nullptr), hsapInvalidArgument);
  char row[400];
  EXPECT_EQ(hsapPartitionScatter(part, row, 0, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapPartitionScatter(part, row, 4, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapPartitionDestroy(part), hsapSuccess);

  hsapBatch_t batch = nullptr;
  hsapBatchConfig_t config = Config();
  EXPECT_EQ(hsapBatchCreate(&batch, nullptr, layout, nullptr, &config), hsapInvalidArgument);
  EXPECT_EQ(hsapAttentionForward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
            hsapInvalidArgument);
  EXPECT_EQ(hsapBatchGetLocalTokens(nullptr, &n), hsapInvalidArgument);
  hsapTraffic_t traffic;
  EXPECT_EQ(hsapBatchGetTraffic(nullptr, &traffic), hsapInvalidArgument);
  EXPECT_EQ(hsapBatchDestroy(nullptr), hsapSuccess);

  // One rank: invalid configs fail with a message, without any peer to wait for.
  std::vector<hsapComm_t> comms = MakeComms(1, 20000);
  hsapBatchConfig_t raw;
  std::memset(&raw, 0, sizeof(raw));
  EXPECT_EQ(hsapBatchCreate(&batch, comms[0], layout, nullptr, &raw), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("HSAP_BATCH_CONFIG_INITIALIZER"));
  hsapBatchConfig_t gqa = Config();
  gqa.numHeadsKV = 3;
  EXPECT_EQ(hsapBatchCreate(&batch, comms[0], layout, nullptr, &gqa), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("multiple of numHeadsKV"));
  hsapBatchConfig_t dim = Config(20);
  EXPECT_EQ(hsapBatchCreate(&batch, comms[0], layout, nullptr, &dim), hsapInvalidArgument);
  EXPECT_EQ(hsapBatchCreate(&batch, comms[0], layout, nullptr, nullptr), hsapInvalidArgument);
  EXPECT_EQ(batch, nullptr);

  // A batch's partition belongs to it.
  ASSERT_EQ(hsapBatchCreate(&batch, comms[0], layout, nullptr, &config), hsapSuccess);
  hsapPartition_t own = nullptr;
  ASSERT_EQ(hsapBatchGetPartition(batch, &own), hsapSuccess);
  EXPECT_EQ(hsapPartitionDestroy(own), hsapInvalidUsage);
  Shard s(100);
  hsapTensor_t tq = s.q.C(), tk = s.k.C(), tv = s.v.C(), to = s.out.C();
  to.dtype = hsapBFloat16;
  EXPECT_EQ(hsapAttentionForward(batch, &tq, &tk, &tv, &to, s.lse.data()), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("out is bf16"));
  to = s.out.C();
  EXPECT_EQ(hsapAttentionForward(batch, &tq, &tk, &tv, &to, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapAttentionForward(batch, &tq, &tk, &tv, &to, s.lse.data()), hsapSuccess)
      << hsapGetLastError();
  EXPECT_EQ(hsapBatchDestroy(batch), hsapSuccess);
  hsapCommDestroy(comms[0]);
  hsapLayoutDestroy(layout);
}

}  // namespace
}  // namespace hsap
