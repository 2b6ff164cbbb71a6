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
//
// The backward (CudnnPass::kBackward) is the composite SDPA-backward pattern of the same
// engines (what cudnn-frontend's SDPA backward node lowers to for cuDNN 9 with ragged
// tensors), written down as data by BackwardGraphPlan below and lowered op by op:
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

// Backward FLOPs by the bench's convention: 2.5x the forward (10 * D per visible pair per
// query head: QK^T recomputed, dV, dP, dQ, dK), as hsap_attn_perf counts ours.
double BackwardFlops(absl::Span<const int64_t> doc_lengths, int heads_q, int head_dim, bool causal);

// The directories searched for libcudnn.so.9, in order ("" is the default loader path).
std::vector<std::string> CudnnLibrarySearchPath();

// Unique ids of the tensors a variant pack binds (virtual tensors count from kUidFirstVirtual).
// The forward binds kUidQ..kUidLowestCausal; the backward also dO, dQ, dK, dV, the constant
// one, and its scratch tensors (allocated by CudnnAttention, not by the caller).
enum CudnnTensorUid : int64_t {
  kUidQ = 1,
  kUidK = 2,  // K^T in the graph
  kUidV = 3,  // V (forward), V^T (backward)
  kUidO = 4,
  kUidStats = 5,
  kUidSeqLenQ = 6,
  kUidSeqLenKv = 7,
  kUidOffsetQo = 8,
  kUidOffsetKv = 9,
  kUidScale = 10,
  kUidLowestPadding = 11,
  kUidLowestCausal = 12,
  kUidDO = 13,
  kUidDQ = 14,
  kUidDK = 15,
  kUidDV = 16,
  kUidOne = 17,
  kUidLowestPadding2 = 18,  // the second padding select of cuDNN 9.0 - 9.9
  kUidSoftmaxSum = 19,      // scratch: fp32 sum_row(dO * O)
  kUidDQAccum = 20,         // scratch: fp32 dQ accumulator
  kUidDKFullHeads = 21,     // scratch (GQA): dK per query head
  kUidDVFullHeads = 22,     // scratch (GQA): dV per query head
  kUidFirstVirtual = 100,
};

// A cuDNN operation graph as data: what the backward builds, testable without cuDNN.
enum class CudnnDataKind { kIo, kFloat, kInt32, kBool };  // kIo: the shape's bf16 / fp16
enum class CudnnOpKind { kMatmul, kPointwise, kReduction, kReshape };
enum class CudnnPointwiseMode {
  kMul,
  kSub,
  kExp,
  kIdentity,
  kGenIndex,
  kCmpLt,
  kCmpGe,
  kLogicalAnd,
  kBinarySelect,  // y = t ? x : b
};

struct CudnnTensorNode {
  std::string name;
  int64_t uid = 0;
  CudnnDataKind dtype = CudnnDataKind::kFloat;
  Dims4 dims{}, strides{};
  bool is_virtual = false;
  bool by_value = false;          // a host scalar in the variant pack
  int64_t ragged_offset_uid = 0;  // the int32 ragged-offset tensor, 0 for none
  size_t scratch_bytes = 0;       // > 0: device scratch the runner allocates for this tensor
};

struct CudnnOpNode {
  CudnnOpKind kind = CudnnOpKind::kPointwise;
  std::string name;
  CudnnPointwiseMode mode = CudnnPointwiseMode::kIdentity;  // kPointwise
  CudnnDataKind math = CudnnDataKind::kFloat;               // kPointwise: compute type
  int64_t axis = -1;                                        // kGenIndex
  // Tensor uids: matmul (A, B), pointwise (x[, b[, t]]), reduction (sum) and reshape (x).
  std::vector<int64_t> inputs;
  int64_t output = 0;
  int64_t m_override = 0, n_override = 0, k_override = 0;  // matmul: seq-len tensors, 0: none
};

struct CudnnGraphPlan {
  std::vector<CudnnTensorNode> tensors;
  std::vector<CudnnOpNode> ops;
  const CudnnTensorNode* Find(int64_t uid) const;
  // The non-virtual tensors: what a variant pack binds, in uid order.
  std::vector<int64_t> BoundUids() const;
};

// The backward graph for `shape` (its geometry from MakeRaggedGeometry) as cuDNN `version`
// (cudnnGetVersion(), e.g. 91900) takes it: 9.0 - 9.9 need the padding applied again after
// the Stats subtraction, as cudnn-frontend does. InvalidArgument for what MakeRaggedGeometry
// rejects.
absl::StatusOr<CudnnGraphPlan> BackwardGraphPlan(const CudnnAttentionShape& shape, int version);

// The plan is well formed: unique uids, virtual ids >= kUidFirstVirtual and bound ones below,
// every op input bound or produced by an earlier op, every op output produced once (virtual
// ones also consumed), matmul dims [B,H,M,K] x [B,H',K,N] -> [B,H'',M,N] with the heads of
// the inputs dividing the output's, pointwise inputs broadcastable to the output, reductions
// to a divisor of each dim, reshapes keeping the element count, GEN_INDEX giving int32, the
// comparisons and LOGICAL_AND booleans, BINARY_SELECT's mask boolean, ragged offsets naming
// int32 tensors. FailedPrecondition naming the first violation.
absl::Status ValidateGraphPlan(const CudnnGraphPlan& plan);

// Creates and finalizes every tensor and operation descriptor of `plan` (I/O type `dtype`)
// with libcudnn, which needs no GPU: cuDNN checks that each descriptor has its required
// attributes with the right attribute types. Shapes and data types across operations are
// checked only by the operation graph and its engines, which need a handle, hence a GPU, and
// are not built here. Unimplemented without
// libcudnn.so.9 or cudnn_graph.h; cuDNN's status (naming the descriptor) when one is refused.
absl::Status FinalizePlanDescriptors(const CudnnGraphPlan& plan, DType dtype);

// Which graph a CudnnAttention runs.
enum class CudnnPass { kForward, kBackward };

class CudnnApi;  // the resolved functions (cudnn_attention.cc)

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

  CudnnRaggedGeometry geometry_;
  size_t workspace_bytes_ = 0;
  size_t scratch_bytes_ = 0;
  int version_ = 0;
  bool causal_ = true;
  CudnnPass pass_ = CudnnPass::kForward;
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

// One timed run of cuDNN's backward on the whole row.
struct CudnnBackwardRun {
  double backward_ms = 0;  // per call, mean over iters after warmup (CUDA events)
  int version = 0;
  size_t workspace_bytes = 0;  // the backward plan's workspace
  size_t scratch_bytes = 0;    // softmax_sum, the fp32 dQ accumulator (and GQA full heads)
};

// Uploads the row's host tensors (our layout, shape.dtype: q and dout T * Hq * D elements, k
// and v T * Hkv * D), runs cuDNN's forward once for O and the Stats, then `warmup` untimed and
// `iters` timed backwards on a stream of its own, and copies dQ, dK, dV back into the host
// buffers that are not null. All device memory is freed on every path.
absl::StatusOr<CudnnBackwardRun> RunCudnnBackward(const CudnnAttentionShape& shape,
                                                  const void* q_host, const void* k_host,
                                                  const void* v_host, const void* dout_host,
                                                  int warmup, int iters, void* dq_host,
                                                  void* dk_host, void* dv_host);

}  // namespace hsap::bench

#endif  // HSAP_BENCH_CUDNN_ATTENTION_H_
