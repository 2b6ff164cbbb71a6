#include "lib/comm/topology.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/params.h"
#include "base/status_macros.h"

namespace hsap {

Topology Topology::SingleNode(int num_ranks) {
  Topology t;
  t.node_of_rank_.assign(std::max(num_ranks, 0), 0);
  t.num_nodes_ = num_ranks > 0 ? 1 : 0;
  return t;
}

absl::StatusOr<Topology> Topology::FromRankNodes(absl::Span<const int> rank_nodes) {
  Topology t;
  for (size_t r = 0; r < rank_nodes.size(); ++r) {
    if (rank_nodes[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("rankNodes[", r, "] = ", rank_nodes[r],
                       " is negative; give every rank the index (>= 0) of its node"));
    }
  }
  t.node_of_rank_.assign(rank_nodes.begin(), rank_nodes.end());
  std::vector<int> nodes = t.node_of_rank_;
  std::sort(nodes.begin(), nodes.end());
  t.num_nodes_ = static_cast<int>(std::unique(nodes.begin(), nodes.end()) - nodes.begin());
  return t;
}

Topology Topology::FromHostHashes(absl::Span<const uint64_t> host_hashes) {
  Topology t;
  std::unordered_map<uint64_t, int> node_of_hash;
  for (uint64_t h : host_hashes) {
    const auto [it, fresh] = node_of_hash.try_emplace(h, static_cast<int>(node_of_hash.size()));
    t.node_of_rank_.push_back(it->second);
  }
  t.num_nodes_ = static_cast<int>(node_of_hash.size());
  return t;
}

std::vector<int> Topology::RanksOf(int node) const {
  std::vector<int> ranks;
  for (int r = 0; r < num_ranks(); ++r) {
    if (node_of_rank_[r] == node) ranks.push_back(r);
  }
  return ranks;
}

uint64_t HostHash(absl::string_view hostname, absl::string_view boot_id,
                  std::optional<absl::string_view> host_id) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a offset basis
  auto mix = [&h](absl::string_view s) {
    for (unsigned char c : s) {
      h ^= c;
      h *= 0x100000001b3ull;  // FNV prime
    }
  };
  if (host_id.has_value()) {
    mix(*host_id);
  } else {
    mix(hostname);
    mix(boot_id);
  }
  return h;
}

uint64_t LocalHostHash() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  const std::optional<std::string> host_id = GetParam(Param::kNcclHostId);
  return HostHash(name, boot_id,
                  host_id.has_value() ? std::optional<absl::string_view>(*host_id) : std::nullopt);
}

absl::StatusOr<Topology> DiscoverTopology(Transport& transport, uint64_t host_hash,
                                          absl::Span<const int> described, std::string stage) {
  // The fingerprint of the described topology: 0 for none (an FNV-1a hash is never 0 here,
  // as it mixes at least the entry count).
  uint64_t fingerprint = 0;
  if (!described.empty()) {
    fingerprint = HostHash(absl::StrCat(described.size(), ":", absl::StrJoin(described, ",")), "");
  }
  const uint64_t mine[2] = {host_hash, fingerprint};
  std::vector<uint64_t> all(2 * static_cast<size_t>(transport.size()));
  HSAP_RETURN_IF_ERROR(transport.AllGather(mine, all.data(), sizeof(mine), std::move(stage)));
  std::vector<uint64_t> hashes;
  for (int r = 0; r < transport.size(); ++r) {
    hashes.push_back(all[2 * r]);
    if (all[2 * r + 1] != all[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", r, (all[2 * r + 1] == 0 ? " describes no" : " describes a different"),
          " topology (rankNodes) than rank 0", (all[1] == 0 ? ", which describes none" : ""),
          "; every rank must pass the same rankNodes, or all NULL"));
    }
  }
  if (!described.empty()) {
    if (described.size() != static_cast<size_t>(transport.size())) {
      return absl::InvalidArgumentError(absl::StrCat("rankNodes has ", described.size(),
                                                     " entries for ", transport.size(), " ranks"));
    }
    return Topology::FromRankNodes(described);
  }
  return Topology::FromHostHashes(hashes);
}

}  // namespace hsap
