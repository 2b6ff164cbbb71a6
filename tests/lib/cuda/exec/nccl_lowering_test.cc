// The NCCL lowering of schedules, checked against what the host executor actually posts on
// the host transport (recorded through a decorator), plus the NCCL-semantics simulator and
// the buffer pool sizing. Needs no GPU.
#include "lib/cuda/exec/nccl_lowering.h"

#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/time/time.h"
#include "attention/kernel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/comm/communicator.h"
#include "lib/comm/host_transport.h"
#include "lib/cuda/runtime/buffer_pool.h"
#include "lib/exec/executor.h"
#include "lib/sched/partition.h"
#include "lib/sched/schedule.h"
#include "tests/support/random_layouts.h"
#include "tests/support/recording_transport.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::DocMix;
using ::testing::HasSubstr;

struct World {
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<RecordingTransport*> recorders;
};

World MakeWorld(int nranks, const std::vector<int>& nodes = {}) {
  World w;
  auto transports = CreateHostTransports(nranks, absl::Seconds(60));
  EXPECT_TRUE(transports.ok()) << transports.status();
  for (auto& t : *transports) {
    auto rec = std::make_unique<RecordingTransport>(std::move(t));
    w.recorders.push_back(rec.get());
    std::optional<Topology> topology;
    if (!nodes.empty()) topology = *Topology::FromRankNodes(nodes);
    w.comms.push_back(
        std::make_unique<Communicator>(std::move(rec), absl::Seconds(60), 1, topology));
  }
  return w;
}

// (kind, step) of a group from its tags: kind 0 = K/V, 1 = dK/dV.
std::pair<int, int> GroupKey(const P2pGroup& g) {
  EXPECT_FALSE(g.ops.empty()) << g.label;
  const uint64_t tag = g.ops.front().tag;
  const int payload = static_cast<int>((tag >> 20) & 0xf);
  return {payload >= 3 ? 1 : 0, static_cast<int>(tag & 0xfffff)};
}

struct Case {
  int ranks;
  DocMix mix;
  uint64_t seed;
};

class LoweringTest : public ::testing::TestWithParam<Case> {};

// Runs one forward and one backward of the host executor on every rank and returns the
// recorded programs, with the schedules.
struct Recorded {
  std::vector<Schedule> schedules;
  std::vector<P2pProgram> forward, backward;
};

Recorded RunHost(const Layout& layout, int R, const AttentionDims& dims, DType dtype,
                 uint64_t call_id, const std::vector<int>& nodes = {}) {
  Recorded out;
  absl::StatusOr<Partition> partition = Partition::Create(layout, R);
  EXPECT_TRUE(partition.ok()) << partition.status();
  for (int r = 0; r < R; ++r) {
    absl::StatusOr<Schedule> s = BuildSchedule(layout, *partition, r, kKernelBlockQ, nodes);
    EXPECT_TRUE(s.ok()) << s.status();
    out.schedules.push_back(*std::move(s));
  }
  World w = MakeWorld(R, nodes);
  out.forward.resize(R);
  out.backward.resize(R);
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(R);
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      const Schedule& sched = out.schedules[r];
      const size_t rows = static_cast<size_t>(sched.local_rows);
      const size_t qn = rows * dims.heads_q * dims.head_dim * DTypeSize(dtype);
      const size_t kn = rows * dims.heads_kv * dims.head_dim * DTypeSize(dtype);
      std::vector<char> q(qn, 0), k(kn, 0), v(kn, 0), o(qn, 0), dq(qn), dk(kn), dv(kn);
      std::vector<float> lse(rows * dims.heads_q);
      ExecContext ctx;
      ctx.comm = w.comms[r].get();
      ctx.schedule = &sched;
      ctx.kernels = &HandWrittenKernels();
      ctx.dims = dims;
      ctx.dtype = dtype;
      ctx.call_id = call_id;
      status[r] = ExecuteForward(ctx, q.data(), k.data(), v.data(), o.data(), lse.data(), nullptr);
      out.forward[r] = w.recorders[r]->TakeRecorded();
      if (!status[r].ok()) return;
      status[r] = ExecuteBackward(ctx, o.data(), q.data(), k.data(), v.data(), o.data(), lse.data(),
                                  dq.data(), dk.data(), dv.data(), nullptr);
      out.backward[r] = w.recorders[r]->TakeRecorded();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < R; ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  return out;
}

