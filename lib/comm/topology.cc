#include "lib/comm/topology.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

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

std::vector<int> Topology::RanksOf(int node) const {
  std::vector<int> ranks;
  for (int r = 0; r < num_ranks(); ++r) {
    if (node_of_rank_[r] == node) ranks.push_back(r);
  }
  return ranks;
}

}  // namespace hsap
