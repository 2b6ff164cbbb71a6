// Stage I of the planner (lib/planner/planner.h): the groupings it searches. A grouping cuts
// the cluster's ranks into head-parallel groups of consecutive ranks; GroupingSpace offers,
// per device kind, the group sizes the search chooses from, and builds the grouping of a
// choice of one size per kind. Internal to the planner.
#ifndef HSAP_LIB_PLANNER_GROUPING_H_
#define HSAP_LIB_PLANNER_GROUPING_H_

#include <string>
#include <utility>
#include <vector>

#include "lib/planner/cluster.h"

namespace hsap::planner_internal {

struct Grouping {
  std::vector<std::vector<int>> groups;  // world ranks, consecutive
  std::string label;                     // "H100:8 A100:4"
};

// Stage I: every combination of per-kind group sizes. Sizes up to the kind's largest node
// (those dividing some node of the kind; a node of m devices with size k is cut into
// groups of gcd(k, m) consecutive devices) keep the all-to-all inside NVLink/PCIe domains;
// multiples of the node size (at most heads_q) join consecutive nodes of the kind, for
// networks fast enough that a cross-node all-to-all beats a longer ring.
class GroupingSpace {
 public:
  // `cluster` must outlive the space.
  GroupingSpace(const Cluster& cluster, int heads_q);

  int num_kinds() const { return static_cast<int>(options_.size()); }
  // The group sizes on offer for `kind`, ascending.
  const std::vector<int>& options(int kind) const { return options_[kind]; }
  // How many choices (one option per kind) there are.
  double Combinations() const;
  // The option index of the largest size within one node, per kind.
  std::vector<int> NodeSizedChoice() const;

  // Pairs (a, b), a > b, of in-node sizes of `kind` (both options of the kind, a below the
  // kind's largest node) for which some node of the kind cuts as a + b + ... + b: the
  // groupings with differing sizes on offer for the kind.
  std::vector<std::pair<int, int>> MixedSizes(int kind) const;

  // Build(choice), but every node of `kind` that allows it cut into one group of `a`
  // devices followed by groups of `b` (a node of 8 as 4 + 2 + 2); its other nodes as in
  // Build. Labelled "H100:4+2 A100:8".
  Grouping BuildMixed(const std::vector<int>& choice, int kind, int a, int b) const;

  // The grouping of `choice` (an option index per kind), labelled "H100:8 A100:4": each
  // node cut into groups of the kind's size, or whole nodes joined into multi-node groups.
  Grouping Build(const std::vector<int>& choice) const;

 private:
  const Cluster& cluster_;
  std::vector<int> largest_;
  std::vector<std::vector<int>> options_;
};

// Stage I, groupings across kinds and nodes: for every head-parallel size h that divides
// both the query heads and the devices, groups of h consecutive ranks, whatever their kinds
// and nodes (a group may hold 4 H100 + 4 A100 of two nodes, as symmetric USP's do); stages
// II and III then give them shares and heads that follow their devices' capability.
// Labelled "span:h".
std::vector<Grouping> SpanningGroupings(const Cluster& cluster, int heads_q);

}  // namespace hsap::planner_internal

#endif  // HSAP_LIB_PLANNER_GROUPING_H_
