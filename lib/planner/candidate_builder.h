// Stages II and III of the planner (lib/planner/planner.h) for one grouping: the plan of a
// grouping and group shares (heads and tokens per device in proportion to FLOP/s), and the
// search for balanced, memory-capped shares by the cost model. Internal to the planner.
#ifndef HSAP_LIB_PLANNER_CANDIDATE_BUILDER_H_
#define HSAP_LIB_PLANNER_CANDIDATE_BUILDER_H_

#include <optional>
#include <string>
#include <vector>

#include "lib/planner/cluster.h"
#include "lib/planner/cost_model.h"
#include "lib/planner/grouping.h"
#include "lib/sched/plan.h"

namespace hsap::planner_internal {

// A plan the search found, with the cost model's figures of it.
struct Candidate {
  Plan plan;
  PlanCost cost;
  std::string label;
  std::vector<bool> capped;  // per group: share limited by memory
};

class CandidateBuilder {
 public:
  // `cluster` and `workload` must outlive the builder.
  CandidateBuilder(const Cluster& cluster, const Workload& workload)
      : cluster_(cluster), workload_(workload) {}

  // Stage III: the plan of `grouping` with group g holding share[g] of the sequence; in
  // each group, query heads dealt in contiguous runs and token weights in proportion to the
  // devices' FLOP/s; the ring in node order.
  Plan Build(const Grouping& grouping, const std::vector<double>& share) const;

  // Stage II for one grouping: balanced, memory-capped shares; the best plan seen (nullopt
  // when none fits). Counts each pricing in `*evaluations`.
  std::optional<Candidate> Balance(const Grouping& grouping, int iterations, RingPricing pricing,
                                   int* evaluations) const;

  int devices() const { return cluster_.size(); }

  // Fills plan->ranks: per rank, the predictions of `cost` and a sentence saying why it
  // holds what it holds (its group, heads, share, `family`, memory).
  void FillReasons(Plan* plan, const PlanCost& cost, const std::vector<bool>& capped,
                   const std::string& family) const;

 private:
  // Each group's share of the cluster's sustained FLOP/s: where stage II starts.
  std::vector<double> FlopShares(const Grouping& grouping) const;

  // Memory caps on the shares, recomputed from every evaluation: beyond the model state, a
  // rank's memory has a part proportional to its group's share (activations, attention
  // tensors, staging) and the ring buffers, sized by the largest share of any group.
  // Returns whether a cap moved, or nullopt when the model state alone does not fit a rank.
  std::optional<bool> UpdateMemoryCaps(const Plan& plan, const PlanCost& cost,
                                       const std::vector<double>& share,
                                       std::vector<double>* cap) const;

  // Stage II also tries blends of the balanced shares with the per-device-equal shares
  // (the symmetric split) and the FLOP-proportional shares: where transfers do not
  // overlap well, a less uneven split can win. Replaces `best` with a faster blend.
  void TryBlends(const Grouping& grouping, RingPricing pricing, const std::vector<bool>& capped,
                 Candidate* best, int* evaluations) const;

  const Cluster& cluster_;
  const Workload& workload_;
};

}  // namespace hsap::planner_internal

#endif  // HSAP_LIB_PLANNER_CANDIDATE_BUILDER_H_
