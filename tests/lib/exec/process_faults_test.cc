// Faults of distributed calls with ranks as processes (hsapGetUniqueId / hsapCommInitRank on
// the host backend): a rank that never arrives, abort from another process, ranks that
// disagree, a size mismatch, and a rank killed with SIGKILL in the middle of a call. Every
// failure must reach every surviving rank quickly with a message, nothing may hang, and no
// segment may be left in /dev/shm.
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/api/handles.h"
#include "lib/comm/transport.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/process_ranks.h"

namespace hsap {
namespace {

using ::hsap::testing::HostTensor;
using ::hsap::testing::ProcessRank;
using ::hsap::testing::RunRanksAsProcesses;
using ::testing::HasSubstr;

constexpr int kHeads = 2, kDim = 32;

void ExpectNoSegment(const hsapUniqueId_t& id) {
  for (const std::string& e : testing::HsapShmEntries()) {
    EXPECT_NE(e, testing::HsapSegmentOf(id)) << "left behind in /dev/shm";
  }
}

hsapUniqueId_t NewId() {
  hsapUniqueId_t id;
  EXPECT_EQ(hsapGetUniqueId(&id), hsapSuccess) << hsapGetLastError();
  return id;
}

hsapComm_t JoinHost(const hsapUniqueId_t& id, int ranks, int rank, int timeout_ms) {
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.timeoutMs = timeout_ms;
  config.numThreads = 1;
  config.backend = hsapBackendHost;
  hsapComm_t comm = nullptr;
  if (hsapCommInitRank(&comm, ranks, id, rank, &config) != hsapSuccess) return nullptr;
  return comm;
}

hsapLayout_t OneCausalDocument(int64_t tokens) {
  const int64_t cu[] = {0, tokens};
  hsapLayout_t layout = nullptr;
  EXPECT_EQ(hsapLayoutCreate(&layout, cu, 1, nullptr, nullptr), hsapSuccess);
  return layout;
}

hsapBatchConfig_t Config() {
  hsapBatchConfig_t c = HSAP_BATCH_CONFIG_INITIALIZER;
  c.dtype = hsapFloat32;
  c.numHeadsQ = kHeads;
  c.numHeadsKV = kHeads;
  c.headDim = kDim;
  return c;
}

// One rank's forward call on its shard of a 300-token causal document.
struct Forward {
  HostTensor q, k, v, out;
  std::vector<float> lse;
  explicit Forward(int64_t n)
      : q(DType::kF32, n, kHeads, kDim),
        k(DType::kF32, n, kHeads, kDim),
        v(DType::kF32, n, kHeads, kDim),
        out(DType::kF32, n, kHeads, kDim),
        lse(n * kHeads + 1, 0.0f) {}
  hsapResult_t Run(hsapBatch_t b) {
    hsapTensor_t tq = q.C(), tk = k.C(), tv = v.C(), to = out.C();
    return hsapAttentionForward(b, &tq, &tk, &tv, &to, lse.data());
  }
};

// A child's report: "<result>|<seconds>|<message>".
std::string Outcome(hsapResult_t result, std::chrono::steady_clock::time_point t0) {
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::StrCat(static_cast<int>(result), "|", seconds, "|",
                      result == hsapSuccess ? "" : hsapGetLastError());
}

struct Parsed {
  int result = -1;
  double seconds = 0;
  std::string message;
};

Parsed Parse(const ProcessRank& rank) {
  Parsed p;
  std::vector<std::string> parts = absl::StrSplit(rank.report, absl::MaxSplits('|', 2));
  if (parts.size() != 3) {
    p.message = "malformed report: " + rank.report;
    return p;
  }
  p.result = std::stoi(parts[0]);
  p.seconds = std::stod(parts[1]);
  p.message = parts[2];
  return p;
}

// Creates the communicator and a batch, then runs `act` (returns the report).
std::string WithBatch(const hsapUniqueId_t& id, int ranks, int rank, int timeout_ms, int64_t tokens,
                      const std::function<std::string(hsapBatch_t, int64_t)>& act) {
  hsapComm_t comm = JoinHost(id, ranks, rank, timeout_ms);
  if (comm == nullptr) return absl::StrCat("init failed: ", hsapGetLastError());
  hsapLayout_t layout = OneCausalDocument(tokens);
  hsapBatchConfig_t config = Config();
  hsapBatch_t batch = nullptr;
  std::string report;
  if (hsapBatchCreate(&batch, comm, layout, nullptr, &config) != hsapSuccess) {
    report = absl::StrCat("batch failed: ", hsapGetLastError());
  } else {
    int64_t n = 0;
    hsapBatchGetLocalTokens(batch, &n);
    report = act(batch, n);
    hsapBatchDestroy(batch);
  }
  hsapLayoutDestroy(layout);
  hsapCommDestroy(comm);
  return report;
}

TEST(ProcessFaultsTest, DefaultBackendWithoutCudaIsHost) {
  // hsapBackendDefault picks the host backend where CUDA or NCCL is missing, so a plain
  // config works across processes too.
  if (cuda::CheckNcclDevice().ok()) GTEST_SKIP() << "this machine has CUDA and NCCL";
  const hsapUniqueId_t id = NewId();
  std::vector<ProcessRank> ranks = RunRanksAsProcesses(2, [&](int r) -> std::string {
    hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
    config.timeoutMs = 30000;
    hsapComm_t comm = nullptr;
    if (hsapCommInitRank(&comm, 2, id, r, &config) != hsapSuccess) return hsapGetLastError();
    int is_cuda = -1, count = 0, rank = -1;
    hsapCommIsCuda(comm, &is_cuda);
    hsapCommCount(comm, &count);
    hsapCommUserRank(comm, &rank);
    hsapCommDestroy(comm);
    return absl::StrCat(is_cuda, " ", count, " ", rank);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(ranks[r].exited_normally());
    EXPECT_EQ(ranks[r].report, absl::StrCat("0 2 ", r));
  }
  ExpectNoSegment(id);
}

TEST(ProcessFaultsTest, RankThatNeverCallsForwardMakesOthersTimeOut) {
  const hsapUniqueId_t id = NewId();
  std::vector<ProcessRank> ranks = RunRanksAsProcesses(3, [&](int r) -> std::string {
    return WithBatch(id, 3, r, 300, 300, [&](hsapBatch_t batch, int64_t n) -> std::string {
      if (r == 2) {  // never calls forward; stays alive until the others gave up
        std::this_thread::sleep_for(std::chrono::seconds(3));
        return "idle";
      }
      Forward f(n);
      const auto t0 = std::chrono::steady_clock::now();
      const hsapResult_t e = f.Run(batch);
      return Outcome(e, t0);
    });
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ranks[r].exited_normally()) << "rank " << r;
    const Parsed p = Parse(ranks[r]);
    EXPECT_EQ(p.result, hsapTimeout) << p.message;
    EXPECT_THAT(p.message, HasSubstr("rank 2"));
    EXPECT_THAT(p.message, HasSubstr("forward"));
    EXPECT_LT(p.seconds, 5.0);
  }
  EXPECT_EQ(ranks[2].report, "idle");
  ExpectNoSegment(id);
}

TEST(ProcessFaultsTest, AbortFromAnotherProcessReleasesEveryone) {
  const hsapUniqueId_t id = NewId();
  std::vector<ProcessRank> ranks = RunRanksAsProcesses(3, [&](int r) -> std::string {
    hsapComm_t comm = JoinHost(id, 3, r, 60000);
    if (comm == nullptr) return hsapGetLastError();
    hsapLayout_t layout = OneCausalDocument(300);
    hsapBatchConfig_t config = Config();
    hsapBatch_t batch = nullptr;
    if (hsapBatchCreate(&batch, comm, layout, nullptr, &config) != hsapSuccess) {
      return hsapGetLastError();
    }
    int64_t n = 0;
    hsapBatchGetLocalTokens(batch, &n);
    Forward f(n);
    const auto t0 = std::chrono::steady_clock::now();
    if (r == 2) {  // aborts instead of calling forward, then calls it: fails at once too
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      hsapCommAbort(comm);
    }
    const std::string report = Outcome(f.Run(batch), t0);
    hsapBatchDestroy(batch);
    hsapLayoutDestroy(layout);
    hsapCommDestroy(comm);
    return report;
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(ranks[r].exited_normally()) << "rank " << r;
    const Parsed p = Parse(ranks[r]);
    EXPECT_EQ(p.result, hsapAborted) << "rank " << r << ": " << p.message;
    EXPECT_THAT(p.message, HasSubstr("hsapCommAbort called on rank 2"));
    EXPECT_LT(p.seconds, 10.0);
  }
  ExpectNoSegment(id);
}

TEST(ProcessFaultsTest, MismatchedLayoutsAreReportedOnEveryRank) {
  const hsapUniqueId_t id = NewId();
  std::vector<ProcessRank> ranks = RunRanksAsProcesses(3, [&](int r) -> std::string {
    hsapComm_t comm = JoinHost(id, 3, r, 20000);
    if (comm == nullptr) return hsapGetLastError();
    hsapLayout_t layout = OneCausalDocument(r == 2 ? 301 : 300);
    hsapBatchConfig_t config = Config();
    hsapBatch_t batch = nullptr;
    const hsapResult_t e = hsapBatchCreate(&batch, comm, layout, nullptr, &config);
    const std::string report = absl::StrCat(static_cast<int>(e), "|0|", hsapGetLastError());
    hsapBatchDestroy(batch);
    hsapLayoutDestroy(layout);
    hsapCommDestroy(comm);
    return report;
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(ranks[r].exited_normally()) << "rank " << r;
    const Parsed p = Parse(ranks[r]);
    EXPECT_EQ(p.result, hsapInvalidUsage) << p.message;
    EXPECT_THAT(p.message, HasSubstr("rank 2's layout differs from rank 0's"));
  }
  ExpectNoSegment(id);
}

// Through a communicator's transport: a message whose size the ranks disagree on fails on
// both processes, naming both sizes and both stages.
TEST(ProcessFaultsTest, SizeMismatchFailsBothProcesses) {
  const hsapUniqueId_t id = NewId();
  std::vector<ProcessRank> ranks = RunRanksAsProcesses(2, [&](int r) -> std::string {
    hsapComm_t comm = JoinHost(id, 2, r, 20000);
    if (comm == nullptr) return hsapGetLastError();
    Transport& t = comm->comm->transport();
    std::vector<uint8_t> a(8, 1), b(16, 0);
    absl::Status s = r == 0 ? t.Exchange({{SendOp{1, a.data(), a.size(), 21}}}, {}, "send stage")
                            : t.Exchange({}, {{RecvOp{0, b.data(), b.size(), 21}}}, "recv stage");
    hsapCommDestroy(comm);
    return s.ToString();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ranks[r].exited_normally()) << "rank " << r;
    EXPECT_THAT(ranks[r].report, HasSubstr("FAILED_PRECONDITION"));
    EXPECT_THAT(ranks[r].report, HasSubstr(absl::StrCat("rank ", r, ": size mismatch")));
    EXPECT_THAT(ranks[r].report, HasSubstr("8 bytes"));
    EXPECT_THAT(ranks[r].report, HasSubstr("16 bytes"));
    EXPECT_THAT(ranks[r].report, HasSubstr("send stage"));
    EXPECT_THAT(ranks[r].report, HasSubstr("recv stage"));
  }
  ExpectNoSegment(id);
}

// kill -9 of a rank: once while the others wait in forward for it, once while every rank
// runs forward and backward in a loop. The survivors get hsapAborted (or, at worst,
// hsapTimeout) long before their 60 s timeout, and nothing is left in /dev/shm.
TEST(ProcessFaultsTest, RankKilledMidCallReleasesTheOthers) {
  for (const bool busy : {false, true}) {
    SCOPED_TRACE(busy ? "killed while computing" : "killed while the others wait");
    const hsapUniqueId_t id = NewId();
    std::vector<ProcessRank> ranks = RunRanksAsProcesses(
        3,
        [&](int r) -> std::string {
          return WithBatch(id, 3, r, 60000, 3000, [&](hsapBatch_t batch, int64_t n) -> std::string {
            Forward f(n);
            if (r == 2 && !busy) {
              while (true) std::this_thread::sleep_for(std::chrono::milliseconds(10));
            }
            const auto t0 = std::chrono::steady_clock::now();
            while (true) {
              const hsapResult_t e = f.Run(batch);
              if (e != hsapSuccess) return Outcome(e, t0);
            }
          });
        },
        [](const std::vector<pid_t>& pids) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1500));
          kill(pids[2], SIGKILL);
        },
        std::chrono::seconds(50));
    EXPECT_TRUE(ranks[2].killed_by(SIGKILL));
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(ranks[r].exited_normally()) << "rank " << r;
      const Parsed p = Parse(ranks[r]);
      EXPECT_TRUE(p.result == hsapAborted || p.result == hsapTimeout)
          << "rank " << r << ": " << p.result << " " << p.message;
      EXPECT_THAT(p.message, HasSubstr("rank 2 (pid"));
      EXPECT_THAT(p.message, HasSubstr("died"));
    }
    ExpectNoSegment(id);
  }
}

TEST(ProcessFaultsTest, InitRankChecksTheBackendAndTheToken) {
  hsapUniqueId_t id = NewId();
  hsapComm_t comm = nullptr;
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.backend = static_cast<hsapBackend_t>(7);
  EXPECT_EQ(hsapCommInitRank(&comm, 1, id, 0, &config), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("config->backend = 7"));
  // A token not made by hsapGetUniqueId cannot name a segment.
  hsapUniqueId_t raw{};
  config.backend = hsapBackendHost;
  EXPECT_EQ(hsapCommInitRank(&comm, 1, raw, 0, &config), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("not made by hsapGetUniqueId"));
  // hsapCommInitAll makes host ranks only.
  hsapComm_t comms[2] = {nullptr, nullptr};
  config.backend = hsapBackendCuda;
  EXPECT_EQ(hsapCommInitAll(comms, 2, &config), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("host ranks only"));
  // A single host rank needs no one else; its segment is gone once it exists.
  config.backend = hsapBackendHost;
  config.timeoutMs = 5000;
  ASSERT_EQ(hsapCommInitRank(&comm, 1, id, 0, &config), hsapSuccess) << hsapGetLastError();
  ExpectNoSegment(id);
  hsapComm_t child = nullptr;
  EXPECT_EQ(hsapCommSplit(comm, 0, 0, &child, nullptr), hsapUnsupported);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("host communicators cannot be split"));
  EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess);
  // The same token twice at once: the second rank 0 is told.
  id = NewId();
  config.timeoutMs = 300;
  std::vector<hsapResult_t> results(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      if (i == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      hsapComm_t c = nullptr;
      results[i] = hsapCommInitRank(&c, 2, id, 0, &config);
      errors[i] = hsapGetLastError();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(results[0], hsapTimeout) << errors[0];
  EXPECT_THAT(errors[0], HasSubstr("rank(s) 1"));
  EXPECT_EQ(results[1], hsapInvalidUsage) << errors[1];
  EXPECT_THAT(errors[1], HasSubstr("already in use"));
  ExpectNoSegment(id);
}

}  // namespace
}  // namespace hsap
