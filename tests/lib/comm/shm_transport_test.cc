// The shared-memory transport with ranks as processes: data, collectives, process death,
// bootstrap failures, cleanup of /dev/shm and waiting without burning a core. The
// transport's semantics with one thread per rank are tested by host_transport_test.cc,
// which runs its suite on both transports.
#include "lib/comm/shm_transport.h"

#include <signal.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/process_ranks.h"

namespace hsap {
namespace {

using ::hsap::testing::ProcessRank;
using ::hsap::testing::RunRanksAsProcesses;
using ::testing::HasSubstr;

ShmWorldId FreshId() {
  absl::StatusOr<ShmWorldId> id = NewShmWorldId();
  EXPECT_TRUE(id.ok()) << id.status();
  return *id;
}

bool SegmentExists(const ShmWorldId& id) {
  const std::string name = ShmSegmentName(id).substr(1);  // without the leading '/'
  for (const std::string& e : testing::HsapShmEntries()) {
    if (e == name) return true;
  }
  return false;
}

uint8_t Pattern(int src, int dst, uint64_t tag, size_t i) {
  return static_cast<uint8_t>(src * 31 + dst * 7 + tag * 5 + i * 13 + (i >> 9));
}

// "ok" or the first failure, as a child's report.
std::string Report(const absl::Status& s) { return s.ok() ? "ok" : std::string(s.ToString()); }

TEST(ShmTransportTest, SegmentNameComesFromTheId) {
  ShmWorldId id;
  for (size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = static_cast<uint8_t>(i * 17);
  EXPECT_EQ(ShmSegmentName(id), "/hsap-00112233445566778899aabbccddeeff");
  EXPECT_NE(ShmSegmentName(FreshId()), ShmSegmentName(FreshId()));
}

TEST(ShmTransportTest, CreateRejectsBadArguments) {
  const ShmWorldId id = FreshId();
  EXPECT_EQ(CreateShmTransport(id, 0, 0, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateShmTransport(id, kMaxShmRanks + 1, 0, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateShmTransport(id, 2, 2, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateShmTransport(id, 2, 0, absl::ZeroDuration()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(SegmentExists(id));
}

// Messages of every size class (empty, small, larger than a ring) in both directions and to
// itself, between two processes; then the counters, and no segment left.
TEST(ShmTransportTest, TwoProcessesExchangeMessagesOfAnySize) {
  const ShmWorldId id = FreshId();
  const std::vector<size_t> sizes = {0, 1, 1000, (3u << 20) + 7};
  std::vector<ProcessRank> ranks = RunRanksAsProcesses(2, [&](int me) -> std::string {
    absl::StatusOr<std::unique_ptr<Transport>> t = CreateShmTransport(id, 2, me, absl::Seconds(60));
    if (!t.ok()) return Report(t.status());
    const int peer = 1 - me;
    for (int round = 0; round < 3; ++round) {
      std::vector<std::vector<uint8_t>> out(sizes.size()), in(sizes.size()), self_in(sizes.size());
      std::vector<SendOp> sends;
      std::vector<RecvOp> recvs;
      for (size_t i = 0; i < sizes.size(); ++i) {
        out[i].resize(sizes[i] + 1);
        for (size_t j = 0; j < sizes[i]; ++j) out[i][j] = Pattern(me, peer, i + round, j);
        in[i].assign(sizes[i] + 1, 0);
        self_in[i].assign(sizes[i] + 1, 0);
      }
      for (size_t i = 0; i < sizes.size(); ++i) {
        // Posted in opposite orders on the two ranks: matching is per tag.
        const size_t k = me == 0 ? i : sizes.size() - 1 - i;
        sends.push_back({peer, out[k].data(), sizes[k], k});
        sends.push_back({me, out[k].data(), sizes[k], 100 + k});
        recvs.push_back({peer, in[i].data(), sizes[i], i});
        recvs.push_back({me, self_in[i].data(), sizes[i], 100 + i});
      }
      absl::Status s = (*t)->Exchange(sends, recvs, absl::StrCat("round ", round));
      if (!s.ok()) return Report(s);
      for (size_t i = 0; i < sizes.size(); ++i) {
        for (size_t j = 0; j < sizes[i]; ++j) {
          if (in[i][j] != Pattern(peer, me, i + round, j) || self_in[i][j] != out[i][j]) {
            return absl::StrCat("round ", round, " message ", i, ": wrong byte at ", j);
          }
        }
      }
    }
    const TrafficCounters c = (*t)->counters();
    size_t total = 0;
    for (size_t s : sizes) total += s;
    if (c.messages_sent != 3 * 2 * sizes.size() || c.bytes_sent != 3 * 2 * total ||
        c.messages_received != c.messages_sent || c.bytes_received != c.bytes_sent) {
      return absl::StrCat("counters: ", c.messages_sent, " ", c.bytes_sent, " ",
                          c.messages_received, " ", c.bytes_received);
    }
    return "ok";
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(ranks[r].exited_normally()) << "rank " << r;
    EXPECT_EQ(ranks[r].report, "ok") << "rank " << r;
  }
  EXPECT_FALSE(SegmentExists(id));
}

TEST(ShmTransportTest, FourProcessesRingStagesAndAllGather) {
  constexpr int kRanks = 4;
  const ShmWorldId id = FreshId();
  std::vector<ProcessRank> ranks = RunRanksAsProcesses(kRanks, [&](int me) -> std::string {
    absl::StatusOr<std::unique_ptr<Transport>> t =
        CreateShmTransport(id, kRanks, me, absl::Seconds(60));
    if (!t.ok()) return Report(t.status());
    const int next = (me + 1) % kRanks, prev = (me + kRanks - 1) % kRanks;
    for (int stage = 0; stage < 40; ++stage) {
      std::vector<uint8_t> out(5000 + stage * 1111), in(5000 + stage * 1111);
      for (size_t j = 0; j < out.size(); ++j) out[j] = Pattern(me, next, stage, j);
      absl::Status s = (*t)->Exchange({{SendOp{next, out.data(), out.size(), 3}}},
                                      {{RecvOp{prev, in.data(), in.size(), 3}}}, "ring");
      if (!s.ok()) return Report(s);
      for (size_t j = 0; j < in.size(); ++j) {
        if (in[j] != Pattern(prev, me, stage, j)) return absl::StrCat("ring stage ", stage);
      }
      std::vector<int64_t> all(kRanks, -1);
      const int64_t mine = me * 1000 + stage;
      s = (*t)->AllGather(&mine, all.data(), sizeof(mine), "gather");
      if (!s.ok()) return Report(s);
      for (int r = 0; r < kRanks; ++r) {
        if (all[r] != r * 1000 + stage) return absl::StrCat("allgather stage ", stage);
      }
    }
    return "ok";
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(ranks[r].exited_normally()) << "rank " << r;
    EXPECT_EQ(ranks[r].report, "ok") << "rank " << r;
  }
  EXPECT_FALSE(SegmentExists(id));
}

// Ranks 0 and 1 wait on rank 2, which is killed with SIGKILL while they wait (once idle,
// once in the middle of streaming a large message to rank 0): both get Aborted naming the
// dead rank well before their 60 s timeout.
TEST(ShmTransportTest, PeerKilledMidCallAbortsTheOthers) {
  for (const bool streaming : {false, true}) {
    SCOPED_TRACE(streaming ? "killed while streaming" : "killed while idle");
    const ShmWorldId id = FreshId();
    std::vector<ProcessRank> ranks = RunRanksAsProcesses(
        3,
        [&](int me) -> std::string {
          absl::StatusOr<std::unique_ptr<Transport>> t =
              CreateShmTransport(id, 3, me, absl::Seconds(60));
          if (!t.ok()) return Report(t.status());
          if (me == 2) {
            std::vector<uint8_t> big(64 << 20, 1);
            while (true) {
              if (streaming) {
                (*t)->Exchange({{SendOp{0, big.data(), big.size(), 1}}}, {}, "stream")
                    .IgnoreError();
              } else {
                std::this_thread::sleep_for(std::chrono::milliseconds(10));
              }
            }
          }
          const auto t0 = std::chrono::steady_clock::now();
          std::vector<uint8_t> in(64 << 20);
          int x = 0;
          absl::Status s =
              me == 0 ? (*t)->Exchange(
                            {}, {{RecvOp{2, in.data(), in.size(), 1}, RecvOp{2, &x, sizeof(x), 2}}},
                            "waiting on 2")
                      : (*t)->Exchange({}, {{RecvOp{2, &x, sizeof(x), 1}}}, "waiting on 2");
          const double seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          return absl::StrCat(static_cast<int>(s.code()), "|", seconds, "|", s.message());
        },
        [](const std::vector<pid_t>& pids) {
          std::this_thread::sleep_for(std::chrono::milliseconds(400));
          kill(pids[2], SIGKILL);
        },
        std::chrono::seconds(50));
    EXPECT_TRUE(ranks[2].killed_by(SIGKILL));
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(ranks[r].exited_normally()) << "rank " << r;
      const std::vector<std::string> parts =
          absl::StrSplit(ranks[r].report, absl::MaxSplits('|', 2));
      ASSERT_EQ(parts.size(), 3u) << ranks[r].report;
      EXPECT_EQ(parts[0], absl::StrCat(static_cast<int>(absl::StatusCode::kAborted)))
          << "rank " << r << ": " << parts[2];
      EXPECT_LT(std::stod(parts[1]), 20.0) << "rank " << r;
      EXPECT_THAT(parts[2], HasSubstr("rank 2 (pid"));
      EXPECT_THAT(parts[2], HasSubstr("died"));
    }
    EXPECT_FALSE(SegmentExists(id));
  }
}

TEST(ShmTransportTest, BootstrapTimeoutNamesTheMissingRanksAndCleansUp) {
  const ShmWorldId id = FreshId();
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = CreateShmTransport(id, 3, 0, absl::Milliseconds(200)).status();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(190));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank(s) 1, 2"));
  EXPECT_FALSE(SegmentExists(id));
  // A rank whose rank 0 never comes.
  s = CreateShmTransport(FreshId(), 2, 1, absl::Milliseconds(100)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("waiting for rank 0"));
}

TEST(ShmTransportTest, RanksDisagreeingOnTheWorldFailEveryRank) {
  const ShmWorldId id = FreshId();
  std::vector<ProcessRank> ranks = RunRanksAsProcesses(3, [&](int me) -> std::string {
    if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    // Rank 1 believes in a world of 4.
    return Report(CreateShmTransport(id, me == 1 ? 4 : 3, me, absl::Seconds(30)).status());
  });
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(ranks[r].exited_normally()) << "rank " << r;
  EXPECT_THAT(ranks[1].report, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(ranks[1].report,
              HasSubstr("nranks = 4 but rank 0 created the world with nranks = 3"));
  for (int r : {0, 2}) {
    EXPECT_THAT(ranks[r].report, HasSubstr("ABORTED")) << "rank " << r;
    EXPECT_THAT(ranks[r].report, HasSubstr("nranks = 4")) << "rank " << r;
  }
  EXPECT_FALSE(SegmentExists(id));
}

TEST(ShmTransportTest, ARankNumberUsedTwiceFailsEveryRank) {
  const ShmWorldId id = FreshId();
  std::vector<absl::Status> results(3);
  std::vector<std::thread> threads;
  const int rank_of[] = {0, 1, 1};
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      if (i == 2) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      results[i] = CreateShmTransport(id, 3, rank_of[i], absl::Seconds(30)).status();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(results[2].code(), absl::StatusCode::kInvalidArgument) << results[2];
  EXPECT_THAT(results[2].message(), HasSubstr("rank 1 is already attached"));
  for (int i : {0, 1}) EXPECT_EQ(results[i].code(), absl::StatusCode::kAborted) << results[i];
  EXPECT_FALSE(SegmentExists(id));
}

// A rank waiting for a peer that never sends sleeps instead of spinning: over a 1 s wait it
// uses a small fraction of a core.
TEST(ShmTransportTest, WaitingDoesNotBurnACore) {
  const ShmWorldId id = FreshId();
  std::vector<std::unique_ptr<Transport>> world(2);
  std::thread other([&] { world[1] = *CreateShmTransport(id, 2, 1, absl::Seconds(1)); });
  world[0] = *CreateShmTransport(id, 2, 0, absl::Seconds(1));
  other.join();
  timespec cpu0{}, cpu1{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
  int x = 0;
  absl::Status s = world[0]->Exchange({}, {{RecvOp{1, &x, sizeof(x), 1}}}, "idle");
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  const double cpu = (cpu1.tv_sec - cpu0.tv_sec) + (cpu1.tv_nsec - cpu0.tv_nsec) * 1e-9;
  EXPECT_LT(cpu, 0.25) << "CPU seconds spent in a 1 s wait";
}

}  // namespace
}  // namespace hsap
