// cuDNN's fused flash-attention forward on one GPU, for packed documents: the baseline that
// hsap_attn_perf --backend cuda-loopback prints next to our kernels, one call over the whole
// row (libhsap's cuDNN engine runs the same graphs per piece: lib/cuda/cudnn/sdpa_graph.h).
//
// The problem. One packed row of T tokens made of documents (lengths l_0..l_{B-1}, in order),
// Q and O [T, Hq, D], K and V [T, Hkv, D] (Hq a multiple of Hkv: GQA), row-major, documents
// concatenated: our layout. Attention stays inside each document, causal (or full) inside it.
//
// How it is expressed to cuDNN: ragged (THD) tensors, not padding. Each document is one batch
// entry (B = documents with at least one token, S = the longest document); Q/K/V/O get a
// CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC tensor (int32 [B+1,1,1,1], element offsets
// cu_seqlens * H * D) and the graph a padding mask with per-document seq_len tensors (int32
// [B,1,1,1]), so cuDNN reads and writes our tensors in place. Padding every document to the
// longest would copy in and out on every call, multiply the memory by S*B/T (a long-tail row
// of 64 documents has one of 30k tokens and many of a few hundred) and let the kernel skip
// padded tiles only through the same seq_len tensors anyway; ragged is what cuDNN's support
// matrix lists for Hopper ("Ragged") and what TransformerEngine's THD path uses.
//
// Which cuDNN API: the backend (graph) API of cudnn_graph.h with the classic SDPA pattern
// that cuDNN's fused flash-attention engines recognise (the pattern cudnn-frontend lowers its
// SDPA node to for cuDNN < 9.21):
//   S = matmul(Q, K^T)  (fp32, M/N overridden by seq_len_q / seq_len_kv)
//   S = S * scale; padding mask (row < seq_len_q && col < seq_len_kv, else lowest float);
//   causal mask (row >= col, else lowest float)
//   M = max_row(S); E = exp(S - M); Z = sum_row(E); Stats = M + log(Z)  (fp32 [B,Hq,S,1])
//   P = E / Z  (cast to the I/O type); O = matmul(P, V)  (K overridden by seq_len_kv)
// Not CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR: in cuDNN 9.19 that "unified" operation has
// no causal attribute and its cumulative-sequence-length (packed) inputs only arrive in 9.24;
// the composite pattern with ragged offsets and causal masking has been served on sm80/sm90
// since cuDNN 8.9 and is what PyTorch and TransformerEngine run on H100/H200.
//
// The backward (CudnnPass::kBackward) is the composite SDPA-backward pattern of the same
// engines (what cudnn-frontend's SDPA backward node lowers to for cuDNN 9 with ragged
// tensors), written down as data by BackwardGraphPlan and lowered op by op:
//   softmax_sum = sum_row(dO * O) * 1                   (fp32 [B,Hq,S,1], scratch)
//   S = matmul(Q, K^T) * scale; padding mask; causal mask; E = exp(S - Stats)
//   dV = matmul(reshape(E)^T, dO)                       (E cast to the I/O type)
//   dS = (matmul(dO, V^T) - softmax_sum) * E * scale
//   dK = matmul(reshape(dS)^T, Q); dQ = identity(matmul(dS, reshape(K^T)))  (fp32 dQ scratch)
// With GQA (Hq > Hkv) dK and dV are first computed per query head into [T, Hq, D] scratch
// (declared in the I/O type, sized for fp32, as cudnn-frontend does) and reduced over each
// group of Hq / Hkv heads (the frontend's "full head" path). It reads the forward's O and
// Stats, so a backward run needs a forward first (RunCudnnBackward runs cuDNN's own forward
// once for them). It has not run on a GPU yet: what is checked without one is the plan (its
// shape, and its gradients when a host interpreter runs it against the fp64 reference), its
// descriptors as libcudnn finalizes them, and the clean failures
// (tests/bench/cudnn_attention_test.cc).
//
// Loading. libcudnn.so.9 is dlopen()ed, only the functions used are resolved, so binaries
// start on machines without cuDNN. Search: $HSAP_CUDA_LIB_PATH (only its directories, as in
// lib/cuda/runtime/cuda_loader.h; tests point it at an empty directory), else $CUDA_HOME/lib64,
// $CUDA_HOME/lib, /usr/local/cuda/lib64, /usr/local/cuda/lib, /usr/local/cuda-13.0/lib, then
// the default loader path. The descriptor code needs cudnn_graph.h at build time
// (HSAP_HAVE_CUDNN_HEADERS, set by CMake when it finds the header); without it Create says
// so. The pure host logic (geometry, offsets, FLOP count) builds everywhere.
//
// Errors: every failure is a Status naming the step and, for cuDNN calls, cuDNN's status
// string (and cudnnGetLastErrorString when it has one): Unimplemented for a missing library,
// header or GPU, InvalidArgument for a shape cuDNN cannot take, NotFound when no engine
// supports the graph, ResourceExhausted when the workspace cannot be allocated. Nothing
// throws or aborts.
//
// The pieces: the host side (geometry, FLOPs, the backward's graph as data) in
// bench/cudnn_graph_plan.h, loading cuDNN and building its descriptors in
// lib/cuda/cudnn/cudnn_descriptors.h, the timed runs hsap_attn_perf calls in
// bench/cudnn_timed_run.h; this header includes them all.
#ifndef HSAP_BENCH_CUDNN_ATTENTION_H_
#define HSAP_BENCH_CUDNN_ATTENTION_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bench/cudnn_graph_plan.h"
#include "bench/cudnn_timed_run.h"
#include "lib/cuda/cudnn/cudnn_descriptors.h"
#include "lib/cuda/cudnn/cudnn_library.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::bench {

