#include "lib/sched/hierarchy.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/exec/executor.h"
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
using ::testing::HasSubstr;

constexpr int kHeadDim = 32;

// Global position of every row of a buffer laid out by runs.
std::vector<int64_t> RowPositions(const std::vector<TokenRun>& runs, int64_t rows) {
  std::vector<int64_t> pos(rows, -1);
  for (const TokenRun& r : runs) {
    for (int64_t i = 0; i < r.length; ++i) pos[r.local_begin + i] = r.global_begin + i;
  }
  return pos;
}

// Calls fn(q_row, k_row) for every pair a work list lists (band applied).
template <typename Fn>
void ForEachListedPair(const WorkList& w, Fn&& fn) {
  for (const QueryBlock& b : w.blocks) {
    for (int64_t s = b.seg_begin; s < b.seg_end; ++s) {
      const KeySegment& seg = w.segments[s];
      for (int64_t q = b.q_begin; q < b.q_end; ++q) {
        for (int64_t k = seg.k_begin; k < seg.k_end; ++k) {
          const int64_t d = k - q;
          if (d >= seg.diag_lo && d <= seg.diag_hi) fn(q, k);
        }
      }
    }
  }
}

// Everything the checks need, computed straight from the plan, the layout and the shards
// (not from the schedules): the owner of each token before the all-to-all, the group of
// each token, and for each group the keys of other groups its queries see.
struct Truth {
  std::vector<int> owner;                      // token -> world rank
  std::vector<int> group;                      // token -> group
  std::vector<std::set<int64_t>> remote_keys;  // [group]
};

Truth ComputeTruth(const Layout& layout, const Plan& plan, const Hierarchy& h) {
  Truth t;
  const int64_t T = layout.num_tokens();
  t.owner.assign(T, -1);
  t.group.assign(T, -1);
  const std::vector<int> group_of = plan.GroupOfRank();
  for (int r = 0; r < plan.num_ranks; ++r) {
    for (const TokenRange& range : h.shard(r)) {
      for (int64_t i = range.begin; i < range.end; ++i) {
        EXPECT_EQ(t.owner[i], -1) << "token " << i << " in two shards";
        t.owner[i] = r;
        t.group[i] = group_of[r];
      }
    }
  }
  for (int64_t i = 0; i < T; ++i) EXPECT_NE(t.owner[i], -1) << "token " << i << " in no shard";
  t.remote_keys.assign(plan.groups.size(), {});
  for (const MaskSlice& s : layout.slices()) {
    for (int64_t q = s.q_begin; q < s.q_end; ++q) {
      for (int64_t k = s.k_begin; k < s.k_end; ++k) {
        if (s.Visible(q, k) && t.group[q] != t.group[k]) t.remote_keys[t.group[q]].insert(k);
      }
    }
  }
  return t;
}

class HierarchyPlans : public ::testing::TestWithParam<std::tuple<PlanSpec, DocMix>> {};

