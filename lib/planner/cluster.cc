#include "lib/planner/cluster.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lib/sched/json_text.h"

namespace hsap {
namespace {

using nlohmann::json;

constexpr double kGB = 1e9;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("cluster: ", message));
}

// Reads an optional positive number field; `scale` converts the JSON unit to SI.
absl::Status ReadPositive(const json& object, const char* name, const std::string& where,
                          double scale, bool required, double* out, bool allow_zero = false) {
  auto it = object.find(name);
  if (it == object.end()) {
    if (required) return Invalid(absl::StrCat(where, " lacks the field \"", name, "\""));
    return absl::OkStatus();
  }
  if (!it->is_number()) return Invalid(absl::StrCat(where, ".", name, " must be a number"));
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < 0 || (v == 0 && !allow_zero)) {
    return Invalid(absl::StrCat(where, ".", name, " = ", v, " must be finite and ",
                                allow_zero ? ">= 0" : "> 0"));
  }
  *out = v * scale;
  return absl::OkStatus();
}

absl::StatusOr<int> ReadCount(const json& object, const char* name, const std::string& where,
                              int default_value, int max_value) {
  auto it = object.find(name);
  if (it == object.end()) return default_value;
  if (!it->is_number_integer()) {
    return Invalid(absl::StrCat(where, ".", name, " must be an integer"));
  }
  const int64_t v = it->get<int64_t>();
  if (v < 1 || v > max_value) {
    return Invalid(absl::StrCat(where, ".", name, " = ", v, " must be in [1, ", max_value, "]"));
  }
  return static_cast<int>(v);
}

}  // namespace

const std::vector<DeviceKind>& BuiltinDeviceKinds() {
  // Datasheet figures (dense, no sparsity); see docs/cost_model.md for sources and for the
  // attention efficiencies, which are calibration defaults, not datasheet figures.
  auto kind = [](const char* name, double peak, double memory, double hbm, double efficiency,
                 double intra_node) {
    DeviceKind k;
    k.name = name;
    k.peak_flops = peak;
    k.memory_bytes = memory;
    k.hbm_bytes_per_s = hbm;
    k.attention_efficiency = efficiency;
    k.intra_node_bytes_per_s = intra_node;
    return k;
  };
  static const std::vector<DeviceKind> kinds = {
      kind("H100", 989.4e12, 80 * kGiB, 3350 * kGB, 0.60, 450 * kGB),
      kind("A100", 312e12, 80 * kGiB, 2039 * kGB, 0.60, 300 * kGB),
      kind("H200", 989.4e12, 140 * kGiB, 4800 * kGB, 0.60, 450 * kGB),
      kind("A800", 312e12, 80 * kGiB, 2039 * kGB, 0.60, 200 * kGB),
      kind("L40S", 362.05e12, 48 * kGiB, 864 * kGB, 0.50, 32 * kGB),
  };
  return kinds;
}

double Cluster::LinkBandwidth(int a, int b) const {
  if (SameNode(a, b)) {
    return std::min(kind_of(a).intra_node_bytes_per_s, kind_of(b).intra_node_bytes_per_s);
  }
  return std::min(nodes[devices[a].node].nic_bytes_per_s, nodes[devices[b].node].nic_bytes_per_s);
}

int Cluster::NicOf(int device) const {
  const Device& d = devices[device];
  return d.local_index % nodes[d.node].nics;
}

double Cluster::TotalAttentionFlops() const {
  double total = 0;
  for (int d = 0; d < size(); ++d) total += kind_of(d).AttentionFlops();
  return total;
}

std::string Cluster::Summary() const {
  std::vector<int> count(kinds.size(), 0);
  for (const Device& d : devices) ++count[d.kind];
  std::vector<std::string> parts;
  for (size_t k = 0; k < kinds.size(); ++k) {
    if (count[k] > 0) parts.push_back(absl::StrCat(count[k], "x", kinds[k].name));
  }
  return absl::StrJoin(parts, " + ");
}

