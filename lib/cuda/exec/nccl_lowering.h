// Lowering a rank's schedule to the NCCL calls that move its data.
//
// NCCL point-to-point has no tags: inside a communicator, the n-th ncclSend from a to b
// meets the n-th ncclRecv on b from a, and the operations between ncclGroupStart and
// ncclGroupEnd progress together. Groups enqueued on one stream run one after another. So
// the order of the groups on every rank must be such that (1) each directed pair's sends
// and receives meet in the same order with the same sizes, and (2) no group waits for a
// group that a peer enqueues only after one waiting on this rank (a cycle = deadlock).
//
// The lowering (the protocol of lib/exec/protocol.h, which every executor follows) guarantees
// both by labelling each group with a global (pass, step) label and
// emitting every rank's groups in one global order of labels: forward kv(1), kv(2), ...;
// backward kv(1), kv(2), grad(1), kv(3), grad(2), ..., grad(R-1) (the K/V of step t+1 is in
// flight while step t's gradients go back, as in the host executor). A group with label L
// only meets groups with label L on its peers, so every group is self-contained and the
// whole sequence is deadlock free. Relays (ranks on several nodes, lib/sched/schedule.h):
// the fan-out stages (steps R + d) follow the direct stages in the same label order, and
// the backward ends with one group returning the relays' summed partials ("bwd relay
// return": each gateway sends, each owner receives, tags kRelayKeyGrad/ValueGrad); a
// relayed buffer's partials are absent from its stage's gradient group. Inside a group operations
// are sorted by (peer, tag), so the two sides of a pair list their K and V messages in the same
// order.
//
// CheckNcclPrograms simulates the NCCL semantics above for all ranks and names any
// mismatch or deadlock; the tests run it on the lowering and on the host executor's own
// order of stages.
#ifndef HSAP_LIB_CUDA_EXEC_NCCL_LOWERING_H_
#define HSAP_LIB_CUDA_EXEC_NCCL_LOWERING_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "lib/comm/p2p_group.h"
#include "lib/comm/transport.h"
#include "lib/sched/schedule.h"

namespace hsap::cuda {

// The NCCL program of one forward / backward of `schedule` (see above).
P2pProgram LowerForward(const Schedule& schedule, const AttentionDims& dims, DType dtype,
                        uint64_t call_id);
P2pProgram LowerBackward(const Schedule& schedule, const AttentionDims& dims, DType dtype,
                         uint64_t call_id);

// Simulates programs[r] (rank r's groups, in stream order) under NCCL semantics. Errors
// (FailedPrecondition): a send and a receive that meet with different sizes or tags, a
// message without partner, a peer outside [0, R), or a deadlock (naming every blocked
// rank's group).
absl::Status CheckNcclPrograms(absl::Span<const P2pProgram> programs);

// "group_start; send(peer 1, 4096 B); recv(peer 3, 4096 B); group_end" per group, one a line.
std::string FormatNcclProgram(const P2pProgram& program);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_NCCL_LOWERING_H_