TEST_P(HierarchyPlans, TablesAreExactAndBytesMeetTheLowerBound) {
  const PlanSpec spec = std::get<0>(GetParam());
  const DocMix mix = std::get<1>(GetParam());
  const Plan plan = MakePlan(spec);
  const Layout layout = testing::RandomLayout(240, mix, spec.seed * 31 + 7, /*causal_only=*/false);
  absl::StatusOr<Hierarchy> hs = Hierarchy::Create(layout, plan);
  ASSERT_TRUE(hs.ok()) << hs.status();
  const Hierarchy& h = *hs;
  const Truth truth = ComputeTruth(layout, plan, h);
  const int R = plan.num_ranks;
  const int64_t T = layout.num_tokens();

  std::vector<RankHierarchy> ranks;
  for (int r = 0; r < R; ++r) {
    absl::StatusOr<RankHierarchy> rh = h.BuildRank(layout, r);
    ASSERT_TRUE(rh.ok()) << rh.status();
    ranks.push_back(*std::move(rh));
  }

  // Shards: sized by the token weights (within one token), contiguous in the group buffer.
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    const PlanGroup& group = plan.groups[g];
    double wsum = 0;
    for (double w : group.token_weights) wsum += w;
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      const double exact = static_cast<double>(h.group_tokens(g)) * group.token_weights[i] / wsum;
      EXPECT_LE(std::abs(static_cast<double>(h.shard_tokens(group.ranks[i])) - exact), 1.0);
    }
  }

  // Every visible (query head, query, key) triple is listed exactly once over all ranks.
  std::vector<int> listed(static_cast<size_t>(T) * T * plan.heads_q, 0);
  auto count = [&](const RankHierarchy& r, const WorkList& w, const std::vector<int64_t>& qpos,
                   const std::vector<int64_t>& kpos) {
    ForEachListedPair(w, [&](int64_t qr, int64_t kr) {
      for (int head : r.q_heads) ++listed[(qpos[qr] * T + kpos[kr]) * plan.heads_q + head];
    });
  };
  for (const RankHierarchy& r : ranks) {
    const std::vector<int64_t> qpos = RowPositions(r.group_runs, r.group_tokens);
    count(r, r.local_work, qpos, qpos);
    for (const SubRingStep& s : r.steps) {
      if (s.recv_group >= 0) count(r, s.recv_work, qpos, RowPositions(s.recv_runs, s.recv_rows));
    }
  }
  for (int64_t q = 0; q < T; ++q) {
    for (int64_t k = 0; k < T; ++k) {
      const int want = layout.Visible(q, k) ? 1 : 0;
      for (int head = 0; head < plan.heads_q; ++head) {
        ASSERT_EQ(listed[(q * T + k) * plan.heads_q + head], want)
            << "q " << q << " k " << k << " head " << head;
      }
    }
  }

  // K/V delivery: each rank receives, for each of its KV heads, exactly the remote keys its
  // group's queries see, each once, from a holder of that head in the key's group; and
  // every receive has the matching send at the same step.
  std::map<std::tuple<int, int, int>, std::vector<int64_t>> sent;  // (from, to, step) -> rows
  std::map<std::tuple<int, int, int>, std::vector<int>> sent_heads;
  for (const RankHierarchy& r : ranks) {
    for (const SubRingStep& s : r.steps) {
      for (const KvTransfer& x : s.send) {
        auto key = std::make_tuple(r.rank, x.peer, s.step);
        ASSERT_EQ(sent.count(key), 0u);
        // The send rows are rows of the sender's group buffer: map them to positions.
        std::vector<int64_t> pos;
        const std::vector<int64_t> group_pos = RowPositions(r.group_runs, r.group_tokens);
        for (const TokenRun& run : s.send_runs) {
          for (int64_t i = 0; i < run.length; ++i) {
            ASSERT_EQ(group_pos[run.local_begin + i], run.global_begin + i);
            pos.push_back(run.global_begin + i);
          }
        }
        sent[key] = pos;
        sent_heads[key] = x.heads;
        for (int head : x.heads)
          ASSERT_TRUE(std::binary_search(r.kv_heads.begin(), r.kv_heads.end(), head));
      }
    }
  }
  size_t matched = 0;
  uint64_t ring_lower_bound_total = 0;
  for (const RankHierarchy& r : ranks) {
    std::map<int, std::multiset<int64_t>> got;  // kv head -> positions
    for (const SubRingStep& s : r.steps) {
      if (s.recv_group < 0) continue;
      std::vector<int64_t> pos;
      for (const TokenRun& run : s.recv_runs) {
        for (int64_t i = 0; i < run.length; ++i) pos.push_back(run.global_begin + i);
      }
      std::vector<int> covered;
      for (const KvTransfer& x : s.recv) {
        auto key = std::make_tuple(x.peer, r.rank, s.step);
        ASSERT_EQ(sent.count(key), 1u) << "rank " << r.rank << " step " << s.step;
        EXPECT_EQ(sent[key], pos);
        EXPECT_EQ(sent_heads[key], x.heads);
        ++matched;
        for (int64_t p : pos) {
          EXPECT_EQ(truth.group[p], s.recv_group);
          for (int head : x.heads) got[head].insert(p);
        }
        covered.insert(covered.end(), x.heads.begin(), x.heads.end());
      }
      std::sort(covered.begin(), covered.end());
      EXPECT_EQ(covered, r.kv_heads);
    }
    const std::set<int64_t>& need = truth.remote_keys[r.group];
    for (int head : r.kv_heads) {
      const std::multiset<int64_t>& g = got[head];
      EXPECT_EQ(g.size(), need.size()) << "rank " << r.rank << " kv head " << head;
      EXPECT_TRUE(std::equal(g.begin(), g.end(), need.begin(), need.end()))
          << "rank " << r.rank << " kv head " << head << " does not get exactly its keys once";
    }
    for (const auto& [head, positions] : got) {
      EXPECT_TRUE(std::binary_search(r.kv_heads.begin(), r.kv_heads.end(), head))
          << "rank " << r.rank << " receives kv head " << head << " it does not use";
    }

    // Bytes: the lower bound from the truth.
    const DType dtype = DType::kBF16;
    const uint64_t es = 2, D = kHeadDim;
    const uint64_t ring_bound = 2 * need.size() * r.kv_heads.size() * D * es;
    ring_lower_bound_total += ring_bound;
    // All-to-all: the rows of my group held by others, for my heads, come in (Q, K, V);
    // my rows' outputs and lse for the heads others compute come back.
    uint64_t others_rows = 0, my_rows = 0;
    for (int64_t i = 0; i < T; ++i) {
      if (truth.group[i] == r.group && truth.owner[i] != r.rank) ++others_rows;
      if (truth.owner[i] == r.rank) ++my_rows;
    }
    const uint64_t heads_elsewhere = plan.heads_q - r.q_heads.size();
    const uint64_t a2a_in = others_rows * (r.q_heads.size() + 2 * r.kv_heads.size()) * D * es +
                            my_rows * heads_elsewhere * (D * es + 4);
    const HierTraffic f = PredictForwardTraffic(r, kHeadDim, dtype);
    EXPECT_EQ(f.ring_received, ring_bound) << "rank " << r.rank;
    EXPECT_EQ(f.a2a_received, a2a_in) << "rank " << r.rank;
  }
  EXPECT_EQ(matched, sent.size()) << "a send without its receive";
  uint64_t ring_sent = 0, ring_recv = 0, a2a_sent = 0, a2a_recv = 0;
  for (const RankHierarchy& r : ranks) {
    for (const HierTraffic& t : {PredictForwardTraffic(r, kHeadDim, DType::kBF16),
                                 PredictBackwardTraffic(r, kHeadDim, DType::kBF16)}) {
      ring_sent += t.ring_sent;
      ring_recv += t.ring_received;
      a2a_sent += t.a2a_sent;
      a2a_recv += t.a2a_received;
    }
  }
  EXPECT_EQ(ring_sent, ring_recv);
  EXPECT_EQ(a2a_sent, a2a_recv);
  if (plan.groups.size() == 1) {
    EXPECT_EQ(ring_lower_bound_total, 0u);
    for (const RankHierarchy& r : ranks) EXPECT_TRUE(r.steps.empty());
  }
}

