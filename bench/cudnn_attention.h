// cuDNN's fused flash-attention forward on one GPU, for packed documents: the baseline that
// hsap_attn_perf --backend cuda-loopback prints next to our kernels (bench-only code; libhsap
// never calls cuDNN).
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
// Only the forward is built (no backward graph yet).
//
// Loading. libcudnn.so.9 is dlopen()ed, only the functions used are resolved, so binaries
// start on machines without cuDNN. Search: $HSAP_CUDA_LIB_PATH (only its directories, as in
// lib/cuda/runtime/cuda_loader.h; tests point it at an empty directory), else $CUDA_HOME/lib64,
// $CUDA_HOME/lib, /usr/local/cuda/lib64, /usr/local/cuda/lib, /usr/local/cuda-13.0/lib, then
// the default loader path. The descriptor code needs cudnn_graph.h at build time
// (HSAP_HAVE_CUDNN_HEADERS, set by CMake when it finds the header); without it Create says
// so. The pure host logic below (geometry, offsets, FLOP count) builds everywhere.
//
// Errors: every failure is a Status naming the step and, for cuDNN calls, cuDNN's status
// string (and cudnnGetLastErrorString when it has one): Unimplemented for a missing library,
// header or GPU, InvalidArgument for a shape cuDNN cannot take, NotFound when no engine
// supports the graph, ResourceExhausted when the workspace cannot be allocated. Nothing
// throws or aborts.
#ifndef HSAP_BENCH_CUDNN_ATTENTION_H_
#define HSAP_BENCH_CUDNN_ATTENTION_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/dtype.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::bench {

// What to build.
struct CudnnAttentionShape {
  std::vector<int64_t> doc_lengths;  // the row's documents in order; zero-length ones allowed
  int heads_q = 0;
  int heads_kv = 0;            // divides heads_q
  int head_dim = 0;            // multiple of 8, at most 256
  DType dtype = DType::kBF16;  // kBF16 or kF16 (cuDNN's fused attention has no fp32)
  bool causal = true;          // causal inside each document; false: full (bidirectional)
};

// 4-d dims and strides in elements, cuDNN's [B, H, S, D] order.
using Dims4 = std::array<int64_t, 4>;

// The ragged (THD) problem handed to cuDNN, computed on the host.
struct CudnnRaggedGeometry {
  int64_t batch = 0;                    // documents with at least one token
  int64_t max_seq_len = 0;              // S: the longest document
  int64_t total_tokens = 0;             // T
  std::vector<int32_t> seq_lens;        // [batch]: lengths of the non-empty documents
  std::vector<int32_t> qo_offsets;      // [batch + 1]: element offsets of Q/O, cu_seqlens * Hq * D
  std::vector<int32_t> kv_offsets;      // [batch + 1]: element offsets of K/V, cu_seqlens * Hkv * D
  Dims4 q_dims{}, q_strides{};          // Q and O: [B, Hq, S, D], strides [S*Hq*D, D, Hq*D, 1]
  Dims4 kt_dims{}, kt_strides{};        // K^T: [B, Hkv, D, S], strides [S*Hkv*D, D, 1, Hkv*D]
  Dims4 v_dims{}, v_strides{};          // V: [B, Hkv, S, D], strides [S*Hkv*D, D, Hkv*D, 1]
  Dims4 score_dims{}, score_strides{};  // virtual scores: [B, Hq, S, S], packed
  Dims4 stats_dims{}, stats_strides{};  // Stats / row max / row sum: [B, Hq, S, 1], packed
  int64_t stats_elements = 0;           // B * Hq * S fp32 values
};

// InvalidArgument for: no token, a negative length, heads not positive or Hq % Hkv != 0, a
// head dim not a multiple of 8 or above 256, fp32, or offsets beyond int32.
absl::StatusOr<CudnnRaggedGeometry> MakeRaggedGeometry(const CudnnAttentionShape& shape);

// Visible (query, key) pairs inside the documents: l (l + 1) / 2 each when causal, l^2 when
// not. As a double: rows of millions of tokens overflow nothing.
double VisiblePairs(absl::Span<const int64_t> doc_lengths, bool causal);

// Forward FLOPs by the bench's convention: 4 * D per visible pair per query head (QK^T, PV).
double ForwardFlops(absl::Span<const int64_t> doc_lengths, int heads_q, int head_dim, bool causal);

// The directories searched for libcudnn.so.9, in order ("" is the default loader path).
std::vector<std::string> CudnnLibrarySearchPath();

class CudnnApi;  // the resolved functions (cudnn_attention.cc)

// cuDNN's fused attention forward for one shape, built once and run many times. Not
// thread-safe; one instance per thread. Bound to the GPU current at Create.
class CudnnAttention {
 public:
  // Loads cuDNN, checks for a CUDA device (sm80 or newer), creates a handle, builds and
  // finalizes the graph, picks the first engine configuration that finalizes (heuristics mode
  // A, then fallback), allocates the workspace and uploads seq_lens / ragged offsets.
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(const CudnnAttentionShape& shape);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Enqueues one forward on `stream` (device pointers in our packed layout: q, o [T, Hq, D],
  // k, v [T, Hkv, D]; stats: StatsBytes() of device memory, fp32 log-sum-exp [B, Hq, S, 1]).
  // Returns once enqueued; the caller synchronizes or times with events.
  absl::Status Forward(const void* q, const void* k, const void* v, void* o, float* stats,
                       cuda::cudaStream stream);

  const CudnnRaggedGeometry& geometry() const { return geometry_; }
  size_t StatsBytes() const { return static_cast<size_t>(geometry_.stats_elements) * 4; }
  size_t WorkspaceBytes() const { return workspace_bytes_; }
  int version() const { return version_; }  // cudnnGetVersion(), e.g. 91900
  const std::string& library_path() const { return library_path_; }

 private:
  struct Impl;
  CudnnAttention() = default;

  CudnnRaggedGeometry geometry_;
  size_t workspace_bytes_ = 0;
  int version_ = 0;
  bool causal_ = true;
  std::string library_path_;
  std::unique_ptr<Impl> impl_;
};

// One timed run of cuDNN's forward on the whole row, as hsap_attn_perf reports it.
struct CudnnForwardRun {
  double forward_ms = 0;  // per call, mean over iters after warmup (CUDA events)
  int version = 0;
  size_t workspace_bytes = 0;
};

// Uploads the row's host tensors (our layout, shape.dtype), runs `warmup` untimed and `iters`
// timed forwards on a stream of its own, and copies the output back into `out_host` (T * Hq *
// D elements) when it is not null. All device memory is freed on every path.
absl::StatusOr<CudnnForwardRun> RunCudnnForward(const CudnnAttentionShape& shape,
                                                const void* q_host, const void* k_host,
                                                const void* v_host, int warmup, int iters,
                                                void* out_host);

}  // namespace hsap::bench

#endif  // HSAP_BENCH_CUDNN_ATTENTION_H_
