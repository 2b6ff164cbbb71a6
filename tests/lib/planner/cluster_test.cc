#include "lib/planner/cluster.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

std::string ClusterPath(const std::string& name) {
  return std::string(HSAP_SOURCE_DIR) + "/clusters/" + name + ".json";
}

TEST(ClusterTest, TestbedHasTheDocumentedLinks) {
  auto c = LoadCluster(ClusterPath("testbed_8h100_8a100"));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->size(), 16);
  EXPECT_EQ(c->Summary(), "8xH100 + 8xA100");
  EXPECT_EQ(c->kind_of(0).name, "H100");
  EXPECT_EQ(c->kind_of(15).name, "A100");
  EXPECT_DOUBLE_EQ(c->LinkBandwidth(0, 7), 450e9);
  EXPECT_DOUBLE_EQ(c->LinkBandwidth(8, 15), 300e9);
  EXPECT_DOUBLE_EQ(c->LinkBandwidth(0, 8), 25e9);
  EXPECT_DOUBLE_EQ(c->Latency(0, 8), 10e-6);
  EXPECT_DOUBLE_EQ(c->kind_of(0).peak_flops, 989.4e12);
}

TEST(ClusterTest, EveryShippedClusterLoads) {
  const std::pair<const char*, int> expected[] = {
      {"testbed_8h100_8a100", 16},      {"mix32_h100_a100", 32},    {"mix32_h100_l40s", 32},
      {"mix64_h100_a100_a800", 64},     {"mix64_h100_l40s", 64},    {"mix128_h100_a100", 128},
      {"mix128_four_kinds", 128},       {"flops_48h100_8a100", 56}, {"flops_160a100", 160},
      {"flops_52h100_4a100_8a800", 64}, {"flops_176a100", 176},     {"scale1024_four_kinds", 1024},
      {"scale1024_h100_a100", 1024}};
  for (auto [name, size] : expected) {
    auto c = LoadCluster(ClusterPath(name));
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    EXPECT_EQ(c->size(), size) << name;
  }
}

TEST(ClusterTest, FlopMatchedPairsMatch) {
  // Peak dense bf16: the two sides of a pair within 1 % of each other.
  auto peak = [](const std::string& name) {
    auto c = LoadCluster(ClusterPath(name));
    double total = 0;
    for (int d = 0; d < c->size(); ++d) total += c->kind_of(d).peak_flops;
    return total;
  };
  EXPECT_NEAR(peak("flops_48h100_8a100") / peak("flops_160a100"), 1.0, 0.01);
  EXPECT_NEAR(peak("flops_52h100_4a100_8a800") / peak("flops_176a100"), 1.0, 0.01);
}

TEST(ClusterTest, CustomKindsAndPorts) {
  auto c = ClusterFromJsonText(R"({
    "device_kinds": {"X1": {"peak_tflops": 100, "memory_gib": 16, "hbm_gbps": 1000,
                            "attention_efficiency": 0.5, "intra_node_gbps": 64}},
    "nodes": [{"kind": "X1", "devices": 4, "nics": 2, "nic_gbps": 10, "count": 2}]})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->size(), 8);
  EXPECT_DOUBLE_EQ(c->kind_of(5).AttentionFlops(), 50e12);
  EXPECT_DOUBLE_EQ(c->TotalAttentionFlops(), 8 * 50e12);
  EXPECT_DOUBLE_EQ(c->LinkBandwidth(0, 3), 64e9);
  EXPECT_DOUBLE_EQ(c->LinkBandwidth(0, 4), 10e9);
  EXPECT_EQ(c->NicOf(5), 1);
  const PortMap ports(*c);
  // Intra-node flows use device ports; devices 0 and 2 share NIC 0 of node 0.
  EXPECT_EQ(ports.Ports(0, 1), ports.Ports(0, 1));
  EXPECT_NE(ports.Ports(0, 1).first, ports.Ports(0, 4).first);
  EXPECT_EQ(ports.Ports(0, 4).first, ports.Ports(2, 5).first);
  EXPECT_NE(ports.Ports(0, 4).first, ports.Ports(1, 5).first);
  EXPECT_DOUBLE_EQ(ports.bandwidth(ports.Ports(0, 4).second), 10e9);
}

TEST(ClusterTest, FromDevicesGroupsConsecutiveRanksIntoNodes) {
  DeviceDescription h100{"H100"}, x1{"X1", 100, 16, 1000, 0.5, 64};
  h100.nic_gbps = x1.nic_gbps = 25;
  x1.node = 1;
  x1.nics = 2;
  auto c = ClusterFromDevices({h100, h100, x1, x1, x1});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->size(), 5);
  ASSERT_EQ(c->nodes.size(), 2u);
  EXPECT_EQ(c->nodes[1].devices, (std::vector<int>{2, 3, 4}));
  EXPECT_EQ(c->nodes[1].nics, 2);
  EXPECT_EQ(c->kind_of(0).name, "H100");
  EXPECT_DOUBLE_EQ(c->kind_of(0).peak_flops, BuiltinDeviceKinds()[0].peak_flops);  // built in
  EXPECT_DOUBLE_EQ(c->kind_of(3).AttentionFlops(), 50e12);
  EXPECT_DOUBLE_EQ(c->LinkBandwidth(1, 2), 25e9);
  EXPECT_FALSE(c->SameNode(1, 2));

  DeviceDescription other = x1;
  other.peak_tflops = 200;
  EXPECT_THAT(ClusterFromDevices({x1, other}).status().message(),
              HasSubstr("rank 1 (X1, node 1) describes its kind otherwise than rank 0"));
  DeviceDescription back = h100;
  EXPECT_THAT(ClusterFromDevices({h100, x1, back}).status().message(),
              HasSubstr("the ranks of a node must be consecutive"));
  DeviceDescription mixed = x1;
  mixed.node = 0;
  EXPECT_THAT(ClusterFromDevices({h100, mixed}).status().message(), HasSubstr("one kind"));
  EXPECT_THAT(ClusterFromDevices({DeviceDescription{"Z9"}}).status().message(), HasSubstr("Z9"));
  EXPECT_FALSE(ClusterFromDevices({}).ok());
}