std::vector<PlanSpec> Specs() {
  std::vector<PlanSpec> out;
  uint64_t seed = 1;
  auto add = [&](std::vector<int> sizes, int hq, int hkv, HeadSplit split, bool uneven) {
    out.push_back({sizes, hq, hkv, split, uneven, seed++});
  };
  add({4}, 8, 8, HeadSplit::kContiguous, false);           // Ulysses
  add({1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, false);  // ring
  add({2, 2}, 4, 4, HeadSplit::kContiguous, false);        // 2x2 (USP)
  add({2, 2, 2, 2}, 8, 8, HeadSplit::kContiguous, false);  // 2x4
  add({4, 4}, 8, 8, HeadSplit::kContiguous, true);         // 4x2
  add({4, 2}, 6, 6, HeadSplit::kRoundRobin, true);
  add({3, 3, 2}, 7, 7, HeadSplit::kRandom, true);  // heads not divisible
  add({1, 2, 5}, 5, 5, HeadSplit::kRandom, true);
  add({2, 3}, 16, 2, HeadSplit::kContiguous, true);  // GQA 8:1
  add({4, 2}, 8, 1, HeadSplit::kRoundRobin, true);   // MQA
  add({3, 3, 2}, 8, 1, HeadSplit::kRandom, false);   // MQA, random heads
  add({2, 2}, 13, 13, HeadSplit::kRandom, true);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Plans, HierarchyPlans,
                         ::testing::Combine(::testing::ValuesIn(Specs()),
                                            ::testing::Values(DocMix::kLongTail, DocMix::kOneHuge,
                                                              DocMix::kSingle)),
                         [](const auto& info) {
                           return std::get<0>(info.param).Name() + "_" +
                                  testing::DocMixName(std::get<1>(info.param));
                         });

TEST(Hierarchy, GroupsOfOneRankAreTheSequenceAwareRing) {
  const Layout layout = testing::RandomLayout(300, DocMix::kLongTail, 5, false);
  const int R = 5;
  const Plan plan = MakePlan({{1, 1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, false, 3});
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan);
  ASSERT_TRUE(h.ok()) << h.status();
  absl::StatusOr<Partition> p = Partition::Create(layout, R);
  ASSERT_TRUE(p.ok());
  AttentionDims dims{4, 2, kHeadDim, 1.0f, {}};
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(h->shard(r), p->ranges(r));
    absl::StatusOr<Schedule> s = BuildSchedule(layout, *p, r, 64);
    absl::StatusOr<RankHierarchy> rh = h->BuildRank(layout, r);
    ASSERT_TRUE(s.ok() && rh.ok());
    ASSERT_EQ(rh->steps.size(), s->stages.size());
    for (size_t i = 0; i < s->stages.size(); ++i) {
      EXPECT_EQ(rh->steps[i].step, s->stages[i].step);
      EXPECT_EQ(rh->steps[i].recv_rows, s->stages[i].recv_rows);
      EXPECT_EQ(rh->steps[i].send_rows, s->stages[i].send_rows);
    }
    const HierTraffic f = PredictForwardTraffic(*rh, kHeadDim, DType::kBF16);
    const ExecTraffic e = ForwardTraffic(*s, dims, DType::kBF16);
    EXPECT_EQ(f.a2a_sent + f.a2a_received, 0u);
    EXPECT_EQ(f.ring_sent, e.bytes_sent);
    EXPECT_EQ(f.ring_received, e.bytes_received);
    const HierTraffic b = PredictBackwardTraffic(*rh, kHeadDim, DType::kBF16);
    const ExecTraffic eb = BackwardTraffic(*s, dims, DType::kBF16);
    EXPECT_EQ(b.ring_sent, eb.bytes_sent);
    EXPECT_EQ(b.ring_received, eb.bytes_received);
  }
}

