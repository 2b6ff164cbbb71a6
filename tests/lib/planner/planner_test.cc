#include "lib/planner/planner.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/api/handles.h"
#include "lib/planner/group_programs.h"
#include "lib/sched/plan_json.h"
#include "tests/support/sweep.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

Cluster Load(const std::string& name) {
  auto c = LoadCluster(std::string(HSAP_SOURCE_DIR) + "/clusters/" + name + ".json");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

Workload MakeWorkload(const std::string& model, int64_t seq) {
  Workload w;
  w.model = *ModelPreset(model);
  w.seq_len = seq;
  return w;
}

// The plan is at least as fast as every available baseline, both priced by what runs (the
// run simulator), fits in memory and is valid.
void ExpectNeverWorse(const PlannerResult& r) {
  ASSERT_TRUE(r.plan.Validate().ok()) << r.plan.Validate();
  EXPECT_TRUE(r.cost.fits_memory);
  for (const RankCost& rc : r.cost.ranks) EXPECT_LE(rc.memory_bytes, rc.memory_capacity);
  for (const Baseline& b : r.baselines) {
    if (!b.available) continue;
    EXPECT_LE(r.run.Seconds(), b.run.Seconds() * (1 + 1e-12)) << b.name << " " << b.config;
  }
  EXPECT_DOUBLE_EQ(r.plan.predicted_forward_seconds, r.run.forward_seconds);
  EXPECT_DOUBLE_EQ(r.plan.predicted_backward_seconds, r.run.backward_seconds);
  ASSERT_EQ(static_cast<int>(r.plan.ranks.size()), r.plan.num_ranks);
  for (const RankPrediction& p : r.plan.ranks) EXPECT_FALSE(p.reason.empty());
}

TEST(PlannerTest, TestbedNeverWorseThanBaselinesAndDeterministic) {
  const Cluster c = Load("testbed_8h100_8a100");
  const Workload w = MakeWorkload("llama-7b", 262144);
  auto a = PlanAttention(c, w);
  ASSERT_TRUE(a.ok()) << a.status();
  ExpectNeverWorse(*a);
  auto b = PlanAttention(c, w);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(PlanToJsonText(a->plan), PlanToJsonText(b->plan));
  // Compute dominates at this length: faster devices get more work than slower ones.
  const std::vector<double> shares = a->plan.RankShares();
  EXPECT_GT(shares[0], 1.5 * shares[15]);  // rank 0 is an H100, rank 15 an A100
}

TEST(PlannerTest, HeterogeneousMixBeatsTheStrongestSymmetricLayout) {
  const Cluster c = Load("mix32_h100_l40s");
  auto r = PlanAttention(c, MakeWorkload("llama-70b", 262144));
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectNeverWorse(*r);
  double best = 0;
  for (const Baseline& b : r->baselines) {
    if (b.available) best = std::max(best, 1.0 / b.run.Seconds());
  }
  // Not asserted as a performance figure, only as "the heterogeneous search did something":
  // at equal shares the L40S ranks are the bottleneck, so balance must help.
  EXPECT_GT(1.0 / r->run.Seconds(), 1.05 * best);
  EXPECT_THAT(r->family, HasSubstr("hsap"));
}

TEST(PlannerTest, HomogeneousClusterMatchesTheBestSymmetricLayout) {
  auto c = ClusterFromJsonText(
      R"({"nodes": [{"kind": "A100", "devices": 8, "nics": 8, "nic_gbps": 25, "count": 2}]})");
  ASSERT_TRUE(c.ok());
  auto r = PlanAttention(*c, MakeWorkload("llama-13b", 131072));
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectNeverWorse(*r);
  double best = 1e300;
  for (const Baseline& b : r->baselines) {
    if (b.available) best = std::min(best, b.run.Seconds());
  }
  EXPECT_LE(r->run.Seconds(), best);
  EXPECT_GE(r->run.Seconds(), 0.99 * best);
}

TEST(PlannerTest, MemoryBudgetShapesThePlan) {
  // 13B at 768K tokens on 8 H100 + 8 L40S: an equal share (48K tokens) does not fit in an
  // L40S (48 GB), so every symmetric layout is out of memory; the plan caps the L40S shares.
  auto c = ClusterFromJsonText(R"({"nodes": [
      {"kind": "H100", "devices": 8, "nics": 8, "nic_gbps": 50},
      {"kind": "L40S", "devices": 8, "nics": 4, "nic_gbps": 50}]})");
  ASSERT_TRUE(c.ok());
  Workload w = MakeWorkload("llama-13b", 786432);
  auto r = PlanAttention(*c, w);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const Baseline& b : r->baselines) {
    EXPECT_FALSE(b.available) << b.name;
    EXPECT_THAT(b.config, ::testing::AnyOf(HasSubstr("out of memory"), HasSubstr("no legal")));
  }
  ExpectNeverWorse(*r);
  // A larger margin leaves less room; the plan still fits its smaller budget, or none does.
  w.budget.margin_fraction = 0.3;
  auto tight = PlanAttention(*c, w);
  if (tight.ok()) {
    for (const RankCost& rc : tight->cost.ranks) EXPECT_LE(rc.memory_bytes, rc.memory_capacity);
  } else {
    EXPECT_EQ(tight.status().code(), absl::StatusCode::kResourceExhausted);
  }
}