PortMap::PortMap(const Cluster& cluster) : cluster_(&cluster) {
  const int n = cluster.size();
  nic_base_.resize(cluster.nodes.size());
  for (size_t i = 0; i < cluster.nodes.size(); ++i) {
    nic_base_[i] = num_nics_;
    num_nics_ += cluster.nodes[i].nics;
  }
  bandwidth_.resize(2 * n + 2 * num_nics_);
  for (int d = 0; d < n; ++d) {
    bandwidth_[d] = bandwidth_[n + d] = cluster.kind_of(d).intra_node_bytes_per_s;
  }
  for (size_t i = 0; i < cluster.nodes.size(); ++i) {
    for (int k = 0; k < cluster.nodes[i].nics; ++k) {
      bandwidth_[2 * n + nic_base_[i] + k] = cluster.nodes[i].nic_bytes_per_s;
      bandwidth_[2 * n + num_nics_ + nic_base_[i] + k] = cluster.nodes[i].nic_bytes_per_s;
    }
  }
}

std::pair<int, int> PortMap::Ports(int src, int dst) const {
  const int n = cluster_->size();
  if (cluster_->SameNode(src, dst)) return {src, n + dst};
  const int out = 2 * n + nic_base_[cluster_->devices[src].node] + cluster_->NicOf(src);
  const int in = 2 * n + num_nics_ + nic_base_[cluster_->devices[dst].node] + cluster_->NicOf(dst);
  return {out, in};
}

absl::StatusOr<Cluster> ClusterFromJson(const json& j) {
  if (!j.is_object()) return Invalid("the description must be a JSON object");
  Cluster cluster;
  if (auto it = j.find("name"); it != j.end() && it->is_string()) {
    cluster.name = it->get<std::string>();
  }
  // Kinds available: the built-in ones, overridden or extended by "device_kinds".
  std::map<std::string, DeviceKind> available;
  for (const DeviceKind& k : BuiltinDeviceKinds()) available[k.name] = k;
  if (auto it = j.find("device_kinds"); it != j.end()) {
    if (!it->is_object()) return Invalid("device_kinds must be an object keyed by kind name");
    for (auto& [name, spec] : it->items()) {
      const std::string where = absl::StrCat("device_kinds.", name);
      if (!spec.is_object()) return Invalid(absl::StrCat(where, " must be an object"));
      DeviceKind kind;
      if (auto b = available.find(name); b != available.end()) kind = b->second;
      kind.name = name;
      const bool builtin = available.count(name) > 0;
      for (auto [field, scale, out] :
           {std::tuple{"peak_tflops", 1e12, &kind.peak_flops},
            std::tuple{"memory_gib", kGiB, &kind.memory_bytes},
            std::tuple{"hbm_gbps", kGB, &kind.hbm_bytes_per_s},
            std::tuple{"attention_efficiency", 1.0, &kind.attention_efficiency},
            std::tuple{"intra_node_gbps", kGB, &kind.intra_node_bytes_per_s}}) {
        if (auto s = ReadPositive(spec, field, where, scale, !builtin, out); !s.ok()) return s;
      }
      if (spec.contains("attention_efficiency")) kind.efficiency_given = true;
      if (kind.attention_efficiency > 1) {
        return Invalid(absl::StrCat(where, ".attention_efficiency = ", kind.attention_efficiency,
                                    " must be in (0, 1]"));
      }
      available[name] = kind;
    }
  }
  auto nodes = j.find("nodes");
  if (nodes == j.end() || !nodes->is_array() || nodes->empty()) {
    return Invalid("\"nodes\" must be a non-empty array of {kind, devices, nics, nic_gbps}");
  }
  std::map<std::string, int> kind_index;
  for (size_t n = 0; n < nodes->size(); ++n) {
    const json& spec = (*nodes)[n];
    const std::string where = absl::StrCat("nodes[", n, "]");
    if (!spec.is_object()) return Invalid(absl::StrCat(where, " must be an object"));
    auto kind_it = spec.find("kind");
    if (kind_it == spec.end() || !kind_it->is_string()) {
      return Invalid(absl::StrCat(where, " lacks the string field \"kind\""));
    }
    const std::string kind_name = kind_it->get<std::string>();
    auto found = available.find(kind_name);
    if (found == available.end()) {
      std::vector<std::string> known;
      for (auto& [name, unused] : available) known.push_back(name);
      return Invalid(absl::StrCat(where, " uses unknown device kind \"", kind_name,
                                  "\"; known kinds: ", absl::StrJoin(known, ", "),
                                  " (or describe it under \"device_kinds\")"));
    }
    if (found->second.memory_bytes <= 0) {
      return Invalid(absl::StrCat("device kind ", kind_name, " has no memory"));
    }
    if (!kind_index.count(kind_name)) {
      kind_index[kind_name] = static_cast<int>(cluster.kinds.size());
      cluster.kinds.push_back(found->second);
    }
    auto devices = ReadCount(spec, "devices", where, 8, 1024);
    if (!devices.ok()) return devices.status();
    auto nics = ReadCount(spec, "nics", where, 1, 64);
    if (!nics.ok()) return nics.status();
    auto count = ReadCount(spec, "count", where, 1, 1 << 16);
    if (!count.ok()) return count.status();
    double nic_bw = 0;
    const bool single = *count == 1 && nodes->size() == 1;
    if (auto s = ReadPositive(spec, "nic_gbps", where, kGB, !single, &nic_bw); !s.ok()) return s;
    for (int c = 0; c < *count; ++c) {
      Node node;
      node.kind = kind_index[kind_name];
      node.nics = *nics;
      node.nic_bytes_per_s = nic_bw > 0 ? nic_bw : 1;
      const int node_id = static_cast<int>(cluster.nodes.size());
      for (int d = 0; d < *devices; ++d) {
        node.devices.push_back(cluster.size());
        cluster.devices.push_back({node.kind, node_id, d});
      }
      cluster.nodes.push_back(std::move(node));
      if (cluster.size() > (1 << 20)) return Invalid("more than 2^20 devices");
    }
  }
  if (auto it = j.find("latency_us"); it != j.end()) {
    if (!it->is_object()) return Invalid("latency_us must be an object");
    if (auto s = ReadPositive(*it, "intra_node", "latency_us", 1e-6, false,
                              &cluster.intra_node_latency_s, true);
        !s.ok()) {
      return s;
    }
    if (auto s = ReadPositive(*it, "inter_node", "latency_us", 1e-6, false,
                              &cluster.inter_node_latency_s, true);
        !s.ok()) {
      return s;
    }
  }
  return cluster;
}

