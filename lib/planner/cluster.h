// The cluster model: device kinds, nodes, links. Read from JSON (clusters/*.json); the
// figures of the built-in device kinds and their sources are in docs/cost_model.md.
//
// JSON form (bandwidths in GB/s = 1e9 bytes/s, per direction):
//   {
//     "name": "testbed",
//     "device_kinds": {            // optional; overrides or adds to the built-in kinds
//       "H100": {"peak_tflops": 989, "memory_gib": 80, "hbm_gbps": 3350,
//                "attention_efficiency": 0.75, "intra_node_gbps": 450}
//     },
//     "nodes": [                   // each entry describes `count` identical nodes
//       {"kind": "H100", "devices": 8, "nics": 1, "nic_gbps": 25, "count": 1}
//     ],
//     "latency_us": {"intra_node": 3, "inter_node": 10}   // optional
//   }
// Devices are numbered node by node in the order of "nodes"; device i is world rank i.
// A node's devices reach each other at the kind's intra-node bandwidth (NVLink, or PCIe
// for cards without NVLink). Traffic between nodes leaves through the node's NICs: device
// with local index j uses NIC j % nics (rail-optimised wiring), each NIC at nic_gbps per
// direction, shared by every flow that crosses it.
#ifndef HSAP_LIB_PLANNER_CLUSTER_H_
#define HSAP_LIB_PLANNER_CLUSTER_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lib/planner/kernel_rates.h"
#include "nlohmann/json.hpp"

namespace hsap {

struct DeviceKind {
  std::string name;
  double peak_flops = 0;              // dense bf16 FLOP/s (no sparsity)
  double memory_bytes = 0;            // device memory
  double hbm_bytes_per_s = 0;         // memory bandwidth
  double attention_efficiency = 0;    // fraction of peak an attention kernel sustains
  double intra_node_bytes_per_s = 0;  // per direction, device to any peer in its node
  // The calibrated rates of the attention engine that runs on the kind (ApplyCalibration,
  // lib/planner/calibration.h); null: peak x attention_efficiency, flat, both directions.
  std::shared_ptr<const AttentionRates> rates;
  // Fraction of peak the dense GEMMs (projections, MLP) sustain; 0: attention_efficiency.
  double gemm_efficiency = 0;
  // Fraction of the device's compute NCCL's kernels take while a transfer overlaps a ring
  // stage's attention (their SMs over the device's).
  double nccl_compute_fraction = 0;
  // The cluster description set attention_efficiency for this kind: it is priced flat at
  // that efficiency, whatever the calibration says (the site's own word wins).
  bool efficiency_given = false;
  // Sustained attention FLOP/s: peak x efficiency. With calibrated rates, ApplyCalibration
  // sets the efficiency to the engine's forward + backward rate at a 16K block, so that
  // shares in proportion to it follow the engine.
  double AttentionFlops() const { return peak_flops * attention_efficiency; }
  // FLOP/s of a piece of attention of `block_tokens` (BlockTokensOf) at `head_dim`.
  double AttentionRate(bool backward, double block_tokens, int head_dim) const {
    return rates ? rates->Rate(backward, block_tokens, head_dim) : AttentionFlops();
  }
  double GemmFlops() const {
    return peak_flops * (gemm_efficiency > 0 ? gemm_efficiency : attention_efficiency);
  }
};

// The built-in kinds: H100 (SXM5 80GB), H200 (SXM 141GB), A100 (SXM4 80GB), A800 (SXM4 80GB),
// L40S.
const std::vector<DeviceKind>& BuiltinDeviceKinds();

struct Node {
  int kind = 0;              // index into Cluster::kinds
  std::vector<int> devices;  // world ranks of its devices
  int nics = 1;
  double nic_bytes_per_s = 0;  // per NIC, per direction
};

struct Device {
  int kind = 0;
  int node = 0;
  int local_index = 0;  // position inside the node
};

struct Cluster {
  std::string name;
  std::vector<DeviceKind> kinds;  // only the kinds used by some node
  std::vector<Node> nodes;
  std::vector<Device> devices;
  double intra_node_latency_s = 3e-6;
  double inter_node_latency_s = 10e-6;
  // What steps and messages cost beyond FLOPs and bytes (ApplyCalibration; the defaults
  // price none of it): per ring stage, the launch of its kernels and the merge of its
  // partial result; NCCL's protocol efficiency by message size: a message of b bytes over a
  // link of bandwidth B takes (b + half_bandwidth_bytes) / (B x link_efficiency).
  double step_overhead_s = 0;
  // HBM bytes per output element of a forward stage's merge into the running output.
  double merge_bytes_per_element = 0;
  double link_efficiency = 1;
  double half_bandwidth_bytes = 0;
  // What priced the cluster's kinds: engine and calibration per kind (ApplyCalibration);
  // empty: the flat datasheet peak x attention_efficiency.
  std::string pricing;

