// The cuDNN engine inside the GPU executors (docs/gpu_backend.md, "Attention engines"): per
// step, the pieces BatchEngines gave to cuDNN run as CudnnPieceRunner calls and are merged
// into the step's fp32 partials; the JIT kernels run the rest of the step's work.
//
// Built once at batch creation (nothing is allocated or uploaded per call): for every step
// with cuDNN pieces, each call's device arrays (EntryRows of its query and key rows, cuDNN's
// int32 sequence lengths and ragged offsets) and the work list of the step's JIT pieces
// (PiecesAsWorkList), in one upload; and scratch memory for cuDNN's outputs (O and dQ rows of
// the largest query buffer, dK and dV rows of the largest key buffer, in the storage dtype;
// Stats of the largest call, fp32, twice: the second holds delta in the Stats layout where the
// backward has no O), owned by the batch.
//
// Forward of a step, per call in order: the runner writes O and Stats into the scratch, then
// merge_entries merges them into (out32, lse32) by LSE, as a JIT partial is merged. Backward
// of a step, per call: gather_stats copies the final lse of the call's rows into Stats (and,
// without O, delta into the second Stats buffer: SdpaBackwardArgs::softmax_sum), the runner
// writes dQ, dK, dV into the scratch, and add_entries adds them into the step's fp32
// dq and dk/dv accumulators. Everything is enqueued on the call's stream, in that order; the
// scratch is reused call after call (stream order makes that safe).
//
// A call the runner refuses (Unimplemented: cuDNN builds no graph for its shape, and nothing
// was enqueued; piece_runner.h) runs on the JIT kernels instead: each call also has the work
// list of its pieces, uploaded with the rest, which the step's JIT launch gets. The results
// are the same (both engines compute the same partials, merged or added the same way); the
// batch's engine report says how many calls fell back and why (RuntimeNote).
#ifndef HSAP_LIB_CUDA_EXEC_CUDNN_STEPS_H_
#define HSAP_LIB_CUDA_EXEC_CUDNN_STEPS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/worklist.h"
#include "lib/cuda/cudnn/batch_engines.h"
#include "lib/cuda/cudnn/piece_runner.h"
#include "lib/cuda/exec/exec_util.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::cuda {

class CudnnSteps {
 public:
  // `steps`: the work lists BatchEngines::Decide was given (same order, same count);
  // `runner` non-null. InvalidArgument when a call's ragged offsets overflow int32 (cuDNN's
  // offset tensors here), naming the rows; device errors from the allocation and upload.
  // Blocks the host until the upload is done.
  static absl::StatusOr<std::unique_ptr<CudnnSteps>> Build(
      Device& device, const BatchEngines& engines, absl::Span<const WorkList* const> steps,
      const SdpaShape& shape, std::shared_ptr<CudnnPieceRunner> runner, cudaStream stream);

  // Whether step `step` has cuDNN calls.
  bool HasCalls(size_t step) const;
  // The work the JIT kernels run in step `step`: `all` (the step's whole list) when cuDNN
  // has none of it, else the list of its JIT pieces (possibly empty).
  const DeviceWorkLists::List& JitWork(size_t step, const DeviceWorkLists::List& all) const;

  // The step's queries against k/v; out32 [q rows, heads_q, D] and lse32 [heads_q,
  // lse_stride] (indexed by query buffer row) merged into.
  struct Forward {
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    float* out32 = nullptr;
    float* lse32 = nullptr;
    int64_t lse_stride = 0;
  };
  // Runs a refused call's pieces on the JIT kernels (their work list).
  using JitFallback = std::function<absl::Status(const DeviceWorkLists::List& pieces)>;
  absl::Status RunForward(size_t step, const Forward& f, const DeviceKernels& kernels,
                          cudaStream stream, const JitFallback& jit) const;

  // lse / delta: the final lse and rowsum(dout * out), [heads_q, stride]; out may be null
  // (SdpaBackwardArgs); dq32 [q rows, heads_q, D], dk32 / dv32 [k rows, heads_kv, D] added
  // into.
  struct Backward {
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    const void* out = nullptr;
    const void* dout = nullptr;
    const float* lse = nullptr;
    const float* delta = nullptr;
    int64_t stride = 0;
    float* dq32 = nullptr;
    float* dk32 = nullptr;
    float* dv32 = nullptr;
  };
  absl::Status RunBackward(size_t step, const Backward& b, const DeviceKernels& kernels,
                           cudaStream stream, const JitFallback& jit) const;

  const CudnnPieceRunner& runner() const { return *runner_; }
  // Calls (forward and backward) the runner refused so far, whose pieces ran on the JIT
  // kernels.
  int64_t refused_calls() const;
  // "" when none was refused; else "; at run time N cuDNN calls ran on the JIT kernels
  // instead (first: <the runner's reason>)".
  std::string RuntimeNote() const;

 private:
  struct Call {
    SdpaCall sdpa;                                // device arrays in memory_
    const hsap_dev::EntryRows* q_rows = nullptr;  // [num_entries], device
    const hsap_dev::EntryRows* k_rows = nullptr;
    int64_t total_q = 0, total_k = 0;  // rows over the entries
    DeviceWorkLists::List pieces;      // the entries as JIT work, for a refused call
  };
  // A refused call: counted, its pieces run by `jit`; any other runner error is returned.
  absl::Status Refused(const absl::Status& runner, const Call& c, const JitFallback& jit) const;
  struct Step {
    std::vector<Call> calls;
    DeviceWorkLists::List jit;  // the JIT pieces' work (used when calls is not empty)
  };
  CudnnSteps() = default;
  // The entry, stride and Stats-layout fields of a call's merge or gather (the query rows,
  // lse [heads_q, lse_stride], Stats [entries, heads_q, max_q_len]).
  template <typename Params>
  Params StatsRows(const Call& c, int64_t lse_stride) const;

  SdpaShape shape_;
  std::shared_ptr<CudnnPieceRunner> runner_;
  std::vector<Step> steps_;
  DeviceBuffer memory_;   // the uploaded arrays and lists
  DeviceBuffer scratch_;  // o / dq | dk | dv | stats
  void* o_ = nullptr;     // also dQ in backward
  void* dk_ = nullptr;
  void* dv_ = nullptr;
  float* stats_ = nullptr;
  float* softmax_sum_ = nullptr;  // delta gathered like Stats (backward without O)
  // Refusals so far (RunForward / RunBackward are const: what they run is fixed at Build;
  // this is what the report says of the runs).
  mutable std::mutex mu_;
  mutable int64_t refused_ = 0;
  mutable std::string first_refusal_;
};

// One step of an executor: LaunchForward over the step's JIT work (`list` when `cudnn` is null
// or has no call in the step), then the step's cuDNN calls merged into p.out / p.lse (their
// stride is p.q_rows). A rank without query heads does nothing.
absl::Status AttendStepForward(const CudnnSteps* cudnn, size_t step, const DeviceKernels& kernels,
                               const hsap_dev::FwdParams& p, const DeviceWorkLists::List& list,
                               const void* k, const void* v, int64_t k_rows, cudaStream stream);
// The same for backward: LaunchBackward, then the cuDNN calls (`out`: the final output, may
// be null) added into p.dq, dk, dv.
absl::Status AttendStepBackward(const CudnnSteps* cudnn, size_t step, const DeviceKernels& kernels,
                                const hsap_dev::BwdParams& p, const void* out,
                                const DeviceWorkLists::List& list, const void* k, const void* v,
                                int64_t k_rows, float* dk, float* dv, cudaStream stream);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_CUDNN_STEPS_H_
