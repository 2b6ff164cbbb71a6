// Plan batches (hsapBatchCreateWithPlan) on communicators whose ranks span several nodes
// (hsapCommConfig_t::rankNodes): sub-ring rows cross into a node once per KV head, whichever
// groups on the node need them, and are fanned out inside it (lib/sched/hierarchy.h, 5. and
// 6.). Results against the
// fp64 reference, bitwise reproducible; inter-node bytes (hsapBatchGetLinkTraffic, counted
// from the messages) equal a node-level bound recomputed here from the mask, the plan and
// the shards; fewer than direct delivery where members of a node share a head; one node
// gives exactly the direct hierarchy.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attention/kernel.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/plan_json.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/hier_plans.h"
#include "tests/support/random_layouts.h"

namespace hsap {
namespace {

using ::hsap::testing::CheckAgainstReference;
using ::hsap::testing::DistCase;
using ::hsap::testing::DocMix;
using ::hsap::testing::HeadSplit;
using ::hsap::testing::MakePlan;
using ::hsap::testing::PlanSpec;
using ::hsap::testing::RandomLayout;
using ::hsap::testing::RowInputs;
using ::hsap::testing::RowOutputs;

constexpr int kHeadDim = 32;

// A random node of each rank: 2..ranks nodes with arbitrary, non-contiguous numbers.
std::vector<int> RandomNodes(int ranks, std::mt19937_64& rng) {
  const int nodes = 2 + static_cast<int>(rng() % std::max(1, ranks - 2));
  std::vector<int> out(ranks);
  for (int r = 0; r < ranks; ++r) out[r] = 5 * static_cast<int>(rng() % nodes) + 2;
  return out;
}

// The KV heads member i of group g uses (its query heads / group size of a KV head).
std::set<int> KvHeadsOf(const Plan& plan, int g, int i) {
  std::set<int> kv;
  for (int q : plan.groups[g].heads[i]) kv.insert(q / (plan.heads_q / plan.heads_kv));
  return kv;
}

struct Expected {
  uint64_t forward = 0, backward = 0;  // inter-node bytes received, all ranks
  uint64_t direct_kv_rows = 0;         // (row, head) crossings of direct delivery
  uint64_t kv_rows = 0;                // the bound's (row, head) crossings
  uint64_t group_kv_rows = 0;          // crossings when each group's rows cross on their own
};

// Inter-node bytes a run must move, from the plan, the shards (rows of each rank) and the
// mask alone:
//  - the group all-to-alls: every message between members on different nodes, sized by
//    the members' rows and heads (hierarchical_executor.h);
//  - the sub-rings: for each node B, KV head h and source group gs, each key row of gs that
//    the queries of some other group with a member on B holding h see enters B once, unless
//    gs has a holder of h on B (then it never crosses). Direct delivery would move it once
//    per such member of each such group (counted for comparison).
Expected ExpectedInterNode(const Layout& layout, const Plan& plan, const DistCase& c,
                           const RowOutputs& got) {
  const int64_t T = layout.num_tokens();
  const std::vector<int> group_of = plan.GroupOfRank();
  std::vector<int> owner_group(T, -1);
  for (int r = 0; r < c.ranks; ++r) {
    for (size_t i = 0; i + 1 < got.ranges[r].size(); i += 2) {
      for (int64_t t = got.ranges[r][i]; t < got.ranges[r][i + 1]; ++t)
        owner_group[t] = group_of[r];
    }
  }
  const uint64_t es = DTypeSize(c.dtype), D = kHeadDim;
  Expected e;
  const int G = static_cast<int>(plan.groups.size());
  for (int g = 0; g < G; ++g) {
    const PlanGroup& group = plan.groups[g];
    // The all-to-alls (each message counted on its receiver).
    bool partial = false;
    std::vector<int> holders(plan.heads_kv, 0);
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      for (int h : KvHeadsOf(plan, g, static_cast<int>(i))) partial |= ++holders[h] > 1;
    }
    const uint64_t grad_es = partial ? 4 : es;
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      for (size_t j = 0; j < group.ranks.size(); ++j) {
        const int ri = group.ranks[i], rj = group.ranks[j];
        if (c.rank_nodes[ri] == c.rank_nodes[rj]) continue;
        const uint64_t ti = got.local_tokens[ri], tj = got.local_tokens[rj];
        const uint64_t qi = group.heads[i].size(), qj = group.heads[j].size();
        const uint64_t ki = KvHeadsOf(plan, g, static_cast<int>(i)).size(),
                       kj = KvHeadsOf(plan, g, static_cast<int>(j)).size();
        // i sends j: Q, K, V of i's rows for j's heads; out and lse of j's rows for i's heads.
        e.forward += ti * (qj + 2 * kj) * D * es + tj * qi * (D * es + 4);
        // Backward: Q, dout, K, V, lse + delta in; dQ, dK, dV back.
        e.backward += ti * (2 * qj * D * es + 2 * kj * D * es + 8 * qj) +
                      tj * (qi * D * es + 2 * ki * D * grad_es);
      }
    }
  }
  // The sub-rings: which keys each group's queries see.
  std::vector<std::vector<bool>> seen(G, std::vector<bool>(T, false));
  for (int64_t q = 0; q < T; ++q) {
    for (int64_t k = 0; k < T; ++k) {
      if (owner_group[q] != owner_group[k] && layout.Visible(q, k)) seen[owner_group[q]][k] = true;
    }
  }
  std::set<int> all_nodes(c.rank_nodes.begin(), c.rank_nodes.end());
  for (int gs = 0; gs < G; ++gs) {
    for (int node : all_nodes) {
      for (int h = 0; h < plan.heads_kv; ++h) {
        bool holder_here = false;
        for (size_t i = 0; i < plan.groups[gs].ranks.size(); ++i) {
          holder_here |= c.rank_nodes[plan.groups[gs].ranks[i]] == node &&
                         KvHeadsOf(plan, gs, static_cast<int>(i)).count(h);
        }
        if (holder_here) continue;
        std::vector<bool> needed(T, false);  // by any group on the node
        for (int g = 0; g < G; ++g) {
          if (g == gs) continue;
          uint64_t receivers = 0;
          for (size_t i = 0; i < plan.groups[g].ranks.size(); ++i) {
            if (c.rank_nodes[plan.groups[g].ranks[i]] == node &&
                KvHeadsOf(plan, g, static_cast<int>(i)).count(h)) {
              ++receivers;
            }
          }
          if (receivers == 0) continue;
          for (int64_t k = 0; k < T; ++k) {
            if (owner_group[k] != gs || !seen[g][k]) continue;
            needed[k] = true;
            e.direct_kv_rows += receivers;
            ++e.group_kv_rows;
          }
        }
        e.kv_rows += std::count(needed.begin(), needed.end(), true);
      }
    }
  }
  e.forward += e.kv_rows * 2 * D * es;
  e.backward += e.kv_rows * 2 * D * (es + 4);
  return e;
}