TEST(PlannerTest, MemoryCapsAFastSmallDevice) {
  // "Fast": H100 speed with 24 GiB. By speed it would take ~3/4 of the work; by memory it
  // cannot, so its share is capped near its budget and the A100s take the rest.
  auto c = ClusterFromJsonText(R"({
      "device_kinds": {"Fast": {"peak_tflops": 989.4, "memory_gib": 24, "hbm_gbps": 3350,
                                "attention_efficiency": 0.6, "intra_node_gbps": 450}},
      "nodes": [{"kind": "Fast", "devices": 8, "nics": 8, "nic_gbps": 50},
                {"kind": "A100", "devices": 8, "nics": 8, "nic_gbps": 25}]})");
  ASSERT_TRUE(c.ok()) << c.status();
  auto r = PlanAttention(*c, MakeWorkload("llama-13b", 524288));
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectNeverWorse(*r);
  const std::vector<double> shares = r->plan.RankShares();
  double fast_share = 0, fullest = 0;
  for (int d = 0; d < 8; ++d) {
    fast_share += shares[d];
    fullest = std::max(fullest, r->cost.ranks[d].memory_bytes / r->cost.ranks[d].memory_capacity);
  }
  EXPECT_LT(fast_share, 0.6);
  EXPECT_GT(fullest, 0.9);
  EXPECT_LE(fullest, 1.0);
}

TEST(PlannerTest, RandomClustersNeverWorseThanAnyBaseline) {
  std::mt19937 rng(20261129);
  const char* kinds[] = {"H100", "A100", "A800", "L40S"};
  const char* models[] = {"llama-3b", "llama-7b", "llama-13b"};
  const int64_t seqs[] = {32768, 131072, 524288};
  // Every trial's cluster is drawn (the generator's sequence stays the same); a sweep's
  // subset plans some of them (tests/support/sweep.h).
  std::vector<int> all_trials(12);
  std::iota(all_trials.begin(), all_trials.end(), 0);
  const std::vector<int> trials = testing::Sweep(all_trials, 4);
  int planned = 0;
  for (int trial = 0; trial < 12; ++trial) {
    std::string nodes;
    const int num_entries = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < num_entries; ++e) {
      const int size = 2 << (rng() % 3);  // 2, 4 or 8 devices
      absl::StrAppend(&nodes, e ? "," : "", "{\"kind\": \"", kinds[rng() % 4],
                      "\", \"devices\": ", size, ", \"nics\": ", 1 + rng() % 4,
                      ", \"nic_gbps\": ", 12.5 * (1 + rng() % 4), ", \"count\": ", 1 + rng() % 2,
                      "}");
    }
    auto c = ClusterFromJsonText(absl::StrCat("{\"nodes\": [", nodes, "]}"));
    ASSERT_TRUE(c.ok()) << c.status();
    const Workload w = MakeWorkload(models[rng() % 3], seqs[rng() % 3]);
    if (std::find(trials.begin(), trials.end(), trial) == trials.end()) continue;
    auto r = PlanAttention(*c, w);
    SCOPED_TRACE(absl::StrCat("trial ", trial, ": ", c->Summary(), ", ", w.model.name, ", ",
                              w.seq_len, " tokens"));
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      continue;
    }
    ++planned;
    ExpectNeverWorse(*r);
    EXPECT_GE(r->run.Seconds(), IdealSeconds(*c, w) * (1 - 1e-9));
  }
  // Most random cases fit (8 of the 12): the property is exercised.
  EXPECT_GE(planned, static_cast<int>(trials.size()) * 2 / 3);
}