bool NamesKind(absl::string_view device_name, absl::string_view kind_name) {
  if (kind_name.empty()) return false;
  const auto is_word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)); };
  for (size_t at = device_name.find(kind_name); at != absl::string_view::npos;
       at = device_name.find(kind_name, at + 1)) {
    const size_t end = at + kind_name.size();
    if ((at == 0 || !is_word_char(device_name[at - 1])) &&
        (end == device_name.size() || !is_word_char(device_name[end]))) {
      return true;
    }
  }
  return false;
}

absl::StatusOr<DeviceDescription> DescribeNamedDevice(absl::string_view device_name,
                                                      uint64_t memory_bytes, int node,
                                                      int devices_on_node) {
  std::vector<std::string> kinds;
  for (const DeviceKind& kind : BuiltinDeviceKinds()) {
    kinds.push_back(kind.name);
    if (NamesKind(device_name, kind.name)) {
      DeviceDescription d;
      d.kind = kind.name;
      d.memory_gib = static_cast<double>(memory_bytes) / kGiB;
      d.node = node;
      d.nics = devices_on_node;
      d.nic_gbps = 50;
      return d;
    }
  }
  return absl::UnimplementedError(
      absl::StrCat("device \"", device_name, "\" is none of the built-in kinds (",
                   absl::StrJoin(kinds, ", "), "): describe it by hand (hsapPlanDevice_t)"));
}