AttentionDims Dims() {
  AttentionDims d;
  d.heads_q = 4;
  d.heads_kv = 2;
  d.head_dim = 32;
  d.scale = 0.1767767f;
  return d;
}

bool SameOps(const P2pGroup& a, const P2pGroup& b) { return a.ops == b.ops; }

TEST_P(LoweringTest, MatchesHostExecutorAndIsDeadlockFree) {
  const Case c = GetParam();
  const Layout layout = testing::RandomLayout(40 * c.ranks + 37, c.mix, c.seed, false);
  const AttentionDims dims = Dims();
  const uint64_t call_id = 5;
  Recorded rec = RunHost(layout, c.ranks, dims, DType::kBF16, call_id);
  std::vector<P2pProgram> fwd(c.ranks), bwd(c.ranks);
  for (int r = 0; r < c.ranks; ++r) {
    fwd[r] = LowerForward(rec.schedules[r], dims, DType::kBF16, call_id);
    bwd[r] = LowerBackward(rec.schedules[r], dims, DType::kBF16, call_id);
    // Forward: the same groups in the same order (peers, bytes, tags, direction).
    ASSERT_EQ(fwd[r].size(), rec.forward[r].size()) << "rank " << r;
    for (size_t g = 0; g < fwd[r].size(); ++g) {
      EXPECT_TRUE(SameOps(fwd[r][g], rec.forward[r][g]))
          << "rank " << r << " group " << g << "\nlowered:\n"
          << FormatNcclProgram({fwd[r][g]}) << "host:\n"
          << FormatNcclProgram({rec.forward[r][g]});
    }
    // Backward: the same groups; K/V groups and gradient groups each in increasing step.
    ASSERT_EQ(bwd[r].size(), rec.backward[r].size()) << "rank " << r;
    std::map<std::pair<int, int>, const P2pGroup*> host_by_key;
    for (const P2pGroup& g : rec.backward[r]) host_by_key[GroupKey(g)] = &g;
    std::pair<int, int> last_kv{0, 0}, last_grad{1, 0};
    for (const P2pGroup& g : bwd[r]) {
      const auto key = GroupKey(g);
      ASSERT_TRUE(host_by_key.count(key)) << g.label;
      EXPECT_TRUE(SameOps(g, *host_by_key[key])) << "rank " << r << " " << g.label;
      auto& last = key.first == 0 ? last_kv : last_grad;
      EXPECT_GT(key.second, last.second) << g.label;
      last = key;
    }
  }
  // Under NCCL semantics both lowered programs meet pairwise and never deadlock.
  EXPECT_TRUE(CheckNcclPrograms(fwd).ok()) << CheckNcclPrograms(fwd);
  EXPECT_TRUE(CheckNcclPrograms(bwd).ok()) << CheckNcclPrograms(bwd);
  // The host forward order is the lowered one, so it is NCCL-safe too.
  EXPECT_TRUE(CheckNcclPrograms(rec.forward).ok());
  // The host backward posts in each rank's own stage order; under NCCL stream semantics
  // that order may deadlock (which is why the lowering uses global step labels). Reported,
  // not asserted: the host transport matches by tag and never needs it.
  absl::Status host_bwd = CheckNcclPrograms(rec.backward);
  RecordProperty("host_backward_order_under_nccl", host_bwd.ok() ? "ok" : "deadlock");
  if (!host_bwd.ok()) std::cout << "note: host backward order under NCCL: " << host_bwd << "\n";
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LoweringTest,
    ::testing::Values(Case{2, DocMix::kUniform, 1}, Case{3, DocMix::kLongTail, 2},
                      Case{4, DocMix::kTiny, 3}, Case{4, DocMix::kOneHuge, 4},
                      Case{5, DocMix::kLongTail, 5}, Case{6, DocMix::kUniform, 6},
                      Case{7, DocMix::kSingle, 7}, Case{8, DocMix::kLongTail, 8}));