// Which graph a CudnnAttention runs.
enum class CudnnPass { kForward, kBackward };

// Loading cuDNN and checking descriptors without a GPU (lib/cuda/cudnn/).
using cuda::CudnnLibrarySearchPath;
using cuda::FinalizePlanDescriptors;

// cuDNN's fused attention forward or backward for one shape, built once and run many times.
// Not thread-safe; one instance per thread. Bound to the GPU current at Create.
class CudnnAttention {
 public:
  // Loads cuDNN, checks for a CUDA device (sm80 or newer), creates a handle, builds and
  // finalizes the graph of `pass`, picks the first engine configuration that finalizes
  // (heuristics mode A, then fallback), allocates the workspace (and the backward's scratch)
  // and uploads seq_lens / ragged offsets.
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(
      const CudnnAttentionShape& shape, CudnnPass pass = CudnnPass::kForward);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Enqueues one forward on `stream` (device pointers in our packed layout: q, o [T, Hq, D],
  // k, v [T, Hkv, D]; stats: StatsBytes() of device memory, fp32 log-sum-exp [B, Hq, S, 1]).
  // Returns once enqueued; the caller synchronizes or times with events.
  absl::Status Forward(const void* q, const void* k, const void* v, void* o, float* stats,
                       cuda::cudaStream stream);

  // Enqueues one backward on `stream` (a kBackward instance): q, o, dout [T, Hq, D], k, v
  // [T, Hkv, D] and stats as the forward left them; writes dq [T, Hq, D], dk, dv [T, Hkv, D].
  absl::Status Backward(const void* q, const void* k, const void* v, const void* o,
                        const void* dout, const float* stats, void* dq, void* dk, void* dv,
                        cuda::cudaStream stream);

  const CudnnRaggedGeometry& geometry() const { return geometry_; }
  size_t StatsBytes() const { return static_cast<size_t>(geometry_.stats_elements) * 4; }
  size_t WorkspaceBytes() const { return workspace_bytes_; }
  size_t ScratchBytes() const { return scratch_bytes_; }  // the backward's scratch tensors
  int version() const { return version_; }                // cudnnGetVersion(), e.g. 91900
  const std::string& library_path() const { return library_path_; }

 private:
  struct Impl;
  CudnnAttention() = default;
  // Binds the graph's tensors (io: q, k, v, o, dout, stats, dq, dk, dv) and executes it.
  absl::Status Run(void* const io[9], cuda::cudaStream stream, absl::string_view what);

  CudnnRaggedGeometry geometry_;
  size_t workspace_bytes_ = 0;
  size_t scratch_bytes_ = 0;
  int version_ = 0;
  bool causal_ = true;
  CudnnPass pass_ = CudnnPass::kForward;
  std::string library_path_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hsap::bench

#endif  // HSAP_BENCH_CUDNN_ATTENTION_H_