hsapPlan_t ToCPlan(const Plan& plan) {
  hsapPlan_t handle = nullptr;
  EXPECT_EQ(hsapPlanCreateFromJson(&handle, PlanToJsonText(plan).c_str()), hsapSuccess)
      << hsapGetLastError();
  return handle;
}

RowOutputs RunCase(const Layout& layout, const DistCase& c, uint64_t seed) {
  hsapLayout_t handle = testing::ToCLayout(layout);
  RowInputs in(c, layout.num_tokens(), seed);
  RowOutputs got = testing::RunDistributed(handle, c, in);
  hsapLayoutDestroy(handle);
  return got;
}

void ExpectBitwiseEqual(const RowOutputs& a, const RowOutputs& b) {
  EXPECT_EQ(a.out.bytes, b.out.bytes);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.dq.bytes, b.dq.bytes);
  EXPECT_EQ(a.dk.bytes, b.dk.bytes);
  EXPECT_EQ(a.dv.bytes, b.dv.bytes);
}

TEST(PlanTopologyTest, FanOutIsExactReproducibleAndCrossesEachNodeOnce) {
  // GQA and MQA with more members than KV heads, groups spanning nodes (random nodes),
  // uneven groups, shards and head sets.
  const std::vector<PlanSpec> specs = {
      {{4, 4}, 4, 1, HeadSplit::kRoundRobin, false, 3},
      {{3, 2, 3}, 6, 2, HeadSplit::kRoundRobin, true, 5},
      {{4, 3}, 8, 2, HeadSplit::kRandom, true, 8},
      {{2, 2, 2}, 4, 2, HeadSplit::kContiguous, false, 13},
      {{5, 1, 2}, 4, 1, HeadSplit::kRandom, true, 21},
      {{3, 3}, 3, 3, HeadSplit::kContiguous, true, 34},
  };
  const DocMix mixes[] = {DocMix::kLongTail, DocMix::kOneHuge, DocMix::kSingle, DocMix::kUniform};
  std::mt19937_64 rng(2026);
  uint64_t saved = 0;
  for (size_t s = 0; s < specs.size(); ++s) {
    const PlanSpec& spec = specs[s];
    const Plan plan = MakePlan(spec);
    DistCase c;
    c.ranks = plan.num_ranks;
    c.rank_nodes = RandomNodes(c.ranks, rng);
    c.dtype = s % 2 ? DType::kBF16 : DType::kF32;
    c.heads_q = spec.heads_q;
    c.heads_kv = spec.heads_kv;
    c.head_dim = kHeadDim;
    c.plan = ToCPlan(plan);
    const Layout layout = RandomLayout(160 + 24 * s, mixes[s % 4], 900 + s, s % 3 == 0);
    SCOPED_TRACE(::testing::Message()
                 << spec.Name() << ", nodes " << ::testing::PrintToString(c.rank_nodes));
    RowOutputs a = CheckAgainstReference(layout, c, 40 + s);
    ASSERT_TRUE(a.ok());
    RowOutputs b = RunCase(layout, c, 40 + s);
    ASSERT_TRUE(b.ok());
    ExpectBitwiseEqual(a, b);

    const Expected e = ExpectedInterNode(layout, plan, c, a);
    uint64_t fwd_sent = 0, fwd_recv = 0, bwd_sent = 0, bwd_recv = 0;
    for (int r = 0; r < c.ranks; ++r) {
      SCOPED_TRACE(::testing::Message() << "rank " << r);
      const hsapLinkTraffic_t& t = a.link_traffic[r];
      const hsapTraffic_t& all = a.traffic[r];
      // The link classes split the same messages hsapBatchGetTraffic counts.
      EXPECT_EQ(t.forwardIntraNodeBytesSent + t.forwardInterNodeBytesSent, all.forwardBytesSent);
      EXPECT_EQ(t.forwardIntraNodeBytesReceived + t.forwardInterNodeBytesReceived,
                all.forwardBytesReceived);
      EXPECT_EQ(t.backwardIntraNodeBytesSent + t.backwardInterNodeBytesSent, all.backwardBytesSent);
      EXPECT_EQ(t.backwardIntraNodeBytesReceived + t.backwardInterNodeBytesReceived,
                all.backwardBytesReceived);
      fwd_sent += t.forwardInterNodeBytesSent;
      fwd_recv += t.forwardInterNodeBytesReceived;
      bwd_sent += t.backwardInterNodeBytesSent;
      bwd_recv += t.backwardInterNodeBytesReceived;
    }
    EXPECT_EQ(fwd_sent, fwd_recv);
    EXPECT_EQ(bwd_sent, bwd_recv);
    EXPECT_EQ(fwd_recv, e.forward);
    EXPECT_EQ(bwd_recv, e.backward);
    EXPECT_LE(e.kv_rows, e.direct_kv_rows);
    saved += e.direct_kv_rows - e.kv_rows;

    // The same results without the topology (direct delivery, every rank on one node).
    DistCase direct = c;
    direct.rank_nodes.clear();
    RowOutputs d = RunCase(layout, direct, 40 + s);
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(a.out.bytes, d.out.bytes);  // the forward sums in the same order
    hsapPlanDestroy(c.plan);
  }
  EXPECT_GT(saved, 0u) << "no case shared a head on a node; the test proves little";
}

