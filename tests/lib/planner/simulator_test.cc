#include "lib/planner/simulator.h"

#include <string>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "lib/planner/baselines.h"

namespace hsap {
namespace {

// Kind T: 50 TFLOP/s sustained; `intra` GB/s inside a node, `nic` GB/s per NIC; no latency.
Cluster TestCluster(int nodes, int per_node, double intra = 100, double nic = 10) {
  auto c = ClusterFromJsonText(absl::StrFormat(R"({
    "device_kinds": {"T": {"peak_tflops": 100, "memory_gib": 80, "hbm_gbps": 1000,
                           "attention_efficiency": 0.5, "intra_node_gbps": %f}},
    "nodes": [{"kind": "T", "devices": %d, "nics": 1, "nic_gbps": %f, "count": %d}],
    "latency_us": {"intra_node": 0, "inter_node": 0}})",
                                               intra, per_node, nic, nodes));
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

Workload TestWorkload() {
  Workload w;
  w.model = {"test", 2, 4, 2, 64, 256, 512, 1000, 2};
  w.seq_len = 4096;
  w.budget.model_state_bytes = 1e9;
  return w;
}

constexpr double kPairs = 4096.0 * 4097.0 / 2.0;
constexpr double kSustained = 50e12;

TEST(SimulatorTest, OneDevice) {
  auto plan = SymmetricPlan(1, 4, 2, 1);
  auto sim = Simulate(TestCluster(1, 1), TestWorkload(), *plan);
  ASSERT_TRUE(sim.ok()) << sim.status();
  const double fwd = 4.0 * 64 * kPairs * 4 / kSustained;
  EXPECT_NEAR(sim->forward_seconds, fwd, 1e-15);
  EXPECT_NEAR(sim->backward_seconds, 2.5 * fwd, 1e-15);
  EXPECT_NEAR(sim->devices[0].busy_seconds, 3.5 * fwd, 1e-15);
  EXPECT_NEAR(sim->devices[0].idle_seconds, 0, 1e-15);
  EXPECT_GT(sim->devices[0].peak_memory_bytes, 1e9);
  EXPECT_NEAR(sim->TokensPerSecond(TestWorkload()), 4096 / (2 * 3.5 * fwd), 1e-6);
}

TEST(SimulatorTest, EqualRingOnEqualDevicesReachesTheIdealBound) {
  // Fast links: transfers hide behind compute; each of 4 ranks computes a quarter.
  const Cluster c = TestCluster(1, 4, /*intra=*/1e6);
  auto plan = SymmetricPlan(4, 4, 2, 1);
  auto sim = Simulate(c, TestWorkload(), *plan);
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_NEAR(sim->Seconds() / IdealSeconds(c, TestWorkload()), 1.0, 1e-3);
  for (const SimDevice& d : sim->devices) EXPECT_LT(d.idle_seconds / sim->Seconds(), 1e-3);
}

TEST(SimulatorTest, SingleSlowLink) {
  // Two ranks on two nodes joined by 10 GB/s: the block crosses once and is not hidden.
  const Cluster c = TestCluster(2, 1);
  auto plan = SymmetricPlan(2, 4, 2, 1);
  auto sim = Simulate(c, TestWorkload(), *plan);
  ASSERT_TRUE(sim.ok()) << sim.status();
  const double transfer = 2048.0 * 2 * 2 * 64 * 2 / 10e9;
  const double block = 4.0 * 64 * kPairs * 0.5 * 4 / kSustained / 2;
  EXPECT_NEAR(sim->forward_seconds, transfer + block, 1e-12);
  EXPECT_NEAR(sim->backward_seconds, 2 * transfer + 2.5 * block, 1e-12);
  auto cost = EvaluatePlan(c, TestWorkload(), *plan);
  EXPECT_NEAR(sim->Seconds(), cost->Seconds(), 1e-12);
}

TEST(SimulatorTest, UlyssesAllToAllInConflictFreeRounds) {
  // 4 ranks in one node: each all-to-all takes (k - 1) rounds of one peer-sized message.
  const Cluster c = TestCluster(1, 4);
  auto plan = SymmetricPlan(4, 4, 2, 4);
  auto sim = Simulate(c, TestWorkload(), *plan);
  ASSERT_TRUE(sim.ok());
  const double q = 1024.0 * 1 * 64 * 2, qkv = 1024.0 * (1 + 2) * 64 * 2;
  const double compute = 4.0 * 64 * kPairs * 1 / kSustained;
  EXPECT_NEAR(sim->forward_seconds, 3 * qkv / 100e9 + compute + 3 * q / 100e9, 1e-12);
  auto cost = EvaluatePlan(c, TestWorkload(), *plan);
  EXPECT_NEAR(sim->forward_seconds, cost->forward_seconds, 1e-12);
}

TEST(SimulatorTest, FlowsSharingANicContend) {
  // Slow compute-free regime: 2 nodes x 2 ranks, one NIC per node.
  Workload w = TestWorkload();
  const Cluster c = TestCluster(2, 2);
  auto plan = SymmetricPlan(4, 4, 2, 1);
  auto local = Simulate(c, w, *plan);  // two hops cross, on different NICs
  plan->ring_order = {0, 2, 1, 3};     // four hops cross, two per NIC
  auto crossed = Simulate(c, w, *plan);
  ASSERT_TRUE(local.ok() && crossed.ok());
  EXPECT_GT(crossed->Seconds(), 1.5 * local->Seconds());
  // With two NICs per node the crossed ring no longer contends.
  auto wide = ClusterFromJsonText(R"({
    "device_kinds": {"T": {"peak_tflops": 100, "memory_gib": 80, "hbm_gbps": 1000,
                           "attention_efficiency": 0.5, "intra_node_gbps": 100}},
    "nodes": [{"kind": "T", "devices": 2, "nics": 2, "nic_gbps": 10, "count": 2}],
    "latency_us": {"intra_node": 0, "inter_node": 0}})");
  auto uncontended = Simulate(*wide, w, *plan);
  ASSERT_TRUE(uncontended.ok());
  EXPECT_LT(uncontended->Seconds(), 0.75 * crossed->Seconds());
}

