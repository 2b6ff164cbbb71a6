// Runs one rank's schedule on a device: the GPU counterpart of lib/exec/executor.h.
//
// Streams. Tensors and all kernels are on the compute stream (the caller's). A device
// transport moves data on its own stream (TransferStream: NCCL's communication stream or a
// loopback rank's stream); before each stage that stream waits for an event recorded on
// the compute stream, so that packed send rows exist and the receive slot's previous
// reader (the compute of two stages earlier) has finished. The host waits for each stage's
// transfers (Transport::Pending::Wait, with the communicator's deadline) before enqueuing
// the kernels that read them; it never waits for kernels, so the transfers of stage i + 1
// overlap the compute of stage i on the device. A call returns with its last kernels (the
// conversion to the storage dtype) enqueued on the compute stream, like a CUDA call.
//
// Memory. Every buffer is a region of the communicator's pool (buffer_pool.h's PoolLayout
// of the schedule): double-buffered K/V receive and send slots, the relay store, fp32
// accumulators, and for backward the dK/dV partials sent back and received. The work lists are
// uploaded once per batch (DeviceWorkLists). Nothing is allocated in forward or backward.
//
// Order. The stages are posted in the global order of nccl_lowering.h (forward kv(1),
// kv(2), ...; backward kv(1), kv(2), grad(1), kv(3), grad(2), ...), because NCCL matches
// messages by posting order; the tests check the posted stages against LowerForward /
// LowerBackward.
//
// Relays (a schedule on several nodes, lib/sched/schedule.h), as the host executor runs
// them (lib/exec/executor.h): the direct stages first, then the fan-out stages, which send
// from the relay store (kept receive buffers land straight in it). In the backward a
// gateway computes a kept buffer's partials into the store's sums, adds the fan-out's
// returned partials there in stage order, and after the last stage returns each kept
// buffer's sums to its owner (the return phase, one transport group), which adds them in
// stage order after all its other partials. The store and its sums are pool regions too.
//
// Fused forward. With ctx.window set, forward posts no stage: the rank packs the rows its
// peers need into its peer window and publishes them with a flag, before any kernel of the
// call (so that its peers' fused kernels, which spin on that flag, never wait for SM slots
// they hold themselves); fused_fwd_kernel copies each stage's rows from the sender's window
// (waiting on its flag) and attends to them, the copy of stage i + 1 overlapping the
// attention of stage i (peer_window.h has the protocol). Its CTAs take their work by
// ticket, so it finishes whichever of them are resident (hsap_params.cuh).
//
// Results. Forward merges every partial into fp32 (out, lse) in the pool and rounds out to
// the storage dtype at the end. Backward: dq from this rank's queries, dk/dv from the
// local keys plus the partials returned by the ranks that used them, added in step order.
// dk/dv use fp32 atomics inside the backward kernel, so they are not bitwise reproducible
// (the host executor's are).
#ifndef HSAP_LIB_CUDA_EXEC_GPU_EXECUTOR_H_
#define HSAP_LIB_CUDA_EXEC_GPU_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "lib/comm/topology.h"
#include "lib/comm/transport.h"
#include "lib/cuda/exec/cudnn_steps.h"
#include "lib/cuda/exec/exec_util.h"
#include "lib/cuda/runtime/buffer_pool.h"
#include "lib/cuda/runtime/device.h"
#include "lib/cuda/runtime/peer_window.h"
#include "lib/exec/executor.h"
#include "lib/sched/schedule.h"

namespace hsap::cuda {

// What a call runs. The two partial modes exist to measure how much transfer time the
// executor hides behind compute (bench/hsap_attn_perf): kComputeOnly posts no transfer (the
// kernels read whatever the receive buffers hold: results are garbage), kTransfersOnly
// launches no attention kernel (outputs are garbage). Every rank must use the same mode.
enum class GpuExecMode { kFull, kComputeOnly, kTransfersOnly };

// The device side of one rank's batch without a plan, built once at batch creation: the
// schedule's work lists in device memory and the layout of the pool regions its calls use.
class DeviceRingProgram {
 public:
  // `schedule` must outlive the program. With `pool`, grows it to the program's need first
  // (so a device that cannot hold the batch says so before anything is uploaded). Blocks the
  // host until the upload is done.
  static absl::StatusOr<std::unique_ptr<DeviceRingProgram>> Build(Device& device,
                                                                  const Schedule& schedule,
                                                                  const AttentionDims& dims,
                                                                  DType dtype, cudaStream stream,
                                                                  DeviceBufferPool* pool = nullptr);

  const Schedule& schedule() const { return *schedule_; }
  const AttentionDims& dims() const { return dims_; }
  DType dtype() const { return dtype_; }
  const PoolLayout& pool_layout() const { return pool_layout_; }
  const DeviceWorkLists& lists() const { return *lists_; }

 private:
  DeviceRingProgram() = default;
  const Schedule* schedule_ = nullptr;
  AttentionDims dims_;
  DType dtype_ = DType::kBF16;
  PoolLayout pool_layout_;
  std::unique_ptr<DeviceWorkLists> lists_;
};

struct GpuExecContext {
  Device* device = nullptr;
  const DeviceKernels* kernels = nullptr;
  Transport* transport = nullptr;
  const DeviceRingProgram* program = nullptr;
  // The pool: at least program->pool_layout().total_bytes() bytes at `pool`.
  void* pool = nullptr;
  size_t pool_bytes = 0;
  uint64_t call_id = 0;         // the batch's call number (tags, lib/exec/protocol.h)
  cudaStream stream = nullptr;  // the compute stream
  GpuExecMode mode = GpuExecMode::kFull;
  // The fused forward (peer_window.h), when the batch was set up for it: forward moves K/V
  // through the peer windows inside fused_fwd_kernel and posts no stage; backward is
  // unchanged. `peer_timeout`: how long a copy CTA waits for a sender before giving up.
  PeerWindow* window = nullptr;
  const FusedRoutes* routes = nullptr;
  absl::Duration peer_timeout = absl::Minutes(5);
  // The communicator's topology: the traffic is counted by link class with it (null: every
  // rank on one node). The fused forward runs only schedules without relays.
  const Topology* topology = nullptr;
  // The cuDNN engine's calls per step (step 0: local work, step i + 1: stage i), when the
  // batch gave cuDNN pieces; null: every piece on the JIT kernels. The fused forward is not
  // used then (its kernel attends whole stages).
  const CudnnSteps* cudnn = nullptr;
};

// Tensors as in lib/exec/executor.h, in device memory, ordered on ctx.stream.
absl::Status GpuExecuteForward(const GpuExecContext& ctx, const void* q, const void* k,
                               const void* v, void* out, float* lse, ExecTraffic* traffic);
absl::Status GpuExecuteBackward(const GpuExecContext& ctx, const void* dout, const void* q,
                                const void* k, const void* v, const void* out, const float* lse,
                                void* dq, void* dk, void* dv, ExecTraffic* traffic);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_GPU_EXECUTOR_H_