// Several groups on one node (hierarchy.h, 6.): a row two groups of a node need, at their
// own steps, crosses into the node once, to the keeper, which forwards it at each group's
// step. Exact against the fp64 reference, bitwise reproducible, inter-node bytes equal the
// node-level bound, fewer than when each group's rows cross on their own.
TEST(PlanTopologyTest, GroupsOnOneNodeShareOneCrossing) {
  struct Case {
    PlanSpec spec;
    std::vector<int> nodes;
    DocMix mix;
    DType dtype;
  };
  const std::vector<Case> cases = {
      // The sequence-aware ring as a plan: six groups of one, three per node.
      {{{1, 1, 1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, false, 3},
       {0, 0, 0, 1, 1, 1},
       DocMix::kSingle,
       DType::kBF16},
      // Uneven groups and heads, GQA, a group spanning nodes, scrambled node numbers.
      {{{2, 1, 2, 1}, 6, 2, HeadSplit::kRoundRobin, true, 5},
       {4, 4, 9, 9, 4, 9},
       DocMix::kSingle,
       DType::kF32},
      // MQA, four groups of two on two nodes, interleaved.
      {{{2, 2, 2, 2}, 4, 1, HeadSplit::kRandom, true, 8},
       {1, 1, 0, 0, 1, 1, 0, 0},
       DocMix::kOneHuge,
       DType::kF32},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& k = cases[i];
    SCOPED_TRACE(::testing::Message()
                 << k.spec.Name() << ", nodes " << ::testing::PrintToString(k.nodes));
    const Plan plan = MakePlan(k.spec);
    const Layout layout = RandomLayout(200 + 16 * i, k.mix, 70 + i, i == 0);
    absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan, k.nodes);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_FALSE(h->stores().empty()) << "no node store: the case tests nothing";
    DistCase c;
    c.ranks = plan.num_ranks;
    c.rank_nodes = k.nodes;
    c.dtype = k.dtype;
    c.heads_q = plan.heads_q;
    c.heads_kv = plan.heads_kv;
    c.head_dim = kHeadDim;
    c.plan = ToCPlan(plan);
    RowOutputs a = CheckAgainstReference(layout, c, 60 + i);
    ASSERT_TRUE(a.ok());
    RowOutputs b = RunCase(layout, c, 60 + i);
    ASSERT_TRUE(b.ok());
    ExpectBitwiseEqual(a, b);
    const Expected e = ExpectedInterNode(layout, plan, c, a);
    uint64_t fwd = 0, bwd = 0;
    for (const hsapLinkTraffic_t& t : a.link_traffic) {
      fwd += t.forwardInterNodeBytesReceived;
      bwd += t.backwardInterNodeBytesReceived;
    }
    EXPECT_EQ(fwd, e.forward);
    EXPECT_EQ(bwd, e.backward);
    EXPECT_LT(e.kv_rows, e.group_kv_rows);
    hsapPlanDestroy(c.plan);
  }
}

