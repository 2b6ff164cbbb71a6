#include "lib/planner/run_simulator.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/sched/plan_json.h"
#include "tests/support/hier_plans.h"

namespace hsap {
namespace {

using ::hsap::testing::HeadSplit;
using ::hsap::testing::MakePlan;
using ::hsap::testing::PlanSpec;

constexpr int kHeadDim = 32;

// `nodes` nodes of `per_node` devices of kind T (50 TFLOP/s sustained), no latency.
Cluster TestCluster(int nodes, int per_node, double intra_gbps = 100, double nic_gbps = 10) {
  auto c = ClusterFromJsonText(absl::StrFormat(R"({
    "device_kinds": {"T": {"peak_tflops": 100, "memory_gib": 80, "hbm_gbps": 1000,
                           "attention_efficiency": 0.5, "intra_node_gbps": %f}},
    "nodes": [{"kind": "T", "devices": %d, "nics": 1, "nic_gbps": %f, "count": %d}],
    "latency_us": {"intra_node": 0, "inter_node": 0}})",
                                               intra_gbps, per_node, nic_gbps, nodes));
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// Runs one forward and one backward of `layout` on R host ranks (a plan's batch when `plan`
// is given, else a flat batch) and returns every rank's traffic detail. rank_nodes: the
// communicator's topology (empty: one node); links: when given, every rank's bytes by link
// class (flat batches).
std::vector<hsapTrafficDetail_t> RunOnHost(const std::vector<int64_t>& cu, int R, int heads_q,
                                           int heads_kv, const Plan* plan,
                                           const std::vector<int>& rank_nodes = {},
                                           std::vector<hsapLinkTraffic_t>* links = nullptr) {
  hsapLayout_t layout = nullptr;
  EXPECT_EQ(
      hsapLayoutCreate(&layout, cu.data(), static_cast<int64_t>(cu.size()) - 1, nullptr, nullptr),
      hsapSuccess);
  hsapPlan_t cplan = nullptr;
  if (plan != nullptr) {
    EXPECT_EQ(hsapPlanCreateFromJson(&cplan, PlanToJsonText(*plan).c_str()), hsapSuccess)
        << hsapGetLastError();
  }
  std::vector<hsapComm_t> comms(R);
  hsapCommConfig_t cc = HSAP_COMM_CONFIG_INITIALIZER;
  cc.timeoutMs = 60000;
  cc.numThreads = 1;
  if (!rank_nodes.empty()) cc.rankNodes = rank_nodes.data();
  if (links != nullptr) links->assign(R, hsapLinkTraffic_t{});
  EXPECT_EQ(hsapCommInitAll(comms.data(), R, &cc), hsapSuccess);
  std::vector<hsapTrafficDetail_t> detail(R);
  std::vector<std::string> errors(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
      bc.dtype = hsapBFloat16;
      bc.numHeadsQ = heads_q;
      bc.numHeadsKV = heads_kv;
      bc.headDim = kHeadDim;
      hsapBatch_t batch = nullptr;
      const hsapResult_t created =
          plan != nullptr ? hsapBatchCreateWithPlan(&batch, comms[r], layout, cplan, &bc)
                          : hsapBatchCreate(&batch, comms[r], layout, nullptr, &bc);
      if (created != hsapSuccess) {
        errors[r] = hsapGetLastError();
        return;
      }
      int64_t n = 0;
      hsapBatchGetLocalTokens(batch, &n);
      // Values do not matter for the bytes: zeros.
      std::vector<uint16_t> q(n * heads_q * kHeadDim + 1), kv(n * heads_kv * kHeadDim + 1),
          out(q.size()), dout(q.size()), dq(q.size()), k(kv.size()), v(kv.size()), dk(kv.size()),
          dv(kv.size());
      std::vector<float> lse(n * heads_q + 1);
      auto t = [&](std::vector<uint16_t>& b, int heads) {
        return hsapTensor_t{b.data(), hsapBFloat16, n, heads, kHeadDim};
      };
      hsapTensor_t tq = t(q, heads_q), tk = t(k, heads_kv), tv = t(v, heads_kv),
                   tout = t(out, heads_q), tdout = t(dout, heads_q), tdq = t(dq, heads_q),
                   tdk = t(dk, heads_kv), tdv = t(dv, heads_kv);
      if (hsapAttentionForward(batch, &tq, &tk, &tv, &tout, lse.data()) != hsapSuccess ||
          hsapAttentionBackward(batch, &tdout, &tq, &tk, &tv, &tout, lse.data(), &tdq, &tdk,
                                &tdv) != hsapSuccess) {
        errors[r] = hsapGetLastError();
      }
      hsapBatchGetTrafficDetail(batch, &detail[r]);
      if (links != nullptr && hsapBatchGetLinkTraffic(batch, &(*links)[r]) != hsapSuccess) {
        errors[r] = hsapGetLastError();
      }
      hsapBatchDestroy(batch);
    });
  }
  for (std::thread& th : threads) th.join();
  for (int r = 0; r < R; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  if (cplan != nullptr) hsapPlanDestroy(cplan);
  hsapLayoutDestroy(layout);
  return detail;
}

