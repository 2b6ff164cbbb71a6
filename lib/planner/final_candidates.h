// The plans the planner (lib/planner/planner.h) prices by what runs besides the search's
// own candidates: other ring orders of the fastest plan, and the equal-group family with its
// symmetric assignment; and the test that keeps one assignment from being priced twice.
// Internal to the planner.
#ifndef HSAP_LIB_PLANNER_FINAL_CANDIDATES_H_
#define HSAP_LIB_PLANNER_FINAL_CANDIDATES_H_

#include <string>
#include <utility>
#include <vector>

#include "lib/planner/candidate_builder.h"
#include "lib/planner/cluster.h"
#include "lib/sched/plan.h"

namespace hsap::planner_internal {

// Whether two plans of one grouping assign the same: equal heads and ring order, and
// proportional sequence and token weights (the weights are relative).
bool SameAssignment(const Plan& a, const Plan& b);

// Ring order: node order (the plan's), the interleaved order, and a local improvement of the
// better of the two by the cost model: adjacent swaps, each kept when the pipelined ring
// prices it faster, in position order, at most 64 tries. Returns the orders that
// differ from the plan's, with their names. Deterministic.
std::vector<std::pair<std::vector<int>, std::string>> RingOrderChoices(const Cluster& cluster,
                                                                       const Workload& workload,
                                                                       const Plan& plan,
                                                                       int* evaluations);

// The equal-group family of the search's space with its symmetric assignment: groups of h
// consecutive ranks (span:h) for every h dividing the devices and the query heads, equal
// shares and heads dealt evenly in order (groups of one rank with all heads: the ring's
// layout; one group: Ulysses'; sizes between: USP's). Stage II moves a mixed cluster's shares
// away from them, but where the ring's pace or the all-to-all, not compute, sets the time
// they run fastest, and the cost model's screen may not rank their groupings in its top
// few. So the final pricing by what runs always sees the ones the pipelined cost model ranks
// best (kSymmetricTop) and both extremes (one rank per group, one group), fastest first.
std::vector<Candidate> SymmetricCandidates(const Cluster& cluster, const Workload& workload,
                                           int* evaluations);

}  // namespace hsap::planner_internal

#endif  // HSAP_LIB_PLANNER_FINAL_CANDIDATES_H_