// Two groups of four, MQA: group {0..3} spans nodes 0 and 1, group {4..7} is node 2. Every
// member holds the one KV head, so a row group 1 needs crosses into node 2 once instead of
// four times, and one group 0 needs crosses into nodes 0 and 1 once each instead of twice.
TEST(PlanTopologyTest, SharedHeadCrossesOnceInsteadOfOncePerMember) {
  const Plan plan = MakePlan({{4, 4}, 4, 1, HeadSplit::kRoundRobin, false, 1});
  const std::vector<int> nodes = {0, 0, 1, 1, 2, 2, 2, 2};
  absl::StatusOr<Layout> layout =
      Layout::FromDocuments(std::vector<int64_t>{0, 192}, std::vector<MaskKind>{MaskKind::kFull});
  ASSERT_TRUE(layout.ok());
  DistCase c;
  c.ranks = 8;
  c.rank_nodes = nodes;
  c.heads_q = 4;
  c.heads_kv = 1;
  c.head_dim = kHeadDim;
  c.plan = ToCPlan(plan);
  RowOutputs got = CheckAgainstReference(*layout, c, 7);
  ASSERT_TRUE(got.ok());
  uint64_t inter = 0;
  for (const hsapLinkTraffic_t& t : got.link_traffic) inter += t.forwardInterNodeBytesReceived;
  const Expected e = ExpectedInterNode(*layout, plan, c, got);
  EXPECT_EQ(inter, e.forward);
  // Direct delivery: the same hierarchy without nodes, its sub-ring receives classified.
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(*layout, plan);
  ASSERT_TRUE(h.ok());
  uint64_t direct_rows = 0;
  for (int r = 0; r < 8; ++r) {
    absl::StatusOr<RankHierarchy> rank = h->BuildRank(*layout, r);
    ASSERT_TRUE(rank.ok());
    for (const SubRingStep& st : rank->steps) {
      for (const KvTransfer& x : st.recv) {
        if (nodes[x.peer] != nodes[r]) direct_rows += st.recv_rows * x.heads.size();
      }
    }
  }
  // A full document: each group needs the other's 96 rows.
  EXPECT_EQ(direct_rows, e.direct_kv_rows);
  EXPECT_EQ(direct_rows, 8u * 96);
  EXPECT_EQ(e.kv_rows, 3u * 96);
  hsapPlanDestroy(c.plan);
}

