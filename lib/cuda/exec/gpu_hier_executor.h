// Runs one rank's part of a hierarchical (head x context parallel) batch on a device: the
// GPU counterpart of lib/exec/hierarchical_executor.h, with the same stages and the same bytes.
//
// Every data movement is an ExchangeProgram (exchange_program.h) built once per batch from
// the rank's RankHierarchy: the ragged all-to-all-v inside the group (Q, K, V, dout and the
// fp32 lse/delta in; out, lse, dQ, dK, dV back), the sub-ring K/V of each step and the
// fp32 dK/dV partials returned along them. A stage packs its outgoing messages on the
// compute stream (copy_chunks), makes the transfer stream wait for it (event), posts the
// messages, and after the host saw the stage complete unpacks on the compute stream. The
// attention kernels get the rank's kv_head_of_q map (uneven, non-contiguous heads). lse and
// delta travel head-major ([heads, rows] pieces), so no transpose is needed.
//
// Order (NCCL matches by posting order): every rank posts the group's all-to-all stages in
// the same order, the sub-ring stages in the global order of nccl_lowering.h (forward by
// step; backward kv(t) before grad(t - 1)), then the all-to-all back. A step's node
// fan-out (and backward fan-in) sits where its gradient group would (protocol.h: after
// kv(t + 1), before kv(t + 2)) in both passes, so ranks of different groups with
// different steps (a node store's keeper and its receivers) post them in one order; the
// stores' final return is the backward's last sub-ring group.
//
// Streams, memory and results: as lib/cuda/exec/gpu_executor.h (pool regions, no allocation in
// a call, dK/dV not bitwise reproducible).
//
// Topology (a hierarchy built with the communicator's nodes, lib/sched/hierarchy.h 5.): as
// the host executor, right after a step's direct K/V arrived, one exchange among the group's
// members of each node forwards the gateway's rows to the node's other receivers (tag
// kKvFanOut), so a step's rows cross the inter-node link once per node; backward, right
// after computing the step, the receivers return their fp32 dK/dV partials of those rows
// to the gateway (kKvGradFanIn), which adds them to its own in fan-out order before its
// one return to the holder. Fan-out buffers are pool regions sized by Build. Link classes
// are counted per posted message from GpuHierContext::node_of_rank.
//
// Node stores (hierarchy.h 6.), as the host executor: a holder's store segments travel to
// their keeper with the step's K/V (tag kKvStore) into the keeper's store, a pool region
// [store_rows, D] K and V. At a participant's step the keeper, after the direct receives,
// fills its slot's store-fed heads from the store, then runs the fan-out exchange (also at
// steps where it receives nothing) with its forwards from the store added to its sends.
// Backward: the keeper adds, in order, the gateway fan-in partials into its step partial,
// the filled heads' step partial into its fp32 store partial, then each forward's receiver
// partials into the store partial (one launch per message, bitwise reproducible); after the
// last step one more exchange returns the store partials to the holders (kKvStoreGrad),
// which add them into their dK/dV in the keeper's step order.
#ifndef HSAP_LIB_CUDA_EXEC_GPU_HIER_EXECUTOR_H_
#define HSAP_LIB_CUDA_EXEC_GPU_HIER_EXECUTOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "lib/comm/transport.h"
#include "lib/cuda/exec/device_hier_program.h"
#include "lib/cuda/exec/exchange_program.h"
#include "lib/cuda/exec/gpu_executor.h"
#include "lib/cuda/runtime/device.h"
#include "lib/exec/runner.h"
#include "lib/sched/hierarchy.h"

namespace hsap::cuda {

struct GpuHierContext {
  Device* device = nullptr;
  const DeviceKernels* kernels = nullptr;
  Transport* transport = nullptr;
  const DeviceHierProgram* program = nullptr;
  void* pool = nullptr;  // at least program->pool_bytes()
  size_t pool_bytes = 0;
  uint64_t call_id = 0;
  cudaStream stream = nullptr;  // the compute stream
  GpuExecMode mode = GpuExecMode::kFull;
  // The node of every world rank, to count link classes (null or empty: one node).
  const std::vector<int>* node_of_rank = nullptr;
  // The cuDNN engine's calls per step (step 0: local work, step i + 1: sub-ring step i), when
  // the batch gave cuDNN pieces; null: every piece on the JIT kernels.
  const CudnnSteps* cudnn = nullptr;
};

// Tensors as in lib/exec/hierarchical_executor.h, in device memory, ordered on ctx.stream.
// `links`: the same bytes by link class (ctx.node_of_rank), counted per posted message.
absl::Status GpuHierarchicalForward(const GpuHierContext& ctx, const void* q, const void* k,
                                    const void* v, void* out, float* lse, HierTraffic* traffic,
                                    LinkTraffic* links = nullptr);
absl::Status GpuHierarchicalBackward(const GpuHierContext& ctx, const void* dout, const void* q,
                                     const void* k, const void* v, const void* out,
                                     const float* lse, void* dq, void* dk, void* dv,
                                     HierTraffic* traffic, LinkTraffic* links = nullptr);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_GPU_HIER_EXECUTOR_H_