absl::StatusOr<Cluster> ClusterFromDevices(const std::vector<DeviceDescription>& devices) {
  if (devices.empty()) return Invalid("no device described");
  json kinds = json::object(), nodes = json::array();
  std::map<std::string, size_t> kind_of;  // kind -> the first rank describing it
  std::map<int, size_t> node_seen;        // node -> the last rank in it
  auto same_kind = [](const DeviceDescription& a, const DeviceDescription& b) {
    return a.peak_tflops == b.peak_tflops && a.memory_gib == b.memory_gib &&
           a.hbm_gbps == b.hbm_gbps && a.attention_efficiency == b.attention_efficiency &&
           a.intra_node_gbps == b.intra_node_gbps;
  };
  for (size_t r = 0; r < devices.size(); ++r) {
    const DeviceDescription& d = devices[r];
    const std::string who = absl::StrCat("rank ", r, " (", d.kind, ", node ", d.node, ")");
    if (d.kind.empty()) return Invalid(absl::StrCat("rank ", r, " names no device kind"));
    if (auto k = kind_of.find(d.kind); k == kind_of.end()) {
      kind_of[d.kind] = r;
      json spec = json::object();
      for (auto [field, value] : {std::pair{"peak_tflops", d.peak_tflops},
                                  {"memory_gib", d.memory_gib},
                                  {"hbm_gbps", d.hbm_gbps},
                                  {"attention_efficiency", d.attention_efficiency},
                                  {"intra_node_gbps", d.intra_node_gbps}}) {
        if (value != 0) spec[field] = value;
      }
      kinds[d.kind] = spec;
    } else if (!same_kind(d, devices[k->second])) {
      return Invalid(absl::StrCat(who, " describes its kind otherwise than rank ", k->second));
    }
    auto seen = node_seen.find(d.node);
    if (seen != node_seen.end() && seen->second != r - 1) {
      return Invalid(absl::StrCat(who, ": the ranks of a node must be consecutive (rank ",
                                  seen->second, " is in node ", d.node, ")"));
    }
    node_seen[d.node] = r;
    if (seen != node_seen.end()) {
      const DeviceDescription& first = devices[r - 1];
      if (first.kind != d.kind || first.nics != d.nics || first.nic_gbps != d.nic_gbps) {
        return Invalid(absl::StrCat(who, " differs from rank ", r - 1,
                                    " of its node in kind or NICs (a node holds one kind)"));
      }
      json& node = nodes.back();
      node["devices"] = node["devices"].get<int>() + 1;
      continue;
    }
    json node = {{"kind", d.kind}, {"devices", 1}, {"nics", d.nics > 0 ? d.nics : 1}};
    if (d.nic_gbps > 0) node["nic_gbps"] = d.nic_gbps;
    nodes.push_back(node);
  }
  json j = {{"name", "described"}, {"device_kinds", kinds}, {"nodes", nodes}};
  return ClusterFromJson(j);
}

absl::StatusOr<Cluster> ClusterFromJsonText(absl::string_view text) {
  absl::StatusOr<json> j = ParseJsonText(text);
  if (!j.ok()) return Invalid(std::string(j.status().message()));
  return ClusterFromJson(*j);
}

absl::StatusOr<Cluster> LoadCluster(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open cluster file ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto cluster = ClusterFromJsonText(buffer.str());
  if (!cluster.ok()) {
    return absl::Status(cluster.status().code(),
                        absl::StrCat(path, ": ", cluster.status().message()));
  }
  if (cluster->name.empty()) cluster->name = path;
  return cluster;
}

PortClock::PortClock(const Cluster& cluster) : cluster_(cluster), map_(cluster) {
  free_.assign(map_.size(), 0.0);
}

double PortClock::Transfer(int src, int dst, double bytes, double ready, double* start) {
  auto [a, b] = map_.Ports(src, dst);
  const double begin = std::max({ready, free_[a], free_[b]});
  // NCCL's protocol: a fixed cost of half_bandwidth_bytes and link_efficiency of the link.
  const double wire = (bytes + cluster_.half_bandwidth_bytes) / cluster_.link_efficiency;
  const double end = begin + wire / std::min(map_.bandwidth(a), map_.bandwidth(b));
  free_[a] = begin + wire / map_.bandwidth(a);
  free_[b] = begin + wire / map_.bandwidth(b);
  *start = begin;
  return end + cluster_.Latency(src, dst);
}

}  // namespace hsap
