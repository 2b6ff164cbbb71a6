// Runs one rank's schedule on a communicator with a kernel set.
//
// Forward: stage 0 computes the local queries against the local keys while the first
// remote stage's transfers are in flight; at each remote stage the transfers of the next
// stage are posted before the current one is computed (double-buffered K/V). The kernels
// merge every partial result by its log-sum-exp into fp32 accumulators; the output is
// rounded to the storage dtype once, at the end.
//
// Backward: the K/V rows travel again along the same stages; each rank computes dQ for its
// queries and fp32 dK/dV partials for the rows it received, and sends those back to their
// owner at the same step (reverse direction). An owner adds the partials of its rows in
// step order after its local gradient, so the result is bitwise the same from run to run.
//
// Relays (a schedule on several nodes, schedule.h): the direct stages run first, then the
// fan-out stages, which send from the relay store (the kept receive buffers, received
// straight into it). In the backward a gateway computes a kept buffer's partials into the
// store, adds the fan-out's returned partials into it in stage order, and after the last
// stage returns each kept buffer's sums to its owner (Payload::kRelayKeyGrad/ValueGrad),
// which adds them in stage order after all its other partials.
//
// Sends of a single contiguous run of rows go straight from the caller's tensors (zero
// copy); others are packed. Transport stages are named like "forward step 3 (kv from rank
// 1, to rank 5)" so that a timeout says where it happened.
#ifndef HSAP_LIB_EXEC_EXECUTOR_H_
#define HSAP_LIB_EXEC_EXECUTOR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "lib/comm/communicator.h"
#include "lib/sched/schedule.h"

namespace hsap {

// Payload bytes of one call, summed over the operations it posted (K/V rows and gradient
// partials; the agreement checks of a batch are not counted).
struct ExecTraffic {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  // The same bytes by link class (the communicator's topology): messages between ranks of
  // one node and of different nodes, counted per message by the host executor.
  uint64_t intra_node_sent = 0, intra_node_received = 0;
  uint64_t inter_node_sent = 0, inter_node_received = 0;
};

// Adds a message of `bytes` between this rank and `peer` to `t`, by link class (every
// host executor counts its messages this way).
void Tally(ExecTraffic& t, const Communicator& comm, int peer, uint64_t bytes, bool sent);
// The same, the link class given (executors that know the nodes otherwise).
void Tally(ExecTraffic& t, bool intra_node, uint64_t bytes, bool sent);
// to += from, field by field.
void AddTraffic(ExecTraffic& to, const ExecTraffic& from);

// Bytes a forward / backward of `schedule` moves, predicted from the schedule alone.
ExecTraffic ForwardTraffic(const Schedule& schedule, const AttentionDims& dims, DType dtype);
ExecTraffic BackwardTraffic(const Schedule& schedule, const AttentionDims& dims, DType dtype);

struct ExecContext {
  Communicator* comm = nullptr;
  const Schedule* schedule = nullptr;
  const KernelSet* kernels = nullptr;
  AttentionDims dims;
  DType dtype = DType::kF32;
  // Distinguishes the transfers of one call from every other call's (tag bits 20..62).
  uint64_t call_id = 0;
};

// q/out: [local_rows, heads_q, head_dim]; k/v: [local_rows, heads_kv, head_dim], all in
// ctx.dtype; lse: fp32 [heads_q, local_rows].
absl::Status ExecuteForward(const ExecContext& ctx, const void* q, const void* k, const void* v,
                            void* out, float* lse, ExecTraffic* traffic);

// dout, q, out, dq: [local_rows, heads_q, head_dim]; k, v, dk, dv: [local_rows, heads_kv,
// head_dim]; lse as produced by ExecuteForward.
absl::Status ExecuteBackward(const ExecContext& ctx, const void* dout, const void* q, const void* k,
                             const void* v, const void* out, const float* lse, void* dq, void* dk,
                             void* dv, ExecTraffic* traffic);

}  // namespace hsap

#endif  // HSAP_LIB_EXEC_EXECUTOR_H_