// Ranks on several nodes (relays): the host executor posts exactly the lowered programs,
// group for group, including the fan-out stages and the return phase of relayed partials,
// and the NCCL simulator accepts them.
TEST(LoweringOnNodes, RelaysMatchTheHostExecutorAndAreDeadlockFree) {
  struct NodeCase {
    std::vector<int> nodes;
    DocMix mix;
    uint64_t seed;
  };
  const AttentionDims dims = Dims();
  int relayed = 0;
  for (const NodeCase& c : {NodeCase{{0, 0, 1, 1}, DocMix::kOneHuge, 21},
                            NodeCase{{4, 1, 4, 1, 1}, DocMix::kLongTail, 22},
                            NodeCase{{0, 1, 2, 0, 1, 2}, DocMix::kSingle, 23},
                            NodeCase{{0, 0, 0, 1, 1, 1, 1}, DocMix::kUniform, 24}}) {
    const int R = static_cast<int>(c.nodes.size());
    SCOPED_TRACE(::testing::Message() << "nodes " << ::testing::PrintToString(c.nodes));
    const Layout layout = testing::RandomLayout(40 * R + 57, c.mix, c.seed, false);
    Recorded rec = RunHost(layout, R, dims, DType::kBF16, 9, c.nodes);
    std::vector<P2pProgram> fwd(R), bwd(R);
    for (int r = 0; r < R; ++r) {
      relayed += rec.schedules[r].store_rows > 0 ? 1 : 0;
      fwd[r] = LowerForward(rec.schedules[r], dims, DType::kBF16, 9);
      bwd[r] = LowerBackward(rec.schedules[r], dims, DType::kBF16, 9);
      for (auto [lowered, host, pass] : {std::tuple{&fwd[r], &rec.forward[r], "forward"},
                                         {&bwd[r], &rec.backward[r], "backward"}}) {
        ASSERT_EQ(lowered->size(), host->size()) << "rank " << r << " " << pass << "\nlowered:\n"
                                                 << FormatNcclProgram(*lowered) << "host:\n"
                                                 << FormatNcclProgram(*host);
        for (size_t g = 0; g < lowered->size(); ++g) {
          EXPECT_TRUE(SameOps((*lowered)[g], (*host)[g]))
              << "rank " << r << " " << pass << " group " << g << " (" << (*lowered)[g].label
              << ")";
        }
      }
    }
    EXPECT_TRUE(CheckNcclPrograms(fwd).ok()) << CheckNcclPrograms(fwd);
    EXPECT_TRUE(CheckNcclPrograms(bwd).ok()) << CheckNcclPrograms(bwd);
  }
  EXPECT_GT(relayed, 0) << "no schedule relays anything; the test proves nothing";
}

P2pGroup G(std::string label, std::vector<P2pOp> ops) { return {std::move(label), ops}; }
P2pOp Send(int peer, size_t bytes, uint64_t tag = 0) { return {true, peer, bytes, tag}; }
P2pOp Recv(int peer, size_t bytes, uint64_t tag = 0) { return {false, peer, bytes, tag}; }

TEST(CheckNcclPrograms, FindsTheCycleOfPerRankStageOrder) {
  // Ranks 0 and 1 of 4: step 1 goes 0 -> 1, step 3 goes 1 -> 0. Rank 0 posts kv(3) before
  // grad(1) (it has no step 2), rank 1 posts grad(1) before kv(3): a cycle on streams.
  std::vector<P2pProgram> p(2);
  p[0] = {G("kv1", {Send(1, 8, 1)}), G("kv3", {Recv(1, 8, 3)}), G("grad1", {Recv(1, 4, 11)})};
  p[1] = {G("kv1", {Recv(0, 8, 1)}), G("grad1", {Send(0, 4, 11)}), G("kv3", {Send(0, 8, 3)})};
  absl::Status s = CheckNcclPrograms(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("message 0 from rank 1 to rank 0"));
  // With matching order per pair but opposite group order, it is a deadlock.
  p[0] = {G("a", {Send(1, 8)}), G("b", {Recv(1, 8)})};
  p[1] = {G("b", {Send(0, 8)}), G("a", {Recv(0, 8)})};
  s = CheckNcclPrograms(p);
  EXPECT_THAT(s.message(), HasSubstr("deadlock"));
  EXPECT_THAT(s.message(), HasSubstr("rank 1 waits in group 0 (b)"));
  // Both in one group each: fine.
  p[0] = {G("ab", {Send(1, 8), Recv(1, 8)})};
  p[1] = {G("ab", {Send(0, 8), Recv(0, 8)})};
  EXPECT_TRUE(CheckNcclPrograms(p).ok());
}

