#include "lib/planner/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "lib/planner/candidate_builder.h"
#include "lib/planner/final_candidates.h"
#include "lib/planner/group_programs.h"
#include "lib/planner/grouping.h"
#include "lib/planner/grouping_screen.h"
#include "lib/sched/plan_json.h"

namespace hsap {
namespace {

using planner_internal::Candidate;
using planner_internal::CandidateBuilder;
using planner_internal::Grouping;
using planner_internal::GroupingScreen;
using planner_internal::GroupingSpace;
using planner_internal::RingOrderChoices;
using planner_internal::SameAssignment;
using planner_internal::SpanningGroupings;
using planner_internal::SymmetricCandidates;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

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

// A candidate priced by what runs.
struct Priced {
  Candidate candidate;
  RunSimulation run;
  std::string family;
};

// The margin against the cost model's error (it has priced plans at half of what runs, not
// yet at twice) beyond which a symmetric candidate is not priced by what runs.
constexpr double kFarSlower = 2.0;
// Where exposed transfer and imbalance exceed this share of the fastest plan's time, blends
// of its grouping's balanced shares with equal ones (this much of the equal shares) are
// priced by what runs.
constexpr double kExposedShare = 0.1;
constexpr double kEvenBlends[] = {0.25, 0.5, 0.75};
constexpr int kBlendDevices = 128;

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

// Stages I-III over every grouping, screened by the cost model: screening with the overlap
// bound (O(groups) per price), then the most promising groupings again with the pipelined
// ring (O(groups^2)). Counts each pricing in `*evaluations`.
std::vector<Candidate> SearchCandidates(const Cluster& cluster, const Workload& workload,
                                        const PlannerOptions& options,
                                        const CandidateBuilder& builder, int* evaluations) {
  const GroupingSpace space(cluster, workload.model.heads_q);
  GroupingScreen screen(space, builder, options.screen_iterations, evaluations);
  if (space.Combinations() <= options.exhaustive_limit) {
    ScreenEveryCombination(&screen);
  } else {
    ScreenByCoordinateDescent(&screen);
  }
  ScreenMixedSizes(&screen);
  for (Grouping& g : SpanningGroupings(cluster, workload.model.heads_q)) {
    screen.ScreenGrouping(std::move(g));
  }
  return RefineCandidates(builder, screen.TakeBest(options.refine_top), options, evaluations);
}

// The final candidates are priced by what runs (the runtime's own programs); the fastest
// there is the plan. Each step below prices one family of plans; best() is the fastest so
// far.
class FinalPricing {
 public:
  FinalPricing(const Cluster& cluster, const Workload& workload, bool debug, int* evaluations)
      : cluster_(cluster), workload_(workload), debug_(debug), evaluations_(evaluations) {}

  std::optional<Priced>& best() { return best_; }

  // Each search candidate with its balanced shares and with per-device-equal group shares
  // (Stage II's alternative where the ring, not compute, sets the pace: equal blocks
  // pipeline better than the cost model's ring predicts), and with the grouping's symmetric
  // assignment.
  absl::Status PriceSearchCandidates(const std::vector<Candidate>& candidates) {
    for (const Candidate& c : candidates) {
      const std::string family = absl::StrCat("hsap groups ", c.label);
      HSAP_RETURN_IF_ERROR(Price(c, family));
      Candidate even = c;
      for (PlanGroup& g : even.plan.groups) g.sequence_weight = static_cast<double>(g.ranks.size());
      HSAP_RETURN_IF_ERROR(PriceVariant(even, {&c.plan}, absl::StrCat(family, ", even shares")));
      // And the symmetric assignment of the grouping: inside each group too, equal tokens and
      // heads dealt as evenly as possible in order (where the all-to-all, not compute, sets a
      // mixed group's pace).
      Candidate symmetric = even;
      for (PlanGroup& g : symmetric.plan.groups) {
        const int size = static_cast<int>(g.ranks.size());
        g.token_weights.assign(size, 1.0);
        for (int i = 0, head = 0; i < size; ++i) {
          const int count = workload_.model.heads_q / size + (i < workload_.model.heads_q % size);
          g.heads[i].resize(count);
          std::iota(g.heads[i].begin(), g.heads[i].end(), head);
          head += count;
        }
      }
      HSAP_RETURN_IF_ERROR(PriceVariant(std::move(symmetric), {&c.plan, &even.plan},
                                        absl::StrCat(family, ", even shares and heads")));
    }
    return absl::OkStatus();
  }

  // The equal-group family with its symmetric assignment, unless a candidate above
  // assigns the same, or the cost model prices it over kFarSlower times the fastest plan
  // priced by what runs (on 1024 devices the ring's programs alone cost a second to price,
  // where the model puts it at 5x the plan).
  absl::Status PriceSymmetricFamily() {
    for (Candidate& c : SymmetricCandidates(cluster_, workload_, evaluations_)) {
      const bool seen = std::any_of(priced_plans_.begin(), priced_plans_.end(),
                                    [&](const Plan& p) { return SameAssignment(c.plan, p); });
      if (seen || (best_ && c.cost.Seconds() > kFarSlower * best_->run.Seconds())) continue;
      const std::string family = absl::StrCat("hsap groups ", c.label, ", even shares and heads");
      HSAP_RETURN_IF_ERROR(Price(std::move(c), family));
    }
    return absl::OkStatus();
  }