// Compares every byte count; returns the ring bytes the run moved.
uint64_t ExpectSameBytes(const RunSimulation& sim, const std::vector<hsapTrafficDetail_t>& run) {
  EXPECT_EQ(sim.ranks.size(), run.size());
  if (sim.ranks.size() != run.size()) return 0;
  uint64_t ring = 0;
  for (size_t r = 0; r < run.size(); ++r) {
    ring += run[r].forwardRingBytesSent + run[r].backwardRingBytesSent;
    const HierTraffic& f = sim.ranks[r].forward;
    const HierTraffic& b = sim.ranks[r].backward;
    const hsapTrafficDetail_t& d = run[r];
    EXPECT_EQ(f.a2a_sent, d.forwardAllToAllBytesSent) << "rank " << r;
    EXPECT_EQ(f.a2a_received, d.forwardAllToAllBytesReceived) << "rank " << r;
    EXPECT_EQ(f.ring_sent, d.forwardRingBytesSent) << "rank " << r;
    EXPECT_EQ(f.ring_received, d.forwardRingBytesReceived) << "rank " << r;
    EXPECT_EQ(b.a2a_sent, d.backwardAllToAllBytesSent) << "rank " << r;
    EXPECT_EQ(b.a2a_received, d.backwardAllToAllBytesReceived) << "rank " << r;
    EXPECT_EQ(b.ring_sent, d.backwardRingBytesSent) << "rank " << r;
    EXPECT_EQ(b.ring_received, d.backwardRingBytesReceived) << "rank " << r;
    EXPECT_EQ(sim.ranks[r].intra_node_bytes_sent + sim.ranks[r].inter_node_bytes_sent,
              f.sent() + b.sent())
        << "rank " << r;
  }
  return ring;
}

std::vector<int64_t> CuSeqlens(const Layout& layout) {
  std::vector<int64_t> cu = {0};
  for (const MaskSlice& s : layout.slices()) {
    if (s.q_end > cu.back()) cu.push_back(s.q_end);
  }
  return cu;
}