TEST(CheckNcclPrograms, SizesUnmatchedAndBadPeers) {
  std::vector<P2pProgram> p(2);
  p[0] = {G("a", {Send(1, 8)})};
  p[1] = {G("a", {Recv(0, 16)})};
  EXPECT_THAT(CheckNcclPrograms(p).message(), HasSubstr("send of 8 bytes"));
  p[1] = {G("a", {})};
  EXPECT_THAT(CheckNcclPrograms(p).message(), HasSubstr("posts 0 receives"));
  p[0] = {G("a", {})};
  p[1] = {G("a", {Recv(0, 16)})};
  EXPECT_THAT(CheckNcclPrograms(p).message(), HasSubstr("never sends"));
  p[1] = {G("a", {Recv(2, 16)})};
  EXPECT_THAT(CheckNcclPrograms(p).message(), HasSubstr("outside [0, 2)"));
}

TEST(GroupOfStage, OrdersByPeerThenDirectionThenTag) {
  std::vector<SendOp> sends = {{2, nullptr, 4, 9}, {1, nullptr, 4, 7}, {1, nullptr, 4, 3}};
  std::vector<RecvOp> recvs = {{1, nullptr, 8, 1}, {0, nullptr, 8, 2}};
  P2pGroup g = GroupOfStage(sends, recvs, "x");
  ASSERT_EQ(g.ops.size(), 5u);
  EXPECT_EQ(g.ops[0], Recv(0, 8, 2));
  EXPECT_EQ(g.ops[1], Send(1, 4, 3));
  EXPECT_EQ(g.ops[2], Send(1, 4, 7));
  EXPECT_EQ(g.ops[3], Recv(1, 8, 1));
  EXPECT_EQ(g.ops[4], Send(2, 4, 9));
  EXPECT_THAT(FormatNcclProgram({g}), HasSubstr("x: group_start; recv(peer 0, 8 B);"));
}

// Pool sizing against the messages the host executor actually moved.
TEST(BufferPool, SizedFromTheLargestStageOfTheHostRun) {
  for (const Case& c : {Case{3, DocMix::kLongTail, 11}, Case{5, DocMix::kUniform, 12},
                        Case{4, DocMix::kSingle, 13}}) {
    const Layout layout = testing::RandomLayout(50 * c.ranks + 11, c.mix, c.seed, false);
    const AttentionDims dims = Dims();
    Recorded rec = RunHost(layout, c.ranks, dims, DType::kF16, 1);
    for (int r = 0; r < c.ranks; ++r) {
      size_t kv_recv_msg = 0, kv_send_msg = 0, grad_send_msg = 0, grad_recv_msg = 0;
      for (const P2pGroup& g : rec.forward[r]) {
        for (const P2pOp& op : g.ops) {
          (op.send ? kv_send_msg : kv_recv_msg) =
              std::max(op.send ? kv_send_msg : kv_recv_msg, op.bytes);
        }
      }
      for (const P2pGroup& g : rec.backward[r]) {
        if (GroupKey(g).first != 1) continue;
        for (const P2pOp& op : g.ops) {
          (op.send ? grad_send_msg : grad_recv_msg) =
              std::max(op.send ? grad_send_msg : grad_recv_msg, op.bytes);
        }
      }
      absl::StatusOr<PoolLayout> pool = ComputePoolLayout(rec.schedules[r], dims, DType::kF16);
      ASSERT_TRUE(pool.ok()) << pool.status();
      const size_t rows = rec.schedules[r].local_rows;
      const size_t q32 = rows * dims.heads_q * dims.head_dim * 4;
      const size_t kv32 = rows * dims.heads_kv * dims.head_dim * 4;
      const size_t lse32 = rows * dims.heads_q * 4;
      EXPECT_EQ(pool->kv_recv, 4 * AlignPool(kv_recv_msg)) << "rank " << r;
      EXPECT_EQ(pool->kv_send, 4 * AlignPool(kv_send_msg)) << "rank " << r;
      EXPECT_EQ(pool->grad_partial, 4 * AlignPool(grad_send_msg)) << "rank " << r;
      EXPECT_EQ(pool->grad_returned, 4 * AlignPool(grad_recv_msg)) << "rank " << r;
      EXPECT_EQ(pool->fwd_accum, AlignPool(q32) + AlignPool(lse32));
      EXPECT_EQ(pool->bwd_accum, AlignPool(q32) + 2 * AlignPool(kv32) + AlignPool(lse32));
      EXPECT_EQ(pool->total_bytes(), std::max(pool->forward_bytes(), pool->backward_bytes()));
      EXPECT_THAT(pool->DebugString(), HasSubstr("pool "));
    }
  }
}

TEST(BufferPool, RejectsEmptyDims) {
  Schedule s;
  AttentionDims d;
  EXPECT_EQ(ComputePoolLayout(s, d, DType::kBF16).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsap::cuda