  // The ring order of the fastest (best() must hold one): the other orders on offer,
  // priced by what runs.
  absl::Status PriceRingOrders() {
    const Candidate fastest = best_->candidate;
    const std::string fastest_family = best_->family;
    for (auto& [order, name] : RingOrderChoices(cluster_, workload_, fastest.plan, evaluations_)) {
      Candidate c = fastest;
      c.plan.ring_order = order;
      auto cost = EvaluatePlan(cluster_, workload_, c.plan, RingPricing::kPipelined);
      ++*evaluations_;
      if (!cost.ok() || !cost->fits_memory) continue;
      c.cost = *cost;
      HSAP_RETURN_IF_ERROR(Price(std::move(c), absl::StrCat(fastest_family, ", ring ", name)));
    }
    return absl::OkStatus();
  }

  // Shares between the balanced ones of the fastest's grouping and per-device-equal ones,
  // priced by what runs, where time no compute covers (exposed transfer and waiting) or
  // imbalance set the fastest's pace. The partition gives each group exactly the work its
  // share asks for, but with uneven shares the ring's steps are uneven too (a slow rank's
  // step with a fast group's block is larger than with a slow one's) and ranks wait on each
  // other's posts, which the cost model (transfers hidden once compute is balanced) does not
  // see (mix32_h100_l40s at 512K: compute balanced to 0.1 %, yet the run takes 1.9x it),
  // while equal shares leave the fast devices idle; between the two may lie the fastest.
  // Up to kBlendDevices devices: on 1024, each costs about a second to price. best() must
  // hold a plan.
  absl::Status PriceEvenBlends(const std::vector<Candidate>& candidates) {
    if (cluster_.size() > kBlendDevices ||
        !(best_->run.ExposedTransferSeconds() + best_->run.ImbalanceSeconds() >
          kExposedShare * best_->run.Seconds())) {
      return absl::OkStatus();
    }
    const std::string family = best_->family;
    const std::vector<int> ring_order = best_->candidate.plan.ring_order;
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
        for (const Plan& p : priced_plans_) priced.push_back(&p);
        HSAP_RETURN_IF_ERROR(PriceVariant(
            std::move(c), priced,
            absl::StrCat(base, ", shares ", std::lround(100 * even), "% even", ring_name)));
      }
      break;
    }
    return absl::OkStatus();
  }

 private:
  // Prices `c` by what runs (choosing its node stores); keeps it when it is the fastest.
  absl::Status Price(Candidate c, const std::string& family) {
    c.plan.node_stores = false;
    HSAP_ASSIGN_OR_RETURN(RunSimulation run, SimulateRun(cluster_, workload_, c.plan));
    HSAP_RETURN_IF_ERROR(ChooseNodeStores(cluster_, workload_, &c.plan, &run));
    priced_plans_.push_back(c.plan);
    if (debug_) {
      std::fprintf(stderr, "candidate %s: model %.3f+%.3f ms, what runs %.3f+%.3f ms\n%s\n",
                   family.c_str(), c.cost.forward_seconds * 1e3, c.cost.backward_seconds * 1e3,
                   run.forward_seconds * 1e3, run.backward_seconds * 1e3,
                   PlanToJsonText(c.plan, -1).c_str());
    }
    if (!best_ || run.Seconds() < best_->run.Seconds()) {
      best_ = Priced{std::move(c), std::move(run), family};
    }
    return absl::OkStatus();
  }

  // A variant of a candidate: priced unless it assigns the same as one already priced.
  absl::Status PriceVariant(Candidate v, const std::vector<const Plan*>& priced,
                            const std::string& family) {
    for (const Plan* p : priced) {
      if (SameAssignment(v.plan, *p)) return absl::OkStatus();
    }
    auto cost = EvaluatePlan(cluster_, workload_, v.plan, RingPricing::kPipelined);
    ++*evaluations_;
    if (!cost.ok() || !cost->fits_memory) return absl::OkStatus();
    v.cost = *cost;
    v.capped.assign(v.plan.groups.size(), false);
    return Price(std::move(v), family);
  }

  const Cluster& cluster_;
  const Workload& workload_;
  const bool debug_;
  int* const evaluations_;
  std::optional<Priced> best_;
  std::vector<Plan> priced_plans_;  // every plan priced by what runs
};

// The fastest plan priced, with its reasons, its predictions those of what runs.
void FillResult(const CandidateBuilder& builder, Priced best, PlannerResult* result) {
  if (best.candidate.plan.node_stores) best.family += ", node stores";
  result->plan = std::move(best.candidate.plan);
  result->cost = best.candidate.cost;
  result->run = std::move(best.run);
  result->family = best.family;
  builder.FillReasons(&result->plan, result->cost, best.candidate.capped, result->family);
  result->plan.predicted_forward_seconds = result->run.forward_seconds;
  result->plan.predicted_backward_seconds = result->run.backward_seconds;
  result->plan.description = result->family;
}

}  // namespace

absl::StatusOr<PlannerResult> PlanAttention(const Cluster& cluster, const Workload& workload,
                                            const PlannerOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  HSAP_RETURN_IF_ERROR(CheckWorkload(cluster, workload));
  PlannerResult result;
  const CandidateBuilder builder(cluster, workload);
  const std::vector<Candidate> candidates =
      SearchCandidates(cluster, workload, options, builder, &result.candidates);

  HSAP_ASSIGN_OR_RETURN(const bool debug, GetBoolParam(Param::kPlanDebug));
  FinalPricing pricing(cluster, workload, debug, &result.candidates);
  HSAP_RETURN_IF_ERROR(pricing.PriceSearchCandidates(candidates));
  HSAP_RETURN_IF_ERROR(pricing.PriceSymmetricFamily());
  if (!pricing.best()) return DoesNotFitError(cluster, workload);
  HSAP_RETURN_IF_ERROR(pricing.PriceRingOrders());
  HSAP_RETURN_IF_ERROR(pricing.PriceEvenBlends(candidates));
  FillResult(builder, *std::move(pricing.best()), &result);
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