TEST(RunSimulatorTest, PlanBytesAreTheRuntimesOnRandomPlans) {
  const std::vector<PlanSpec> specs = {
      {{2, 2}, 4, 2, HeadSplit::kContiguous, false, 1},
      {{3, 1, 2}, 8, 2, HeadSplit::kRandom, true, 7},
      {{1, 1, 1, 1}, 4, 4, HeadSplit::kContiguous, true, 4},
      {{2, 3}, 4, 1, HeadSplit::kRoundRobin, true, 11},
  };
  uint64_t ring = 0;
  for (const PlanSpec& spec : specs) {
    SCOPED_TRACE(spec.Name());
    const Plan plan = MakePlan(spec);
    absl::StatusOr<Layout> layout = SampleRow(600, 250, spec.seed);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const LayerShape shape{spec.heads_q, spec.heads_kv, kHeadDim, DType::kBF16};
    absl::StatusOr<std::vector<RankProgram>> programs = PlanPrograms(*layout, plan, shape);
    ASSERT_TRUE(programs.ok()) << programs.status();
    const int R = plan.num_ranks;
    absl::StatusOr<RunSimulation> sim = SimulatePrograms(TestCluster(R, 1), *programs, kHeadDim);
    ASSERT_TRUE(sim.ok()) << sim.status();
    ring +=
        ExpectSameBytes(*sim, RunOnHost(CuSeqlens(*layout), R, spec.heads_q, spec.heads_kv, &plan));
  }
  EXPECT_GT(ring, 0u) << "no K/V crossed groups: the comparison would prove little";
}

TEST(RunSimulatorTest, FlatBytesAreTheRuntimes) {
  uint64_t ring = 0;
  for (int R : {2, 5}) {
    for (double mean : {0.0, 120.0}) {
      SCOPED_TRACE(absl::StrFormat("%d ranks, mean document %g", R, mean));
      absl::StatusOr<Layout> layout = SampleRow(500, mean, 3);
      ASSERT_TRUE(layout.ok()) << layout.status();
      absl::StatusOr<std::vector<RankProgram>> programs =
          FlatPrograms(*layout, R, {}, {4, 2, kHeadDim, DType::kBF16});
      ASSERT_TRUE(programs.ok()) << programs.status();
      absl::StatusOr<RunSimulation> sim = SimulatePrograms(TestCluster(1, R), *programs, kHeadDim);
      ASSERT_TRUE(sim.ok()) << sim.status();
      ring += ExpectSameBytes(*sim, RunOnHost(CuSeqlens(*layout), R, 4, 2, nullptr));
    }
  }
  EXPECT_GT(ring, 0u) << "no K/V crossed ranks: the comparison would prove little";
}

// Flat batches over several nodes: the schedules relay (lib/sched/schedule.h) and the
// simulator's bytes per rank per link class are what the runtime counts.
TEST(RunSimulatorTest, FlatBytesPerLinkClassAreTheRuntimesOnSeveralNodes) {
  uint64_t inter = 0, relayed = 0;
  for (auto [nodes, per_node] : {std::pair{2, 2}, std::pair{2, 3}, std::pair{3, 2}}) {
    for (double mean : {0.0, 150.0}) {
      const int R = nodes * per_node;
      SCOPED_TRACE(
          absl::StrFormat("%d nodes of %d ranks, mean document %g", nodes, per_node, mean));
      absl::StatusOr<Layout> layout = SampleRow(600, mean, 5);
      ASSERT_TRUE(layout.ok()) << layout.status();
      const Cluster cluster = TestCluster(nodes, per_node);
      absl::StatusOr<std::vector<RankProgram>> programs =
          FlatPrograms(*layout, cluster, {}, {4, 2, kHeadDim, DType::kBF16});
      ASSERT_TRUE(programs.ok()) << programs.status();
      absl::StatusOr<RunSimulation> sim = SimulatePrograms(cluster, *programs, kHeadDim);
      ASSERT_TRUE(sim.ok()) << sim.status();
      std::vector<int> rank_nodes;
      for (int r = 0; r < R; ++r) rank_nodes.push_back(cluster.devices[r].node);
      std::vector<hsapLinkTraffic_t> links;
      ExpectSameBytes(*sim, RunOnHost(CuSeqlens(*layout), R, 4, 2, nullptr, rank_nodes, &links));
      ASSERT_EQ(links.size(), static_cast<size_t>(R));
      for (int r = 0; r < R; ++r) {
        SCOPED_TRACE(absl::StrFormat("rank %d", r));
        const LinkBytes f = (*programs)[r].forward.Links(), b = (*programs)[r].backward.Links();
        const hsapLinkTraffic_t& l = links[r];
        EXPECT_EQ(f.intra_sent, l.forwardIntraNodeBytesSent);
        EXPECT_EQ(f.intra_received, l.forwardIntraNodeBytesReceived);
        EXPECT_EQ(f.inter_sent, l.forwardInterNodeBytesSent);
        EXPECT_EQ(f.inter_received, l.forwardInterNodeBytesReceived);
        EXPECT_EQ(b.intra_sent, l.backwardIntraNodeBytesSent);
        EXPECT_EQ(b.intra_received, l.backwardIntraNodeBytesReceived);
        EXPECT_EQ(b.inter_sent, l.backwardInterNodeBytesSent);
        EXPECT_EQ(b.inter_received, l.backwardInterNodeBytesReceived);
        // The simulator priced each message on the link class the runtime counted it on.
        EXPECT_EQ(sim->ranks[r].intra_node_bytes_sent,
                  l.forwardIntraNodeBytesSent + l.backwardIntraNodeBytesSent);
        EXPECT_EQ(sim->ranks[r].inter_node_bytes_sent,
                  l.forwardInterNodeBytesSent + l.backwardInterNodeBytesSent);
        relayed += (*programs)[r].backward.returns.size();
      }
      inter += sim->InterNodeBytes();
    }
  }
  EXPECT_GT(inter, 0u) << "nothing crossed a node: the comparison would prove little";
  EXPECT_GT(relayed, 0u) << "no row was relayed: the comparison would prove little";
}

