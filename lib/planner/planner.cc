#include "lib/planner/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "lib/planner/group_programs.h"
#include "lib/sched/plan_json.h"

namespace hsap {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Grouping {
  std::vector<std::vector<int>> groups;  // world ranks, consecutive
  std::string label;                     // "H100:8 A100:4"
};

struct Candidate {
  Plan plan;
  PlanCost cost;
  std::string label;
  std::vector<bool> capped;  // per group: share limited by memory
};

absl::Status CheckWorkload(const Cluster& cluster, const Workload& w) {
  const ModelSpec& m = w.model;
  if (m.layers < 1 || m.heads_q < 1 || m.heads_kv < 1 || m.head_dim < 1 || m.hidden < 1 ||
      m.dtype_bytes < 1) {
    return absl::InvalidArgumentError(
        "model: layers, heads_q, heads_kv, head_dim, hidden and dtype_bytes must be >= 1");
  }
  if (m.heads_q % m.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: heads_q = ", m.heads_q, " must be a multiple of heads_kv = ", m.heads_kv));
  }
  if (w.seq_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat("sequence length ", w.seq_len, " must be >= 1"));
  }
  if (!(w.budget.margin_fraction >= 0 && w.budget.margin_fraction < 1)) {
    return absl::InvalidArgumentError("memory margin must be in [0, 1)");
  }
  if (cluster.size() < 1) return absl::InvalidArgumentError("the cluster has no devices");
  if (cluster.size() > kMaxPlannerDevices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the cluster has ", cluster.size(), " devices; the planner plans clusters of 1 to ",
        kMaxPlannerDevices, " devices (its time grows about quadratically with them)"));
  }
  return absl::OkStatus();
}

// Stage I: every combination of per-kind group sizes. Sizes up to the kind's largest node
// (those dividing some node of the kind; a node of m devices with size k is cut into
// groups of gcd(k, m) consecutive devices) keep the all-to-all inside NVLink/PCIe domains;
// multiples of the node size (at most heads_q) join consecutive nodes of the kind, for
// networks fast enough that a cross-node all-to-all beats a longer ring.
class GroupingSpace {
 public:
  GroupingSpace(const Cluster& cluster, int heads_q) : cluster_(cluster) {
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

  int num_kinds() const { return static_cast<int>(options_.size()); }
  const std::vector<int>& options(int kind) const { return options_[kind]; }
  double Combinations() const {
    double n = 1;
    for (const auto& o : options_) n *= static_cast<double>(o.size());
    return n;
  }
  // The option index of the largest size within one node, per kind.
  std::vector<int> NodeSizedChoice() const {
    std::vector<int> choice(num_kinds(), 0);
    for (int k = 0; k < num_kinds(); ++k) {
      for (size_t i = 0; i < options_[k].size(); ++i) {
        if (options_[k][i] <= largest_[k]) choice[k] = static_cast<int>(i);
      }
    }
    return choice;
  }

  // Pairs (a, b), a > b, of in-node sizes of `kind` (both options of the kind, a below the
  // kind's largest node) for which some node of the kind cuts as a + b + ... + b: the
  // groupings with differing sizes on offer for the kind.
  std::vector<std::pair<int, int>> MixedSizes(int kind) const {
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

  // Build(choice), but every node of `kind` that allows it cut into one group of `a`
  // devices followed by groups of `b` (a node of 8 as 4 + 2 + 2); its other nodes as in
  // Build. Labelled "H100:4+2 A100:8".
  Grouping BuildMixed(const std::vector<int>& choice, int kind, int a, int b) const {
    Grouping grouping = Build(choice);
    std::vector<std::string> parts;
    for (int k = 0; k < num_kinds(); ++k) {
      parts.push_back(k == kind
                          ? absl::StrCat(cluster_.kinds[k].name, ":", a, "+", b)
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

  Grouping Build(const std::vector<int>& choice) const {
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
        grouping.groups.emplace_back(open[k].begin() + start,
                                     open[k].begin() + start + largest_[k]);
      }
    }
    return grouping;
  }

 private:
  const Cluster& cluster_;
  std::vector<int> largest_;
  std::vector<std::vector<int>> options_;
};

// Stage III, heads: `total` heads over ranks in proportion to `rate`, at least one each
// when possible, by largest remainder; ties to the lower index.
std::vector<int> Apportion(const std::vector<double>& rate, int total) {
  const int k = static_cast<int>(rate.size());
  std::vector<int> count(k, total >= k ? 1 : 0);
  int left = total - std::accumulate(count.begin(), count.end(), 0);
  const double sum = std::accumulate(rate.begin(), rate.end(), 0.0);
  std::vector<double> exact(k);
  for (int i = 0; i < k; ++i) exact[i] = rate[i] / sum * left;
  int given = 0;
  for (int i = 0; i < k; ++i) {
    const int whole = static_cast<int>(std::floor(exact[i]));
    count[i] += whole;
    given += whole;
  }
  std::vector<int> idx(k);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) {
    return exact[a] - std::floor(exact[a]) > exact[b] - std::floor(exact[b]);
  });
  for (int j = 0; j < left - given; ++j) ++count[idx[j % k]];
  return count;
}

// Water-filling: scale shares to sum 1 with share[g] <= cap[g]. False if the caps sum < 1.
bool NormalizeWithCaps(std::vector<double>* share, const std::vector<double>& cap,
                       std::vector<bool>* capped) {
  const int n = static_cast<int>(share->size());
  capped->assign(n, false);
  if (std::accumulate(cap.begin(), cap.end(), 0.0) < 1.0 - 1e-12) return false;
  for (int round = 0; round <= n; ++round) {
    double fixed = 0, free_sum = 0;
    for (int g = 0; g < n; ++g)
      ((*capped)[g] ? fixed : free_sum) += (*capped)[g] ? cap[g] : (*share)[g];
    bool changed = false;
    for (int g = 0; g < n; ++g) {
      if ((*capped)[g]) {
        (*share)[g] = cap[g];
        continue;
      }
      (*share)[g] *= (1.0 - fixed) / free_sum;
      if ((*share)[g] > cap[g]) {
        (*capped)[g] = true;
        changed = true;
      }
    }
    if (!changed) return true;
  }
  return true;
}

// Stage II's model of each group's time, linearised at the current shares:
//   f_g(t) = max((A_g + C_g) t, X_g + (A_g - X_g) t)
// (all-to-all A and compute C grow with the share t; the K/V it must receive, X, shrinks
// with it).
struct LinearGroupTimes {
  std::vector<double> a, c, x;
};

LinearGroupTimes LineariseGroupTimes(const Grouping& grouping, const PlanCost& cost,
                                     const std::vector<double>& share) {
  const int num_groups = static_cast<int>(grouping.groups.size());
  LinearGroupTimes f{std::vector<double>(num_groups, 0.0), std::vector<double>(num_groups, 0.0),
                     std::vector<double>(num_groups, 0.0)};
  for (int g = 0; g < num_groups; ++g) {
    for (int r : grouping.groups[g]) {
      const RankCost& rc = cost.ranks[r];
      f.a[g] = std::max(f.a[g], (rc.a2a_forward + rc.a2a_backward) / share[g]);
      f.c[g] = std::max(f.c[g], rc.compute_forward * (1.0 + kBackwardFactor) / share[g]);
      f.x[g] = std::max(f.x[g], 3.0 * rc.ring_transfer_forward / (1.0 - share[g]));
    }
  }
  return f;
}

// For a common time T, each f_g(t) <= T is an interval [lo_g, hi_g] of shares, further
// bounded by the group's memory cap and a floor that keeps every group in the ring.
class ShareIntervals {
 public:
  ShareIntervals(const LinearGroupTimes& f, const std::vector<double>& cap)
      : f_(f), cap_(cap), lo_(cap.size()), hi_(cap.size()) {}

