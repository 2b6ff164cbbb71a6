// Sequence-aware partition: which tokens of a packed row each rank holds.
//
// The work of a query token is the number of keys it sees (Layout::VisibleKeysPerQuery); a
// rank computes every visible pair of the queries it holds, so its work is the sum over
// its tokens. Rank r's target is W * weights[r] / sum(weights), W the row's total work.
//
// Algorithm (deterministic: every rank computes the same partition from the same inputs):
//  1. Units: each non-empty document of a document layout; the whole row for a layout built
//     from slices. Units are visited by decreasing work (ties: position in the row).
//  2. A unit that fits in the remaining capacity of some rank goes whole to the rank with
//     the smallest remaining capacity that fits (best-fit decreasing): zero communication.
//     A unit that fits nowhere still goes whole to the roomiest rank when it overshoots
//     that rank's capacity by at most 1% of the smallest target.
//  3. Otherwise the unit is split: ranks by decreasing remaining capacity each receive a
//     piece whose work fills their capacity, cut at the prefix sum of the unit's work that
//     is nearest to it. Causal and prefix-LM documents are cut in folded ("zigzag") order:
//     folded position f holds tokens f and L-1-f, so a piece is an early chunk plus the
//     mirrored late chunk and holds as many tokens as work (memory follows work). Full and
//     sliding-window documents and slice layouts are cut into contiguous pieces.
//  A row without visible pairs is split by token count (memory only).
//
// Balance rule (tested): with g = max_position_work() (the work of one folded position of
// a unit that went through step 3, at most twice its largest per-token work; 0 if none) and
// min_target the smallest target of a rank of positive weight,
//   |work(r) - target(r)| <= 0.02 * min_target + 2 * g       for every rank r.
// Memory (tokens held) is proportional to work inside split documents; across whole
// documents it cannot be both (a causal document's work grows with the square of its
// length), and work wins.
//
// Every token belongs to exactly one rank. A rank's shard holds its token ranges in
// increasing order of position (adjacent ranges merged); a rank may hold no token (e.g.
// fewer tokens than ranks); a rank of weight 0 never holds one. No length needs to be a multiple of
// anything.
#ifndef HSAP_LIB_SCHED_PARTITION_H_
#define HSAP_LIB_SCHED_PARTITION_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/layout.h"
#include "attention/worklist.h"

namespace hsap {

// A maximal range of the row held by one rank, at rows [local_begin, ...) of its shard.
struct Placement {
  int64_t begin = 0, end = 0;
  int rank = 0;
  int64_t local_begin = 0;
};

class Partition {
 public:
  // weights: one finite value >= 0 per rank, at least one positive; empty means equal. A
  // rank of weight 0 holds no token. num_ranks >= 1.
  static absl::StatusOr<Partition> Create(const Layout& layout, int num_ranks,
                                          absl::Span<const double> weights = {});
  // One partition shared by the masks of several layers over the same row (every layout
  // has the same token count): the algorithm above with a token's work summed over the
  // layouts, so that the sum of the layers' work is balanced (the balance rule holds for
  // that sum). Units are the documents when every layout is a document layout with the
  // same non-empty documents (a document is folded when some layout makes it causal or
  // prefix-LM), else the whole row. With one layout it is Create(layout, ...).
  static absl::StatusOr<Partition> Create(absl::Span<const Layout* const> layouts, int num_ranks,
                                          absl::Span<const double> weights = {});
  // A partition given by its ranges (e.g. the shards of a hierarchical plan, see
  // hierarchy.h): ranges[r] are rank r's token ranges, increasing and disjoint, and all of
  // them together tile [0, layout.num_tokens()). Adjacent ranges of a rank are merged.
  // work(r) is the work of r's tokens, target(r) = work(r), weights() the work shares
  // (token shares when nothing is visible); max_position_work() and split_units() are 0.
  static absl::StatusOr<Partition> FromRanges(const Layout& layout,
                                              std::vector<std::vector<TokenRange>> ranges);

  int num_ranks() const { return static_cast<int>(ranges_.size()); }
  int64_t num_tokens() const { return num_tokens_; }
  // Token ranges of `rank`, increasing and disjoint: the order of its local shard.
  const std::vector<TokenRange>& ranges(int rank) const { return ranges_[rank]; }
  int64_t local_tokens(int rank) const { return local_tokens_[rank]; }
  // A hash of the ranges of every rank, equal for equal partitions; used to check that
  // ranks share one.
  uint64_t Fingerprint() const;
  // The shard of `rank` as runs (global position <-> local row).
  std::vector<TokenRun> Runs(int rank) const;
  // Every range of every rank, sorted by position; they tile [0, num_tokens).
  const std::vector<Placement>& placements() const { return placements_; }
  // Index into placements() of the range holding `position` (0 <= position < num_tokens).
  size_t PlacementIndexOf(int64_t position) const;
  // The same, searching near `hint` first (cheap when the answer is close to it).
  size_t PlacementIndexOf(int64_t position, size_t hint) const;

  // The balance figures: the weights used (normalised to sum 1), the work each rank got
  // and its target, and g of the balance rule above.
  const std::vector<double>& weights() const { return weights_; }
  int64_t work(int rank) const { return work_[rank]; }
  double target(int rank) const { return target_[rank]; }
  int64_t max_position_work() const { return max_position_work_; }
  // Number of documents (units) cut across more than one rank.
  int64_t split_units() const { return split_units_; }

  // Copies a packed row [num_tokens, bytes_per_token] into per-rank shards
  // (shards[r]: [local_tokens(r), bytes_per_token]) and back.
  void Scatter(const void* row, size_t bytes_per_token, void* const* shards) const;
  void Gather(const void* const* shards, size_t bytes_per_token, void* row) const;

 private:
  int64_t num_tokens_ = 0;
  std::vector<std::vector<TokenRange>> ranges_;
  std::vector<int64_t> local_tokens_;
  std::vector<Placement> placements_;
  std::vector<double> weights_;
  std::vector<int64_t> work_;
  std::vector<double> target_;
  int64_t max_position_work_ = 0;
  int64_t split_units_ = 0;
};

}  // namespace hsap

#endif  // HSAP_LIB_SCHED_PARTITION_H_
