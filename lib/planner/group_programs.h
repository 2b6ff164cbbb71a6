// The programs of a plan's batch built for the planner's search: the same RankPrograms as
// PlanPrograms (lib/planner/run_simulator.h), byte for byte and pair for pair, at a fraction
// of the cost, so that the search can price its final candidates with what runs.
//
// Every member of a group runs the schedule of the group's ring position (Hierarchy::
// BuildRank builds it once per RANK): here it is built once per GROUP and every member's
// sub-ring transfers are derived from it. The work lists are built with one query block per
// run (block_q = the row's length): the program needs only their visible pair counts, which
// do not depend on the blocking. The chosen holder of a KV head follows Hierarchy::SenderOf
// from a per-group table. A test compares every program with PlanPrograms' on random plans;
// a change to Hierarchy::BuildRank that this file does not follow fails it.
#ifndef HSAP_LIB_PLANNER_GROUP_PROGRAMS_H_
#define HSAP_LIB_PLANNER_GROUP_PROGRAMS_H_

#include <vector>

#include "absl/status/statusor.h"
#include "attention/layout.h"
#include "lib/planner/cluster.h"
#include "lib/planner/cost_model.h"
#include "lib/planner/run_simulator.h"
#include "lib/sched/plan.h"
#include "lib/sched/transfers.h"

namespace hsap {

// Equal to PlanPrograms(layout, plan, shape) (the same errors for an invalid plan).
absl::StatusOr<std::vector<RankProgram>> PlanProgramsByGroup(const Layout& layout, const Plan& plan,
                                                             const LayerShape& shape);

// What the planner prices: `plan` running the workload's row (one document of seq_len
// tokens, causal or full as the workload says) on `cluster`, with the model's layer shape.
absl::StatusOr<RunSimulation> SimulateRun(const Cluster& cluster, const Workload& workload,
                                          const Plan& plan);

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_GROUP_PROGRAMS_H_