  // Computes the intervals for time t; whether shares inside them can sum to 1. Stops at
  // the first empty interval.
  bool Feasible(double t) {
    const int num_groups = static_cast<int>(cap_.size());
    const double floor_share = 1e-3 / num_groups;
    double sum_lo = 0, sum_hi = 0;
    for (int g = 0; g < num_groups; ++g) {
      double l = floor_share, h = std::min(cap_[g], t / (f_.a[g] + f_.c[g]));
      const double slope = f_.a[g] - f_.x[g];
      if (slope > 0) {
        h = std::min(h, (t - f_.x[g]) / slope);
      } else if (slope < 0) {
        l = std::max(l, (f_.x[g] - t) / -slope);
      } else if (f_.x[g] > t) {
        h = -1;
      }
      lo_[g] = l;
      hi_[g] = h;
      sum_lo += l;
      sum_hi += std::max(h, l);
      if (h < l) return false;
    }
    return sum_lo <= 1.0 && sum_hi >= 1.0;
  }
  const std::vector<double>& lo() const { return lo_; }
  const std::vector<double>& hi() const { return hi_; }

 private:
  const LinearGroupTimes& f_;
  const std::vector<double>& cap_;
  std::vector<double> lo_, hi_;
};

// Stage II rebalance: minimises max_g f_g subject to sum t = 1, t <= cap by bisection on
// the common time T, then spreads the slack over the groups in proportion to their
// intervals. Returns the largest relative change of a share, or nullopt (shares untouched)
// when even a generous T admits no split.
std::optional<double> Rebalance(const Grouping& grouping, const PlanCost& cost,
                                const std::vector<double>& cap, std::vector<double>* share) {
  const int num_groups = static_cast<int>(grouping.groups.size());
  const LinearGroupTimes f = LineariseGroupTimes(grouping, cost, *share);
  ShareIntervals interval(f, cap);
  double t_lo = 0, t_hi = 0;
  for (int g = 0; g < num_groups; ++g) {
    const double s = (*share)[g];
    t_hi = std::max(t_hi, std::max((f.a[g] + f.c[g]) * s, f.x[g] + (f.a[g] - f.x[g]) * s));
  }
  t_hi *= 4;
  if (!interval.Feasible(t_hi)) return std::nullopt;
  for (int step = 0; step < 60; ++step) {
    const double mid = 0.5 * (t_lo + t_hi);
    (interval.Feasible(mid) ? t_hi : t_lo) = mid;
  }
  interval.Feasible(t_hi);
  const std::vector<double>& lo = interval.lo();
  const std::vector<double>& hi = interval.hi();
  double sum_lo = 0, room = 0;
  for (int g = 0; g < num_groups; ++g) {
    sum_lo += lo[g];
    room += hi[g] - lo[g];
  }
  double change = 0;
  for (int g = 0; g < num_groups; ++g) {
    const double next = lo[g] + (room > 0 ? (1.0 - sum_lo) * (hi[g] - lo[g]) / room : 0.0);
    change = std::max(change, std::abs(next - (*share)[g]) / (*share)[g]);
    (*share)[g] = next;
  }
  return change;
}

class Builder {
 public:
  Builder(const Cluster& cluster, const Workload& workload)
      : cluster_(cluster), workload_(workload) {}