// Plans on several nodes: sub-ring rows shared by members of a node are fanned out inside
// it (lib/sched/hierarchy.h, 5.); the simulator's bytes per rank per link class are what
// the runtime counts.
TEST(RunSimulatorTest, PlanBytesPerLinkClassAreTheRuntimesOnSeveralNodes) {
  const std::vector<std::pair<PlanSpec, std::pair<int, int>>> cases = {
      {{{4, 4}, 4, 1, HeadSplit::kRoundRobin, false, 2}, {2, 4}},
      {{{3, 3}, 6, 2, HeadSplit::kRoundRobin, true, 9}, {3, 2}},
      {{{2, 3, 3}, 8, 2, HeadSplit::kRandom, true, 12}, {4, 2}},
  };
  uint64_t inter = 0, fanned = 0;
  for (const auto& [spec, shape] : cases) {
    const auto [nodes, per_node] = shape;
    SCOPED_TRACE(absl::StrFormat("%s on %d nodes of %d", spec.Name(), nodes, per_node));
    const Plan plan = MakePlan(spec);
    ASSERT_EQ(plan.num_ranks, nodes * per_node);
    absl::StatusOr<Layout> layout = SampleRow(600, 200, spec.seed);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const Cluster cluster = TestCluster(nodes, per_node);
    const LayerShape layer{spec.heads_q, spec.heads_kv, kHeadDim, DType::kBF16};
    absl::StatusOr<std::vector<RankProgram>> programs = PlanPrograms(*layout, plan, cluster, layer);
    ASSERT_TRUE(programs.ok()) << programs.status();
    absl::StatusOr<RunSimulation> sim = SimulatePrograms(cluster, *programs, kHeadDim);
    ASSERT_TRUE(sim.ok()) << sim.status();
    const int R = plan.num_ranks;
    std::vector<int> rank_nodes;
    for (int r = 0; r < R; ++r) rank_nodes.push_back(cluster.devices[r].node);
    std::vector<hsapLinkTraffic_t> links;
    ExpectSameBytes(*sim, RunOnHost(CuSeqlens(*layout), R, spec.heads_q, spec.heads_kv, &plan,
                                    rank_nodes, &links));
    ASSERT_EQ(links.size(), static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE(absl::StrFormat("rank %d", r));
      const LinkBytes f = (*programs)[r].forward.Links(), b = (*programs)[r].backward.Links();
      const hsapLinkTraffic_t& l = links[r];
      EXPECT_EQ(f.intra_sent, l.forwardIntraNodeBytesSent);
      EXPECT_EQ(f.intra_received, l.forwardIntraNodeBytesReceived);
      EXPECT_EQ(f.inter_sent, l.forwardInterNodeBytesSent);
      EXPECT_EQ(f.inter_received, l.forwardInterNodeBytesReceived);
      EXPECT_EQ(b.intra_sent, l.backwardIntraNodeBytesSent);
      EXPECT_EQ(b.intra_received, l.backwardIntraNodeBytesReceived);
      EXPECT_EQ(b.inter_sent, l.backwardInterNodeBytesSent);
      EXPECT_EQ(b.inter_received, l.backwardInterNodeBytesReceived);
      EXPECT_EQ(sim->ranks[r].intra_node_bytes_sent,
                l.forwardIntraNodeBytesSent + l.backwardIntraNodeBytesSent);
      EXPECT_EQ(sim->ranks[r].inter_node_bytes_sent,
                l.forwardInterNodeBytesSent + l.backwardInterNodeBytesSent);
      for (const ProgramStage& st : (*programs)[r].forward.stages) fanned += st.fan_out_kv.size();
    }
    inter += sim->InterNodeBytes();
    // Fan-outs move fewer inter-node bytes than the direct hierarchy on the same cluster.
    absl::StatusOr<std::vector<RankProgram>> direct = PlanPrograms(*layout, plan, layer);
    ASSERT_TRUE(direct.ok());
    absl::StatusOr<RunSimulation> direct_sim = SimulatePrograms(cluster, *direct, kHeadDim);
    ASSERT_TRUE(direct_sim.ok());
    EXPECT_LT(sim->InterNodeBytes(), direct_sim->InterNodeBytes());
  }
  EXPECT_GT(inter, 0u) << "nothing crossed a node: the comparison would prove little";
  EXPECT_GT(fanned, 0u) << "no step fanned out: the comparison would prove little";
}