TEST(Hierarchy, MqaReceiversSpreadOverHolders) {
  const Layout layout = *Layout::FromDocuments({0, 200}, {MaskKind::kFull});
  const Plan plan = MakePlan({{4, 4}, 8, 1, HeadSplit::kContiguous, false, 1});
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan);
  ASSERT_TRUE(h.ok());
  for (int r = 0; r < 8; ++r) {
    absl::StatusOr<RankHierarchy> rh = h->BuildRank(layout, r);
    ASSERT_TRUE(rh.ok());
    ASSERT_EQ(rh->steps.size(), 1u);
    ASSERT_EQ(rh->steps[0].recv.size(), 1u);
    // Receiver i of one group reads from member i of the other.
    EXPECT_EQ(rh->steps[0].recv[0].peer, (r + 4) % 8);
    ASSERT_EQ(rh->steps[0].send.size(), 1u);
    EXPECT_EQ(rh->steps[0].send[0].peer, (r + 4) % 8);
    EXPECT_TRUE(rh->kv_grad_partial);
  }
}

// With a topology: every message a rank lists is listed by its peer with the same heads
// (sub-ring sends and receives, fan-outs); a rank's heads of a step come once each, from
// holders or its gateway; fan-outs stay inside a node; a head crosses into a node at most
// once per step; gateway duty spreads over the node's members.
TEST(Hierarchy, FanOutsMatchAndCrossEachNodeOncePerStep) {
  const std::vector<PlanSpec> specs = {
      {{4, 4}, 8, 1, HeadSplit::kContiguous, false, 1},
      {{3, 2, 3}, 6, 2, HeadSplit::kRoundRobin, true, 5},
      {{4, 3, 1}, 8, 2, HeadSplit::kRandom, true, 8},
  };
  std::mt19937_64 rng(77);
  int fanned = 0;
  for (const PlanSpec& spec : specs) {
    const Plan plan = MakePlan(spec);
    std::vector<int> nodes(plan.num_ranks);
    for (int& n : nodes) n = static_cast<int>(rng() % 3);
    SCOPED_TRACE(::testing::Message()
                 << spec.Name() << " nodes " << ::testing::PrintToString(nodes));
    const Layout layout = *Layout::FromDocuments({0, 240}, {MaskKind::kFull});
    absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan, nodes);
    ASSERT_TRUE(h.ok()) << h.status();
    std::vector<RankHierarchy> ranks;
    for (int r = 0; r < plan.num_ranks; ++r) ranks.push_back(*h->BuildRank(layout, r));
    // (kind, step, from, to) -> heads; kind 0: sub-ring, 1: fan-out.
    std::map<std::tuple<int, int, int, int>, std::vector<int>> sent, received;
    std::map<std::tuple<int, int, int>, int> crossings;  // (step, node, head) -> count
    std::map<int, std::set<int>> gateways;               // node -> ranks that forwarded
    for (const RankHierarchy& r : ranks) {
      for (const SubRingStep& st : r.steps) {
        std::vector<int> heads;
        for (const KvTransfer& x : st.send) sent[{0, st.step, r.rank, x.peer}] = x.heads;
        for (const KvTransfer& x : st.fan_out_send) {
          sent[{1, st.step, r.rank, x.peer}] = x.heads;
          EXPECT_EQ(nodes[x.peer], nodes[r.rank]);
          gateways[nodes[r.rank]].insert(r.rank);
          ++fanned;
        }
        for (const KvTransfer& x : st.recv) {
          received[{0, st.step, x.peer, r.rank}] = x.heads;
          heads.insert(heads.end(), x.heads.begin(), x.heads.end());
          if (nodes[x.peer] != nodes[r.rank]) {
            for (int hd : x.heads) ++crossings[{st.step * 100 + r.group, nodes[r.rank], hd}];
          }
        }
        for (const KvTransfer& x : st.fan_out_recv) {
          received[{1, st.step, x.peer, r.rank}] = x.heads;
          heads.insert(heads.end(), x.heads.begin(), x.heads.end());
        }
        for (const StoreFanOut& f : st.store_fan_send) {
          sent[{1, st.step, r.rank, f.peer}] = f.heads;
          EXPECT_EQ(nodes[f.peer], nodes[r.rank]);
        }
        for (const StoreTransfer& x : st.store_fill) heads.push_back(x.kv_head);
        if (st.recv_group >= 0) {
          std::sort(heads.begin(), heads.end());
          EXPECT_EQ(heads, r.kv_heads) << "rank " << r.rank << " step " << st.step;
        }
      }
    }
    EXPECT_EQ(sent, received);
    for (const auto& [key, count] : crossings) EXPECT_EQ(count, 1);
    for (const auto& [node, g] : gateways) EXPECT_GE(g.size(), 1u);
  }
  EXPECT_GT(fanned, 0) << "no fan-out: the test proves little";
  // MQA, two groups of four, each group on its own node: all four members of a node need
  // the one head; the gateway rotates with the step and the head ((0 + 1) mod 4 = 1).
  const Plan plan = MakePlan({{4, 4}, 8, 1, HeadSplit::kContiguous, false, 1});
  const Layout layout = *Layout::FromDocuments({0, 200}, {MaskKind::kFull});
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan, {0, 0, 0, 0, 1, 1, 1, 1});
  ASSERT_TRUE(h.ok());
  for (int r = 0; r < 8; ++r) {
    const RankHierarchy rh = *h->BuildRank(layout, r);
    ASSERT_EQ(rh.steps.size(), 1u);
    const SubRingStep& st = rh.steps[0];
    const int gateway = r < 4 ? 1 : 5;
    EXPECT_EQ(h->GatewayOf(st.step, 1 - rh.group, 0, r), gateway);
    if (r == gateway) {
      ASSERT_EQ(st.recv.size(), 1u);
      EXPECT_EQ(st.fan_out_send.size(), 3u);
    } else {
      EXPECT_TRUE(st.recv.empty());
      ASSERT_EQ(st.fan_out_recv.size(), 1u);
      EXPECT_EQ(st.fan_out_recv[0].peer, gateway);
    }
  }
  EXPECT_FALSE(Hierarchy::Create(layout, plan, {0, 0, 1}).ok());
}