  Plan Build(const Grouping& grouping, const std::vector<double>& share) const {
    const ModelSpec& m = workload_.model;
    Plan plan;
    plan.num_ranks = cluster_.size();
    plan.heads_q = m.heads_q;
    plan.heads_kv = m.heads_kv;
    for (size_t g = 0; g < grouping.groups.size(); ++g) {
      PlanGroup group;
      group.ranks = grouping.groups[g];
      group.sequence_weight = share[g];
      std::vector<double> rate;
      for (int r : group.ranks) rate.push_back(cluster_.kind_of(r).AttentionFlops());
      const std::vector<int> counts = Apportion(rate, m.heads_q);
      int head = 0;
      for (size_t i = 0; i < group.ranks.size(); ++i) {
        std::vector<int> heads(counts[i]);
        std::iota(heads.begin(), heads.end(), head);
        head += counts[i];
        group.heads.push_back(std::move(heads));
        group.token_weights.push_back(rate[i]);
      }
      plan.groups.push_back(std::move(group));
    }
    // Groups are listed node by node, so consecutive ring hops stay inside a node where a
    // node holds several groups.
    plan.ring_order.resize(plan.groups.size());
    std::iota(plan.ring_order.begin(), plan.ring_order.end(), 0);
    return plan;
  }

  // Stage II for one grouping: balanced, memory-capped shares; the best plan seen.
  std::optional<Candidate> Balance(const Grouping& grouping, int iterations, RingPricing pricing,
                                   int* evaluations) const {
    const int num_groups = static_cast<int>(grouping.groups.size());
    std::vector<double> share = FlopShares(grouping);
    std::vector<double> cap(num_groups, 1.0);
    std::vector<bool> capped(num_groups, false);
    std::optional<Candidate> best;
    for (int it = 0; it < iterations; ++it) {
      Plan plan = Build(grouping, share);
      auto cost = EvaluatePlan(cluster_, workload_, plan, pricing);
      ++*evaluations;
      if (!cost.ok()) return best;
      const std::optional<bool> caps_changed = UpdateMemoryCaps(plan, *cost, share, &cap);
      if (!caps_changed) return best;  // the model state alone does not fit
      if (cost->fits_memory && (!best || cost->Seconds() < best->cost.Seconds())) {
        best = Candidate{std::move(plan), *cost, grouping.label, capped};
      }
      if (num_groups == 1) break;
      const std::optional<double> change = Rebalance(grouping, *cost, cap, &share);
      if (!change) break;
      if (!NormalizeWithCaps(&share, cap, &capped)) break;
      if (*change < 1e-4 && !*caps_changed) break;
    }
    if (best && num_groups > 1 && pricing == RingPricing::kPipelined) {
      TryBlends(grouping, pricing, capped, &*best, evaluations);
    }
    return best;
  }

  int devices() const { return cluster_.size(); }

  void FillReasons(Plan* plan, const PlanCost& cost, const std::vector<bool>& capped,
                   const std::string& family) const {
    plan->ranks.assign(plan->num_ranks, {});
    double total = 0;
    for (const PlanGroup& g : plan->groups) total += g.sequence_weight;
    for (size_t g = 0; g < plan->groups.size(); ++g) {
      const PlanGroup& group = plan->groups[g];
      for (size_t i = 0; i < group.ranks.size(); ++i) {
        const int r = group.ranks[i];
        const DeviceKind& kind = cluster_.kind_of(r);
        RankPrediction& p = plan->ranks[r];
        p.forward_seconds = cost.ranks[r].compute_forward + cost.ranks[r].a2a_forward;
        p.backward_seconds = cost.ranks[r].compute_backward + cost.ranks[r].a2a_backward;
        p.memory_bytes = cost.ranks[r].memory_bytes;
        p.reason = absl::StrFormat(
            "%s, node %d: head group %d of %d ranks (all-to-all at %.0f GB/s); %d of %d "
            "heads; group holds %.2f%% of the work%s; %s; memory %.1f of %.1f GiB",
            kind.name, cluster_.devices[r].node, g, group.ranks.size(),
            group.ranks.size() > 1 ? cluster_.LinkBandwidth(group.ranks[0], group.ranks[1]) / 1e9
                                   : 0.0,
            group.heads[i].size(), plan->heads_q, 100.0 * group.sequence_weight / total,
            !capped.empty() && capped[g] ? " (capped by memory)" : "", family,
            cost.ranks[r].memory_bytes / kGiB, cost.ranks[r].memory_capacity / kGiB);
      }
    }
  }

 private:
  // Each group's share of the cluster's sustained FLOP/s: where stage II starts.
  std::vector<double> FlopShares(const Grouping& grouping) const {
    std::vector<double> share(grouping.groups.size());
    for (size_t g = 0; g < grouping.groups.size(); ++g) {
      for (int r : grouping.groups[g]) share[g] += cluster_.kind_of(r).AttentionFlops();
    }
    const double total = std::accumulate(share.begin(), share.end(), 0.0);
    for (double& s : share) s /= total;
    return share;
  }