TEST(ClusterTest, MalformedInputsGiveClearErrors) {
  EXPECT_THAT(ClusterFromJsonText("{\"nodes\": [").status().message(), HasSubstr("not valid JSON"));
  EXPECT_THAT(ClusterFromJsonText("{\"nodes\": [1 2]}").status().message(),
              HasSubstr("not valid JSON at byte 14 (parse error at line 1, column 14"));
  EXPECT_THAT(ClusterFromJsonText("{}").status().message(), HasSubstr("\"nodes\""));
  auto unknown = ClusterFromJsonText(R"({"nodes": [{"kind": "B200", "devices": 8}]})");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("unknown device kind \"B200\""));
  EXPECT_THAT(unknown.status().message(), HasSubstr("H100"));
  auto zero_memory = ClusterFromJsonText(
      R"({"device_kinds": {"H100": {"memory_gib": 0}},
          "nodes": [{"kind": "H100", "devices": 8}]})");
  EXPECT_THAT(zero_memory.status().message(), HasSubstr("memory_gib = 0"));
  auto no_nic = ClusterFromJsonText(R"({"nodes": [{"kind": "H100", "devices": 8, "count": 2}]})");
  EXPECT_THAT(no_nic.status().message(), HasSubstr("nic_gbps"));
  auto bad_count = ClusterFromJsonText(R"({"nodes": [{"kind": "H100", "devices": 0}]})");
  EXPECT_THAT(bad_count.status().message(), HasSubstr("nodes[0].devices"));
  auto partial_kind = ClusterFromJsonText(
      R"({"device_kinds": {"Z": {"peak_tflops": 1}}, "nodes": [{"kind": "Z"}]})");
  EXPECT_THAT(partial_kind.status().message(), HasSubstr("device_kinds.Z lacks"));
  EXPECT_EQ(LoadCluster("/nonexistent/c.json").status().code(), absl::StatusCode::kNotFound);
}

TEST(DescribeNamedDevice, TakesTheKindItsDriverNameNames) {
  constexpr uint64_t kGiB = 1ull << 30;
  struct Case {
    const char* name;
    const char* kind;
  };
  for (const Case& c : {Case{"NVIDIA H100 80GB HBM3", "H100"}, Case{"NVIDIA H200", "H200"},
                        Case{"NVIDIA A100-SXM4-80GB", "A100"},
                        Case{"NVIDIA A800 80GB PCIe", "A800"}, Case{"NVIDIA L40S", "L40S"}}) {
    absl::StatusOr<DeviceDescription> d = DescribeNamedDevice(c.name, 79 * kGiB, 3, 8);
    ASSERT_TRUE(d.ok()) << c.name << ": " << d.status();
    EXPECT_EQ(d->kind, c.kind) << c.name;
    EXPECT_DOUBLE_EQ(d->memory_gib, 79) << c.name;
    EXPECT_EQ(d->node, 3);
    EXPECT_EQ(d->nics, 8);  // one NIC per GPU of the node
    EXPECT_GT(d->nic_gbps, 0);
    EXPECT_EQ(d->peak_tflops, 0);  // the built-in kind's figures
  }
  // A kind's name inside a longer word is not that kind.
  for (const char* name : {"NVIDIA A10", "NVIDIA GH200 480GB", "NVIDIA L40", "NVIDIA A1000"}) {
    absl::StatusOr<DeviceDescription> d = DescribeNamedDevice(name, 24 * kGiB, 0, 1);
    ASSERT_FALSE(d.ok()) << name << " taken as " << d->kind;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_THAT(d.status().message(), HasSubstr(name));
    EXPECT_THAT(d.status().message(), HasSubstr("hsapPlanDevice_t"));
  }
}

TEST(DescribeNamedDevice, NamesKindAsAWholeWord) {
  EXPECT_TRUE(NamesKind("NVIDIA H100 80GB HBM3", "H100"));
  EXPECT_TRUE(NamesKind("NVIDIA A100-SXM4-80GB", "A100"));
  EXPECT_TRUE(NamesKind("H200", "H200"));
  EXPECT_TRUE(NamesKind("NVIDIA H100 NVL", "H100 NVL"));
  EXPECT_TRUE(NamesKind("A1000 A100", "A100"));  // a later whole-word occurrence
  EXPECT_FALSE(NamesKind("NVIDIA H1000", "H100"));
  EXPECT_FALSE(NamesKind("NVIDIA RTX A1000", "A100"));
  EXPECT_FALSE(NamesKind("NVIDIA GH200", "H200"));
  EXPECT_FALSE(NamesKind("NVIDIA H200", ""));
}

TEST(DescribeNamedDevice, DescribedRanksFormACluster) {
  std::vector<DeviceDescription> devices;
  for (int r = 0; r < 4; ++r) {
    absl::StatusOr<DeviceDescription> d =
        DescribeNamedDevice(r < 2 ? "NVIDIA H200" : "NVIDIA A100-SXM4-80GB", 80ull << 30, r / 2, 2);
    ASSERT_TRUE(d.ok()) << d.status();
    devices.push_back(*d);
  }
  absl::StatusOr<Cluster> c = ClusterFromDevices(devices);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kind_of(0).name, "H200");
  EXPECT_EQ(c->kind_of(3).name, "A100");
  EXPECT_FALSE(c->SameNode(1, 2));
}

}  // namespace
}  // namespace hsap