// Node stores (hierarchy.h, 6.): with several groups on a node, every (row, KV head) a node
// needs from a holder elsewhere enters it exactly once, whichever groups and steps need it.
// Checked against the truth (the mask, the shards and the plan) for the bytes, and message
// by message for the rows: every store segment, fill and forward carries exactly the
// positions its receiver's buffer lists, in order.
class NodeStorePlans : public ::testing::TestWithParam<std::tuple<PlanSpec, DocMix>> {};

TEST_P(NodeStorePlans, EachNeededRowEntersEachNodeOnce) {
  const auto& [spec, mix] = GetParam();
  const Plan plan = MakePlan(spec);
  const Layout layout = testing::RandomLayout(300, mix, spec.seed, false);
  std::mt19937_64 rng(spec.seed * 31 + 7);
  int stores = 0;
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<int> nodes(plan.num_ranks);
    for (int& n : nodes) n = static_cast<int>(rng() % 3);
    SCOPED_TRACE(::testing::Message() << "nodes " << ::testing::PrintToString(nodes));
    absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan, nodes);
    ASSERT_TRUE(h.ok()) << h.status();
    const Truth truth = ComputeTruth(layout, plan, *h);
    std::vector<RankHierarchy> ranks;
    for (int r = 0; r < plan.num_ranks; ++r) ranks.push_back(*h->BuildRank(layout, r));
    stores += static_cast<int>(h->stores().size());

    // The bound: (node, head, key row) needed on the node from a group with no holder of
    // the head there.
    const int G = static_cast<int>(plan.groups.size());
    auto holds = [&](int g, size_t i, int kv) {
      for (int q : plan.groups[g].heads[i]) {
        if (q / (plan.heads_q / plan.heads_kv) == kv) return true;
      }
      return false;
    };
    std::set<std::tuple<int, int, int64_t>> bound;
    for (int g = 0; g < G; ++g) {
      for (size_t i = 0; i < plan.groups[g].ranks.size(); ++i) {
        const int node = nodes[plan.groups[g].ranks[i]];
        for (int kv = 0; kv < plan.heads_kv; ++kv) {
          if (!holds(g, i, kv)) continue;
          for (int64_t k : truth.remote_keys[g]) {
            const int gs = truth.group[k];
            bool near = false;
            for (size_t j = 0; j < plan.groups[gs].ranks.size(); ++j) {
              near |= nodes[plan.groups[gs].ranks[j]] == node && holds(gs, j, kv);
            }
            if (!near) bound.insert({node, kv, k});
          }
        }
      }
    }
    // What crosses, from the tables (positions of each message's rows).
    std::map<std::tuple<int, int, int64_t>, int> crossed;
    // Messages: (from, to, step, head) -> positions, as sent and as received.
    std::map<std::tuple<int, int, int, int>, std::vector<int64_t>> sent, received;
    auto positions = [](const std::vector<TokenRun>& runs) {
      std::vector<int64_t> p;
      for (const TokenRun& run : runs) {
        for (int64_t i = 0; i < run.length; ++i) p.push_back(run.global_begin + i);
      }
      return p;
    };
    for (const RankHierarchy& r : ranks) {
      for (const SubRingStep& st : r.steps) {
        const std::vector<int64_t> buffer = positions(st.recv_runs);
        std::vector<int> heads;
        for (const KvTransfer& x : st.recv) {
          heads.insert(heads.end(), x.heads.begin(), x.heads.end());
          for (int kv : x.heads) {
            received[{x.peer, r.rank, st.step, kv}] = buffer;
            if (nodes[x.peer] == nodes[r.rank]) continue;
            for (int64_t k : buffer) ++crossed[{nodes[r.rank], kv, k}];
          }
        }
        for (const KvTransfer& x : st.fan_out_recv) {
          heads.insert(heads.end(), x.heads.begin(), x.heads.end());
          for (int kv : x.heads) received[{x.peer, r.rank, -st.step, kv}] = buffer;
        }
        for (const StoreTransfer& x : st.store_fill) {
          heads.push_back(x.kv_head);
          EXPECT_EQ(positions(x.runs), buffer) << "rank " << r.rank << " step " << st.step;
        }
        if (st.recv_group >= 0) {
          std::sort(heads.begin(), heads.end());
          EXPECT_EQ(heads, r.kv_heads) << "rank " << r.rank << " step " << st.step;
        }
        for (const StoreTransfer& x : st.store_recv) {
          received[{x.peer, r.rank, 1000 + st.step, x.kv_head}] = positions(x.runs);
          ASSERT_NE(nodes[x.peer], nodes[r.rank]);
          for (int64_t k : positions(x.runs)) ++crossed[{nodes[r.rank], x.kv_head, k}];
        }
        for (const StoreTransfer& x : st.store_send) {
          sent[{r.rank, x.peer, 1000 + st.step, x.kv_head}] = positions(x.runs);
        }
        const std::vector<int64_t> sent_rows = positions(st.send_runs);
        for (const KvTransfer& x : st.send) {
          for (int kv : x.heads) sent[{r.rank, x.peer, st.step, kv}] = sent_rows;
        }
        for (const KvTransfer& x : st.fan_out_send) {
          for (int kv : x.heads) sent[{r.rank, x.peer, -st.step, kv}] = buffer;
        }
        for (const StoreFanOut& f : st.store_fan_send) {
          ASSERT_EQ(f.heads.size(), f.runs.size());
          EXPECT_TRUE(std::is_sorted(f.heads.begin(), f.heads.end()));
          for (size_t i = 0; i < f.heads.size(); ++i) {
            EXPECT_EQ(static_cast<int64_t>(positions(f.runs[i]).size()), f.rows);
            sent[{r.rank, f.peer, -st.step, f.heads[i]}] = positions(f.runs[i]);
          }
        }
      }
    }
    EXPECT_EQ(sent, received);
    std::set<std::tuple<int, int, int64_t>> crossed_once;
    for (const auto& [key, count] : crossed) {
      EXPECT_EQ(count, 1) << "node " << std::get<0>(key) << " head " << std::get<1>(key) << " row "
                          << std::get<2>(key);
      crossed_once.insert(key);
    }
    EXPECT_EQ(crossed_once, bound);
    // The store rows of every keeper are the segments it receives, laid end to end.
    for (const RankHierarchy& r : ranks) {
      int64_t rows = 0;
      for (const SubRingStep& st : r.steps) {
        for (const StoreTransfer& x : st.store_recv) {
          ASSERT_FALSE(x.runs.empty());
          EXPECT_EQ(x.runs.front().local_begin, rows);
          rows += x.rows;
        }
      }
      EXPECT_EQ(rows, r.store_rows);
    }
  }
  // One document over every group: groups on one node need overlapping rows of others.
  if (mix == DocMix::kSingle) EXPECT_GT(stores, 0) << "no store: the test proves little";
  // Without node stores (Plan::node_stores false) nothing is kept and every table is the
  // per-group one: no store field is set on any rank.
  Plan without = plan;
  without.node_stores = false;
  std::vector<int> nodes(plan.num_ranks);
  for (int r = 0; r < plan.num_ranks; ++r) nodes[r] = r % 2;
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, without, nodes);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->stores().empty());
  for (int r = 0; r < plan.num_ranks; ++r) {
    const RankHierarchy rh = *h->BuildRank(layout, r);
    EXPECT_EQ(rh.store_rows, 0);
    for (const SubRingStep& st : rh.steps) {
      EXPECT_TRUE(st.store_send.empty() && st.store_recv.empty() && st.store_fill.empty() &&
                  st.store_fan_send.empty() && st.store_return_send.empty() &&
                  st.store_return_recv.empty());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Plans, NodeStorePlans,
    ::testing::Combine(
        ::testing::Values(PlanSpec{{1, 1, 1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, false, 3},
                          PlanSpec{{2, 1, 2, 1, 2}, 6, 2, HeadSplit::kRoundRobin, true, 5},
                          PlanSpec{{3, 2, 2, 1}, 8, 2, HeadSplit::kRandom, true, 9},
                          PlanSpec{{2, 2, 2, 2}, 8, 1, HeadSplit::kContiguous, false, 11}),
        ::testing::Values(DocMix::kLongTail, DocMix::kSingle, DocMix::kOneHuge)));

TEST(Hierarchy, FewerTokensThanGroupsAndEmptyShards) {
  const Layout layout = *Layout::FromDocuments({0, 1, 3});
  const Plan plan = MakePlan({{3, 1, 2}, 4, 2, HeadSplit::kRandom, true, 9});
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan);
  ASSERT_TRUE(h.ok()) << h.status();
  int64_t total = 0;
  for (int r = 0; r < plan.num_ranks; ++r) {
    total += h->shard_tokens(r);
    EXPECT_TRUE(h->BuildRank(layout, r).ok());
  }
  EXPECT_EQ(total, 3);
}

TEST(Hierarchy, SplitByWeights) {
  EXPECT_EQ(SplitByWeights(10, {1, 1, 1}), (std::vector<int64_t>{4, 3, 3}));
  EXPECT_EQ(SplitByWeights(10, {3, 0, 1}), (std::vector<int64_t>{8, 0, 2}));
  EXPECT_EQ(SplitByWeights(0, {1, 2}), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(SplitByWeights(1, {0, 0, 5}), (std::vector<int64_t>{0, 0, 1}));
}

TEST(Hierarchy, InvalidPlansAreRejectedWithTheirProblem) {
  const Layout layout = *Layout::FromDocuments({0, 100});
  const Plan good = MakePlan({{2, 2}, 4, 4, HeadSplit::kContiguous, false, 1});
  ASSERT_TRUE(Hierarchy::Create(layout, good).ok());
  {
    Plan p = good;
    p.groups[0].heads[1].push_back(0);  // head 0 owned twice
    absl::Status s = Hierarchy::Create(layout, p).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("query head 0 is owned twice in group 0"));
  }
  {
    Plan p = good;
    p.groups[1].heads[1].pop_back();  // head 3 owned by nobody in group 1
    EXPECT_THAT(Hierarchy::Create(layout, p).status().message(),
                HasSubstr("query head 3 is owned by no rank of group 1"));
  }
  {
    Plan p = good;
    p.groups[1].ranks[0] = 0;  // rank 0 in both groups
    EXPECT_THAT(Hierarchy::Create(layout, p).status().message(),
                HasSubstr("rank 0 is in two groups"));
  }
  {
    Plan p = good;
    p.groups[1].sequence_weight = 0;  // a group with no tokens
    EXPECT_THAT(Hierarchy::Create(layout, p).status().message(),
                HasSubstr("group 1 has sequence weight 0"));
  }
  {
    Plan p = good;
    p.groups[0].token_weights = {0, 0};
    EXPECT_THAT(Hierarchy::Create(layout, p).status().message(),
                HasSubstr("group 0 has all token weights zero"));
  }
  {
    Plan p = good;
    p.heads_kv = 3;  // 4 is not a multiple of 3
    EXPECT_THAT(Hierarchy::Create(layout, p).status().message(),
                HasSubstr("must be a multiple of heads_kv"));
  }
  {
    absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, good);
    EXPECT_THAT(h->BuildRank(layout, 4).status().message(), HasSubstr("rank 4 is outside"));
  }
}

}  // namespace
}  // namespace hsap