  // Memory caps on the shares, recomputed from every evaluation: beyond the model state, a
  // rank's memory has a part proportional to its group's share (activations, attention
  // tensors, staging) and the ring buffers, sized by the largest share of any group.
  // Returns whether a cap moved, or nullopt when the model state alone does not fit a rank.
  std::optional<bool> UpdateMemoryCaps(const Plan& plan, const PlanCost& cost,
                                       const std::vector<double>& share,
                                       std::vector<double>* cap) const {
    const int num_groups = static_cast<int>(plan.groups.size());
    const double state = ModelStateBytesPerDevice(cluster_, workload_);
    const double seq = static_cast<double>(workload_.seq_len);
    bool caps_changed = false;
    for (int g = 0; g < num_groups; ++g) {
      double limit = 1.0;
      const PlanGroup& group = plan.groups[g];
      for (size_t i = 0; i < group.ranks.size(); ++i) {
        const RankCost& rc = cost.ranks[group.ranks[i]];
        const double room = rc.memory_capacity - state;
        if (room <= 0) return std::nullopt;
        const double own =
            RankMemoryBytes(cluster_, workload_, rc.tokens, seq * share[g],
                            static_cast<int>(group.heads[i].size()),
                            static_cast<int>(plan.KvHeadsOf(g, static_cast<int>(i)).size()), 0,
                            false) -
            state;
        const double ring = rc.memory_bytes - state - own;
        limit = std::min(limit, own > 0 ? share[g] * std::max(0.0, room - ring) / own : 1.0);
      }
      limit = std::max(limit, 1e-3 / num_groups);
      if (std::abs(limit - (*cap)[g]) > 1e-9 * (*cap)[g]) caps_changed = true;
      (*cap)[g] = limit;
    }
    return caps_changed;
  }

  // Stage II also tries blends of the balanced shares with the per-device-equal shares
  // (the symmetric split) and the FLOP-proportional shares: where transfers do not
  // overlap well, a less uneven split can win. Replaces `best` with a faster blend.
  void TryBlends(const Grouping& grouping, RingPricing pricing, const std::vector<bool>& capped,
                 Candidate* best, int* evaluations) const {
    const int num_groups = static_cast<int>(grouping.groups.size());
    std::vector<double> balanced(num_groups), equal(num_groups);
    for (int g = 0; g < num_groups; ++g) {
      balanced[g] = best->plan.groups[g].sequence_weight;
      equal[g] = static_cast<double>(grouping.groups[g].size()) / cluster_.size();
    }
    std::vector<double> flops = FlopShares(grouping);
    const double balanced_sum = std::accumulate(balanced.begin(), balanced.end(), 0.0);
    for (double& b : balanced) b /= balanced_sum;
    for (const auto* other : {&equal, &flops}) {
      for (double alpha : {0.125, 0.25, 0.5, 0.75, 1.0}) {
        std::vector<double> trial(num_groups);
        for (int g = 0; g < num_groups; ++g) {
          trial[g] = (1 - alpha) * balanced[g] + alpha * (*other)[g];
        }
        Plan plan = Build(grouping, trial);
        auto cost = EvaluatePlan(cluster_, workload_, plan, pricing);
        ++*evaluations;
        if (cost.ok() && cost->fits_memory && cost->Seconds() < best->cost.Seconds()) {
          *best = Candidate{std::move(plan), *cost, grouping.label, capped};
        }
      }
    }
  }

  const Cluster& cluster_;
  const Workload& workload_;
};

// Stage I search state: each grouping (a choice of option per kind) is screened once, by
// stage II with the overlap-bound ring (O(groups) per price); the groupings that yield a
// plan are kept with their time.
class GroupingScreen {
 public:
  GroupingScreen(const GroupingSpace& space, const Builder& builder, int iterations,
                 int* evaluations)
      : space_(space), builder_(builder), iterations_(iterations), evaluations_(evaluations) {}

  const GroupingSpace& space() const { return space_; }

  // The screened time of the grouping `choice`; infinity when no plan of it fits.
  double Screen(const std::vector<int>& choice) {
    if (auto it = seen_.find(choice); it != seen_.end()) return it->second;
    Grouping grouping = space_.Build(choice);
    auto best = builder_.Balance(grouping, iterations_, RingPricing::kOverlapBound, evaluations_);
    const double t = best ? best->cost.Seconds() : std::numeric_limits<double>::infinity();
    seen_[choice] = t;
    if (best) {
      screened_.push_back({t, static_cast<int>(groupings_.size())});
      groupings_.push_back(std::move(grouping));
    }
    return t;
  }

  // The per-kind choice screened fastest (ties: the smaller choice); empty when none fits.
  std::vector<int> BestChoice() const {
    std::vector<int> best;
    double t = std::numeric_limits<double>::infinity();
    for (const auto& [choice, time] : seen_) {
      if (time < t) {
        t = time;
        best = choice;
      }
    }
    return best;
  }

  // The screened time of a grouping from outside the per-kind space (keyed by its label).
  double ScreenGrouping(Grouping grouping) {
    if (auto it = seen_labels_.find(grouping.label); it != seen_labels_.end()) return it->second;
    auto best = builder_.Balance(grouping, iterations_, RingPricing::kOverlapBound, evaluations_);
    const double t = best ? best->cost.Seconds() : std::numeric_limits<double>::infinity();
    seen_labels_[grouping.label] = t;
    if (best) {
      screened_.push_back({t, static_cast<int>(groupings_.size())});
      groupings_.push_back(std::move(grouping));
    }
    return t;
  }

  // The `count` fastest groupings screened, fastest first (ties: screening order).
  std::vector<Grouping> TakeBest(int count) {
    std::stable_sort(screened_.begin(), screened_.end());
    if (static_cast<int>(screened_.size()) > count) screened_.resize(count);
    std::vector<Grouping> best;
    for (auto [unused, i] : screened_) best.push_back(std::move(groupings_[i]));
    return best;
  }

