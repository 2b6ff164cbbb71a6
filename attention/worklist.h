// Work lists: which (query block, key range) pairs a kernel computes, in buffer rows.
//
// A kernel reads queries from one buffer and keys/values from another. Each buffer holds
// some token positions of the packed row, described by runs. BuildWorkList intersects the
// mask slices with those runs and cuts the queries into blocks of at most `block_q` rows;
// every visible (query, key) pair that both buffers hold appears exactly once. Fully
// masked ranges are never listed; ranges that are partly masked carry a diagonal band that
// the kernel applies per element.
//
// A block never spans two runs nor a boundary of a slice's query range (like varlen
// FlashAttention, whose blocks never span two documents), so every segment's band holds for
// all rows of its block. A segment's key range is clipped to the keys some row of the
// block sees; a side of the band that no pair of the block needs is dropped (so a fully
// visible range is marked full). A partial segment may still contain fully visible and
// fully masked key tiles (e.g. the causal segment [0, q_end) of a block); the kernel
// classifies each of its tiles in O(1).
#ifndef HSAP_ATTENTION_WORKLIST_H_
#define HSAP_ATTENTION_WORKLIST_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/layout.h"

namespace hsap {

// Buffer rows [local_begin, local_begin + length) hold the tokens at positions
// [global_begin, global_begin + length) of the packed row.
struct TokenRun {
  int64_t global_begin = 0;
  int64_t local_begin = 0;
  int64_t length = 0;

  friend bool operator==(const TokenRun&, const TokenRun&) = default;
};

// Key rows [k_begin, k_end) of the key buffer, seen by the rows of a query block under a
// band in buffer-row coordinates: key row kr is visible to query row qr iff
//   diag_lo <= kr - qr <= diag_hi.
// Full segments have diag_lo <= -kNoDiagLimit and diag_hi >= kNoDiagLimit.
struct KeySegment {
  int64_t k_begin = 0, k_end = 0;
  int64_t diag_lo = -kNoDiagLimit;
  int64_t diag_hi = kNoDiagLimit;

  bool IsFull() const { return diag_lo <= -kNoDiagLimit && diag_hi >= kNoDiagLimit; }
  friend bool operator==(const KeySegment&, const KeySegment&) = default;
};

// Query rows [q_begin, q_end) of the query buffer and their segments
// WorkList::segments[seg_begin, seg_end). Segments of a block are sorted by k_begin and
// are disjoint in the (query, key) plane.
struct QueryBlock {
  int64_t q_begin = 0, q_end = 0;
  int64_t seg_begin = 0, seg_end = 0;

  friend bool operator==(const QueryBlock&, const QueryBlock&) = default;
};

struct WorkList {
  std::vector<QueryBlock> blocks;  // sorted by q_begin, disjoint
  std::vector<KeySegment> segments;
  int64_t visible_pairs = 0;  // per head

  bool empty() const { return blocks.empty(); }
};

// Intersects `slices` (global positions, non-overlapping, e.g. Layout::slices()) with the
// query and key buffers' runs. Runs of one buffer must not overlap in global or local
// positions; runs of length 0 are ignored. block_q > 0. Cost: O((slices + runs) log +
// blocks * (slices per block) * log(k_runs)); about 2 ms for 1M tokens in 10,000 documents.
absl::StatusOr<WorkList> BuildWorkList(absl::Span<const MaskSlice> slices,
                                       absl::Span<const TokenRun> q_runs,
                                       absl::Span<const TokenRun> k_runs, int64_t block_q);

// The single-device case: both buffers hold the whole row.
absl::StatusOr<WorkList> BuildWorkList(const Layout& layout, int64_t block_q);

}  // namespace hsap

#endif  // HSAP_ATTENTION_WORKLIST_H_