TEST(PlanTopologyTest, OneNodeGivesExactlyTheDirectHierarchy) {
  const std::vector<PlanSpec> specs = {
      {{4, 4}, 4, 1, HeadSplit::kRoundRobin, false, 3},
      {{3, 2, 3}, 6, 2, HeadSplit::kRandom, true, 5},
      {{1, 1, 1}, 2, 2, HeadSplit::kContiguous, true, 7},
  };
  for (const PlanSpec& spec : specs) {
    SCOPED_TRACE(spec.Name());
    const Plan plan = MakePlan(spec);
    const Layout layout = RandomLayout(300, DocMix::kLongTail, 17, false);
    const std::vector<int> one_node(plan.num_ranks, 4);
    absl::StatusOr<Hierarchy> direct = Hierarchy::Create(layout, plan);
    absl::StatusOr<Hierarchy> topo = Hierarchy::Create(layout, plan, one_node);
    ASSERT_TRUE(direct.ok() && topo.ok());
    for (int r = 0; r < plan.num_ranks; ++r) {
      absl::StatusOr<RankHierarchy> a = direct->BuildRank(layout, r);
      absl::StatusOr<RankHierarchy> b = topo->BuildRank(layout, r);
      ASSERT_TRUE(a.ok() && b.ok());
      ASSERT_EQ(a->steps.size(), b->steps.size());
      for (size_t s = 0; s < a->steps.size(); ++s) {
        EXPECT_EQ(a->steps[s].recv, b->steps[s].recv);
        EXPECT_EQ(a->steps[s].send, b->steps[s].send);
        EXPECT_TRUE(b->steps[s].fan_out_recv.empty() && b->steps[s].fan_out_send.empty());
      }
      EXPECT_EQ(PredictForwardTraffic(*a, kHeadDim, DType::kBF16),
                PredictForwardTraffic(*b, kHeadDim, DType::kBF16));
      EXPECT_EQ(PredictBackwardTraffic(*a, kHeadDim, DType::kBF16),
                PredictBackwardTraffic(*b, kHeadDim, DType::kBF16));
    }
  }
  // Through the C ABI: the same bytes and results as without rankNodes, all intra-node.
  const Plan plan = MakePlan(specs[1]);
  const Layout layout = RandomLayout(240, DocMix::kLongTail, 9, false);
  DistCase c;
  c.ranks = plan.num_ranks;
  c.dtype = DType::kBF16;
  c.heads_q = plan.heads_q;
  c.heads_kv = plan.heads_kv;
  c.head_dim = kHeadDim;
  c.plan = ToCPlan(plan);
  DistCase with = c;
  with.rank_nodes.assign(c.ranks, 3);
  RowOutputs a = RunCase(layout, with, 3), b = RunCase(layout, c, 3);
  ASSERT_TRUE(a.ok() && b.ok());
  ExpectBitwiseEqual(a, b);
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_EQ(a.traffic[r].forwardBytesReceived, b.traffic[r].forwardBytesReceived);
    EXPECT_EQ(a.traffic[r].backwardBytesSent, b.traffic[r].backwardBytesSent);
    EXPECT_EQ(a.link_traffic[r].forwardIntraNodeBytesReceived, a.traffic[r].forwardBytesReceived);
    EXPECT_EQ(a.link_traffic[r].backwardIntraNodeBytesSent, a.traffic[r].backwardBytesSent);
    EXPECT_EQ(a.link_traffic[r].forwardInterNodeBytesSent, 0u);
  }
  hsapPlanDestroy(c.plan);
}

}  // namespace
}  // namespace hsap
