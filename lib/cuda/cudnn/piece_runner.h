// The cuDNN side of the cuDNN attention engine: one execution of cuDNN's fused attention
// (forward with Stats, or backward) over one ragged batch of a step's pieces (a CudnnCall of
// attention_pieces.h). The executors never talk to it directly: lib/cuda/exec/cudnn_steps.h
// prepares every call's device arrays at batch creation and, per step, hands each call to
// the runner and merges what it wrote into hsap's fp32 partials with the DeviceKernels
// helpers (merge_entries, gather_stats, add_entries).
//
// A runner computes exactly what cuDNN's SDPA graph computes over THD (ragged) tensors:
// entry b of the call attends seq_q[b] query rows starting at element offset q_offsets[b] of
// Q (rows of heads_q * head_dim elements) to seq_kv[b] key rows starting at kv_offsets[b] of
// K and V (rows of heads_kv * head_dim), query head h reading K/V head h / (heads_q /
// heads_kv), under the call's CudnnMask relative to the entry's own rectangle
// (CudnnMask::Admits), with scores scaled by `scale`:
//   forward: O rows at the same offsets as Q (storage dtype), and
//            Stats[b, h, i] = log(sum_j exp(s_ij)) (natural log, fp32) at
//            stats + b * heads_q * max_q_len + h * max_q_len + i (cuDNN's padded BHS1 Stats);
//   backward: given dO (rows like Q), the final Stats of every entry row (same layout) and
//            delta[h * delta_stride + r] = sum_d dO[r, h, d] * O[r, h, d] of the final output
//            O (hsap's attn_delta, which cuDNN computes itself from O when it has it), the
//            gradients dQ (rows like Q), dK and dV (rows like K) of the entry rows, in the
//            storage dtype, each written (not added: the entries of a call are disjoint).
// Rows outside the entries are left as they are. Every device array is read on `stream`, in
// stream order.
//
// Errors: Unimplemented means the runner cannot run this call (cuDNN builds no graph for its
// shape) and enqueued nothing, so the caller may run the call's pieces on the JIT kernels
// instead (lib/cuda/exec/cudnn_steps.h does, and reports it); a runner answers a shape alike
// every time. Any other error may come after part of the call was enqueued.
//
// Implementations: libcudnn's (lib/cuda/cudnn/libcudnn_runner.h), which needs a GPU; the
// tests' host fake (tests/support/fake_cudnn_runner.h) evaluates the same definition on the
// emulated device.
#ifndef HSAP_LIB_CUDA_CUDNN_PIECE_RUNNER_H_
#define HSAP_LIB_CUDA_CUDNN_PIECE_RUNNER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "attention/dtype.h"
#include "lib/cuda/cudnn/attention_pieces.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::cuda {

// What a cuDNN graph is specialised on besides the mask and the max lengths.
struct SdpaShape {
  DType dtype = DType::kBF16;
  int head_dim = 0;
  int heads_q = 0, heads_kv = 0;
  float scale = 0.0f;
};

// One ragged batch in device memory (int32, as cuDNN's ragged offset and sequence length
// tensors): seq_q, seq_kv [num_entries]; q_offsets, kv_offsets [num_entries + 1], in elements.
struct SdpaCall {
  CudnnMask mask;
  int num_entries = 0;
  int64_t max_q_len = 0, max_k_len = 0;  // the graph's S_q and S_kv
  const int32_t* seq_q = nullptr;
  const int32_t* seq_kv = nullptr;
  const int32_t* q_offsets = nullptr;
  const int32_t* kv_offsets = nullptr;
  // Rows of the query and key buffers the offsets address (at least the last entry's end):
  // what a runner sizes its per-call scratch by.
  int64_t q_rows = 0, k_rows = 0;
};

struct SdpaForwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;       // rows like q, storage dtype
  float* stats = nullptr;  // [num_entries, heads_q, max_q_len]
};

struct SdpaBackwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;  // the final output (rows like q), or null where the executor has none
  const void* dout = nullptr;
  const float* stats = nullptr;  // the final Stats, [num_entries, heads_q, max_q_len]
  const float* delta = nullptr;  // [heads_q, delta_stride], indexed by query buffer row
  int64_t delta_stride = 0;
  // delta gathered into the Stats layout ([num_entries, heads_q, max_q_len]): what the libcudnn
  // runner binds as cuDNN's softmax_sum where o is null.
  const float* softmax_sum = nullptr;
  void* dq = nullptr;  // rows like q, storage dtype
  void* dk = nullptr;  // rows like k, storage dtype
  void* dv = nullptr;
};

class CudnnPieceRunner {
 public:
  virtual ~CudnnPieceRunner() = default;
  // "cuDNN 9.19.0", "host fake": what the engine report names.
  virtual std::string name() const = 0;
  virtual absl::Status Forward(const SdpaShape& shape, const SdpaCall& call,
                               const SdpaForwardArgs& args, cudaStream stream) = 0;
  virtual absl::Status Backward(const SdpaShape& shape, const SdpaCall& call,
                                const SdpaBackwardArgs& args, cudaStream stream) = 0;
};

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_CUDNN_PIECE_RUNNER_H_
