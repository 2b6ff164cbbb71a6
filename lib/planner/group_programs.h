// The programs of a plan's batch built for the planner's search: the same RankPrograms as
// PlanPrograms (lib/planner/run_simulator.h), byte for byte and pair for pair, at a fraction
// of the cost, so that the search can price its final candidates with what runs.
//
// Every member of a group runs the schedule of the group's ring position, which
// Hierarchy::BuildRank builds per RANK (a scan of the mask over every placement, and the
// work lists). Here one scan of the mask over the partition's placements gives, for every
// pair of ring positions, the key rows one needs from the other and their visible pairs
// (all a program needs of the schedule and the work lists), and each member's sub-ring
// messages follow from its group's position; the chosen holder of a KV head follows
// Hierarchy::SenderOf and GatewayOf from a per-group table (node fan-outs included when the
// nodes are given). Bytes stay exact. A test compares every
// program with PlanPrograms' on random plans, ring orders and mask kinds; a change to
// Hierarchy::BuildRank or ProgramOf(RankHierarchy) that this file does not follow fails it.
#ifndef HSAP_LIB_PLANNER_GROUP_PROGRAMS_H_
#define HSAP_LIB_PLANNER_GROUP_PROGRAMS_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
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
// Equal to PlanPrograms(layout, plan, node_of_rank, shape): with the node of every rank,
// the fan-outs and node stores of lib/sched/hierarchy.h, 5. and 6., and each message's
// link class.
absl::StatusOr<std::vector<RankProgram>> PlanProgramsByGroup(const Layout& layout, const Plan& plan,
                                                             absl::Span<const int> node_of_rank,
                                                             const LayerShape& shape);

// What the planner prices: `plan` running the workload's row (one document of seq_len
// tokens, causal or full as the workload says) on `cluster` (its nodes: the fan-outs of
// PlanPrograms(layout, plan, cluster, shape)), with the model's layer shape.
absl::StatusOr<RunSimulation> SimulateRun(const Cluster& cluster, const Workload& workload,
                                          const Plan& plan);

// Node stores for a plan priced without them (`run`, plan->node_stores false): when groups
// of the plan share a node of the cluster, prices the plan with node stores too (fewer
// inter-node bytes against an earlier, larger crossing; hierarchy.h, 6.) and, when that is
// faster, sets plan->node_stores and replaces `run`. Only on clusters of at most
// kNodeStoreDevices devices (beyond, plans run without them: on 1024 devices the ring's
// stores alone take seconds to price), so the search and the baselines choose alike.
inline constexpr int kNodeStoreDevices = 128;
absl::Status ChooseNodeStores(const Cluster& cluster, const Workload& workload, Plan* plan,
                              RunSimulation* run);

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_GROUP_PROGRAMS_H_