  int size() const { return static_cast<int>(devices.size()); }
  const DeviceKind& kind_of(int device) const { return kinds[devices[device].kind]; }
  bool SameNode(int a, int b) const { return devices[a].node == devices[b].node; }
  // Per-direction bandwidth of one flow from a to b with no other traffic.
  double LinkBandwidth(int a, int b) const;
  double Latency(int a, int b) const {
    return SameNode(a, b) ? intra_node_latency_s : inter_node_latency_s;
  }
  // The NIC device `d` uses: node's NIC (local_index % nics).
  int NicOf(int device) const;
  // Sum over devices of peak x efficiency.
  double TotalAttentionFlops() const;
  // "8xH100 + 8xA100"
  std::string Summary() const;
};

// The ports traffic flows through: each device's intra-node egress and ingress, each NIC's
// egress and ingress. A flow inside a node uses its source's egress and destination's
// ingress device port; a flow between nodes uses the source NIC's egress and the
// destination NIC's ingress (the devices' rails).
class PortMap {
 public:
  explicit PortMap(const Cluster& cluster);
  int size() const { return static_cast<int>(bandwidth_.size()); }
  double bandwidth(int port) const { return bandwidth_[port]; }
  // (egress port, ingress port) of a flow src -> dst, src != dst.
  std::pair<int, int> Ports(int src, int dst) const;

 private:
  const Cluster* cluster_;
  std::vector<int> nic_base_;
  int num_nics_ = 0;
  std::vector<double> bandwidth_;
};

// First-come-first-served ports (the simulators' link model): a transfer starts when it is
// ready and both its ports are free, lasts bytes / min(bandwidths), holds each port for
// bytes / that port's bandwidth (a fast port carrying a flow limited by a slow peer is free
// again for the next flow), and arrives one latency after it ends. Transfers must be
// issued in the order they become ready.
class PortClock {
 public:
  explicit PortClock(const Cluster& cluster);
  // Returns the arrival time of a transfer src -> dst (src != dst) of `bytes`, ready at
  // `ready`; *start is when it began.
  double Transfer(int src, int dst, double bytes, double ready, double* start);

 private:
  const Cluster& cluster_;
  PortMap map_;
  std::vector<double> free_;
};

// One rank's device as the rank describes it (hsapPlanCreateForComm gathers them). Figures
// of 0 take the built-in kind's; a kind that is not built in needs all of them.
struct DeviceDescription {
  std::string kind;
  double peak_tflops = 0;
  double memory_gib = 0;
  double hbm_gbps = 0;
  double attention_efficiency = 0;
  double intra_node_gbps = 0;
  int node = 0;         // ranks of equal node share a node
  int nics = 0;         // of the node; 0: 1
  double nic_gbps = 0;  // per NIC of the node; needed when there is more than one node
  friend bool operator==(const DeviceDescription&, const DeviceDescription&) = default;
};

// The cluster of ranks described one by one (device i is rank i), through the JSON form
// above so that the same checks apply. A node's ranks must be consecutive and of one kind
// with equal node figures; every rank of a kind must describe it alike. Errors name the rank.
absl::StatusOr<Cluster> ClusterFromDevices(const std::vector<DeviceDescription>& devices);

// Whether `device_name` (the driver's: "NVIDIA H100 80GB HBM3") names the kind `kind_name`
// as a whole word: no letter or digit right before or after it, so an "A10" is no A100, an
// "H1000" no H100, nor a "GH200" an H200. An empty kind name names nothing.
bool NamesKind(absl::string_view device_name, absl::string_view kind_name);

// A GPU described from what its driver says (name, total memory) and where it is: the first
// built-in kind its name names (NamesKind) with that kind's figures, its own memory, and a
// DGX-class node: one 400 Gb/s (50 GB/s per direction) NIC per GPU of the node. Unimplemented, naming the device and the built-in kinds,
// when no kind matches: such a device must be described by hand.
absl::StatusOr<DeviceDescription> DescribeNamedDevice(absl::string_view device_name,
                                                      uint64_t memory_bytes, int node,
                                                      int devices_on_node);

absl::StatusOr<Cluster> ClusterFromJson(const nlohmann::json& json);
absl::StatusOr<Cluster> ClusterFromJsonText(absl::string_view text);
// Reads a file; errors name the path.
absl::StatusOr<Cluster> LoadCluster(const std::string& path);

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_CLUSTER_H_
