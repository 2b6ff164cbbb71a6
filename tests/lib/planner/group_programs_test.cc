#include "lib/planner/group_programs.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lib/planner/baselines.h"
#include "lib/planner/run_simulator.h"
#include "tests/support/hier_plans.h"

namespace hsap {
namespace {

using ::hsap::testing::HeadSplit;
using ::hsap::testing::MakePlan;
using ::hsap::testing::PlanSpec;

void ExpectSameTransfers(const std::vector<Transfer>& a, const std::vector<Transfer>& b,
                         const std::string& where) {
  ASSERT_EQ(a.size(), b.size()) << where;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i] == b[i]) << where << " message " << i;
}

void ExpectSameExchanges(const std::vector<Exchange>& a, const std::vector<Exchange>& b,
                         const std::string& where) {
  ASSERT_EQ(a.size(), b.size()) << where;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(std::string(a[i].what), std::string(b[i].what)) << where;
    ExpectSameTransfers(a[i].transfers, b[i].transfers, where + " " + a[i].what);
  }
}

void ExpectSamePass(const PassProgram& a, const PassProgram& b, const std::string& where) {
  ExpectSameExchanges(a.before, b.before, where + " before");
  ExpectSameExchanges(a.after, b.after, where + " after");
  EXPECT_EQ(a.local_pairs, b.local_pairs) << where;
  ExpectSameTransfers(a.returns, b.returns, where + " returns");
  ASSERT_EQ(a.stages.size(), b.stages.size()) << where;
  for (size_t i = 0; i < a.stages.size(); ++i) {
    const std::string at = where + " stage " + std::to_string(i);
    EXPECT_EQ(a.stages[i].step, b.stages[i].step) << at;
    EXPECT_EQ(a.stages[i].fan_out, b.stages[i].fan_out) << at;
    EXPECT_EQ(a.stages[i].pairs, b.stages[i].pairs) << at;
    ExpectSameTransfers(a.stages[i].kv, b.stages[i].kv, at + " kv");
    ExpectSameTransfers(a.stages[i].fan_out_kv, b.stages[i].fan_out_kv, at + " fan-out");
    ExpectSameTransfers(a.stages[i].fan_in_grad, b.stages[i].fan_in_grad, at + " fan-in");
    ExpectSameTransfers(a.stages[i].grad, b.stages[i].grad, at + " grad");
  }
}

// Every program of `fast` equals the one of `full`.
void ExpectSamePrograms(const std::vector<RankProgram>& full,
                        const std::vector<RankProgram>& fast) {
  ASSERT_EQ(full.size(), fast.size());
  for (size_t r = 0; r < full.size(); ++r) {
    const std::string where = "rank " + std::to_string(r);
    const RankProgram& a = full[r];
    const RankProgram& b = fast[r];
    EXPECT_EQ(a.rank, b.rank) << where;
    EXPECT_EQ(a.query_heads, b.query_heads) << where;
    EXPECT_EQ(a.query_rows, b.query_rows) << where;
    ExpectSamePass(a.forward, b.forward, where + " forward");
    ExpectSamePass(a.backward, b.backward, where + " backward");
  }
}

// Fan-out messages in `programs` (both passes).
int FanOutMessages(const std::vector<RankProgram>& programs) {
  int n = 0;
  for (const RankProgram& p : programs) {
    for (const PassProgram* pass : {&p.forward, &p.backward}) {
      for (const ProgramStage& s : pass->stages) n += static_cast<int>(s.fan_out_kv.size());
    }
  }
  return n;
}

// Messages of node stores (hierarchy.h, 6.): segments into a keeper's store.
int StoreMessages(const std::vector<RankProgram>& programs) {
  int n = 0;
  for (const RankProgram& p : programs) {
    for (const ProgramStage& s : p.forward.stages) {
      for (const Transfer& t : s.kv) n += t.kind == TransferKind::kKvStore;
    }
  }
  return n;
}

