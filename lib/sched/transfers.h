// The transfer program of a rank: every message it posts and the work it computes, stage
// by stage, in the order the executors run them. Built from the same Schedule (flat
// batches, lib/exec/executor.h) or RankHierarchy (plans, lib/exec/hierarchical_executor.h)
// the runtime executes, so the bytes, the peers, the step counts and the work per step of a
// program are those of a run, by construction. The planner's simulator prices programs;
// tests compare their byte totals with what the executors report.
//
// A pass (forward or backward) runs, in this order:
//  1. `before`: the all-to-alls into the head layout, one per tensor, each completed before
//     the next starts (plans only; forward q, k, v; backward q, dout, k, v, lse + delta).
//     An all-to-all posts one message to and from every other member of the group, zero
//     bytes included.
//  2. The K/V stages (lib/exec/staged.h): stage 0 posts its K/V, then the rank computes
//     `local_pairs` (its queries against its own keys) while it is in flight; at stage i
//     it posts stage i + 1's K/V, waits for stage i's and computes `pairs` against it.
//     Backward: after computing stage i the rank posts stage i's gradient group (`grad`:
//     the fp32 dK/dV partials of the rows it received go back to their sender; partials of
//     its own rows come back from their users) and then completes stage i - 1's gradient
//     group, so a stage's gradients return one step later (protocol::BackwardPostingOrder).
//     Flat batches on several nodes (relays, lib/sched/schedule.h): the direct stages run
//     as above, then the fan-out stages (`fan_out`: forwarded from the relay store) as a
//     second staged run with no local work, once every direct stage is done. A relayed
//     buffer's gradients do not travel at its stage: after the last stage the gateway
//     returns their sums to the owner in one final group (`returns`).
//     Plans on several nodes (lib/sched/hierarchy.h, 5. and 6.): a stage's `fan_out_kv`
//     exchange runs once its K/V arrived, before its kernels (a keeper's forwards from its
//     store included); backward, its `fan_in_grad` after them. A node store's segment
//     (`kKvStore`) travels with the stage's K/V; backward, its summed partials go back in
//     the gradient group of its last participant's stage (`kKvGradReturn` in `grad`).
//  3. `after`: the all-to-alls back to the token layout (forward out, lse; backward dq, dk,
//     dv).
// Work is counted in visible (query, key) pairs per query head; the rank's kernels run
// `query_heads` heads over them.
#ifndef HSAP_LIB_SCHED_TRANSFERS_H_
#define HSAP_LIB_SCHED_TRANSFERS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "attention/dtype.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/schedule.h"

namespace hsap {

enum class TransferKind {
  kKv,            // K and V rows of a stage (two messages on the flat ring, one per peer in plans)
  kKvGrad,        // backward: fp32 dK/dV partials returned to the rows' sender
  kKvGradReturn,  // backward: a gateway's (relays) or keeper's (node stores) summed fp32
                  // dK/dV partials to the owner
  kAllToAll,      // a group all-to-all (plans)
  kKvFanOut,      // plans on several nodes: a gateway forwards a step's K/V inside its node
  kKvGradFanIn,   // backward: the fan-out's fp32 dK/dV partials back to the gateway
  kKvStore,       // plans on several nodes: a node store's rows of one head, holder to keeper
};

// Bytes of a pass by link class.
struct LinkBytes {
  uint64_t intra_sent = 0, intra_received = 0, inter_sent = 0, inter_received = 0;
  friend bool operator==(const LinkBytes&, const LinkBytes&) = default;
};

// One message as seen by this rank.
struct Transfer {
  int peer = -1;  // world rank
  bool send = false;
  TransferKind kind = TransferKind::kKv;
  uint64_t bytes = 0;
  bool inter_node = false;  // crosses a node boundary (programs built with a topology)
  friend bool operator==(const Transfer&, const Transfer&) = default;
};

// One all-to-all: a message to and from every other member, in group order.
struct Exchange {
  const char* what = "";  // the tensor: "q", "k", "v", "out", "lse", "dout", ...
  std::vector<Transfer> transfers;
};

struct ProgramStage {
  int step = 0;                // the schedule's step t (ring distance), >= 1
  bool fan_out = false;        // forwards rows of the relay store (step >= R)
  std::vector<Transfer> kv;    // K/V sends and receives posted for this stage
  std::vector<Transfer> grad;  // backward only: the stage's gradient group
  // Plans on several nodes: the step's fan-out (K/V from the gateway) and, backward, its
  // fan-in (partials back to the gateway); each one exchange completed after the stage's
  // K/V arrived (fan_out_kv before the stage's kernels, fan_in_grad after them, before `grad`).
  std::vector<Transfer> fan_out_kv, fan_in_grad;
  int64_t pairs = 0;  // visible pairs against the rows received, per query head
};

struct PassProgram {
  std::vector<Exchange> before;
  int64_t local_pairs = 0;  // visible pairs against the rank's own keys, per query head
  std::vector<ProgramStage> stages;
  // Backward of relayed flat batches: the final gradient return group, posted once every
  // stage is done.
  std::vector<Transfer> returns;
  std::vector<Exchange> after;

  // Byte totals split as the runtime reports them (hsapBatchGetTrafficDetail): all-to-all
  // messages, and K/V + gradient messages ("ring").
  HierTraffic Traffic() const;
  // Bytes by link class as hsapBatchGetLinkTraffic reports them (Transfer::inter_node).
  LinkBytes Links() const;
  int64_t pairs() const;  // local_pairs + every stage's pairs
};

struct RankProgram {
  int rank = 0;
  int query_heads = 0;     // heads the rank's kernels compute
  int64_t query_rows = 0;  // rows of those queries (local shard, or group buffer for plans)
  PassProgram forward, backward;
};

// The program of a flat (sequence-aware ring) batch's rank: `schedule` from BuildSchedule,
// heads and head_dim of the layer, the storage dtype. node_of_rank: the topology the
// schedule was built with (empty: one node), which sets each message's link class.
RankProgram ProgramOf(const Schedule& schedule, int heads_q, int heads_kv, int head_dim,
                      DType dtype, absl::Span<const int> node_of_rank = {});

// The program of a rank of a plan's batch: `rank` from Hierarchy::BuildRank. node_of_rank:
// the topology the hierarchy was built with (empty: one node), which sets link classes.
RankProgram ProgramOf(const RankHierarchy& rank, int head_dim, DType dtype,
                      absl::Span<const int> node_of_rank = {});

}  // namespace hsap

#endif  // HSAP_LIB_SCHED_TRANSFERS_H_
