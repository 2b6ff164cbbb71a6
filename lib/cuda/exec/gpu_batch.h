// Batches on CUDA communicators: the GPU side of a communicator and the runners
// (lib/exec/runner.h) of batches with and without a plan on it.
//
// Streams. A communicator created with a caller's stream (hsapCommConfig_t::cudaStream)
// runs every kernel of forward/backward on it, and the calls return once the work is
// enqueued (the host still waits for each stage's transfers, never for kernels): the
// results are ready when that stream reaches them, as with any CUDA call. Without one, the
// communicator uses a stream of its own and the calls return after their work finished.
// Transfers run on the transport's stream (TransferStream), never on the caller's.
//
// A stream per call (hsapAttentionForwardOnStream, Batch::Forward's `stream`): the call's
// kernels run on that stream instead (so they follow its earlier work, and its later work
// sees their results, in stream order), and the call returns once enqueued, whether or not
// the communicator has a stream of its own. The calls of a communicator share its pool, so
// each call is ordered after the previous one of any batch of the communicator, on whatever
// stream that ran: when the stream changes, the new one first waits for an event recorded
// at the end of the previous call (GpuComm::OrderAfterCalls / EndCall).
//
// Fused forward. On a transport that offers peer windows (loopback, NCCL), with kernels
// that have the fused forward (JitKernelsForBatch(..., fused = true)), batches without a
// plan move forward's K/V through the communicator's peer window (peer_window.h) instead of
// stages when every rank reaches every other's window (else stages, on every rank alike)
// and the communicator's ranks are on one node (on several, K/V are relayed, which takes
// stages).
//
// Topology. Batches without a plan get the communicator's topology in their schedules
// (relayed delivery, lib/sched/schedule.h) and count their bytes by link class.
//
// Memory. The communicator's pool grows at batch creation to the largest PoolLayout of its
// batches (the size is reported by GpuComm::pool_bytes); forward and backward allocate
// nothing.
#ifndef HSAP_LIB_CUDA_EXEC_GPU_BATCH_H_
#define HSAP_LIB_CUDA_EXEC_GPU_BATCH_H_

#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attention/layout.h"
#include "lib/cuda/cudnn/batch_engines.h"
#include "lib/cuda/exec/gpu_executor.h"
#include "lib/cuda/runtime/buffer_pool.h"
#include "lib/cuda/runtime/device.h"
#include "lib/cuda/runtime/peer_window.h"
#include "lib/exec/batch.h"
#include "lib/exec/runner.h"

namespace hsap::cuda {

class GpuComm {
 public:
  // `stream`: the caller's compute stream, or null for one of our own (then calls are
  // synchronous); InvalidArgument when it is a stream of another device than `device`.
  // `timeout`: the deadline of every host wait on the device.
  static absl::StatusOr<std::shared_ptr<GpuComm>> Create(std::unique_ptr<Device> device,
                                                         cudaStream stream, absl::Duration timeout);
  ~GpuComm();
  GpuComm(const GpuComm&) = delete;
  GpuComm& operator=(const GpuComm&) = delete;

  Device& device() { return *device_; }
  cudaStream stream() const { return stream_; }
  bool synchronous() const { return owns_stream_; }
  absl::Duration timeout() const { return timeout_; }
  DeviceBufferPool& pool() { return *pool_; }
  // Device bytes held by the pool.
  size_t pool_bytes() const { return pool_->size(); }
  // This rank's peer window (peer_window.h), created on first use for rank `rank` of `size`.
  PeerWindow& peer_window(int rank, int size);

  // OK when `stream` (a caller's) is a stream of this communicator's device, else
  // InvalidArgument naming `what` (kernels launch only on streams of their device; one event
  // record tells). Sets the device current for the check.
  absl::Status CheckStream(cudaStream stream, absl::string_view what);
  // Makes `stream` wait for the work of every call enqueued so far on this communicator (a
  // no-op when the last call ran on `stream` too, or none ran).
  absl::Status OrderAfterCalls(cudaStream stream);
  // Marks the end of a call whose work was enqueued on `stream`.
  absl::Status EndCall(cudaStream stream);

 private:
  GpuComm() = default;
  std::unique_ptr<Device> device_;
  std::unique_ptr<DeviceBufferPool> pool_;
  std::unique_ptr<PeerWindow> window_;
  cudaStream stream_ = nullptr;
  bool owns_stream_ = false;
  absl::Duration timeout_;
  cudaEvent probe_ = nullptr;         // CheckStream's
  cudaEvent last_call_ = nullptr;     // recorded at the end of the last call
  cudaStream last_stream_ = nullptr;  // the stream of the last call (null: none yet)
};

// The runners of batches on `comm` with `kernels` (both shared with other batches): the GPU
// ring executor (gpu_executor.h) for batches without a plan, the GPU plan executor
// (gpu_hier_executor.h) under a plan. Their device programs (work lists, exchange copy
// lists, pool layout) are built and the pool grown when the runner is made, and every
// piece of every step gets its engine under `engines` (BatchEngines::Decide; a plan rank
// whose kv-head map is not the GQA grouping cannot use cuDNN, so under `cudnn` making its
// runner fails).
std::unique_ptr<RunnerFactory> NewGpuRunners(std::shared_ptr<GpuComm> comm,
                                             std::shared_ptr<const DeviceKernels> kernels,
                                             EngineSetup engines = {});

// Sets the mode of the later calls of a batch whose runner is `runner` (GpuExecMode: the
// bench measures the share of transfer time hidden behind compute with it). False when
// `runner` is not a GPU runner.
bool SetGpuExecMode(BatchRunner* runner, GpuExecMode mode);

// The JIT kernels of a batch on the current CUDA device: the configuration of (device
// architecture, dtype, head dim, heads_q / heads_kv, whether the layout has banded
// slices, fused), compiled through the compile cache and loaded once per process.
// `fused`: with the fused forward (for batches without a plan on communicators whose
// transport offers peer windows; plan batches never use it).
absl::StatusOr<std::shared_ptr<const DeviceKernels>> JitKernelsForBatch(const BatchOptions& options,
                                                                        const Layout& layout,
                                                                        bool fused = false);

// Whether the batch running `runner` runs its forward through peer windows (false when
// `runner` is not a GPU ring runner).
bool UsesFusedForward(const BatchRunner* runner);

// The engine choice of the batch running `runner` (null when `runner` is not a GPU runner).
const BatchEngines* EnginesOf(const BatchRunner* runner);
// The batch's engine report: the choice made at creation (EngineTally::ToString) and the cuDNN
// calls that ran on the JIT kernels at run time instead (CudnnSteps::RuntimeNote). Empty when
// `runner` is not a GPU runner.
std::string EngineReportOf(const BatchRunner* runner);

// A batch's attention as the engine choice sees it: its dtype and the layer's heads (GQA
// grouping), for CudnnTakesBatch before the batch is made.
EngineShape EngineShapeOf(const AttentionDims& dims, DType dtype);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_GPU_BATCH_H_