TEST(PlannerTest, OwnSearchNeverWorseThanABaselineOnEveryShippedCluster) {
  // The baselines are references, not candidates: the plan comes from the search alone.
  const Workload w = MakeWorkload("llama-7b", 131072);
  for (const char* name : testing::Sweep(
           {"testbed_8h100_8a100", "mix32_h100_a100", "mix32_h100_l40s", "mix64_h100_a100_a800",
            "mix64_h100_l40s", "mix128_h100_a100", "mix128_four_kinds", "flops_48h100_8a100",
            "flops_160a100", "flops_52h100_4a100_8a800", "flops_176a100", "scale1024_four_kinds",
            "scale1024_h100_a100"},
           3)) {
    SCOPED_TRACE(name);
    auto r = PlanAttention(Load(name), w);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->family, HasSubstr("hsap groups"));
    ExpectNeverWorse(*r);
  }
}

// The same with Llama 3 8B (GQA 32:8, models/llama3-8b.json) at 128K, 512K and 1M tokens
// on every shipped cluster of at most 128 devices (the 1024-device ones take seconds each:
// `hsap_plan --brief` sweeps them, docs/planner.md). The search reaches the ring's, Ulysses'
// and USP's layouts by itself (its equal-group family), so no baseline beats it.
TEST(PlannerTest, OwnSearchNeverWorseWithLlama3At128KTo1M) {
  std::ifstream in(std::string(HSAP_SOURCE_DIR) + "/models/llama3-8b.json");
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<ModelSpec> model = ModelFromJsonText(text.str());
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::pair<int64_t, const char*>> cases;
  for (const int64_t seq : {131072, 524288, 1048576}) {
    for (const char* name :
         {"testbed_8h100_8a100", "mix32_h100_a100", "mix32_h100_l40s", "mix64_h100_a100_a800",
          "mix64_h100_l40s", "mix128_h100_a100", "mix128_four_kinds", "flops_48h100_8a100",
          "flops_52h100_4a100_8a800"}) {
      cases.emplace_back(seq, name);
    }
  }
  for (const auto& [seq, name] : testing::Sweep(cases, 3)) {
    SCOPED_TRACE(absl::StrCat(name, ", ", seq, " tokens"));
    Workload w;
    w.model = *model;
    w.seq_len = seq;
    auto r = PlanAttention(Load(name), w);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->family, HasSubstr("hsap groups"));
    ExpectNeverWorse(*r);
  }
}

// The C ABI plans without pricing the baselines (they are references only).
TEST(PlannerTest, WithoutBaselinesTheSamePlan) {
  const Cluster c = Load("mix32_h100_l40s");
  const Workload w = MakeWorkload("llama-7b", 131072);
  PlannerOptions without;
  without.with_baselines = false;
  auto a = PlanAttention(c, w);
  auto b = PlanAttention(c, w, without);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(a->baselines.empty());
  EXPECT_TRUE(b->baselines.empty());
  EXPECT_EQ(PlanToJsonText(a->plan), PlanToJsonText(b->plan));
  EXPECT_LE(b->search_cpu_seconds, b->planning_cpu_seconds);
}

// The plan's figures are what runs: pricing the returned plan again gives them exactly.
TEST(PlannerTest, PredictionIsWhatRuns) {
  const Cluster c = Load("mix32_h100_a100");
  const Workload w = MakeWorkload("llama-7b", 131072);
  auto r = PlanAttention(c, w);
  ASSERT_TRUE(r.ok()) << r.status();
  auto again = SimulateRun(c, w, r->plan);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->forward_seconds, r->plan.predicted_forward_seconds);
  EXPECT_EQ(again->backward_seconds, r->plan.predicted_backward_seconds);
}

// The ring order is searched: on 64 H100 + 64 A100 (node order puts every H100 group before
// every A100 group) an order other than node order wins at 128K, and the plan says so.
TEST(PlannerTest, RingOrderIsSearchedAndWinsWhereItHelps) {
  const Cluster c = Load("mix128_h100_a100");
  const Workload w = MakeWorkload("llama-7b", 131072);
  auto r = PlanAttention(c, w);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectNeverWorse(*r);
  EXPECT_THAT(r->family, HasSubstr(", ring "));
  std::vector<int> node_order(r->plan.groups.size());
  std::iota(node_order.begin(), node_order.end(), 0);
  EXPECT_NE(r->plan.RingOrder(), node_order);
  // Node order priced the same way is slower.
  Plan in_node_order = r->plan;
  in_node_order.ring_order = node_order;
  auto node = SimulateRun(c, w, in_node_order);
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_LT(r->run.Seconds(), node->Seconds());
}

