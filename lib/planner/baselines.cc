#include "lib/planner/baselines.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/planner/group_programs.h"

namespace hsap {
namespace {

// Best symmetric configuration over the given group sizes; `pad` pads the row to a multiple
// of 2 x CP tokens (TransformerEngine's requirement on each document).
Baseline BestOf(const Cluster& cluster, const Workload& workload, const std::string& name,
                const std::vector<int>& group_sizes, bool pad) {
  Baseline best;
  best.name = name;
  best.config = "no legal configuration";
  const int n = cluster.size();
  const ModelSpec& m = workload.model;
  std::string rejected;
  struct Priced {
    Plan plan;
    Workload workload;
    PlanCost cost;
    std::string config;
  };
  std::vector<Priced> priced;
  constexpr size_t kSimulated = 3;
  for (int k : group_sizes) {
    if (k < 1 || n % k != 0 || m.heads_q % k != 0) continue;
    auto plan = SymmetricPlan(n, m.heads_q, m.heads_kv, k);
    if (!plan.ok()) continue;
    Workload w = workload;
    if (pad) {
      const int64_t unit = 2 * static_cast<int64_t>(n / k);
      w.seq_len = (workload.seq_len + unit - 1) / unit * unit;
      w.visible_pairs = 0;
    }
    auto cost = EvaluatePlan(cluster, w, *plan, RingPricing::kPipelined);
    if (!cost.ok()) continue;
    const std::string config = absl::StrCat("CP=", n / k, " x HP=", k);
    if (!cost->fits_memory) {
      const int r = cost->worst_memory_rank;
      rejected = absl::StrCat(config, " needs ", cost->ranks[r].memory_bytes / (1 << 30),
                              " GiB on rank ", r, " (", cluster.kind_of(r).name, "), has ",
                              cost->ranks[r].memory_capacity / (1 << 30));
      continue;
    }
    priced.push_back({std::move(*plan), w, *std::move(cost), config});
  }
  // The configurations the cost model ranks best are priced by what runs; the fastest there
  // is the baseline's best configuration.
  std::stable_sort(priced.begin(), priced.end(), [](const Priced& a, const Priced& b) {
    return a.cost.Seconds() < b.cost.Seconds();
  });
  for (size_t i = 0; i < priced.size() && i < kSimulated; ++i) {
    priced[i].plan.node_stores = false;
    auto run = SimulateRun(cluster, priced[i].workload, priced[i].plan);
    if (!run.ok()) continue;
    // With node stores too, where they are faster (an error keeps it without them).
    ChooseNodeStores(cluster, priced[i].workload, &priced[i].plan, &*run).IgnoreError();
    if (!best.available || run->Seconds() < best.run.Seconds()) {
      best.available = true;
      best.run = *std::move(run);
      best.config = priced[i].config;
      best.plan = priced[i].plan;
      best.workload = priced[i].workload;
      best.cost = priced[i].cost;
    }
  }
  if (!best.available && !rejected.empty()) best.config = "out of memory: " + rejected;
  return best;
}

}  // namespace

absl::StatusOr<Plan> SymmetricPlan(int num_ranks, int heads_q, int heads_kv, int group_size) {
  if (group_size < 1 || num_ranks % group_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("group size ", group_size, " does not divide ", num_ranks, " ranks"));
  }
  Plan plan;
  plan.num_ranks = num_ranks;
  plan.heads_q = heads_q;
  plan.heads_kv = heads_kv;
  for (int start = 0; start < num_ranks; start += group_size) {
    PlanGroup group;
    group.sequence_weight = 1.0;
    int head = 0;
    for (int i = 0; i < group_size; ++i) {
      group.ranks.push_back(start + i);
      group.token_weights.push_back(1.0);
      const int count = heads_q / group_size + (i < heads_q % group_size ? 1 : 0);
      std::vector<int> heads;
      for (int h = 0; h < count; ++h) heads.push_back(head++);
      group.heads.push_back(std::move(heads));
    }
    plan.groups.push_back(std::move(group));
  }
  plan.ring_order.resize(plan.groups.size());
  std::iota(plan.ring_order.begin(), plan.ring_order.end(), 0);
  HSAP_RETURN_IF_ERROR(plan.Validate());
  return plan;
}

std::vector<Baseline> EvaluateBaselines(const Cluster& cluster, const Workload& workload) {
  const int n = cluster.size();
  std::vector<int> divisors;
  for (int k = 1; k <= n; ++k) {
    if (n % k == 0) divisors.push_back(k);
  }
  int node_size = static_cast<int>(cluster.nodes[0].devices.size());
  for (const Node& node : cluster.nodes) {
    node_size = std::min(node_size, static_cast<int>(node.devices.size()));
  }
  std::vector<Baseline> out;
  out.push_back(BestOf(cluster, workload, "Ring", {1}, false));
  out.push_back(BestOf(cluster, workload, "Ulysses", {n}, false));
  out.push_back(BestOf(cluster, workload, "USP", divisors, false));
  // TE: all-to-all among the devices of a node (or the largest legal divisor of it).
  std::vector<int> te;
  for (int k = node_size; k >= 1; --k) {
    if (node_size % k == 0 && n % k == 0 && workload.model.heads_q % k == 0) {
      te.push_back(k);
      break;
    }
  }
  out.push_back(BestOf(cluster, workload, "TE a2a+p2p", te, true));
  return out;
}

}  // namespace hsap
