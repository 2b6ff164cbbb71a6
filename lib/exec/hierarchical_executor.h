// Runs one rank's part of a hierarchical (head x context parallel) batch: the ragged
// all-to-all-v inside the group, the sub-ring schedule across groups, the kernels, and the
// all-to-all back (see hierarchy.h for the layout).
//
// Forward: Q, K, V of the rank's shard go to the members holding their heads (one
// AllToAllV each); the rank then computes its query heads over the whole group buffer:
// local keys first, while the first sub-ring step's K/V is in flight, then every step's
// received rows, posting step i+1 before computing step i (double-buffered). Partial
// results are merged by log-sum-exp inside the kernels in fp32; out (rounded once to the
// storage dtype) and lse (fp32) go back to the shards' owners.
//
// Backward: delta = rowsum(dout * out) is computed by the shard's owner and travels with
// lse (fp32), instead of out; Q, K, V and dout go out again; the sub-rings run as in the
// forward and the fp32 dK/dV partials of received rows return to their sender at the same
// step, where they are added in step and transfer order. dQ returns in the storage dtype;
// dK/dV return in fp32 when a KV head is held by several members (the owner adds them in
// member order and rounds once), else in the storage dtype. The result is bitwise the same
// from run to run.
//
// Topology (the hierarchy built with the communicator's nodes, hierarchy.h 5.): at a step
// with a fan-out, the rank first completes the step's direct receives, then runs the
// fan-out exchange with its node's members (the gateway forwards), then its kernels; in
// the backward the fan-out receivers' fp32 partials go to the gateway right after the
// step's kernels (one exchange), and the gateway adds them to its own, in fan-out order,
// before its partials return to the holder. These two exchanges complete inside the step
// (no look-ahead), which keeps the stage loops of staged.h unchanged.
//
// Every transport stage is named ("hier forward step 2 (kv from rank 3, 5; to rank 6)", "hier
// forward all-to-all q"), so a timeout says where it happened.
#ifndef HSAP_LIB_EXEC_HIERARCHICAL_EXECUTOR_H_
#define HSAP_LIB_EXEC_HIERARCHICAL_EXECUTOR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "lib/comm/communicator.h"
#include "lib/exec/executor.h"
#include "lib/sched/hierarchy.h"

namespace hsap {

struct HierExecContext {
  Communicator* comm = nullptr;
  const RankHierarchy* rank = nullptr;
  const KernelSet* kernels = nullptr;
  // The whole layer's heads (heads_q, heads_kv), head_dim and scale; kv_head_of_q unused.
  AttentionDims dims;
  DType dtype = DType::kF32;
  // Distinguishes the transfers of one call from every other call's.
  uint64_t call_id = 0;
};

// q/out: [shard_tokens, heads_q, head_dim]; k/v: [shard_tokens, heads_kv, head_dim], in
// ctx.dtype; lse: fp32 [heads_q, shard_tokens]. traffic may be null; links (may be null)
// receives the same bytes by link class (the communicator's topology), counted per message.
absl::Status HierarchicalForward(const HierExecContext& ctx, const void* q, const void* k,
                                 const void* v, void* out, float* lse, HierTraffic* traffic,
                                 ExecTraffic* links = nullptr);

// dout, q, out, dq: [shard_tokens, heads_q, head_dim]; k, v, dk, dv: [shard_tokens,
// heads_kv, head_dim]; lse as produced by HierarchicalForward.
absl::Status HierarchicalBackward(const HierExecContext& ctx, const void* dout, const void* q,
                                  const void* k, const void* v, const void* out, const float* lse,
                                  void* dq, void* dk, void* dv, HierTraffic* traffic,
                                  ExecTraffic* links = nullptr);

}  // namespace hsap

#endif  // HSAP_LIB_EXEC_HIERARCHICAL_EXECUTOR_H_