TEST(SimulatorTest, AgreesWithTheCostModelOnSymmetricPlans) {
  auto c = LoadCluster(std::string(HSAP_SOURCE_DIR) + "/clusters/mix32_h100_a100.json");
  ASSERT_TRUE(c.ok());
  Workload w;
  w.model = *ModelPreset("llama-7b");
  w.seq_len = 65536;
  for (int k : {1, 2, 4, 8, 16, 32}) {
    auto plan = SymmetricPlan(32, 32, 32, k);
    auto sim = Simulate(*c, w, *plan);
    auto cost = EvaluatePlan(*c, w, *plan);
    ASSERT_TRUE(sim.ok() && cost.ok());
    EXPECT_NEAR(sim->Seconds() / cost->Seconds(), 1.0, 0.10) << "group size " << k;
  }
}

TEST(SimulatorTest, RecordsATimeline) {
  const Cluster c = TestCluster(2, 2);
  auto plan = SymmetricPlan(4, 4, 2, 2);
  SimOptions options;
  options.record_events = true;
  auto sim = Simulate(c, TestWorkload(), *plan, options);
  ASSERT_TRUE(sim.ok());
  int compute = 0, ring = 0, a2a = 0;
  for (const SimEvent& e : sim->events) {
    EXPECT_LE(e.start, e.end);
    EXPECT_GE(e.start, 0);
    EXPECT_LE(e.end, sim->Seconds() * (1 + 1e-12));
    compute += e.kind == SimEventKind::kCompute;
    ring += e.kind == SimEventKind::kRing;
    a2a += e.kind == SimEventKind::kAllToAll;
  }
  EXPECT_EQ(compute, 4 * 2 * 2);  // 4 ranks x 2 ring steps x (fwd, bwd)
  EXPECT_EQ(ring, 4 * 1 * 2);     // one received block per rank and pass
  EXPECT_EQ(a2a, 4 * 1 * 2 * 2);  // one peer, in and out, fwd and bwd
}

}  // namespace
}  // namespace hsap