 private:
  const GroupingSpace& space_;
  const Builder& builder_;
  const int iterations_;
  int* const evaluations_;
  std::vector<Grouping> groupings_;
  std::vector<std::pair<double, int>> screened_;  // (time, index into groupings_)
  std::map<std::vector<int>, double> seen_;
  std::map<std::string, double> seen_labels_;
};

// Stage I, groupings across kinds and nodes: for every head-parallel size h that divides
// both the query heads and the devices, groups of h consecutive ranks, whatever their kinds
// and nodes (a group may hold 4 H100 + 4 A100 of two nodes, as symmetric USP's do); stages
// II and III then give them shares and heads that follow their devices' capability.
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

// Stage I when the combinations are few: every one, the first kind's option varying fastest.
void ScreenEveryCombination(GroupingScreen* screen) {
  const GroupingSpace& space = screen->space();
  const int num_kinds = space.num_kinds();
  std::vector<int> choice(num_kinds, 0);
  while (true) {
    screen->Screen(choice);
    int k = 0;
    while (k < num_kinds && ++choice[k] == static_cast<int>(space.options(k).size())) {
      choice[k++] = 0;
    }
    if (k == num_kinds) break;
  }
}

// Stage I when the combinations are many: coordinate descent (one kind at a time, two
// sweeps) from the best starting point: node-sized groups, or every kind at the same size
// v (the largest option <= v) for every size v on offer.
void ScreenByCoordinateDescent(GroupingScreen* screen) {
  const GroupingSpace& space = screen->space();
  const int num_kinds = space.num_kinds();
  std::vector<int> choice = space.NodeSizedChoice();
  double current = screen->Screen(choice);
  std::vector<int> sizes;
  for (int k = 0; k < num_kinds; ++k) {
    sizes.insert(sizes.end(), space.options(k).begin(), space.options(k).end());
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (int v : sizes) {
    std::vector<int> start(num_kinds, 0);
    for (int k = 0; k < num_kinds; ++k) {
      for (size_t i = 0; i < space.options(k).size(); ++i) {
        if (space.options(k)[i] <= v) start[k] = static_cast<int>(i);
      }
    }
    const double t = screen->Screen(start);
    if (t < current) {
      current = t;
      choice = start;
    }
  }
  for (int sweep = 0; sweep < 2; ++sweep) {
    for (int k = 0; k < num_kinds; ++k) {
      int best_option = choice[k];
      for (int o = 0; o < static_cast<int>(space.options(k).size()); ++o) {
        std::vector<int> trial = choice;
        trial[k] = o;
        const double t = screen->Screen(trial);
        if (t < current) {
          current = t;
          best_option = o;
        }
      }
      choice[k] = best_option;
    }
  }
}

// Stage I, differing group sizes: around the fastest per-kind choice, each kind's nodes cut
// as a + b + ... + b for every pair of its in-node sizes on offer (GroupingSpace::
// MixedSizes), one kind at a time: at most (sizes per node)^2 groupings per kind.
void ScreenMixedSizes(GroupingScreen* screen) {
  const GroupingSpace& space = screen->space();
  const std::vector<int> best = screen->BestChoice();
  if (best.empty()) return;
  for (int k = 0; k < space.num_kinds(); ++k) {
    for (auto [a, b] : space.MixedSizes(k)) screen->ScreenGrouping(space.BuildMixed(best, k, a, b));
  }
}

// Stage II again for the screened groupings, with the pipelined ring (O(groups^2) per
// price): the fastest candidates, fastest first: options.simulate_top of them, or all of them
// on clusters of at most kPriceAllDevices devices (where pricing what runs is cheap).
constexpr int kPriceAllDevices = 64;

std::vector<Candidate> RefineCandidates(const Builder& builder,
                                        const std::vector<Grouping>& groupings,
                                        const PlannerOptions& options, int* evaluations) {
  std::vector<Candidate> candidates;
  for (const Grouping& grouping : groupings) {
    auto best =
        builder.Balance(grouping, options.balance_iterations, RingPricing::kPipelined, evaluations);
    if (best) candidates.push_back(*std::move(best));
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
    return a.cost.Seconds() < b.cost.Seconds();
  });
  const int keep = builder.devices() <= kPriceAllDevices ? static_cast<int>(candidates.size())
                                                         : options.simulate_top;
  if (static_cast<int>(candidates.size()) > keep) {
    candidates.resize(keep);
  }
  return candidates;
}

// Whether two plans of one grouping assign the same: equal heads and ring order, and
// proportional sequence and token weights (the weights are relative).
bool SameAssignment(const Plan& a, const Plan& b) {
  if (a.groups.size() != b.groups.size() || a.RingOrder() != b.RingOrder()) return false;
  auto proportional = [](const std::vector<double>& x, const std::vector<double>& y) {
    if (x.size() != y.size()) return false;
    const double sx = std::accumulate(x.begin(), x.end(), 0.0);
    const double sy = std::accumulate(y.begin(), y.end(), 0.0);
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::abs(x[i] / sx - y[i] / sy) > 1e-12) return false;
    }
    return true;
  };
  std::vector<double> wa, wb;
  for (size_t g = 0; g < a.groups.size(); ++g) {
    const PlanGroup& ga = a.groups[g];
    const PlanGroup& gb = b.groups[g];
    if (ga.ranks != gb.ranks || ga.heads != gb.heads ||
        !proportional(ga.token_weights, gb.token_weights)) {
      return false;
    }
    wa.push_back(ga.sequence_weight);
    wb.push_back(gb.sequence_weight);
  }
  return proportional(wa, wb);
}

