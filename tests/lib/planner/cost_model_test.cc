#include "lib/planner/cost_model.h"

#include <string>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/planner/baselines.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

// Kind T: 100 TFLOP/s x 0.5 = 50 TFLOP/s sustained, 100 GB/s inside a node; 10 GB/s NICs;
// zero latency so that times are pure bandwidth and FLOP arithmetic.
Cluster TestCluster(int nodes, int per_node, int nics = 1) {
  auto c = ClusterFromJsonText(absl::StrFormat(R"({
    "device_kinds": {"T": {"peak_tflops": 100, "memory_gib": 80, "hbm_gbps": 1000,
                           "attention_efficiency": 0.5, "intra_node_gbps": 100}},
    "nodes": [{"kind": "T", "devices": %d, "nics": %d, "nic_gbps": 10, "count": %d}],
    "latency_us": {"intra_node": 0, "inter_node": 0}})",
                                               per_node, nics, nodes));
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

Plan OneGroup(int ranks) {
  auto plan = SymmetricPlan(ranks, 4, 2, ranks);
  EXPECT_TRUE(plan.ok());
  return *plan;
}

constexpr double kPairs = 4096.0 * 4097.0 / 2.0;  // causal, per head
constexpr double kSustained = 50e12;

TEST(CostModelTest, WorkloadFlopsAndParameters) {
  const Workload w = TestWorkload();
  EXPECT_DOUBLE_EQ(w.VisiblePairs(), kPairs);
  EXPECT_DOUBLE_EQ(w.ForwardFlops(), 4.0 * 64 * kPairs * 4);
  EXPECT_DOUBLE_EQ(w.BackwardFlops(), 2.5 * w.ForwardFlops());
  Workload full = w;
  full.causal = false;
  EXPECT_DOUBLE_EQ(full.VisiblePairs(), 4096.0 * 4096.0);
  // 2 x (q,o: 2*256*4*64 + k,v: 2*256*2*64 + mlp: 3*256*512) + 2*1000*256.
  EXPECT_DOUBLE_EQ(w.model.Parameters(), 2 * (131072 + 65536 + 393216) + 512000);
  EXPECT_DOUBLE_EQ(IdealSeconds(TestCluster(1, 4), w), 3.5 * w.ForwardFlops() / (4 * kSustained));
}

TEST(CostModelTest, YardsticksAndTheDenseRestOfTheLayer) {
  const Workload w = TestWorkload();  // hidden 256, heads 4 / 2 of 64, ffn 512
  const Cluster c = TestCluster(1, 4);
  // Datasheet peak 100 TFLOP/s, sustained 50: the hardware bound is half the model bound.
  EXPECT_DOUBLE_EQ(HardwareBoundSeconds(c, w), 0.5 * IdealSeconds(c, w));
  // 2 x (projections 256 x (2 x 4 + 2 x 2) x 64 + MLP 3 x 256 x 512).
  EXPECT_DOUBLE_EQ(DenseForwardFlopsPerToken(w.model), 2.0 * (256 * 12 * 64 + 3 * 256 * 512));
  // Equal shares on 4 equal devices: a quarter of the row each, forward + 2x backward, and
  // the forward again since the memory model checkpoints activations (the default): the
  // recompute is priced. The GEMMs run at attention_efficiency where the kind gives no
  // gemm_efficiency.
  ASSERT_TRUE(w.budget.activation_checkpointing);
  const double per_rank = 4096 / 4.0 * 4 * DenseForwardFlopsPerToken(w.model) / kSustained;
  EXPECT_DOUBLE_EQ(DenseLayerSeconds(c, w, OneGroup(4)), per_rank);
  Workload no_recompute = w;
  no_recompute.budget.activation_checkpointing = false;
  EXPECT_DOUBLE_EQ(DenseLayerSeconds(c, no_recompute, OneGroup(4)), 0.75 * per_rank);
  Cluster gemm = c;
  gemm.kinds[0].gemm_efficiency = 0.25;  // half the attention's 0.5
  EXPECT_DOUBLE_EQ(DenseLayerSeconds(gemm, w, OneGroup(4)), 2 * per_rank);
  // Uneven token weights: the rank holding the most tokens sets the time.
  Plan uneven = OneGroup(4);
  uneven.groups[0].token_weights = {2, 1, 1, 0};
  EXPECT_DOUBLE_EQ(DenseLayerSeconds(c, w, uneven), 2 * per_rank);
}

TEST(CostModelTest, PresetsMatchPublishedShapes) {
  auto m70 = ModelPreset("llama-70b");
  ASSERT_TRUE(m70.ok());
  EXPECT_EQ(m70->heads_q, 64);
  EXPECT_EQ(m70->heads_kv, 8);
  EXPECT_NEAR(m70->Parameters() / 1e9, 69, 1.5);
  auto m7 = ModelPreset("LLaMA-7B");
  ASSERT_TRUE(m7.ok());
  EXPECT_NEAR(m7->Parameters() / 1e9, 6.7, 0.2);
  EXPECT_NEAR(ModelPreset("llama-13b")->Parameters() / 1e9, 13.0, 0.3);
  EXPECT_NEAR(ModelPreset("llama-3b")->Parameters() / 1e9, 3.6, 0.4);
  EXPECT_THAT(ModelPreset("gpt-5").status().message(), HasSubstr("llama-70b"));
}

TEST(CostModelTest, ModelFromJson) {
  auto m = ModelFromJsonText(
      R"({"name": "m", "layers": 4, "heads_q": 16, "heads_kv": 4, "head_dim": 64,
          "hidden": 1024})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->ffn_hidden, 4096);
  EXPECT_EQ(m->dtype_bytes, 2);
  EXPECT_THAT(ModelFromJsonText(R"({"layers": 4})").status().message(),
              HasSubstr("lacks the field \"heads_q\""));
  EXPECT_THAT(ModelFromJsonText(R"({"layers": 4, "heads_q": 6, "heads_kv": 4,
      "head_dim": 64, "hidden": 1024})")
                  .status()
                  .message(),
              HasSubstr("multiple of heads_kv"));
  EXPECT_FALSE(ModelFromJsonText("[").ok());
}

TEST(CostModelTest, OneDeviceIsPureCompute) {
  const Cluster c = TestCluster(1, 1);
  auto cost = EvaluatePlan(c, TestWorkload(), OneGroup(1));
  ASSERT_TRUE(cost.ok()) << cost.status();
  const double fwd = 4.0 * 64 * kPairs * 4 / kSustained;
  EXPECT_DOUBLE_EQ(cost->forward_seconds, fwd);
  EXPECT_DOUBLE_EQ(cost->backward_seconds, 2.5 * fwd);
  EXPECT_DOUBLE_EQ(cost->ranks[0].tokens, 4096);
}

TEST(CostModelTest, UlyssesPairOverNvlink) {
  const Cluster c = TestCluster(1, 2);
  auto cost = EvaluatePlan(c, TestWorkload(), OneGroup(2));
  ASSERT_TRUE(cost.ok()) << cost.status();
  // Each rank holds 2048 tokens, owns 2 query heads and 1 KV head after the all-to-all.
  const double qkv = 2048.0 * (2 + 2 * 1) * 64 * 2;  // bytes to the peer: q, k, v
  const double q = 2048.0 * 2 * 64 * 2;              // out (fwd) or dout (bwd)
  const double compute = 4.0 * 64 * kPairs * 2 / kSustained;
  EXPECT_DOUBLE_EQ(cost->forward_seconds, qkv / 100e9 + compute + q / 100e9);
  EXPECT_DOUBLE_EQ(cost->backward_seconds, q / 100e9 + 2.5 * compute + qkv / 100e9);
}