// One causal document of `tokens` tokens through a layer of 8 query and 2 KV heads of 16
// (bf16).
Workload TestWorkload(int64_t tokens) {
  Workload w;
  w.seq_len = tokens;
  w.causal = true;
  w.model.heads_q = 8;
  w.model.heads_kv = 2;
  w.model.head_dim = 16;
  w.model.dtype_bytes = 2;
  return w;
}

// Nodes of 4 devices, 100 TFLOP/s peak, 10 GB/s NICs.
Cluster TestCluster(int devices) {
  auto c = ClusterFromJsonText(absl::StrCat(
      R"({"device_kinds": {"T": {"peak_tflops": 100, "memory_gib": 80,
          "hbm_gbps": 1000, "attention_efficiency": 0.5, "intra_node_gbps": 100}},
          "nodes": [{"kind": "T", "devices": )",
      std::min(devices, 4), R"(, "nics": 1, "nic_gbps": 10, "count": )", (devices + 3) / 4, "}]}"));
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// The documents of `row` with every mask kind in turn: causal, full, prefix-LM (half the
// document), sliding window (a quarter).
absl::StatusOr<Layout> MixedMasks(const Layout& row) {
  std::vector<int64_t> cu = {0};
  for (const MaskSlice& s : row.slices()) {
    if (s.q_end > cu.back()) cu.push_back(s.q_end);
  }
  std::vector<MaskKind> kinds;
  std::vector<int64_t> params;
  const MaskKind cycle[] = {MaskKind::kCausal, MaskKind::kFull, MaskKind::kPrefixLM,
                            MaskKind::kSlidingWindow};
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t length = cu[d + 1] - cu[d];
    kinds.push_back(cycle[d % 4]);
    params.push_back(kinds.back() == MaskKind::kPrefixLM        ? length / 2
                     : kinds.back() == MaskKind::kSlidingWindow ? std::max<int64_t>(1, length / 4)
                                                                : 0);
  }
  return Layout::FromDocuments(cu, kinds, params);
}

// Random plans (group sizes, head splits, uneven weights, scrambled ranks, shuffled ring
// orders) on rows of one or many documents: every program equals PlanPrograms', and so
// the priced times and bytes are equal too.
TEST(GroupProgramsTest, EqualToTheFullPathOnRandomPlans) {
  std::mt19937_64 rng(1301);
  const HeadSplit splits[] = {HeadSplit::kContiguous, HeadSplit::kRoundRobin, HeadSplit::kRandom};
  int compared = 0;
  for (int trial = 0; trial < 24; ++trial) {
    PlanSpec spec;
    const int num_groups = 1 + static_cast<int>(rng() % 5);
    for (int g = 0; g < num_groups; ++g)
      spec.group_sizes.push_back(1 + static_cast<int>(rng() % 4));
    spec.heads_kv = 1 << (rng() % 3);
    spec.heads_q = spec.heads_kv * (1 + static_cast<int>(rng() % 3));
    spec.split = splits[rng() % 3];
    spec.uneven = rng() % 2 == 0;
    spec.seed = rng();
    Plan plan = MakePlan(spec);
    plan.ring_order.resize(plan.groups.size());
    for (size_t g = 0; g < plan.groups.size(); ++g) plan.ring_order[g] = static_cast<int>(g);
    std::shuffle(plan.ring_order.begin(), plan.ring_order.end(), rng);
    const double mean_doc = trial % 3 == 0 ? 0.0 : 60.0 + static_cast<double>(rng() % 400);
    absl::StatusOr<Layout> layout =
        SampleRow(700 + static_cast<int64_t>(rng() % 300), mean_doc, rng());
    ASSERT_TRUE(layout.ok()) << layout.status();
    SCOPED_TRACE(spec.Name() + " trial " + std::to_string(trial));
    const LayerShape shape{spec.heads_q, spec.heads_kv, 16, DType::kBF16};
    auto full = PlanPrograms(*layout, plan, shape);
    auto fast = PlanProgramsByGroup(*layout, plan, shape);
    ASSERT_TRUE(full.ok()) << full.status();
    ASSERT_TRUE(fast.ok()) << fast.status();
    ExpectSamePrograms(*full, *fast);
    const Cluster cluster = TestCluster(plan.num_ranks);
    if (cluster.size() != plan.num_ranks) continue;  // the last node is not full
    auto priced_full = SimulatePrograms(cluster, *full, shape.head_dim);
    auto priced_fast = SimulatePrograms(cluster, *fast, shape.head_dim);
    ASSERT_TRUE(priced_full.ok() && priced_fast.ok());
    EXPECT_EQ(priced_full->forward_seconds, priced_fast->forward_seconds);
    EXPECT_EQ(priced_full->backward_seconds, priced_fast->backward_seconds);
    EXPECT_EQ(priced_full->InterNodeBytes(), priced_fast->InterNodeBytes());
    ++compared;
  }
  EXPECT_GT(compared, 4);
}

