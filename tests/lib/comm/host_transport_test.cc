#include "lib/comm/host_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/comm/shm_transport.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

std::vector<std::unique_ptr<Transport>> MakeWorld(int n,
                                                  absl::Duration timeout = absl::Seconds(20)) {
  absl::StatusOr<std::vector<std::unique_ptr<Transport>>> world = CreateHostTransports(n, timeout);
  EXPECT_TRUE(world.ok()) << world.status();
  return std::move(*world);
}

// Runs body(rank) on one thread per rank and returns each rank's status.
std::vector<absl::Status> RunRanks(int n, const std::function<absl::Status(int)>& body) {
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r]() { results[r] = body(r); });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// A deterministic byte for (stage, sender, receiver, index): a mismatch shows misrouting.
uint8_t Pattern(int stage, int src, int dst, size_t i) {
  return static_cast<uint8_t>(stage * 131 + src * 31 + dst * 7 + i * 13 + (i >> 8));
}

// The suite below runs on both transports of host ranks: the in-process one and the
// shared-memory one (lib/comm/shm_transport.h), here with one thread per rank; the
// process-based runs are in shm_transport_test.cc.
enum class World { kHost, kShm };

class TransportTest : public ::testing::TestWithParam<World> {
 protected:
  std::vector<std::unique_ptr<Transport>> MakeWorld(int n,
                                                    absl::Duration timeout = absl::Seconds(20)) {
    if (GetParam() == World::kHost) return ::hsap::MakeWorld(n, timeout);
    absl::StatusOr<ShmWorldId> id = NewShmWorldId();
    EXPECT_TRUE(id.ok()) << id.status();
    std::vector<std::unique_ptr<Transport>> world(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<Transport>> t = CreateShmTransport(*id, n, r, timeout);
        EXPECT_TRUE(t.ok()) << t.status();
        if (t.ok()) world[r] = *std::move(t);
      });
    }
    for (std::thread& t : threads) t.join();
    return world;
  }
};

INSTANTIATE_TEST_SUITE_P(Transports, TransportTest, ::testing::Values(World::kHost, World::kShm),
                         [](const ::testing::TestParamInfo<World>& info) {
                           return info.param == World::kHost ? "Host" : "Shm";
                         });

