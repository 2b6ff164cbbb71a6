#include "lib/planner/grouping.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hsap::planner_internal {

GroupingSpace::GroupingSpace(const Cluster& cluster, int heads_q) : cluster_(cluster) {
  const int num_kinds = static_cast<int>(cluster.kinds.size());
  largest_.assign(num_kinds, 0);
  std::vector<int> devices_of_kind(num_kinds, 0);
  for (const Node& node : cluster.nodes) {
    largest_[node.kind] = std::max(largest_[node.kind], static_cast<int>(node.devices.size()));
    devices_of_kind[node.kind] += static_cast<int>(node.devices.size());
  }
  options_.resize(num_kinds);
  for (int k = 0; k < num_kinds; ++k) {
    for (int size = 1; size <= std::min(largest_[k], heads_q); ++size) {
      bool divides_some = false;
      for (const Node& node : cluster.nodes) {
        divides_some |= node.kind == k && static_cast<int>(node.devices.size()) % size == 0;
      }
      if (divides_some) options_[k].push_back(size);
    }
    for (int size = 2 * largest_[k]; size <= std::min(heads_q, devices_of_kind[k]); size *= 2) {
      options_[k].push_back(size);
    }
  }
}

double GroupingSpace::Combinations() const {
  double n = 1;
  for (const auto& o : options_) n *= static_cast<double>(o.size());
  return n;
}

std::vector<int> GroupingSpace::NodeSizedChoice() const {
  std::vector<int> choice(num_kinds(), 0);
  for (int k = 0; k < num_kinds(); ++k) {
    for (size_t i = 0; i < options_[k].size(); ++i) {
      if (options_[k][i] <= largest_[k]) choice[k] = static_cast<int>(i);
    }
  }
  return choice;
}

std::vector<std::pair<int, int>> GroupingSpace::MixedSizes(int kind) const {
  std::vector<std::pair<int, int>> out;
  for (int a : options_[kind]) {
    for (int b : options_[kind]) {
      if (b >= a || a >= largest_[kind]) continue;
      bool cuts = false;
      for (const Node& node : cluster_.nodes) {
        const int m = static_cast<int>(node.devices.size());
        cuts |= node.kind == kind && m > a && (m - a) % b == 0;
      }
      if (cuts) out.push_back({a, b});
    }
  }
  return out;
}

Grouping GroupingSpace::BuildMixed(const std::vector<int>& choice, int kind, int a, int b) const {
  Grouping grouping = Build(choice);
  std::vector<std::string> parts;
  for (int k = 0; k < num_kinds(); ++k) {
    parts.push_back(k == kind ? absl::StrCat(cluster_.kinds[k].name, ":", a, "+", b)
                              : absl::StrCat(cluster_.kinds[k].name, ":", options_[k][choice[k]]));
  }
  grouping.label = absl::StrJoin(parts, " ");
  std::vector<std::vector<int>> groups;
  std::vector<bool> recut(cluster_.devices.size(), false);
  for (const Node& node : cluster_.nodes) {
    const int m = static_cast<int>(node.devices.size());
    if (node.kind != kind || m <= a || (m - a) % b != 0) continue;
    for (int d : node.devices) recut[d] = true;
  }
  // Groups in node order: a recut node's groups replace the groups of its devices.
  for (const std::vector<int>& g : grouping.groups) {
    if (!recut[g[0]]) {
      groups.push_back(g);
      continue;
    }
    // Each recut node once, at its first device (a multi-node group holds whole nodes).
    for (int d : g) {
      const Node& node = cluster_.nodes[cluster_.devices[d].node];
      if (d != node.devices[0]) continue;
      groups.emplace_back(node.devices.begin(), node.devices.begin() + a);
      for (size_t start = a; start < node.devices.size(); start += b) {
        groups.emplace_back(node.devices.begin() + start, node.devices.begin() + start + b);
      }
    }
  }
  grouping.groups = std::move(groups);
  return grouping;
}

Grouping GroupingSpace::Build(const std::vector<int>& choice) const {
  const int num_kinds = this->num_kinds();
  Grouping grouping;
  std::vector<std::string> parts;
  for (int k = 0; k < num_kinds; ++k) {
    parts.push_back(absl::StrCat(cluster_.kinds[k].name, ":", options_[k][choice[k]]));
  }
  grouping.label = absl::StrJoin(parts, " ");
  // Multi-node groups: collect full nodes of the kind until the group is complete.
  std::vector<std::vector<int>> open(num_kinds);
  for (const Node& node : cluster_.nodes) {
    const int m = static_cast<int>(node.devices.size());
    const int want = options_[node.kind][choice[node.kind]];
    if (want > largest_[node.kind] && m == largest_[node.kind]) {
      std::vector<int>& acc = open[node.kind];
      acc.insert(acc.end(), node.devices.begin(), node.devices.end());
      if (static_cast<int>(acc.size()) == want) {
        grouping.groups.push_back(std::move(acc));
        acc.clear();
      }
      continue;
    }
    const int size = std::gcd(std::min(want, m), m);
    for (int start = 0; start < m; start += size) {
      grouping.groups.emplace_back(node.devices.begin() + start,
                                   node.devices.begin() + start + size);
    }
  }
  // Leftover nodes of an incomplete multi-node group become one group each.
  for (int k = 0; k < num_kinds; ++k) {
    for (size_t start = 0; start < open[k].size(); start += largest_[k]) {
      grouping.groups.emplace_back(open[k].begin() + start, open[k].begin() + start + largest_[k]);
    }
  }
  return grouping;
}

std::vector<Grouping> SpanningGroupings(const Cluster& cluster, int heads_q) {
  std::vector<Grouping> out;
  const int n = cluster.size();
  for (int h = 1; h <= std::min(n, heads_q); ++h) {
    if (heads_q % h != 0 || n % h != 0) continue;
    Grouping g;
    g.label = absl::StrCat("span:", h);
    for (int start = 0; start < n; start += h) {
      std::vector<int> group(h);
      std::iota(group.begin(), group.end(), start);
      g.groups.push_back(std::move(group));
    }
    out.push_back(std::move(g));
  }
  return out;
}

}  // namespace hsap::planner_internal