// The same on multi-node topologies (nodes of 2 to 4 ranks, ranks scrambled over groups),
// with GQA plans whose groups have more members than KV heads, so that several members of
// a node receive one head and the rows cross once, through a gateway (hierarchy.h, 5.), and
// several groups share nodes (node stores, 6.): the fan-outs, the stores, the holders chosen
// on the receiver's node and every message's link class
// equal PlanPrograms(layout, plan, cluster, shape)'s, and so the priced times and bytes.
TEST(GroupProgramsTest, EqualToTheFullPathOnMultiNodeClusters) {
  std::mt19937_64 rng(1313);
  const HeadSplit splits[] = {HeadSplit::kContiguous, HeadSplit::kRoundRobin, HeadSplit::kRandom};
  int fan_out_plans = 0, store_plans = 0;
  for (int trial = 0; trial < 24; ++trial) {
    PlanSpec spec;
    const int num_groups = 2 + static_cast<int>(rng() % 4);
    for (int g = 0; g < num_groups; ++g)
      spec.group_sizes.push_back(1 + static_cast<int>(rng() % 6));
    spec.heads_kv = 1 << (rng() % 2);
    spec.heads_q = spec.heads_kv * (2 + static_cast<int>(rng() % 3));
    spec.split = splits[rng() % 3];
    spec.uneven = rng() % 2 == 0;
    spec.seed = rng();
    Plan plan = MakePlan(spec);
    plan.ring_order.resize(plan.groups.size());
    for (size_t g = 0; g < plan.groups.size(); ++g) plan.ring_order[g] = static_cast<int>(g);
    std::shuffle(plan.ring_order.begin(), plan.ring_order.end(), rng);
    const int node_size = 2 + static_cast<int>(rng() % 3);
    std::vector<int> node_of_rank(plan.num_ranks);
    for (int r = 0; r < plan.num_ranks; ++r) node_of_rank[r] = r / node_size;
    const double mean_doc = trial % 3 == 0 ? 0.0 : 60.0 + static_cast<double>(rng() % 400);
    absl::StatusOr<Layout> layout =
        SampleRow(700 + static_cast<int64_t>(rng() % 300), mean_doc, rng());
    ASSERT_TRUE(layout.ok()) << layout.status();
    if (trial % 2 == 1) layout = MixedMasks(*layout);  // every mask kind
    ASSERT_TRUE(layout.ok()) << layout.status();
    SCOPED_TRACE(spec.Name() + " nodes of " + std::to_string(node_size) + " trial " +
                 std::to_string(trial));
    const LayerShape shape{spec.heads_q, spec.heads_kv, 16, DType::kBF16};
    auto full = PlanPrograms(*layout, plan, node_of_rank, shape);
    auto fast = PlanProgramsByGroup(*layout, plan, node_of_rank, shape);
    ASSERT_TRUE(full.ok()) << full.status();
    ASSERT_TRUE(fast.ok()) << fast.status();
    ExpectSamePrograms(*full, *fast);
    fan_out_plans += FanOutMessages(*full) > 0;
    store_plans += StoreMessages(*full) > 0;
  }
  EXPECT_GT(fan_out_plans, 4);
  EXPECT_GT(store_plans, 4);

  // And through SimulateRun on a cluster of 3 nodes of 4 (what the planner prices).
  const Cluster cluster = TestCluster(12);
  const Plan plan = MakePlan({{6, 6}, 8, 2, HeadSplit::kRoundRobin, false, 7});
  const Workload workload = TestWorkload(3000);
  const int64_t cu[] = {0, workload.seq_len};
  const MaskKind kind[] = {MaskKind::kCausal};
  absl::StatusOr<Layout> row = Layout::FromDocuments(cu, kind);
  ASSERT_TRUE(row.ok());
  auto full = PlanPrograms(*row, plan, cluster, {8, 2, 16, DType::kBF16});
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_GT(FanOutMessages(*full), 0);
  auto priced_full = SimulatePrograms(cluster, *full, 16);
  auto priced_fast = SimulateRun(cluster, workload, plan);
  ASSERT_TRUE(priced_full.ok() && priced_fast.ok()) << priced_fast.status();
  EXPECT_EQ(priced_full->forward_seconds, priced_fast->forward_seconds);
  EXPECT_EQ(priced_full->backward_seconds, priced_fast->backward_seconds);
  EXPECT_EQ(priced_full->InterNodeBytes(), priced_fast->InterNodeBytes());
}

