#include "lib/sched/transfers.h"

#include <map>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "lib/exec/executor.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/partition.h"
#include "lib/sched/schedule.h"
#include "tests/support/hier_plans.h"
#include "tests/support/random_layouts.h"

namespace hsap {
namespace {

using ::hsap::testing::DocMix;
using ::hsap::testing::HeadSplit;
using ::hsap::testing::MakePlan;
using ::hsap::testing::PlanSpec;

constexpr int kHeadDim = 16;
constexpr int64_t kBlockQ = 64;

// Every message of every rank's pass, keyed so that a send and its receive meet:
// (sender, receiver, kind, step or -1 for all-to-alls, exchange index) -> bytes.
using MessageKey = std::tuple<int, int, TransferKind, int, int>;

void CollectMessages(const PassProgram& pass, int rank, std::multimap<MessageKey, uint64_t>* sent,
                     std::multimap<MessageKey, uint64_t>* received) {
  auto add = [&](const Transfer& t, int step, int exchange) {
    if (t.send) {
      sent->insert({{rank, t.peer, t.kind, step, exchange}, t.bytes});
    } else {
      received->insert({{t.peer, rank, t.kind, step, exchange}, t.bytes});
    }
  };
  int exchange = 0;
  for (const std::vector<Exchange>* xs : {&pass.before, &pass.after}) {
    for (const Exchange& x : *xs) {
      for (const Transfer& t : x.transfers) add(t, -1, exchange);
      ++exchange;
    }
  }
  for (const ProgramStage& s : pass.stages) {
    for (const Transfer& t : s.kv) add(t, s.step, -1);
    for (const Transfer& t : s.grad) add(t, s.step, -1);
  }
  for (const Transfer& t : pass.returns) add(t, -2, -1);
}

void ExpectSendsMeetReceives(const std::vector<RankProgram>& programs) {
  for (bool backward : {false, true}) {
    std::multimap<MessageKey, uint64_t> sent, received;
    for (const RankProgram& p : programs) {
      CollectMessages(backward ? p.backward : p.forward, p.rank, &sent, &received);
    }
    ASSERT_EQ(sent.size(), received.size()) << (backward ? "backward" : "forward");
    EXPECT_TRUE(sent == received) << (backward ? "backward" : "forward")
                                  << ": some message has no matching receive of equal size";
  }
}

class FlatPrograms : public ::testing::TestWithParam<std::tuple<int, DocMix>> {};

TEST_P(FlatPrograms, BytesAreTheExecutorsAndWorkCoversTheRow) {
  const auto [ranks, mix] = GetParam();
  const Layout layout = testing::RandomLayout(700, mix, 11 + ranks, false);
  absl::StatusOr<Partition> partition = Partition::Create(layout, ranks);
  ASSERT_TRUE(partition.ok()) << partition.status();
  const int heads_q = 4, heads_kv = 2;
  AttentionDims dims;
  dims.heads_q = heads_q;
  dims.heads_kv = heads_kv;
  dims.head_dim = kHeadDim;
  std::vector<RankProgram> programs;
  int64_t pairs = 0;
  for (int r = 0; r < ranks; ++r) {
    absl::StatusOr<Schedule> sched = BuildSchedule(layout, *partition, r, kBlockQ);
    ASSERT_TRUE(sched.ok()) << sched.status();
    const RankProgram p = ProgramOf(*sched, heads_q, heads_kv, kHeadDim, DType::kBF16);
    EXPECT_EQ(p.query_heads, heads_q);
    EXPECT_EQ(p.query_rows, partition->local_tokens(r));
    ASSERT_EQ(p.forward.stages.size(), sched->stages.size());
    const ExecTraffic fwd = ForwardTraffic(*sched, dims, DType::kBF16);
    const ExecTraffic bwd = BackwardTraffic(*sched, dims, DType::kBF16);
    EXPECT_EQ(p.forward.Traffic(), (HierTraffic{0, 0, fwd.bytes_sent, fwd.bytes_received}));
    EXPECT_EQ(p.backward.Traffic(), (HierTraffic{0, 0, bwd.bytes_sent, bwd.bytes_received}));
    EXPECT_EQ(p.forward.pairs(), p.backward.pairs());
    for (const ProgramStage& s : p.forward.stages) EXPECT_TRUE(s.grad.empty());
    pairs += p.forward.pairs();
    programs.push_back(p);
  }
  EXPECT_EQ(pairs, layout.VisiblePairs());
  ExpectSendsMeetReceives(programs);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FlatPrograms,
                         ::testing::Combine(::testing::Values(1, 2, 5, 8),
                                            ::testing::Values(DocMix::kLongTail, DocMix::kSingle,
                                                              DocMix::kTiny)));

// node_of_rank of `ranks` ranks in nodes of `per_node` consecutive ranks (the last may be
// smaller).
std::vector<int> Nodes(int ranks, int per_node) {
  std::vector<int> nodes;
  for (int r = 0; r < ranks; ++r) nodes.push_back(r / per_node);
  return nodes;
}

class RelayedPrograms : public ::testing::TestWithParam<std::tuple<int, int, DocMix>> {};

TEST_P(RelayedPrograms, BytesAreTheExecutorsByLinkClass) {
  const auto [ranks, per_node, mix] = GetParam();
  const std::vector<int> nodes = Nodes(ranks, per_node);
  // kSingle: one causal document (RandomLayout may draw a narrow window for it).
  const Layout layout = mix == DocMix::kSingle ? *Layout::FromDocuments({0, 900})
                                               : testing::RandomLayout(900, mix, 5 + ranks, false);
  absl::StatusOr<Partition> partition = Partition::Create(layout, ranks);
  ASSERT_TRUE(partition.ok()) << partition.status();
  const int heads_q = 4, heads_kv = 2;
  AttentionDims dims;
  dims.heads_q = heads_q;
  dims.heads_kv = heads_kv;
  dims.head_dim = kHeadDim;
  std::vector<RankProgram> programs;
  int64_t pairs = 0;
  uint64_t relayed_inter = 0, direct_inter = 0;
  size_t fan_outs = 0, returns = 0;
  for (int r = 0; r < ranks; ++r) {
    absl::StatusOr<Schedule> sched = BuildSchedule(layout, *partition, r, kBlockQ, nodes);
    ASSERT_TRUE(sched.ok()) << sched.status();
    const RankProgram p = ProgramOf(*sched, heads_q, heads_kv, kHeadDim, DType::kBF16, nodes);
    ASSERT_EQ(p.forward.stages.size(), sched->stages.size());
    // Totals: what the executor counts (ForwardTraffic / BackwardTraffic).
    const ExecTraffic fwd = ForwardTraffic(*sched, dims, DType::kBF16);
    const ExecTraffic bwd = BackwardTraffic(*sched, dims, DType::kBF16);
    EXPECT_EQ(p.forward.Traffic(), (HierTraffic{0, 0, fwd.bytes_sent, fwd.bytes_received}));
    EXPECT_EQ(p.backward.Traffic(), (HierTraffic{0, 0, bwd.bytes_sent, bwd.bytes_received}));
    EXPECT_TRUE(p.forward.returns.empty());
    for (const PassProgram* pass : {&p.forward, &p.backward}) {
      const LinkBytes links = pass->Links();
      const HierTraffic t = pass->Traffic();
      EXPECT_EQ(links.intra_sent + links.inter_sent, t.sent());
      EXPECT_EQ(links.intra_received + links.inter_received, t.received());
    }
    // Link classes follow the nodes; fan-outs stay inside a node and come last.
    auto check_class = [&](const Transfer& t) {
      EXPECT_EQ(t.inter_node, nodes[t.peer] != nodes[r]) << "rank " << r << " peer " << t.peer;
    };
    bool seen_fan_out = false;
    for (const ProgramStage& s : p.backward.stages) {
      EXPECT_TRUE(!seen_fan_out || s.fan_out) << "a direct stage after a fan-out";
      seen_fan_out = seen_fan_out || s.fan_out;
      EXPECT_EQ(s.fan_out, s.step >= ranks);
      for (const Transfer& t : s.kv) {
        check_class(t);
        if (s.fan_out) {
          EXPECT_FALSE(t.inter_node);
        }
      }
      for (const Transfer& t : s.grad) check_class(t);
      fan_outs += s.fan_out;
    }
    for (const Transfer& t : p.backward.returns) {
      check_class(t);
      EXPECT_EQ(t.kind, TransferKind::kKvGradReturn);
    }
    returns += p.backward.returns.size();
    relayed_inter += p.forward.Links().inter_sent;
    // Direct delivery on the same topology, for comparison.
    absl::StatusOr<Schedule> direct = BuildSchedule(layout, *partition, r, kBlockQ);
    ASSERT_TRUE(direct.ok()) << direct.status();
    direct_inter += ProgramOf(*direct, heads_q, heads_kv, kHeadDim, DType::kBF16, nodes)
                        .forward.Links()
                        .inter_sent;
    pairs += p.forward.pairs();
    programs.push_back(p);
  }
  EXPECT_EQ(pairs, layout.VisiblePairs());
  ExpectSendsMeetReceives(programs);
  // Relays never add inter-node bytes; with one long document every later node needs rows
  // of earlier ones on several of its ranks, so relays happen and save some.
  EXPECT_LE(relayed_inter, direct_inter);
  if (mix == DocMix::kSingle) {
    EXPECT_GT(fan_outs, 0u);
    EXPECT_GT(returns, 0u);
    EXPECT_LT(relayed_inter, direct_inter);
  }
}

INSTANTIATE_TEST_SUITE_P(Topologies, RelayedPrograms,
                         ::testing::Combine(::testing::Values(4, 8), ::testing::Values(2, 3),
                                            ::testing::Values(DocMix::kLongTail, DocMix::kSingle)));

class PlanPrograms : public ::testing::TestWithParam<std::tuple<PlanSpec, DocMix>> {};

TEST_P(PlanPrograms, BytesAreThePredictedAndWorkCoversEveryHead) {
  const auto& [spec, mix] = GetParam();
  const Plan plan = MakePlan(spec);
  const Layout layout = testing::RandomLayout(500, mix, spec.seed, false);
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan);
  ASSERT_TRUE(h.ok()) << h.status();
  std::vector<RankProgram> programs;
  int64_t head_pairs = 0;
  for (int r = 0; r < plan.num_ranks; ++r) {
    absl::StatusOr<RankHierarchy> rank = h->BuildRank(layout, r, kBlockQ);
    ASSERT_TRUE(rank.ok()) << rank.status();
    const RankProgram p = ProgramOf(*rank, kHeadDim, DType::kF16);
    EXPECT_EQ(p.forward.Traffic(), PredictForwardTraffic(*rank, kHeadDim, DType::kF16));
    EXPECT_EQ(p.backward.Traffic(), PredictBackwardTraffic(*rank, kHeadDim, DType::kF16));
    EXPECT_EQ(p.forward.before.size(), 3u);
    EXPECT_EQ(p.backward.after.size(), 3u);
    for (const Exchange& x : p.forward.before) {
      EXPECT_EQ(x.transfers.size(), 2 * (rank->members.size() - 1)) << x.what;
    }
    head_pairs += p.forward.pairs() * p.query_heads;
    programs.push_back(p);
  }
  EXPECT_EQ(head_pairs, layout.VisiblePairs() * plan.heads_q);
  ExpectSendsMeetReceives(programs);
}

INSTANTIATE_TEST_SUITE_P(
    Plans, PlanPrograms,
    ::testing::Combine(::testing::Values(PlanSpec{{1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous},
                                         PlanSpec{{4}, 8, 2, HeadSplit::kContiguous},
                                         PlanSpec{{2, 2, 2}, 4, 4, HeadSplit::kRoundRobin},
                                         PlanSpec{{3, 1, 2}, 8, 2, HeadSplit::kRandom, true, 7},
                                         PlanSpec{{2, 4}, 8, 1, HeadSplit::kContiguous, true, 3}),
                       ::testing::Values(DocMix::kLongTail, DocMix::kSingle)),
    [](const auto& info) {
      return std::get<0>(info.param).Name() + "_" + testing::DocMixName(std::get<1>(info.param)) +
             "_" + std::to_string(info.index);
    });

TEST(Programs, BackwardGradientsAreFp32AndReturnToTheSender) {
  // Two ranks, one causal document: rank 1's queries see rank 0's keys.
  const Layout layout = *Layout::FromDocuments({0, 256});
  const Partition partition = *Partition::Create(layout, 2);
  const Schedule s1 = *BuildSchedule(layout, partition, 1, kBlockQ);
  ASSERT_EQ(s1.stages.size(), 1u);
  const RankProgram p = ProgramOf(s1, 2, 1, 8, DType::kBF16);
  const ProgramStage& st = p.backward.stages[0];
  const uint64_t rows = static_cast<uint64_t>(s1.stages[0].recv_rows);
  ASSERT_GT(rows, 0u);
  uint64_t kv_in = 0, grad_out = 0;
  for (const Transfer& t : st.kv) {
    if (!t.send) kv_in += t.bytes;
  }
  for (const Transfer& t : st.grad) {
    EXPECT_EQ(t.peer, s1.stages[0].recv_from);
    if (t.send) grad_out += t.bytes;
  }
  EXPECT_EQ(kv_in, rows * 2 * 8 * 2);     // K and V, bf16
  EXPECT_EQ(grad_out, rows * 2 * 8 * 4);  // dK and dV, fp32: twice the bytes
}

}  // namespace
}  // namespace hsap
