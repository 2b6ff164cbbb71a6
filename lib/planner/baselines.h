// The symmetric baselines, expressed as plans for the same cost model and simulator:
//   Ring     — ring attention, every rank its own group, equal zigzag shards;
//   Ulysses  — one group of every rank, equal heads (needs ranks | query heads);
//   USP      — every legal symmetric factorisation CP x HP (HP | query heads, HP | ranks),
//              groups of consecutive ranks, equal shards and heads; the best one;
//   TE a2a+p2p — TransformerEngine's hierarchical scheme: all-to-all inside a node (HP =
//              devices per node), p2p ring across nodes, every document padded to 2 x CP.
// Each gets its best configuration: the legal configurations that fit in memory (cost
// model account) are priced by the cost model, the best three are priced by the run
// simulator (the runtime's own programs, lib/planner/run_simulator.h), as the planner's own
// candidates are, and the fastest there is kept.
#ifndef HSAP_LIB_PLANNER_BASELINES_H_
#define HSAP_LIB_PLANNER_BASELINES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/planner/cluster.h"
#include "lib/planner/cost_model.h"
#include "lib/planner/run_simulator.h"
#include "lib/sched/plan.h"

namespace hsap {

// A symmetric plan: groups of `group_size` consecutive ranks (group_size | num_ranks),
// equal sequence and token weights, query heads dealt out contiguously and as evenly as
// possible.
absl::StatusOr<Plan> SymmetricPlan(int num_ranks, int heads_q, int heads_kv, int group_size);

struct Baseline {
  std::string name;        // "Ring", "Ulysses", "USP", "TE a2a+p2p"
  bool available = false;  // a legal configuration exists and fits in memory
  std::string config;      // e.g. "CP=4 x HP=8", or why none is available
  Plan plan;
  Workload workload;  // the workload it runs (TE pads the sequence)
  PlanCost cost;      // cost model figures of its best configuration
  RunSimulation run;  // run simulator figures of its best configuration
};

// All four baselines for the workload on the cluster.
std::vector<Baseline> EvaluateBaselines(const Cluster& cluster, const Workload& workload);

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_BASELINES_H_
