// The host side of the cuDNN attention baseline (bench/cudnn_attention.h): the ragged (THD)
// geometry of a packed row as cuDNN takes it, the bench's FLOP convention, and the backward's
// operation graph written down as data (BackwardGraphPlan) with its well-formedness check.
// Builds and runs without cuDNN or a GPU.
#ifndef HSAP_BENCH_CUDNN_GRAPH_PLAN_H_
#define HSAP_BENCH_CUDNN_GRAPH_PLAN_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/dtype.h"

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

}  // namespace hsap::bench

#endif  // HSAP_BENCH_CUDNN_GRAPH_PLAN_H_
