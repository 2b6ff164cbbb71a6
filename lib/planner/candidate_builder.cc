#include "lib/planner/candidate_builder.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_format.h"

namespace hsap::planner_internal {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

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
      f.c[g] = std::max(f.c[g], (rc.compute_forward + rc.compute_backward) / share[g]);
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

}  // namespace

Plan CandidateBuilder::Build(const Grouping& grouping, const std::vector<double>& share) const {
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

std::optional<Candidate> CandidateBuilder::Balance(const Grouping& grouping, int iterations,
                                                   RingPricing pricing, int* evaluations) const {
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

void CandidateBuilder::FillReasons(Plan* plan, const PlanCost& cost,
                                   const std::vector<bool>& capped,
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

std::vector<double> CandidateBuilder::FlopShares(const Grouping& grouping) const {
  std::vector<double> share(grouping.groups.size());
  for (size_t g = 0; g < grouping.groups.size(); ++g) {
    for (int r : grouping.groups[g]) share[g] += cluster_.kind_of(r).AttentionFlops();
  }
  const double total = std::accumulate(share.begin(), share.end(), 0.0);
  for (double& s : share) s /= total;
  return share;
}

std::optional<bool> CandidateBuilder::UpdateMemoryCaps(const Plan& plan, const PlanCost& cost,
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

void CandidateBuilder::TryBlends(const Grouping& grouping, RingPricing pricing,
                                 const std::vector<bool>& capped, Candidate* best,
                                 int* evaluations) const {
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

}  // namespace hsap::planner_internal