// Node stores priced both ways (ChooseNodeStores): a ring of 12 single-rank groups on three
// nodes of 4 moves fewer inter-node bytes with stores (each needed row enters each node once
// instead of once per group), and the choice keeps whichever of the two runs is faster.
TEST(GroupProgramsTest, NodeStoresArePricedBothWaysAndTheFasterKept) {
  const Cluster cluster = TestCluster(12);
  absl::StatusOr<Plan> ring = SymmetricPlan(12, 8, 2, 1);
  ASSERT_TRUE(ring.ok());
  const Workload workload = TestWorkload(6000);
  Plan with = *ring, without = *ring;
  with.node_stores = true;
  without.node_stores = false;
  auto stores = SimulateRun(cluster, workload, with);
  auto none = SimulateRun(cluster, workload, without);
  ASSERT_TRUE(stores.ok() && none.ok());
  EXPECT_LT(stores->InterNodeBytes(), none->InterNodeBytes());
  Plan chosen = without;
  RunSimulation run = *none;
  ASSERT_TRUE(ChooseNodeStores(cluster, workload, &chosen, &run).ok());
  EXPECT_EQ(chosen.node_stores, stores->Seconds() < none->Seconds());
  EXPECT_EQ(run.Seconds(), std::min(stores->Seconds(), none->Seconds()));
  // Groups that do not share a node: nothing to choose, the run is kept as it is.
  const Plan nodes = MakePlan({{4, 4, 4}, 8, 2, HeadSplit::kContiguous, false, 1});
  auto alone = SimulateRun(cluster, workload, nodes);
  ASSERT_TRUE(alone.ok());
  Plan same = nodes;
  same.node_stores = false;
  RunSimulation kept = *alone;
  ASSERT_TRUE(ChooseNodeStores(cluster, workload, &same, &kept).ok());
  EXPECT_FALSE(same.node_stores);
  EXPECT_EQ(kept.Seconds(), alone->Seconds());
}

TEST(GroupProgramsTest, RejectsALayerThePlanIsNotFor) {
  const Plan plan = MakePlan({{2, 2}, 4, 2, HeadSplit::kContiguous, false, 1});
  absl::StatusOr<Layout> layout = SampleRow(100, 0, 1);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(PlanProgramsByGroup(*layout, plan, {8, 2, 16, DType::kBF16}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsap
