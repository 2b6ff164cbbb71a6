// hsapPlanCreateForCluster and hsapPlanCreateForComm: the plan every rank gets from its
// communicator is the one the described cluster gives.
#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"

namespace {

using ::testing::HasSubstr;

hsapPlanModel_t SmallModel() {
  hsapPlanModel_t m = HSAP_PLAN_MODEL_INITIALIZER;
  m.seqLen = 32768;
  m.numLayers = 4;
  m.numHeadsQ = 16;
  m.numHeadsKV = 4;
  m.headDim = 64;
  return m;
}

std::string Json(hsapPlan_t plan) {
  size_t size = 0;
  EXPECT_EQ(hsapPlanToJson(plan, nullptr, &size), hsapSuccess);
  std::string text(size, '\0');
  EXPECT_EQ(hsapPlanToJson(plan, text.data(), &size), hsapSuccess);
  return text;
}

// Every rank of a host world of `devices.size()` ranks plans from its own description
// (null: none); returns each rank's plan as JSON, or its error prefixed by "error: ".
// rank_nodes: the communicator's described topology (empty: one node).
std::vector<std::string> PlanOverComm(const std::vector<const hsapPlanDevice_t*>& devices,
                                      const std::vector<int>& rank_nodes = {}) {
  const int n = static_cast<int>(devices.size());
  std::vector<hsapComm_t> comms(n);
  hsapCommConfig_t cc = HSAP_COMM_CONFIG_INITIALIZER;
  if (!rank_nodes.empty()) cc.rankNodes = rank_nodes.data();
  EXPECT_EQ(hsapCommInitAll(comms.data(), n, &cc), hsapSuccess);
  std::vector<std::string> out(n);
  std::vector<std::thread> threads;
  const hsapPlanModel_t model = SmallModel();
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      hsapPlan_t plan = nullptr;
      if (hsapPlanCreateForComm(&plan, comms[r], devices[r], &model) != hsapSuccess) {
        out[r] = std::string("error: ") + hsapGetLastError();
        return;
      }
      out[r] = Json(plan);
      hsapPlanDestroy(plan);
    });
  }
  for (std::thread& t : threads) t.join();
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  return out;
}

hsapPlanDevice_t Device(const char* kind, int node, double nic_gbps) {
  hsapPlanDevice_t d = HSAP_PLAN_DEVICE_INITIALIZER;
  std::strncpy(d.kind, kind, sizeof(d.kind) - 1);
  d.node = node;
  d.nicGbps = nic_gbps;
  return d;
}

TEST(ApiPlanningTest, HostRanksAgreeOnOnePlanOfEveryRank) {
  const std::vector<std::string> plans = PlanOverComm({nullptr, nullptr, nullptr, nullptr});
  for (const std::string& p : plans) {
    EXPECT_THAT(p, Not(HasSubstr("error:")));
    EXPECT_EQ(p, plans[0]);
  }
  EXPECT_THAT(plans[0], HasSubstr("\"num_ranks\": 4"));
}

// The cluster file of host ranks as hsapPlanCreateForComm describes them (nominal "cpu"
// devices, one 1 GB/s NIC per node), nodes of `per_node` ranks.
std::string HostClusterJson(int nodes, int per_node) {
  return R"({"device_kinds": {"cpu": {"peak_tflops": 1, "memory_gib": 16, "hbm_gbps": 100,
                                      "attention_efficiency": 1, "intra_node_gbps": 10}},
             "nodes": [{"kind": "cpu", "devices": )" +
         std::to_string(per_node) + R"(, "nics": 1, "nic_gbps": 1, "count": )" +
         std::to_string(nodes) + "}]}";
}

TEST(ApiPlanningTest, HostRanksTakeTheirNodeFromTheCommunicatorsTopology) {
  const hsapPlanModel_t model = SmallModel();
  hsapPlan_t two_nodes = nullptr, one_node = nullptr;
  ASSERT_EQ(hsapPlanCreateForCluster(&two_nodes, HostClusterJson(2, 2).c_str(), &model),
            hsapSuccess)
      << hsapGetLastError();
  ASSERT_EQ(hsapPlanCreateForCluster(&one_node, HostClusterJson(1, 4).c_str(), &model), hsapSuccess)
      << hsapGetLastError();
  const std::string want = Json(two_nodes);
  ASSERT_NE(want, Json(one_node)) << "the node split must show in the plan for this to test it";
  for (const std::string& p : PlanOverComm({nullptr, nullptr, nullptr, nullptr}, {3, 3, 8, 8})) {
    EXPECT_EQ(p, want);
  }
  // Without a topology: one node.
  for (const std::string& p : PlanOverComm({nullptr, nullptr, nullptr, nullptr})) {
    EXPECT_EQ(p, Json(one_node));
  }
  // A rank that describes itself says its own node; the others take the communicator's.
  const hsapPlanDevice_t cpu1 = [] {
    hsapPlanDevice_t d = Device("cpu", 8, 1);
    d.peakTflops = 1;
    d.memoryGib = 16;
    d.hbmGbps = 100;
    d.attentionEfficiency = 1;
    d.intraNodeGbps = 10;
    d.nics = 1;
    return d;
  }();
  for (const std::string& p : PlanOverComm({nullptr, nullptr, &cpu1, nullptr}, {3, 3, 8, 8})) {
    EXPECT_EQ(p, want);
  }
  hsapPlanDestroy(two_nodes);
  hsapPlanDestroy(one_node);
}

TEST(ApiPlanningTest, DescribedTopologyGivesTheClusterFilesPlan) {
  // Two H100 in node 0, two A100 in node 1, one 25 GB/s NIC each.
  const hsapPlanDevice_t h0 = Device("H100", 0, 25), h1 = h0, a0 = Device("A100", 1, 25), a1 = a0;
  const std::vector<std::string> plans = PlanOverComm({&h0, &h1, &a0, &a1});
  hsapPlan_t expected = nullptr;
  const hsapPlanModel_t model = SmallModel();
  ASSERT_EQ(hsapPlanCreateForCluster(&expected,
                                     R"({"nodes": [
      {"kind": "H100", "devices": 2, "nics": 1, "nic_gbps": 25},
      {"kind": "A100", "devices": 2, "nics": 1, "nic_gbps": 25}]})",
                                     &model),
            hsapSuccess)
      << hsapGetLastError();
  const std::string want = Json(expected);
  for (const std::string& p : plans) EXPECT_EQ(p, want);
  double h100 = 0, a100 = 0;
  ASSERT_EQ(hsapPlanGetRankMemory(expected, 0, &h100), hsapSuccess);
  ASSERT_EQ(hsapPlanGetRankMemory(expected, 2, &a100), hsapSuccess);
  EXPECT_GT(h100, 0);
  EXPECT_GT(a100, 0);
  hsapPlanDestroy(expected);
}

TEST(ApiPlanningTest, BadDescriptionsFailOnEveryRankWithTheReason) {
  // Node 0 is split by node 1: its ranks are not consecutive.
  const hsapPlanDevice_t n0 = Device("H100", 0, 25), n1 = Device("H100", 1, 25);
  for (const std::string& p : PlanOverComm({&n0, &n1, &n0})) {
    EXPECT_THAT(p, HasSubstr("the ranks of a node must be consecutive"));
  }
  // One rank describes nothing usable (an unknown kind without figures): every rank fails.
  const hsapPlanDevice_t odd = Device("TPU", 1, 25);
  for (const std::string& p : PlanOverComm({&n0, &odd})) {
    EXPECT_THAT(p, HasSubstr("error: "));
    EXPECT_THAT(p, HasSubstr("TPU"));
  }
}

TEST(ApiPlanningTest, ModelAndHandleErrors) {
  hsapPlan_t plan = nullptr;
  hsapPlanModel_t m = SmallModel();
  m.seqLen = 0;
  EXPECT_EQ(hsapPlanCreateForCluster(&plan, R"({"nodes": [{"kind": "H100"}]})", &m),
            hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("seqLen"));
  m = SmallModel();
  m.memoryMargin = 1.0;
  EXPECT_EQ(hsapPlanCreateForCluster(&plan, R"({"nodes": [{"kind": "H100"}]})", &m),
            hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("memoryMargin"));
  EXPECT_EQ(hsapPlanCreateForCluster(&plan, nullptr, &m), hsapInvalidArgument);
  EXPECT_EQ(hsapPlanCreateForComm(&plan, nullptr, nullptr, &m), hsapInvalidArgument);
  double bytes = 0;
  EXPECT_EQ(hsapPlanGetRankMemory(nullptr, 0, &bytes), hsapInvalidArgument);
  // A plan built by hand has no predictions: memory 0.
  const int sizes[] = {1}, ranks[] = {0}, counts[] = {2}, heads[] = {0, 1};
  ASSERT_EQ(
      hsapPlanCreate(&plan, 1, 2, 1, 1, sizes, ranks, nullptr, nullptr, counts, heads, nullptr),
      hsapSuccess);
  ASSERT_EQ(hsapPlanGetRankMemory(plan, 0, &bytes), hsapSuccess);
  EXPECT_EQ(bytes, 0);
  hsapPlanDestroy(plan);
}

// How the plan is priced: the engine and the calibration (hsapPlanModel_t.engine,
// .calibrationJson). One H200, 32K causal, 16 heads of 128: the predicted forward is the
// forward FLOPs over the engine's rate.
TEST(ApiPlanningTest, EngineAndCalibrationPriceThePlan) {
  hsapPlanModel_t m = HSAP_PLAN_MODEL_INITIALIZER;
  m.seqLen = 32768;
  m.numLayers = 1;
  m.numHeadsQ = m.numHeadsKV = 16;
  m.headDim = 128;
  const char* one_h200 = R"({"nodes": [{"kind": "H200", "devices": 1}]})";
  const double flops = 4.0 * 128 * 32768.0 * 32769 / 2 * 16;
  auto forward = [&](const hsapPlanModel_t& model) {
    hsapPlan_t plan = nullptr;
    EXPECT_EQ(hsapPlanCreateForCluster(&plan, one_h200, &model), hsapSuccess) << hsapGetLastError();
    double fwd = 0, bwd = 0;
    EXPECT_EQ(hsapPlanGetPredictedTime(plan, &fwd, &bwd), hsapSuccess);
    hsapPlanDestroy(plan);
    return fwd;
  };
  EXPECT_NEAR(forward(m) * 1e3, 7.496, 0.01);  // default: auto = cuDNN, measured 7.50 ms
  m.engine = "jit";
  EXPECT_NEAR(forward(m) * 1e3, 32.04, 0.05);  // measured 32.0 ms
  m.engine = "none";
  EXPECT_NEAR(forward(m), flops / (0.6 * 989.4e12), 1e-9);  // the flat 0.60 of peak
  m.engine = "cudnn";
  m.calibrationJson = R"({"format": "hsap-calibration", "version": 1, "name": "test",
      "rates": [{"device_kind": "H200", "engine": "cudnn", "direction": "forward",
                 "block_tokens": 32768, "head_dim": 128, "tflops": 300},
                {"device_kind": "H200", "engine": "cudnn", "direction": "backward",
                 "block_tokens": 32768, "head_dim": 128, "tflops": 200}]})";
  EXPECT_NEAR(forward(m), flops / 300e12, 1e-9);
  // Refused, naming the field.
  hsapPlan_t plan = nullptr;
  m.calibrationJson = R"({"rates": [{"device_kind": "H200"}]})";
  EXPECT_EQ(hsapPlanCreateForCluster(&plan, one_h200, &m), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("model->calibrationJson: calibration: rates[0]"));
  m.calibrationJson = nullptr;
  m.engine = "tpu";
  EXPECT_EQ(hsapPlanCreateForCluster(&plan, one_h200, &m), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("model->engine: unknown attention engine \"tpu\""));
  // A caller built against the header before these fields: the built-in calibration, auto.
  hsapPlanModel_t old = HSAP_PLAN_MODEL_INITIALIZER;
  old = m;
  old.engine = "tpu";  // beyond the size the caller says it has: never read
  old.size = offsetof(hsapPlanModel_t, engine);
  EXPECT_NEAR(forward(old) * 1e3, 7.496, 0.01);
}

}  // namespace
