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
// The schedule is a pure function of (layout, partition, rank): every rank builds the
// same view of each pair, so matching sends and receives always agree.
#ifndef HSAP_LIB_SCHED_SCHEDULE_H_
#define HSAP_LIB_SCHED_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "lib/sched/partition.h"

namespace hsap {

struct Stage {
  int step = 0;  // t in 1..R-1

  // Receive from (rank - step) mod R, into a buffer of recv_rows rows laid out by
  // recv_runs (global positions -> buffer rows, increasing). recv_from < 0: none.
  int recv_from = -1;
  std::vector<TokenRun> recv_runs;
  int64_t recv_rows = 0;
  WorkList recv_work;  // this rank's queries (local rows) x the receive buffer

  // Send to (rank + step) mod R the rows of this rank's shard listed by send_runs
  // (global positions -> local rows of the shard, increasing); they are packed in that
  // order. send_to < 0: none.
  int send_to = -1;
  std::vector<TokenRun> send_runs;
  int64_t send_rows = 0;
};

struct Schedule {
  int rank = 0;
  int num_ranks = 1;
  int64_t local_rows = 0;
  std::vector<TokenRun> local_runs;  // the shard: global positions -> local rows
  WorkList local_work;               // stage 0: local queries x local keys
  std::vector<Stage> stages;         // increasing step; only stages that move something

  int64_t rows_sent() const;
  int64_t rows_received() const;
};

// Builds `rank`'s schedule. block_q: query rows per kernel block (kKernelBlockQ).
absl::StatusOr<Schedule> BuildSchedule(const Layout& layout, const Partition& partition, int rank,
                                       int64_t block_q);

}  // namespace hsap

#endif  // HSAP_LIB_SCHED_SCHEDULE_H_