// Groups of one kind may differ in size: on the four-kind 128-GPU cluster (Llama 3.2 3B,
// 512K tokens) the search's fastest plan, by what runs, cuts the H100 nodes as 2 + 1 + ...,
// with a ring order found by adjacent swaps, and beats every baseline.
TEST(PlannerTest, DifferingGroupSizesWinWhereTheyHelp) {
  const Cluster c = Load("mix128_four_kinds");
  auto r = PlanAttention(c, MakeWorkload("llama-3b", 524288));
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectNeverWorse(*r);
  EXPECT_THAT(r->family, HasSubstr("H100:2+1"));
  EXPECT_THAT(r->family, HasSubstr(", ring by swaps"));
  std::set<size_t> h100_sizes;
  for (const PlanGroup& g : r->plan.groups) {
    if (c.kind_of(g.ranks[0]).name == std::string("H100")) h100_sizes.insert(g.ranks.size());
  }
  EXPECT_EQ(h100_sizes, (std::set<size_t>{1, 2}));
}

TEST(PlannerTest, InfeasibleAndMalformedInputs) {
  auto tiny = ClusterFromJsonText(R"({"nodes": [{"kind": "L40S", "devices": 2}]})");
  ASSERT_TRUE(tiny.ok());
  auto r = PlanAttention(*tiny, MakeWorkload("llama-70b", 1048576));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("does not fit"));
  Workload bad = MakeWorkload("llama-7b", 4096);
  bad.model.heads_kv = 5;
  EXPECT_THAT(PlanAttention(*tiny, bad).status().message(), HasSubstr("multiple of heads_kv"));
  Workload empty = MakeWorkload("llama-7b", 0);
  EXPECT_THAT(PlanAttention(*tiny, empty).status().message(), HasSubstr("sequence length"));
}

// A cluster beyond the supported range is refused at once, not planned for minutes or hours.
TEST(PlannerTest, ClusterBeyondTheSupportedRangeIsRejectedQuickly) {
  auto cluster_of = [](int devices_per_node, int nodes) {
    return ClusterFromJsonText(absl::StrCat(R"({"nodes": [{"kind": "H100", "nic_gbps": 50, )",
                                            R"("devices": )", devices_per_node, R"(, "count": )",
                                            nodes, "}]}"));
  };
  auto huge = cluster_of(16, 1 << 16);  // 2^20 devices, the most a cluster file may hold
  ASSERT_TRUE(huge.ok()) << huge.status();
  const auto start = std::chrono::steady_clock::now();
  auto r = PlanAttention(*huge, MakeWorkload("llama-7b", 131072));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("the cluster has 1048576 devices"));
  EXPECT_THAT(r.status().message(),
              HasSubstr(absl::StrCat("clusters of 1 to ", kMaxPlannerDevices, " devices")));
  EXPECT_LT(seconds, 1.0);
  auto just_over = cluster_of(8, kMaxPlannerDevices / 8 + 1);
  ASSERT_TRUE(just_over.ok());
  EXPECT_EQ(PlanAttention(*just_over, MakeWorkload("llama-7b", 131072)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PlannerTest, PlanTravelsThroughTheCApi) {
  auto r = PlanAttention(Load("testbed_8h100_8a100"), MakeWorkload("llama-3b", 131072));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string text = PlanToJsonText(r->plan);
  hsapPlan_t plan = nullptr;
  ASSERT_EQ(hsapPlanCreateFromJson(&plan, text.c_str()), hsapSuccess) << hsapGetLastError();
  double fwd = 0, bwd = 0;
  ASSERT_EQ(hsapPlanGetPredictedTime(plan, &fwd, &bwd), hsapSuccess);
  EXPECT_DOUBLE_EQ(fwd, r->run.forward_seconds);
  EXPECT_DOUBLE_EQ(bwd, r->run.backward_seconds);
  EXPECT_EQ(plan->plan, r->plan);
  EXPECT_EQ(hsapPlanDestroy(plan), hsapSuccess);
}

}  // namespace
}  // namespace hsap