TEST(RunSimulatorTest, RelaysCrossTheNicOnceAndArePricedAsSuch) {
  // One causal document on two nodes of four: the later node's ranks all need the first
  // node's rows; relayed, each crosses the slow NIC once instead of once per rank.
  const Layout layout = *SampleRow(4096, 0, 1);
  const LayerShape shape{4, 2, 64, DType::kBF16};
  const Cluster cluster = TestCluster(2, 4, 100, /*nic_gbps=*/1);
  auto relayed = FlatPrograms(layout, cluster, {}, shape);
  auto direct = FlatPrograms(layout, cluster.size(), {}, shape);
  ASSERT_TRUE(relayed.ok() && direct.ok());
  auto relayed_sim = SimulatePrograms(cluster, *relayed, 64);
  auto direct_sim = SimulatePrograms(cluster, *direct, 64);
  ASSERT_TRUE(relayed_sim.ok() && direct_sim.ok());
  EXPECT_LT(relayed_sim->InterNodeBytes(), direct_sim->InterNodeBytes());
  EXPECT_LT(relayed_sim->Seconds(), direct_sim->Seconds());
  EXPECT_NEAR(relayed_sim->MaxComputeSeconds(), direct_sim->MaxComputeSeconds(), 1e-15);
}

TEST(RunSimulatorTest, OneDeviceComputesEveryPairAtItsRate) {
  const Layout layout = *SampleRow(1000, 0, 1);
  auto programs = FlatPrograms(layout, 1, {}, {4, 2, 64, DType::kBF16});
  ASSERT_TRUE(programs.ok()) << programs.status();
  auto sim = SimulatePrograms(TestCluster(1, 1), *programs, 64);
  ASSERT_TRUE(sim.ok()) << sim.status();
  const double forward = 4.0 * 64 * (1000.0 * 1001 / 2) * 4 / 50e12;
  EXPECT_NEAR(sim->forward_seconds, forward, 1e-15);
  EXPECT_NEAR(sim->backward_seconds, 2.5 * forward, 1e-15);
  EXPECT_NEAR(sim->ExposedTransferSeconds(), 0, 1e-15);
  EXPECT_NEAR(sim->ImbalanceSeconds(), 0, 1e-15);
}

