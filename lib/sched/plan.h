// The plan: how the ranks of a job share one attention layer (HexiSeq's CP x HP layout).
//
// Ranks are partitioned into head-parallel groups. Each group g holds a share of the
// packed row proportional to its `sequence_weight` (a share of the attention WORK, i.e. of
// the visible (query, key) pairs, as hsapPartitionCreate's weights are). Inside the group:
//  - before the all-to-all, rank i of the group holds a token shard of the group's share,
//    sized in proportion to token_weights[i];
//  - after the all-to-all, rank i holds ALL of the group's tokens for the query heads
//    heads[i] (any subset of [0, heads_q), possibly non-contiguous, possibly empty); the
//    heads of the ranks of a group partition [0, heads_q) exactly. The KV heads a rank needs
//    follow from its query heads (query head h uses KV head h / (heads_q / heads_kv)).
// Across groups, K/V slices travel along `ring_order` (a permutation of group indices) in
// "sub-rings": the ranks of different groups holding a given KV head exchange that head's
// K/V slices that their queries see.
//
// Degenerate cases: one group = Ulysses; groups of one rank = (sequence-aware) ring
// attention; equal groups with equal heads = USP / TransformerEngine's a2a+p2p.
//
// Predicted figures (times, memory, reasons) are optional: a plan built by hand has none;
// the planner fills them.
#ifndef HSAP_LIB_SCHED_PLAN_H_
#define HSAP_LIB_SCHED_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsap {

struct PlanGroup {
  std::vector<int> ranks;               // world ranks, in group-local order (no duplicates)
  double sequence_weight = 1.0;         // share of the row's attention work (> 0, relative)
  std::vector<double> token_weights;    // per rank of the group (>= 0, relative, sum > 0)
  std::vector<std::vector<int>> heads;  // per rank of the group: query heads, sorted

  friend bool operator==(const PlanGroup&, const PlanGroup&) = default;
};

// Predictions for one rank (all optional; zero / empty when unknown).
struct RankPrediction {
  double forward_seconds = 0;   // attention forward of one layer on this rank, busy time
  double backward_seconds = 0;  // the same for backward
  double memory_bytes = 0;      // peak memory of the rank under the plan
  std::string reason;           // why the rank got its tokens and heads

  friend bool operator==(const RankPrediction&, const RankPrediction&) = default;
};

struct Plan {
  int num_ranks = 0;
  int heads_q = 0;
  int heads_kv = 0;
  std::vector<PlanGroup> groups;
  std::vector<int> ring_order;  // permutation of [0, groups.size()); empty = index order
  // On several nodes, whether groups sharing a node share its crossings (node stores,
  // hierarchy.h 6.): fewer inter-node bytes, but the union of their rows crosses at the
  // earliest group's step and the gradients return after the last step, so the planner
  // prices both and keeps the faster. JSON "node_stores" (default true).
  bool node_stores = true;

  // Predicted wall time of one layer's attention (forward / backward), 0 when unknown.
  double predicted_forward_seconds = 0;
  double predicted_backward_seconds = 0;
  std::vector<RankPrediction> ranks;  // empty, or one per world rank
  std::string description;            // free text (e.g. which candidate family won)

  // Checks every invariant; the message names the group, rank or head at fault:
  // num_ranks >= 1; heads_q, heads_kv >= 1 with heads_q a multiple of heads_kv; every rank
  // in [0, num_ranks) in exactly one group; sequence weights finite and > 0; token weights
  // finite, >= 0, one per rank, not all zero in a group; heads one list per rank, each
  // head in [0, heads_q); every head owned exactly once within every group; ring_order
  // empty or a permutation of the groups; ranks empty or one per world rank.
  absl::Status Validate() const;

  // Group index and position inside the group of every world rank (Validate() first).
  std::vector<int> GroupOfRank() const;
  std::vector<int> IndexInGroup() const;
  // The ring order, with the empty default expanded to 0..G-1.
  std::vector<int> RingOrder() const;
  // Fraction of the whole row's tokens (work) held by each world rank before the
  // all-to-all: sequence_weight(g) / sum * token_weight(i) / sum in group.
  std::vector<double> RankShares() const;
  // KV heads rank i of group g needs (sorted, unique).
  std::vector<int> KvHeadsOf(int group, int index) const;
  // A hash of what the ranks do under the plan: num_ranks, the head counts, every group's
  // ranks, sequence weight, token weights and heads, the ring order (empty and the
  // expanded default hash alike) and node_stores (false only). Equal for equal structures on every
  // platform; the predictions and the description do not count. Cheap: one pass over the fields,
  // for the ranks' agreement on a batch.
  uint64_t Fingerprint() const;

  friend bool operator==(const Plan&, const Plan&) = default;
};

// "0-5,12" for {0,1,2,3,4,5,12}; the input need not be sorted.
std::string FormatHeads(const std::vector<int>& heads);
// Inverse of FormatHeads: comma-separated heads and inclusive ranges "a-b"; "" is empty.
absl::StatusOr<std::vector<int>> ParseHeads(absl::string_view text);

// A human-readable summary, one line per group and rank.
std::string DescribePlan(const Plan& plan);

}  // namespace hsap

#endif  // HSAP_LIB_SCHED_PLAN_H_
