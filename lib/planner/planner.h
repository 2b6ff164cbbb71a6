// The hierarchical planner (HexiSeq's scheduler): finds the plan for a workload on a
// heterogeneous cluster. See docs/planner.md.
//
//   Stage I   — grouping: for every device kind, a head-parallel group size: sizes that
//               divide its nodes (the all-to-all stays in an NVLink/PCIe domain) or
//               power-of-two multiples of a node (consecutive nodes of the kind). All
//               combinations over the kinds when there are at most `exhaustive_limit`,
//               else coordinate descent, one kind at a time, from the best of the
//               node-sized and the all-kinds-equal-size starting points.
//   Stage II  — sequence split: group shares start proportional to the group's sustained
//               FLOP/s and are rebalanced by multiplicative updates until the groups'
//               predicted times (all-to-all + compute/transfer) agree, with each share
//               capped by the memory of its ranks.
//   Stage III — per device: query heads dealt in contiguous runs in proportion to FLOP/s
//               (largest remainder), token shards in proportion to FLOP/s, then a memory
//               repair that moves tokens off ranks over their budget.
//   Stage I also screens groupings across kinds and nodes: groups of h consecutive ranks for
//               every h dividing the query heads and the devices (mixed-kind groups, as
//               symmetric USP forms, but with stages II and III giving them capability-
//               following shares and heads), and groupings whose groups of one kind differ
//               in size (a node of 8 as 4 + 2 + 2) around the fastest per-kind choice.
// Candidates are screened with the cost model; the best few are priced by what runs (the
// run simulator over the runtime's own programs, lib/planner/run_simulator.h), with their
// balanced shares, equal group shares and the grouping's symmetric assignment; the ring order
// of the fastest is searched (node order, fast and slow groups interleaved, adjacent swaps
// by the cost model), and the fastest by what runs is returned, its predicted times the run
// simulator's. The equal-group family (groups of h consecutive ranks with equal shares and
// heads: the ring's layout for h = 1, Ulysses' for one group, USP's between) always reaches
// that final pricing too, its cost-model-best three and both extremes (unless the model
// puts one at over twice the fastest plan), so the search alone is never slower than a
// symmetric baseline. Where the fastest loses over a tenth of its time to exposed transfer
// and imbalance (clusters of at most 128 devices), its grouping's balanced shares blended
// with equal ones (25, 50, 75 % equal), in its ring order, are priced by what runs too. The symmetric baselines (Ring, Ulysses, USP, TE a2a+p2p) are priced the same
// way alongside, as references only: they are never returned as the plan, so the
// comparison with them measures the search.
// Deterministic: no randomness, ties broken by enumeration order.
// HSAP_PLAN_DEBUG=1 in the environment prints the priced candidates to stderr (a value
// that is not a boolean is an InvalidArgument error).
#ifndef HSAP_LIB_PLANNER_PLANNER_H_
#define HSAP_LIB_PLANNER_PLANNER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/planner/baselines.h"
#include "lib/planner/cluster.h"
#include "lib/planner/cost_model.h"
#include "lib/planner/run_simulator.h"
#include "lib/sched/plan.h"

namespace hsap {

// The largest cluster PlanAttention plans. Planning time grows about quadratically with the
// devices: about 8 s of CPU at 4096 devices (2 s at 2048), where the 2^20 devices a cluster
// file may hold would take days.
inline constexpr int kMaxPlannerDevices = 4096;

struct PlannerOptions {
  double exhaustive_limit = 128;  // stage I: all size combinations up to this many
  int screen_iterations = 4;      // stage II updates per grouping when screening
  int balance_iterations = 12;    // stage II updates per grouping when refining
  int refine_top = 12;            // groupings re-balanced with the pipelined ring model
  int simulate_top = 3;           // hsap candidates priced by what runs at the end
  // Price the symmetric baselines too (PlannerResult::baselines). They take no part in the
  // choice; a trainer that only wants the plan (the C ABI) skips them.
  bool with_baselines = true;
};

struct PlannerResult {
  Plan plan;                         // predicted times from `run`, reasons per rank
  PlanCost cost;                     // cost model figures of the plan
  RunSimulation run;                 // what runs: the run simulator's figures of the plan
  std::string family;                // which candidate won, e.g. "hsap groups H100:8 A100:4"
  std::vector<Baseline> baselines;   // references, not candidates (empty without them)
  int candidates = 0;                // plans priced by the cost model
  double planning_seconds = 0;       // wall time of PlanAttention, baselines included
  double planning_cpu_seconds = 0;   // process CPU time over the same span
  double search_cpu_seconds = 0;     // of which the search (the plan alone)
  double baselines_cpu_seconds = 0;  // and the baselines' pricing
};

// Errors: a model that fits nowhere ("does not fit": names the device and the bytes),
// head counts inconsistent (heads_q not a multiple of heads_kv), empty sequence, a cluster
// of more than kMaxPlannerDevices devices (InvalidArgument, at once).
absl::StatusOr<PlannerResult> PlanAttention(const Cluster& cluster, const Workload& workload,
                                            const PlannerOptions& options = {});

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_PLANNER_H_