namespace hsap {
namespace {

TEST(PartitionFromRanges, TheShardsOfAPlanAndBadRanges) {
  const Layout layout = testing::RandomLayout(200, DocMix::kLongTail, 3, false);
  const Plan plan = testing::MakePlan({{3, 2}, 4, 4, HeadSplit::kRandom, true, 5});
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan);
  ASSERT_TRUE(h.ok());
  absl::StatusOr<Partition> p = Partition::FromRanges(layout, h->shards());
  ASSERT_TRUE(p.ok()) << p.status();
  int64_t work = 0;
  for (int r = 0; r < plan.num_ranks; ++r) {
    EXPECT_EQ(p->ranges(r), h->shard(r));
    EXPECT_EQ(p->local_tokens(r), h->shard_tokens(r));
    work += p->work(r);
  }
  EXPECT_EQ(work, layout.VisiblePairs());
  EXPECT_THAT(Partition::FromRanges(layout, {{{0, 100}}, {{90, 200}}}).status().message(),
              HasSubstr("token 90 belongs to two ranks"));
  EXPECT_THAT(Partition::FromRanges(layout, {{{0, 100}}, {{101, 200}}}).status().message(),
              HasSubstr("token 100 belongs to no rank"));
  EXPECT_THAT(Partition::FromRanges(layout, {{{0, 100}}, {{100, 201}}}).status().message(),
              HasSubstr("not inside [0, 200)"));
}

}  // namespace
}  // namespace hsap