// A candidate priced by what runs.
struct Priced {
  Candidate candidate;
  RunSimulation run;
  std::string family;
};

// Each group's sustained attention FLOP/s.
std::vector<double> GroupFlops(const Cluster& cluster, const Plan& plan) {
  std::vector<double> flops(plan.groups.size(), 0.0);
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    for (int r : plan.groups[g].ranks) flops[g] += cluster.kind_of(r).AttentionFlops();
  }
  return flops;
}

// The ring order interleaving fast and slow groups: by capability (FLOP/s, ties to the lower
// index), then the fastest, the slowest, the second fastest, the second slowest, ..., so
// that each ring step pairs unlike groups.
std::vector<int> InterleavedOrder(const Cluster& cluster, const Plan& plan) {
  const std::vector<double> flops = GroupFlops(cluster, plan);
  std::vector<int> by_flops(plan.groups.size());
  std::iota(by_flops.begin(), by_flops.end(), 0);
  std::stable_sort(by_flops.begin(), by_flops.end(),
                   [&](int a, int b) { return flops[a] > flops[b]; });
  std::vector<int> order;
  for (size_t lo = 0, hi = by_flops.size(); lo < hi;) {
    order.push_back(by_flops[lo++]);
    if (lo < hi) order.push_back(by_flops[--hi]);
  }
  return order;
}

// Ring order: node order (the plan's), the interleaved order, and a local improvement of the
// better of the two by the cost model: adjacent swaps, each kept when the pipelined ring
// prices it faster, in position order, at most kMaxRingSwaps tries. Returns the orders that
// differ from the plan's, with their names. Deterministic.
constexpr int kMaxRingSwaps = 64;

std::vector<std::pair<std::vector<int>, std::string>> RingOrderChoices(const Cluster& cluster,
                                                                       const Workload& workload,
                                                                       const Plan& plan,
                                                                       int* evaluations) {
  std::vector<std::pair<std::vector<int>, std::string>> out;
  const int num_groups = static_cast<int>(plan.groups.size());
  if (num_groups < 3) return out;  // two groups: every order is the same ring
  const std::vector<int> node = plan.RingOrder();
  auto price = [&](const std::vector<int>& order) {
    Plan trial = plan;
    trial.ring_order = order;
    auto cost = EvaluatePlan(cluster, workload, trial, RingPricing::kPipelined);
    ++*evaluations;
    return cost.ok() && cost->fits_memory ? cost->Seconds()
                                          : std::numeric_limits<double>::infinity();
  };
  const std::vector<int> interleaved = InterleavedOrder(cluster, plan);
  if (interleaved != node) out.push_back({interleaved, "interleaved"});
  const double node_time = price(node), interleaved_time = price(interleaved);
  std::vector<int> order = interleaved_time < node_time ? interleaved : node;
  double current = std::min(node_time, interleaved_time);
  int tries = 0;
  for (int pass = 0; pass < 2 && tries < kMaxRingSwaps; ++pass) {
    bool improved = false;
    for (int p = 0; p + 1 < num_groups && tries < kMaxRingSwaps; ++p, ++tries) {
      std::swap(order[p], order[p + 1]);
      const double t = price(order);
      if (t < current) {
        current = t;
        improved = true;
      } else {
        std::swap(order[p], order[p + 1]);
      }
    }
    if (!improved) break;
  }
  if (order != node && order != interleaved) out.push_back({order, "by swaps"});
  return out;
}

// The equal-group family of the search's space with its symmetric assignment: groups of h
// consecutive ranks (span:h) for every h dividing the devices and the query heads, equal
// shares and heads dealt evenly in order (groups of one rank with all heads: the ring's
// layout; one group: Ulysses'; sizes between: USP's). Stage II moves a mixed cluster's shares
// away from them, but where the ring's pace or the all-to-all, not compute, sets the time
// they run fastest, and the cost model's screen may not rank their groupings in its top
// few. So the final pricing by what runs always sees the ones the pipelined cost model ranks
// best (kSymmetricTop) and both extremes (one rank per group, one group), fastest first.
constexpr size_t kSymmetricTop = 3;
// The margin against the cost model's error (it has priced plans at half of what runs, not
// yet at twice) beyond which a symmetric candidate is not priced by what runs.
constexpr double kFarSlower = 2.0;
// Where exposed transfer and imbalance exceed this share of the fastest plan's time, blends
// of its grouping's balanced shares with equal ones (this much of the equal shares) are
// priced by what runs.
constexpr double kExposedShare = 0.1;
constexpr double kEvenBlends[] = {0.25, 0.5, 0.75};
constexpr int kBlendDevices = 128;

std::vector<Candidate> SymmetricCandidates(const Cluster& cluster, const Workload& workload,
                                           int* evaluations) {
  const int n = cluster.size();
  const ModelSpec& m = workload.model;
  std::vector<Candidate> all;
  for (int h = 1; h <= std::min(n, m.heads_q); ++h) {
    if (n % h != 0 || m.heads_q % h != 0) continue;
    absl::StatusOr<Plan> plan = SymmetricPlan(n, m.heads_q, m.heads_kv, h);
    if (!plan.ok()) continue;
    auto cost = EvaluatePlan(cluster, workload, *plan, RingPricing::kPipelined);
    ++*evaluations;
    if (!cost.ok() || !cost->fits_memory) continue;
    Candidate c{*std::move(plan), *std::move(cost), absl::StrCat("span:", h), {}};
    c.capped.assign(c.plan.groups.size(), false);
    all.push_back(std::move(c));
  }
  std::stable_sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
    return a.cost.Seconds() < b.cost.Seconds();
  });
  std::vector<Candidate> out;
  for (size_t i = 0; i < all.size(); ++i) {
    const int groups = static_cast<int>(all[i].plan.groups.size());
    if (i < kSymmetricTop || groups == n || groups == 1) out.push_back(std::move(all[i]));
  }
  return out;
}