TEST(CostModelTest, RingOfTwoAcrossASlowLink) {
  const Cluster c = TestCluster(2, 1);
  auto plan = SymmetricPlan(2, 4, 2, 1);
  ASSERT_TRUE(plan.ok());
  auto cost = EvaluatePlan(c, TestWorkload(), *plan);
  ASSERT_TRUE(cost.ok()) << cost.status();
  // Block: 2048 tokens x 2 KV heads x (K, V) x 64 x 2 bytes over 10 GB/s.
  const double transfer = 2048.0 * 2 * 2 * 64 * 2 / 10e9;
  const double half_compute = 4.0 * 64 * kPairs * 0.5 * 4 / kSustained / 2;  // one block
  ASSERT_GT(transfer, half_compute);  // the link is the bottleneck
  EXPECT_NEAR(cost->forward_seconds, transfer + half_compute, 1e-12);
  EXPECT_NEAR(cost->backward_seconds, 2 * transfer + 2.5 * half_compute, 1e-12);
  // The overlap bound hides the transfer behind nothing more than the whole compute.
  auto bound = EvaluatePlan(c, TestWorkload(), *plan, RingPricing::kOverlapBound);
  EXPECT_NEAR(bound->forward_seconds, half_compute + std::max(half_compute, transfer), 1e-12);
}

TEST(CostModelTest, SharedNicDoublesRingTransfer) {
  const Cluster c = TestCluster(2, 2);  // one NIC per node
  auto plan = SymmetricPlan(4, 4, 2, 1);
  ASSERT_TRUE(plan.ok());
  auto local = EvaluatePlan(c, TestWorkload(), *plan);  // ring 0 1 2 3: one flow per NIC
  plan->ring_order = {0, 2, 1, 3};                      // every hop crosses; two per NIC
  auto crossed = EvaluatePlan(c, TestWorkload(), *plan);
  ASSERT_TRUE(local.ok() && crossed.ok());
  const double unit = 4096.0 * 2 * 2 * 64 * 2 / 10e9 * 0.75;  // 3 of 4 blocks arrive
  EXPECT_NEAR(local->ranks[2].ring_transfer_forward, unit, 1e-12);
  EXPECT_NEAR(crossed->ranks[2].ring_transfer_forward, 2 * unit, 1e-12);
  EXPECT_GT(crossed->forward_seconds, local->forward_seconds);
}

TEST(CostModelTest, MemoryAccountByHand) {
  const Cluster c = TestCluster(1, 1);
  const Workload w = TestWorkload();
  // activations: 1000 tokens x 256 x 2 bytes x 2 layers + 34 x 256 x 1000 (working set);
  // attention: 2 x 2000 x (2*2 + 2*1) x 64 x 2; ring: 2 x 2 x 2000 x 2*1 x 64 x 2;
  // staging: 2 x 1000 x (4 + 2*2) x 64 x 2.
  const double expected = 1e9 + 1024000 + 8704000 + 3072000 + 2048000 + 2048000;
  EXPECT_DOUBLE_EQ(RankMemoryBytes(c, w, 1000, 2000, 2, 1, 2000, true), expected);
  EXPECT_DOUBLE_EQ(RankMemoryBytes(c, w, 1000, 2000, 2, 1, 2000, false), expected - 2048000);
  Workload no_ckpt = w;
  no_ckpt.budget.activation_checkpointing = false;
  EXPECT_DOUBLE_EQ(RankMemoryBytes(c, no_ckpt, 1000, 2000, 2, 1, 2000, false),
                   expected - 2048000 - 1024000 - 8704000 + 2 * 8704000);
  Workload zero3 = w;
  zero3.budget.model_state_bytes = -1;
  EXPECT_DOUBLE_EQ(ModelStateBytesPerDevice(TestCluster(1, 4), zero3),
                   16.0 * w.model.Parameters() / 4);
  EXPECT_DOUBLE_EQ(UsableMemoryBytes(c, w, 0), 0.9 * 80 * 1024.0 * 1024 * 1024);
}

TEST(CostModelTest, MismatchedPlansAreRejected) {
  const Cluster c = TestCluster(1, 2);
  EXPECT_THAT(EvaluatePlan(c, TestWorkload(), OneGroup(1)).status().message(),
              HasSubstr("the plan has 1 ranks but the cluster has 2 devices"));
  auto plan = SymmetricPlan(2, 8, 2, 2);
  EXPECT_THAT(EvaluatePlan(c, TestWorkload(), *plan).status().message(),
              HasSubstr("query/KV heads"));
}

}  // namespace
}  // namespace hsap
