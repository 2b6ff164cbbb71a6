// Which ranks of a communicator share a node: the topology K/V delivery is planned on
// (lib/sched/schedule.h relays a row needed by several ranks of another node through one of
// them) and traffic is classified by (intra-node, inter-node).
#ifndef HSAP_LIB_COMM_TOPOLOGY_H_
#define HSAP_LIB_COMM_TOPOLOGY_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace hsap {

class Topology {
 public:
  // All `num_ranks` ranks on node 0.
  static Topology SingleNode(int num_ranks);
  // rank_nodes[r]: the node of rank r (num_ranks entries, each >= 0; node numbers need not
  // be contiguous). InvalidArgument names the first bad entry.
  static absl::StatusOr<Topology> FromRankNodes(absl::Span<const int> rank_nodes);

  int num_ranks() const { return static_cast<int>(node_of_rank_.size()); }
  int node_of(int rank) const { return node_of_rank_[rank]; }
  bool SameNode(int a, int b) const { return node_of_rank_[a] == node_of_rank_[b]; }
  // True when every rank is on one node (delivery is then exactly the direct one).
  bool single_node() const { return num_nodes_ <= 1; }
  // node of every rank, indexed by rank.
  const std::vector<int>& node_of_rank() const { return node_of_rank_; }
  // The ranks of `node` (increasing); empty for a node number no rank has.
  std::vector<int> RanksOf(int node) const;

  friend bool operator==(const Topology&, const Topology&) = default;

 private:
  std::vector<int> node_of_rank_;
  int num_nodes_ = 0;  // distinct node numbers in use
};

}  // namespace hsap

#endif  // HSAP_LIB_COMM_TOPOLOGY_H_