// The error when no plan, hsap or baseline, fits in memory: the figures that explain why.
absl::Status DoesNotFitError(const Cluster& cluster, const Workload& workload) {
  const double state = ModelStateBytesPerDevice(cluster, workload);
  double most = 0;
  for (int d = 0; d < cluster.size(); ++d) {
    most = std::max(most, UsableMemoryBytes(cluster, workload, d));
  }
  const double per_token = RankMemoryBytes(cluster, workload, 1.0, 0, 0, 0, 0, false) - state;
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s with %d tokens does not fit on %s: every plan needs more memory than a device "
      "has (model state %.1f GiB per device, about %.2f MiB per token held, at most %.1f "
      "GiB usable per device); use more devices, a shorter sequence, or a smaller model",
      workload.model.name, workload.seq_len, cluster.Summary(), state / kGiB, per_token / (1 << 20),
      most / kGiB));
}

}  // namespace

absl::StatusOr<PlannerResult> PlanAttention(const Cluster& cluster, const Workload& workload,
                                            const PlannerOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  HSAP_RETURN_IF_ERROR(CheckWorkload(cluster, workload));
  PlannerResult result;
  Builder builder(cluster, workload);

  // Stages I-III over every grouping, screened by the cost model.
  // Screening with the overlap bound (O(groups) per price), then the most promising
  // groupings again with the pipelined ring (O(groups^2)).
  const GroupingSpace space(cluster, workload.model.heads_q);
  GroupingScreen screen(space, builder, options.screen_iterations, &result.candidates);
  if (space.Combinations() <= options.exhaustive_limit) {
    ScreenEveryCombination(&screen);
  } else {
    ScreenByCoordinateDescent(&screen);
  }
  ScreenMixedSizes(&screen);
  for (Grouping& g : SpanningGroupings(cluster, workload.model.heads_q)) {
    screen.ScreenGrouping(std::move(g));
  }
  const std::vector<Candidate> candidates =
      RefineCandidates(builder, screen.TakeBest(options.refine_top), options, &result.candidates);

  HSAP_ASSIGN_OR_RETURN(const bool debug, GetBoolParam(Param::kPlanDebug));
  // The final candidates are priced by what runs (the runtime's own programs); the fastest
  // there is the plan. Each is priced with its balanced shares and with per-device-equal
  // group shares (Stage II's alternative where the ring, not compute, sets the pace: equal
  // blocks pipeline better than the cost model's ring predicts).
  std::optional<Priced> best;
  std::vector<Plan> priced_plans;  // every plan priced by what runs
  auto price = [&](Candidate c, const std::string& family) -> absl::Status {
    c.plan.node_stores = false;
    HSAP_ASSIGN_OR_RETURN(RunSimulation run, SimulateRun(cluster, workload, c.plan));
    HSAP_RETURN_IF_ERROR(ChooseNodeStores(cluster, workload, &c.plan, &run));
    priced_plans.push_back(c.plan);
    if (debug) {
      std::fprintf(stderr, "candidate %s: model %.3f+%.3f ms, what runs %.3f+%.3f ms\n%s\n",
                   family.c_str(), c.cost.forward_seconds * 1e3, c.cost.backward_seconds * 1e3,
                   run.forward_seconds * 1e3, run.backward_seconds * 1e3,
                   PlanToJsonText(c.plan, -1).c_str());
    }
    if (!best || run.Seconds() < best->run.Seconds()) {
      best = Priced{std::move(c), std::move(run), family};
    }
    return absl::OkStatus();
  };
  // A variant of a candidate: priced unless it assigns the same as one already priced.
  auto price_variant = [&](Candidate v, const std::vector<const Plan*>& priced,
                           const std::string& family) -> absl::Status {
    for (const Plan* p : priced) {
      if (SameAssignment(v.plan, *p)) return absl::OkStatus();
    }
    auto cost = EvaluatePlan(cluster, workload, v.plan, RingPricing::kPipelined);
    ++result.candidates;
    if (!cost.ok() || !cost->fits_memory) return absl::OkStatus();
    v.cost = *cost;
    v.capped.assign(v.plan.groups.size(), false);
    return price(std::move(v), family);
  };
  for (const Candidate& c : candidates) {
    const std::string family = absl::StrCat("hsap groups ", c.label);
    HSAP_RETURN_IF_ERROR(price(c, family));
    Candidate even = c;
    for (PlanGroup& g : even.plan.groups) g.sequence_weight = static_cast<double>(g.ranks.size());
    HSAP_RETURN_IF_ERROR(price_variant(even, {&c.plan}, absl::StrCat(family, ", even shares")));
    // And the symmetric assignment of the grouping: inside each group too, equal tokens and
    // heads dealt as evenly as possible in order (where the all-to-all, not compute, sets a
    // mixed group's pace).
    Candidate symmetric = even;
    for (PlanGroup& g : symmetric.plan.groups) {
      const int size = static_cast<int>(g.ranks.size());
      g.token_weights.assign(size, 1.0);
      for (int i = 0, head = 0; i < size; ++i) {
        const int count = workload.model.heads_q / size + (i < workload.model.heads_q % size);
        g.heads[i].resize(count);
        std::iota(g.heads[i].begin(), g.heads[i].end(), head);
        head += count;
      }
    }
    HSAP_RETURN_IF_ERROR(price_variant(std::move(symmetric), {&c.plan, &even.plan},
                                       absl::StrCat(family, ", even shares and heads")));
  }
  // The equal-group family with its symmetric assignment, unless a candidate above
  // assigns the same, or the cost model prices it over kFarSlower times the fastest plan
  // priced by what runs (on 1024 devices the ring's programs alone cost a second to price,
  // where the model puts it at 5x the plan).
  for (Candidate& c : SymmetricCandidates(cluster, workload, &result.candidates)) {
    const bool seen = std::any_of(priced_plans.begin(), priced_plans.end(),
                                  [&](const Plan& p) { return SameAssignment(c.plan, p); });
    if (seen || (best && c.cost.Seconds() > kFarSlower * best->run.Seconds())) continue;
    const std::string family = absl::StrCat("hsap groups ", c.label, ", even shares and heads");
    HSAP_RETURN_IF_ERROR(price(std::move(c), family));
  }
  if (!best) return DoesNotFitError(cluster, workload);
  // The ring order of the fastest: the other orders on offer, priced by what runs.
  const Candidate fastest = best->candidate;
  const std::string fastest_family = best->family;
  for (auto& [order, name] :
       RingOrderChoices(cluster, workload, fastest.plan, &result.candidates)) {
    Candidate c = fastest;
    c.plan.ring_order = order;
    auto cost = EvaluatePlan(cluster, workload, c.plan, RingPricing::kPipelined);
    ++result.candidates;
    if (!cost.ok() || !cost->fits_memory) continue;
    c.cost = *cost;
    HSAP_RETURN_IF_ERROR(price(std::move(c), absl::StrCat(fastest_family, ", ring ", name)));
  }
  // Shares between the balanced ones of the fastest's grouping and per-device-equal ones,
  // priced by what runs, where time no compute covers (exposed transfer and waiting) or
  // imbalance set the fastest's pace. The partition gives each group exactly the work its
  // share asks for, but with uneven shares the ring's steps are uneven too (a slow rank's
  // step with a fast group's block is larger than with a slow one's) and ranks wait on each
  // other's posts, which the cost model (transfers hidden once compute is balanced) does not
  // see (mix32_h100_l40s at 512K: compute balanced to 0.1 %, yet the run takes 1.9x it),
  // while equal shares leave the fast devices idle; between the two may lie the fastest.
  // Up to kBlendDevices devices: on 1024, each costs about a second to price.
  if (cluster.size() <= kBlendDevices &&
      best->run.ExposedTransferSeconds() + best->run.ImbalanceSeconds() >
          kExposedShare * best->run.Seconds()) {
    const std::string family = best->family;
    const std::vector<int> ring_order = best->candidate.plan.ring_order;
    const size_t ring_at = family.find(", ring ");  // the fastest's ring order, if searched
    const std::string ring_name = ring_at == std::string::npos ? "" : family.substr(ring_at);
    for (const Candidate& balanced : candidates) {
      const std::string base = absl::StrCat("hsap groups ", balanced.label);
      if (family != base && family.rfind(base + ",", 0) != 0) continue;
      double weights = 0, ranks = 0;
      for (const PlanGroup& g : balanced.plan.groups) {
        weights += g.sequence_weight;
        ranks += static_cast<double>(g.ranks.size());
      }
      for (double even : kEvenBlends) {
        Candidate c = balanced;
        c.plan.ring_order = ring_order;
        for (PlanGroup& g : c.plan.groups) {
          g.sequence_weight = (1 - even) * g.sequence_weight / weights +
                              even * static_cast<double>(g.ranks.size()) / ranks;
        }
        std::vector<const Plan*> priced;
        for (const Plan& p : priced_plans) priced.push_back(&p);
        HSAP_RETURN_IF_ERROR(price_variant(
            std::move(c), priced,
            absl::StrCat(base, ", shares ", std::lround(100 * even), "% even", ring_name)));
      }
      break;
    }
  }
  if (best->candidate.plan.node_stores) best->family += ", node stores";
  result.plan = std::move(best->candidate.plan);
  result.cost = best->candidate.cost;
  result.run = std::move(best->run);
  result.family = best->family;
  builder.FillReasons(&result.plan, result.cost, best->candidate.capped, result.family);
  result.plan.predicted_forward_seconds = result.run.forward_seconds;
  result.plan.predicted_backward_seconds = result.run.backward_seconds;
  result.plan.description = result.family;
  // The symmetric baselines are references only: the plan comes from the search above.
  const std::clock_t baselines_start = std::clock();
  result.search_cpu_seconds = static_cast<double>(baselines_start - cpu_start) / CLOCKS_PER_SEC;
  if (options.with_baselines) result.baselines = EvaluateBaselines(cluster, workload);
  result.planning_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::clock_t end = std::clock();
  result.planning_cpu_seconds = static_cast<double>(end - cpu_start) / CLOCKS_PER_SEC;
  result.baselines_cpu_seconds = static_cast<double>(end - baselines_start) / CLOCKS_PER_SEC;
  return result;
}

}  // namespace hsap
