// The per-batch schedule of one rank: which K/V rows it receives from whom, which of its
// rows it sends to whom, and the work lists of the kernels, stage by stage.
//
// Stages. Stage 0 computes the rank's queries against its own keys. At stage t = 1..R-1,
// rank r receives from (r - t) mod R the key rows of that peer's shard that r's queries
// see, and sends to (r + t) mod R the rows of its own shard that the peer's queries see
// (with every pair busy this is exactly ring order; a pair with nothing to move is skipped
// by both sides, so a document on few ranks is delivered directly, peer to peer). Rows are
// chosen at row granularity from the mask: every K/V row a rank needs arrives exactly once,
// and no row that none of its queries sees is sent. Stages where the rank neither sends
// nor receives are absent from its list; stages where no rank moves anything are absent
// from every list.
//
// Backward runs the same stages: the K/V rows travel again, and the fp32 dK/dV partials of
// the received rows travel back to their owner at the same stage (reverse direction),
// where they are added in stage order, so the result is bitwise reproducible.
//
// Topology (node_of_rank given, ranks on several nodes). A K/V row of owner o needed by k >= 2
// ranks of another node B would cross the inter-node link k times if delivered directly.
// Instead it is relayed: it crosses once, to one rank of B (the gateway of (o, B)), which
// forwards it to the others over intra-node links. Cost rule: a row needed by k ranks of B
// costs k inter-node transfers directly and 1 inter-node + (k - 1) intra-node transfers
// relayed (k when the gateway does not need it itself), so relaying wins whenever an
// intra-node byte is cheaper than an inter-node one — the only case a topology describes;
// rows needed by one rank of B go directly. A gateway fans out (one hop to each rank that
// needs the row) rather than forwarding along the node's ring: both move the same
// intra-node bytes, the fan-out in one hop. So every K/V row needed by a node and owned
// outside it enters that node exactly once.
//
// Gateways: for each owner o (increasing) and node B (increasing), the rows of o needed by
// at least two ranks of B ("shared rows") go to the rank of B, among those needing some of
// them, with the fewest shared rows assigned so far (ties: lowest rank), so gateway duty
// spreads over the node's ranks. The gateway's direct stage from o carries its own rows
// plus the shared rows (the buffer is kept in its relay store); the others' direct stages
// from o carry only their unshared rows. After the direct stages, fan-out stages (step
// R + d, d = 1..R-1) move rows from the relay store of rank r - d to rank r of the same node.
//
// Backward: the K/V travel again the same way. The fan-out's fp32 dK/dV partials return to
// the gateway at their stage and are added into its relay store after its own partial, in
// stage order; once all stages are done, the gateway returns each kept buffer's summed
// partials to the owner (the return phase), which adds them after its other partials, in
// stage order. So gradients cross the node boundary once too, and the result is bitwise
// reproducible.
//
// With every rank on one node (or no topology) the schedule is exactly the direct one.
//
// The schedule is a pure function of (layout, partition, topology, rank): every rank builds
// the same view of each pair, so matching sends and receives always agree.
#ifndef HSAP_LIB_SCHED_SCHEDULE_H_
#define HSAP_LIB_SCHED_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "lib/sched/partition.h"

namespace hsap {

struct Stage {
  int step = 0;  // t in 1..R-1: direct; R + d (d in 1..R-1): fan-out inside a node

  // Direct stages: receive from (rank - step) mod R; fan-out stages: from (rank - d) mod R.
  // Into a buffer of recv_rows rows laid out by recv_runs (global positions -> buffer rows,
  // increasing). recv_from < 0: none.
  int recv_from = -1;
  std::vector<TokenRun> recv_runs;
  int64_t recv_rows = 0;
  WorkList recv_work;  // this rank's queries (local rows) x the receive buffer
  // >= 0: the buffer also holds rows this rank relays; it is kept as rows [store_begin,
  // store_begin + recv_rows) of the relay store, and its dK/dV partials go back to recv_from
  // in the return phase (not at this stage).
  int64_t store_begin = -1;

  // Send to (rank + step) mod R (fan-out: (rank + d) mod R) the rows listed by send_runs
  // (global positions -> local rows of the shard, or of the relay store for a fan-out,
  // increasing global positions); they are packed in that order. send_to < 0: none.
  int send_to = -1;
  std::vector<TokenRun> send_runs;
  int64_t send_rows = 0;
  bool send_from_store = false;  // a fan-out: send_runs index the relay store
  // The destination relays some of these rows: their partials come back in the return
  // phase (not at this stage).
  bool send_grads_deferred = false;
};

struct Schedule {
  int rank = 0;
  int num_ranks = 1;
  int64_t local_rows = 0;
  std::vector<TokenRun> local_runs;  // the shard: global positions -> local rows
  WorkList local_work;               // stage 0: local queries x local keys
  std::vector<Stage> stages;         // increasing step; only stages that move something
  // Rows of the relay store (the kept buffers of stages with store_begin >= 0).
  int64_t store_rows = 0;

  // Index of the first fan-out stage (stages.size() when there is none): the direct stages
  // come first, and a fan-out may only start once they are all received.
  size_t first_fan_out() const;
  int64_t rows_sent() const;
  int64_t rows_received() const;
};

// Builds `rank`'s schedule. block_q: query rows per kernel block (kKernelBlockQ).
// node_of_rank: the node of every partition rank (empty: all on one node).
absl::StatusOr<Schedule> BuildSchedule(const Layout& layout, const Partition& partition, int rank,
                                       int64_t block_q, absl::Span<const int> node_of_rank = {});

// The key rows of every rank that the queries of another rank see, from one scan of the mask:
// needs[k * R + q] lists the ranges of k's keys that q's queries see (sorted and merged: the
// direct schedule's receive rows of q from k), for the pairs q != k that want(q, k) accepts.
// want(q, -1) is asked first for each query placement and must be true when any key rank may
// be wanted for q.
absl::flat_hash_map<int64_t, std::vector<TokenRange>> KeyRowsNeeded(
    const Layout& layout, const Partition& partition,
    absl::FunctionRef<bool(int query_rank, int key_rank)> want);

// Token-range helpers (ranges sorted by begin; "merged": disjoint and not adjacent).
// Sorts `ranges` and merges the overlapping or adjacent ones.
void SortAndMerge(std::vector<TokenRange>& ranges);
// a intersected with b; both sorted and merged.
std::vector<TokenRange> Intersect(const std::vector<TokenRange>& a,
                                  const std::vector<TokenRange>& b);
// The local rows of `runs`, as token ranges in run order.
std::vector<TokenRange> LocalRows(const std::vector<TokenRun>& runs);
// Runs (global positions -> local rows of a buffer laid out by `runs`) for `ranges` (sorted,
// merged, each inside the buffer), with `offset` added to the local rows, appended to `out`.
void AppendRunsIn(const std::vector<TokenRange>& ranges, const std::vector<TokenRun>& runs,
                  int64_t offset, std::vector<TokenRun>& out);

}  // namespace hsap

#endif  // HSAP_LIB_SCHED_SCHEDULE_H_