TEST(RunSimulatorTest, SlowNicIsExposedAndInterNodeBytesCounted) {
  // Two ranks on two nodes: rank 1's queries see rank 0's keys, which cross a slow NIC.
  const Layout layout = *SampleRow(4096, 0, 1);
  const LayerShape shape{4, 2, 64, DType::kBF16};
  auto programs = FlatPrograms(layout, 2, {}, shape);
  ASSERT_TRUE(programs.ok()) << programs.status();
  auto apart = SimulatePrograms(TestCluster(2, 1, 100, /*nic_gbps=*/0.01), *programs, 64);
  auto together = SimulatePrograms(TestCluster(1, 2, 1e6), *programs, 64);
  ASSERT_TRUE(apart.ok() && together.ok());
  const uint64_t moved = apart->ranks[0].forward.sent() + apart->ranks[0].backward.sent() +
                         apart->ranks[1].forward.sent() + apart->ranks[1].backward.sent();
  ASSERT_GT(moved, 0u);
  EXPECT_EQ(apart->InterNodeBytes(), moved);
  EXPECT_EQ(together->InterNodeBytes(), 0u);
  // The NIC bound: the busier node's bytes over its one NIC.
  const double node0 = static_cast<double>(apart->ranks[0].inter_node_bytes_sent);
  const double node1 = static_cast<double>(apart->ranks[1].inter_node_bytes_sent);
  EXPECT_DOUBLE_EQ(NicBoundSeconds(TestCluster(2, 1, 100, 0.01), *apart),
                   std::max(node0, node1) / 0.01e9);
  EXPECT_EQ(NicBoundSeconds(TestCluster(1, 2, 1e6), *together), 0);
  // The forward K/V alone needs bytes / bandwidth on the wire before rank 1 can use it.
  EXPECT_GE(apart->forward_seconds, apart->ranks[0].forward.ring_sent / 0.01e9);
  EXPECT_GT(apart->ExposedTransferSeconds(), together->ExposedTransferSeconds());
  // The same work on both layouts of the cluster.
  EXPECT_NEAR(apart->MaxComputeSeconds(), together->MaxComputeSeconds(), 1e-15);
}

TEST(RunSimulatorTest, SampleRowIsDeterministicAndCoversTheRow) {
  const Layout a = *SampleRow(10000, 300, 42), b = *SampleRow(10000, 300, 42);
  EXPECT_EQ(a.num_tokens(), 10000);
  EXPECT_EQ(CuSeqlens(a), CuSeqlens(b));
  EXPECT_GT(CuSeqlens(a).size(), 10u);
  EXPECT_NE(CuSeqlens(a), CuSeqlens(*SampleRow(10000, 300, 43)));
  EXPECT_EQ(CuSeqlens(*SampleRow(100, 0, 1)).size(), 2u);
}

TEST(RunSimulatorTest, RejectsProgramsThatDoNotFitTheCluster) {
  const Layout layout = *SampleRow(100, 0, 1);
  auto programs = FlatPrograms(layout, 2, {}, {4, 2, 32, DType::kBF16});
  ASSERT_TRUE(programs.ok());
  EXPECT_FALSE(SimulatePrograms(TestCluster(1, 3), *programs, 32).ok());
  EXPECT_FALSE(PlanPrograms(layout, MakePlan({{1, 1}, 8, 2}), {4, 2, 32}).ok());
}

}  // namespace
}  // namespace hsap