TEST(HostTransportTest, CreateRejectsBadArguments) {
  EXPECT_EQ(CreateHostTransports(0, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateHostTransports(kMaxHostRanks + 1, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateHostTransports(2, absl::ZeroDuration()).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto world = MakeWorld(3);
  ASSERT_EQ(world.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(world[r]->rank(), r);
    EXPECT_EQ(world[r]->size(), 3);
  }
}

TEST_P(TransportTest, MatchesByTagInAnyPostingOrder) {
  auto world = MakeWorld(2);
  const std::vector<uint64_t> tags = {5, 1, 99, 7};
  std::vector<std::vector<uint8_t>> payload(tags.size());
  for (size_t i = 0; i < tags.size(); ++i)
    payload[i].assign(10 + i * 3, static_cast<uint8_t>(i + 1));
  std::vector<std::vector<uint8_t>> received(tags.size());
  for (size_t i = 0; i < tags.size(); ++i) received[i].assign(payload[i].size(), 0);

  for (int receiver_delay_ms : {0, 30}) {
    for (auto& r : received) std::fill(r.begin(), r.end(), 0);
    auto results = RunRanks(2, [&](int rank) -> absl::Status {
      if (rank == 0) {
        std::vector<SendOp> sends;
        for (size_t i : {2, 0, 3, 1}) {
          sends.push_back({1, payload[i].data(), payload[i].size(), tags[i]});
        }
        return world[0]->Exchange(sends, {}, "sends");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(receiver_delay_ms));
      std::vector<RecvOp> recvs;
      for (size_t i : {1, 3, 0, 2}) {
        recvs.push_back({0, received[i].data(), received[i].size(), tags[i]});
      }
      return world[1]->Exchange({}, recvs, "recvs");
    });
    for (const auto& s : results) EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(received, payload);
  }
}

TEST_P(TransportTest, EqualTagsMatchInPostingOrder) {
  auto world = MakeWorld(2);
  uint32_t a = 0xAAAA, b = 0xBBBB, c = 0xCCCC;
  uint32_t ra = 0, rb = 0, rc = 0;
  auto results = RunRanks(2, [&](int rank) -> absl::Status {
    if (rank == 0) {
      // Two stages: two messages with tag 3, then one more.
      SendOp ops[] = {{1, &a, 4, 3}, {1, &b, 4, 3}};
      if (auto s = world[0]->Exchange(ops, {}, "first"); !s.ok()) return s;
      SendOp last[] = {{1, &c, 4, 3}};
      return world[0]->Exchange(last, {}, "second");
    }
    RecvOp ops[] = {{0, &ra, 4, 3}, {0, &rb, 4, 3}, {0, &rc, 4, 3}};
    return world[1]->Exchange({}, ops, "all three");
  });
  for (const auto& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
  EXPECT_EQ(rc, c);
}

TEST_P(TransportTest, SelfSendAndZeroBytes) {
  auto world = MakeWorld(1);
  std::vector<int> in = {1, 2, 3}, out(3, 0);
  SendOp sends[] = {{0, in.data(), sizeof(int) * 3, 4}, {0, nullptr, 0, 5}};
  RecvOp recvs[] = {{0, nullptr, 0, 5}, {0, out.data(), sizeof(int) * 3, 4}};
  ASSERT_TRUE(world[0]->Exchange(sends, recvs, "self").ok());
  EXPECT_EQ(out, in);
  TrafficCounters c = world[0]->counters();
  EXPECT_EQ(c.bytes_sent, 12u);
  EXPECT_EQ(c.bytes_received, 12u);
  EXPECT_EQ(c.messages_sent, 2u);
  EXPECT_EQ(c.messages_received, 2u);
  world[0]->ResetCounters();
  EXPECT_EQ(world[0]->counters().messages_sent, 0u);
}

TEST_P(TransportTest, RingStagesBackToBack) {
  constexpr int kRanks = 4;
  constexpr int kStages = 200;
  auto world = MakeWorld(kRanks);
  auto results = RunRanks(kRanks, [&](int rank) -> absl::Status {
    std::vector<uint8_t> out(64), in(64);
    const int next = (rank + 1) % kRanks, prev = (rank + kRanks - 1) % kRanks;
    for (int stage = 0; stage < kStages; ++stage) {
      for (size_t i = 0; i < out.size(); ++i) out[i] = Pattern(stage, rank, next, i);
      SendOp s[] = {{next, out.data(), out.size(), static_cast<uint64_t>(stage)}};
      RecvOp r[] = {{prev, in.data(), in.size(), static_cast<uint64_t>(stage)}};
      if (auto st = world[rank]->Exchange(s, r, absl::StrCat("ring ", stage)); !st.ok()) return st;
      for (size_t i = 0; i < in.size(); ++i) {
        if (in[i] != Pattern(stage, prev, rank, i)) {
          return absl::InternalError(absl::StrCat("rank ", rank, " stage ", stage, " byte ", i));
        }
      }
    }
    return absl::OkStatus();
  });
  for (const auto& s : results) EXPECT_TRUE(s.ok()) << s;
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(world[r]->counters().bytes_sent, 64u * kStages);
    EXPECT_EQ(world[r]->counters().messages_received, static_cast<uint64_t>(kStages));
  }
}

TEST_P(TransportTest, AllToAllRandomSizesWithExactCounters) {
  constexpr int kRanks = 5;
  constexpr int kRounds = 12;
  auto world = MakeWorld(kRanks);
  // sizes[round][src][dst], shared by all ranks; zero-byte messages included.
  std::mt19937 rng(1234);
  std::vector<std::vector<std::vector<size_t>>> sizes(
      kRounds, std::vector<std::vector<size_t>>(kRanks, std::vector<size_t>(kRanks)));
  for (auto& round : sizes) {
    for (auto& row : round) {
      for (size_t& s : row) s = (rng() % 4 == 0) ? 0 : rng() % 3000;
    }
  }
  auto results = RunRanks(kRanks, [&](int me) -> absl::Status {
    for (int round = 0; round < kRounds; ++round) {
      std::vector<std::vector<uint8_t>> out(kRanks), in(kRanks);
      std::vector<SendOp> sends;
      std::vector<RecvOp> recvs;
      // Post in a rank-dependent order to exercise matching.
      for (int k = 0; k < kRanks; ++k) {
        const int peer = (me * 3 + k) % kRanks;
        out[peer].resize(sizes[round][me][peer]);
        for (size_t i = 0; i < out[peer].size(); ++i) out[peer][i] = Pattern(round, me, peer, i);
        sends.push_back({peer, out[peer].data(), out[peer].size(), 40});
        const int src = (me + kRanks - k) % kRanks;
        in[src].assign(sizes[round][src][me], 0);
        recvs.push_back({src, in[src].data(), in[src].size(), 40});
      }
      if (auto s = world[me]->Exchange(sends, recvs, "a2a"); !s.ok()) return s;
      for (int src = 0; src < kRanks; ++src) {
        for (size_t i = 0; i < in[src].size(); ++i) {
          if (in[src][i] != Pattern(round, src, me, i)) {
            return absl::InternalError(absl::StrCat("round ", round, " from ", src, " byte ", i));
          }
        }
      }
    }
    return absl::OkStatus();
  });
  for (const auto& s : results) EXPECT_TRUE(s.ok()) << s;
  for (int me = 0; me < kRanks; ++me) {
    uint64_t sent = 0, received = 0;
    for (int round = 0; round < kRounds; ++round) {
      for (int peer = 0; peer < kRanks; ++peer) {
        sent += sizes[round][me][peer];
        received += sizes[round][peer][me];
      }
    }
    TrafficCounters c = world[me]->counters();
    EXPECT_EQ(c.bytes_sent, sent);
    EXPECT_EQ(c.bytes_received, received);
    EXPECT_EQ(c.messages_sent, static_cast<uint64_t>(kRounds * kRanks));
    EXPECT_EQ(c.messages_received, static_cast<uint64_t>(kRounds * kRanks));
  }
}

TEST_P(TransportTest, WaitsInAnyOrderAcrossStages) {
  // Rank 0 waits on its send first, rank 1 on its other send first: each Wait must also
  // perform the copies of the rank's other stage, or this deadlocks.
  auto world = MakeWorld(2, absl::Seconds(10));
  int x0 = 10, x1 = 11, y0 = 0, y1 = 0;
  auto results = RunRanks(2, [&](int rank) -> absl::Status {
    Transport& t = *world[rank];
    const int peer = 1 - rank;
    int* out = rank == 0 ? &x0 : &x1;
    int* in = rank == 0 ? &y0 : &y1;
    SendOp s[] = {{peer, out, sizeof(int), static_cast<uint64_t>(rank)}};
    RecvOp r[] = {{peer, in, sizeof(int), static_cast<uint64_t>(peer)}};
    auto send_stage = t.Start(s, {}, "send");
    if (!send_stage.ok()) return send_stage.status();
    auto recv_stage = t.Start({}, r, "recv");
    if (!recv_stage.ok()) return recv_stage.status();
    if (auto st = (*send_stage)->Wait(); !st.ok()) return st;
    return (*recv_stage)->Wait();
  });
  for (const auto& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(y0, 11);
  EXPECT_EQ(y1, 10);
}

TEST_P(TransportTest, AllGather) {
  for (int n : {1, 2, 5}) {
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{37}}) {
      for (bool in_place : {false, true}) {
        auto world = MakeWorld(n);
        std::vector<std::vector<uint8_t>> outs(n, std::vector<uint8_t>(n * bytes + 1, 0xEE));
        auto results = RunRanks(n, [&](int me) -> absl::Status {
          std::vector<uint8_t> in(bytes);
          for (size_t i = 0; i < bytes; ++i) in[i] = Pattern(0, me, 0, i);
          uint8_t* out = outs[me].data();
          for (int call = 0; call < 2; ++call) {
            const void* src = in.data();
            if (in_place) {
              if (bytes > 0) std::memcpy(out + me * bytes, in.data(), bytes);
              src = out + me * bytes;
            }
            if (auto s = world[me]->AllGather(src, out, bytes, "gather"); !s.ok()) return s;
          }
          return absl::OkStatus();
        });
        for (const auto& s : results) EXPECT_TRUE(s.ok()) << s;
        for (int me = 0; me < n; ++me) {
          for (int r = 0; r < n; ++r) {
            for (size_t i = 0; i < bytes; ++i) {
              ASSERT_EQ(outs[me][r * bytes + i], Pattern(0, r, 0, i))
                  << "n=" << n << " bytes=" << bytes << " rank " << me << " slot " << r;
            }
          }
          EXPECT_EQ(outs[me][n * bytes], 0xEE) << "wrote past the end";
        }
      }
    }
  }
}

TEST_P(TransportTest, AllGatherRejectsOverlap) {
  auto world = MakeWorld(1);
  std::vector<uint8_t> buf(16);
  EXPECT_EQ(world[0]->AllGather(buf.data() + 1, buf.data(), 8, "g").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(world[0]->AllGather(nullptr, buf.data(), 8, "g").code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(TransportTest, SizeMismatchFailsOnBothSides) {
  auto world = MakeWorld(2);
  std::vector<uint8_t> a(8, 1), b(16, 0), c(4, 9), d(4, 0);
  auto results = RunRanks(2, [&](int rank) -> absl::Status {
    if (rank == 0) {
      SendOp s[] = {{1, a.data(), a.size(), 21}, {1, c.data(), c.size(), 22}};
      return world[0]->Exchange(s, {}, "send stage");
    }
    RecvOp r[] = {{0, b.data(), b.size(), 21}, {0, d.data(), d.size(), 22}};
    return world[1]->Exchange({}, r, "recv stage");
  });
  for (const auto& s : results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("size mismatch"));
    EXPECT_THAT(s.message(), HasSubstr("tag 21"));
    EXPECT_THAT(s.message(), HasSubstr("8 bytes"));
    EXPECT_THAT(s.message(), HasSubstr("16 bytes"));
    EXPECT_THAT(s.message(), HasSubstr("send stage"));
    EXPECT_THAT(s.message(), HasSubstr("recv stage"));
  }
  EXPECT_THAT(results[0].message(), HasSubstr("rank 0"));
  EXPECT_THAT(results[1].message(), HasSubstr("rank 1"));
  EXPECT_EQ(b, std::vector<uint8_t>(16, 0)) << "nothing may be copied on a mismatch";
  EXPECT_EQ(d, c) << "the well-formed message of the stage still arrives";
}

TEST_P(TransportTest, TimeoutNamesRankPeerTagAndStage) {
  auto world = MakeWorld(3, absl::Milliseconds(200));
  std::vector<uint8_t> buf(32);
  const absl::Time start = absl::Now();
  absl::Status s =
      world[2]->Exchange({}, {{RecvOp{1, buf.data(), buf.size(), 17}}}, "fwd kv step 3");
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.message(),
            "rank 2: timed out after 200 ms in stage 'fwd kv step 3' waiting for rank 1 (recv "
            "tag 17)");
  EXPECT_GE(elapsed, absl::Milliseconds(195));
  EXPECT_LT(elapsed, absl::Milliseconds(200) + absl::Seconds(3));
  // The world is now unusable: later calls fail at once instead of hanging.
  int x = 0;
  absl::Status later = world[1]->Exchange({{SendOp{2, &x, sizeof(x), 17}}}, {}, "late");
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
  EXPECT_THAT(later.message(), HasSubstr("timed out"));
}

TEST_P(TransportTest, TimeoutListsEveryMissingPeer) {
  auto world = MakeWorld(4, absl::Milliseconds(150));
  int out = 1, in1 = 0, in3 = 0;
  auto results = RunRanks(4, [&](int rank) -> absl::Status {
    if (rank == 2) {
      // Waits for rank 1 (never comes) and rank 3 (never comes); rank 0 delivers.
      SendOp s[] = {{3, &out, sizeof(int), 8}};
      RecvOp r[] = {{1, &in1, sizeof(int), 5}, {3, &in3, sizeof(int), 6}, {0, &in1, 0, 4}};
      return world[2]->Exchange(s, r, "mixed");
    }
    if (rank == 0) return world[0]->Exchange({{SendOp{2, nullptr, 0, 4}}}, {}, "deliver");
    return absl::OkStatus();
  });
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(results[2].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(results[2].message(),
            "rank 2: timed out after 150 ms in stage 'mixed' waiting for rank 1 (recv tag 5), "
            "rank 3 (send tag 8, recv tag 6)");
}

TEST_P(TransportTest, RankThatNeverArrivesTimesOutTheOthers) {
  constexpr int kRanks = 4;
  auto world = MakeWorld(kRanks, absl::Milliseconds(200));
  auto results = RunRanks(kRanks, [&](int me) -> absl::Status {
    if (me == 0) return absl::OkStatus();  // never arrives
    std::vector<int> out(kRanks, me), in(kRanks, -1);
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    for (int p = 0; p < kRanks; ++p) {
      if (p == me) continue;
      sends.push_back({p, &out[p], sizeof(int), 1});
      recvs.push_back({p, &in[p], sizeof(int), 1});
    }
    return world[me]->Exchange(sends, recvs, "a2a");
  });
  for (int me = 1; me < kRanks; ++me) {
    EXPECT_EQ(results[me].code(), absl::StatusCode::kDeadlineExceeded) << results[me];
    EXPECT_THAT(results[me].message(),
                HasSubstr(absl::StrCat("rank ", me,
                                       ": timed out after 200 ms in stage 'a2a' "
                                       "waiting for rank 0 (send tag 1, recv tag 1)")));
  }
}

TEST_P(TransportTest, WithdrawnReceiveIsNeverWrittenAfterTimeout) {
  auto world = MakeWorld(2, absl::Milliseconds(100));
  auto buffer = std::make_unique<std::vector<uint8_t>>(1024, 0);
  absl::Status s = world[0]->Exchange({}, {{RecvOp{1, buffer->data(), 1024, 3}}}, "early");
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  buffer.reset();  // ASan reports any later write into it
  std::vector<uint8_t> payload(1024, 7);
  absl::Status late = world[1]->Exchange({{SendOp{0, payload.data(), 1024, 3}}}, {}, "late");
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
}

// Host transport only: the shared-memory transport writes a send's payload into the ring at
// once, so a receiver finds the message there even after the sender timed out.
TEST(HostTransportTest, WithdrawnMatchedSendFailsThePeerCleanly) {
  // Rank 1 posts its receive (so the send is matched) but waits only after rank 0 has timed
  // out and freed its send buffer: rank 1 must fail with Aborted and never read the buffer.
  auto world = MakeWorld(2, absl::Milliseconds(100));
  std::vector<uint8_t> in(4096, 0);
  std::atomic<bool> sender_done{false};
  auto results = RunRanks(2, [&](int rank) -> absl::Status {
    if (rank == 1) {
      RecvOp r[] = {{0, in.data(), in.size(), 9}};
      auto pending = world[1]->Start({}, r, "slow receiver");
      if (!pending.ok()) return pending.status();
      while (!sender_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return (*pending)->Wait();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the receive be posted
    auto out = std::make_unique<std::vector<uint8_t>>(4096, 5);
    absl::Status s = world[0]->Exchange({{SendOp{1, out->data(), out->size(), 9}}}, {}, "sender");
    out.reset();
    sender_done.store(true);
    return s;
  });
  EXPECT_EQ(results[0].code(), absl::StatusCode::kDeadlineExceeded) << results[0];
  EXPECT_THAT(results[0].message(), HasSubstr("waiting for rank 1 (send tag 9)"));
  EXPECT_EQ(results[1].code(), absl::StatusCode::kAborted) << results[1];
  EXPECT_THAT(results[1].message(), HasSubstr("rank 0 withdrew the matching send (tag 9"));
  EXPECT_EQ(in, std::vector<uint8_t>(4096, 0));
}

TEST_P(TransportTest, AbortFromAnotherThreadReleasesEveryWaiter) {
  constexpr int kRanks = 3;
  auto world = MakeWorld(kRanks, absl::Seconds(60));
  const absl::Time start = absl::Now();
  std::thread aborter([&]() {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    world[1]->Abort("operator pressed stop");
  });
  auto results = RunRanks(kRanks, [&](int me) -> absl::Status {
    int x = 0;
    // Everyone waits for a message from the next rank that nobody sends.
    return world[me]->Exchange({}, {{RecvOp{(me + 1) % kRanks, &x, sizeof(x), 77}}}, "stuck");
  });
  aborter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  for (int me = 0; me < kRanks; ++me) {
    EXPECT_EQ(results[me].code(), absl::StatusCode::kAborted) << results[me];
    EXPECT_THAT(results[me].message(), HasSubstr("operator pressed stop"));
    EXPECT_THAT(results[me].message(), HasSubstr("stage 'stuck'"));
    EXPECT_TRUE(world[me]->aborted());
  }
  int x = 0;
  absl::Status future = world[0]->Exchange({{SendOp{1, &x, sizeof(x), 1}}}, {}, "after");
  EXPECT_EQ(future.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(future.message(), HasSubstr("operator pressed stop"));
  EXPECT_EQ(world[2]->AllGather(&x, &x, 0, "after").code(), absl::StatusCode::kAborted);
}

TEST_P(TransportTest, AbortRacingLargeTransfersIsSafe) {
  // Ranks stream 256 KiB messages around a ring while another thread aborts at a random
  // moment: every rank ends with OK or Aborted, and (under ASan) no buffer is touched after
  // its stage returned.
  constexpr int kRanks = 4;
  for (int trial = 0; trial < 4; ++trial) {
    auto world = MakeWorld(kRanks, absl::Seconds(30));
    std::thread aborter([&]() {
      std::this_thread::sleep_for(std::chrono::microseconds(500 + trial * 1500));
      world[trial % kRanks]->Abort("racing abort");
    });
    auto results = RunRanks(kRanks, [&](int me) -> absl::Status {
      for (int stage = 0; stage < 1000; ++stage) {
        auto out = std::make_unique<std::vector<uint8_t>>(256 << 10, static_cast<uint8_t>(me));
        auto in = std::make_unique<std::vector<uint8_t>>(256 << 10);
        SendOp s[] = {{(me + 1) % kRanks, out->data(), out->size(), 0}};
        RecvOp r[] = {{(me + kRanks - 1) % kRanks, in->data(), in->size(), 0}};
        if (auto st = world[me]->Exchange(s, r, "stream"); !st.ok()) return st;
      }
      return absl::OkStatus();
    });
    aborter.join();
    for (const auto& s : results) {
      EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kAborted) << s;
    }
  }
}

TEST_P(TransportTest, RejectsBadOperations) {
  auto world = MakeWorld(2);
  std::vector<uint8_t> buf(64);
  auto code = [&](std::vector<SendOp> s, std::vector<RecvOp> r) {
    return world[0]->Start(s, r, "bad").status();
  };
  absl::Status s = code({{2, buf.data(), 4, 0}}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("sends[0].peer = 2"));
  EXPECT_EQ(code({}, {{-1, buf.data(), 4, 0}}).code(), absl::StatusCode::kInvalidArgument);
  s = code({}, {{1, nullptr, 4, 0}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("recvs[0].data is null"));
  s = code({}, {{1, buf.data(), 16, 0}, {1, buf.data() + 8, 16, 1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("overlaps"));
  s = code({{1, buf.data() + 20, 8, 0}}, {{1, buf.data() + 16, 8, 1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // Overlapping sends are fine (read only); so are adjacent receives.
  std::vector<uint8_t> in(32);
  auto results = RunRanks(2, [&](int me) -> absl::Status {
    if (me == 0) {
      SendOp s2[] = {{1, buf.data(), 16, 0}, {1, buf.data() + 8, 16, 1}};
      return world[0]->Exchange(s2, {}, "ok");
    }
    RecvOp r2[] = {{0, in.data(), 16, 0}, {0, in.data() + 16, 16, 1}};
    return world[1]->Exchange({}, r2, "ok");
  });
  for (const auto& st : results) EXPECT_TRUE(st.ok()) << st;
  // Nothing was posted by the rejected calls.
  EXPECT_EQ(world[0]->counters().messages_sent, 2u);
}

TEST_P(TransportTest, DestroyedPeerFailsFast) {
  auto world = MakeWorld(3, absl::Seconds(60));
  int x = 0;
  const absl::Time start = absl::Now();
  std::thread destroyer([&]() {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    world[1].reset();
  });
  absl::Status s = world[0]->Exchange({}, {{RecvOp{1, &x, sizeof(x), 2}}}, "waiting");
  destroyer.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1 was destroyed"));
  s = world[2]->Exchange({{SendOp{1, &x, sizeof(x), 2}}}, {}, "after");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1 has been destroyed"));
}

TEST_P(TransportTest, DestroyingAnUnwaitedStageWaitsForIt) {
  auto world = MakeWorld(2);
  int a = 42, b = 0;
  auto results = RunRanks(2, [&](int me) -> absl::Status {
    if (me == 0) {
      auto p = world[0]->Start({{SendOp{1, &a, sizeof(a), 1}}}, {}, "dropped");
      return p.status();  // the handle's destructor completes the stage
    }
    return world[1]->Exchange({}, {{RecvOp{0, &b, sizeof(b), 1}}}, "recv");
  });
  for (const auto& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(b, 42);
}

}  // namespace
}  // namespace hsap
