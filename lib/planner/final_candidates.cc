#include "lib/planner/final_candidates.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "lib/planner/baselines.h"

namespace hsap::planner_internal {
namespace {

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

constexpr int kMaxRingSwaps = 64;

}  // namespace

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

constexpr size_t kSymmetricTop = 3;

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

}  // namespace hsap::planner_internal
