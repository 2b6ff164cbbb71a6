// cuDNN's fused attention (SDPA) as operation graphs written down as data: what libhsap's
// cuDNN piece runner (lib/cuda/cudnn/libcudnn_runner.h) and the bench's whole-row baseline
// (bench/cudnn_attention.h) lower to backend descriptors (lib/cuda/cudnn/cudnn_descriptors.h),
// and what a host interpreter (tests/support/sdpa_plan_interpreter.h) runs in fp64 without a
// GPU. Pure host code: no cuDNN, no CUDA.
//
// One graph serves one ragged (THD) batch of `batch` entries (a CudnnCall of
// attention_pieces.h, or a packed row's documents): entry b attends seq_q[b] query rows from
// element offset q_offsets[b] of Q (rows of heads_q * head_dim elements) to seq_kv[b] key rows
// from kv_offsets[b] of K and V (rows of heads_kv * head_dim), under one CudnnMask relative to
// the entry's own rectangle (CudnnMask::Admits). The graph's dims are S_q = max_q_len and
// S_kv = max_k_len; Stats are fp32 [batch, heads_q, S_q, 1], packed (cuDNN's padded BHS1).
//
// The forward, the classic composite SDPA pattern that cuDNN's fused flash-attention engines
// recognise (what cudnn-frontend lowers its SDPA node to for cuDNN < 9.21):
//   S = matmul(Q, K^T) (M/N overridden by seq_q / seq_kv); S *= scale;
//   padding: keep row < seq_q && col < seq_kv; the mask (below), else the lowest float;
//   M = max_row(S); E = exp(S - M); Z = sum_row(E); Stats = M + log(Z); P = E / Z (I/O type);
//   O = matmul(P, V) (K overridden by seq_kv).
// The mask, as cudnn-frontend's composite diagonal-band mask builds it from GEN_INDEX:
//   row' = row (TOP_LEFT) or row + (seq_kv - seq_q) (BOTTOM_RIGHT, per entry);
//   right bound 0: keep row' >= col; left bound l (a by-value int32): keep col > row' - l.
// The backward (the composite SDPA-backward pattern, as bench/cudnn_attention.h describes):
//   softmax_sum = sum_row(dO * O) (fp32 scratch), or bound as an input (softmax_sum_input:
//   delta gathered into the Stats layout, for callers without O);
//   S as above, E = exp(S - Stats) (cuDNN 9.0 - 9.9: the padding applied again after the
//   subtraction); dV = E^T dO; dS = (dO V^T - softmax_sum) * E * scale; dK = dS^T Q;
//   dQ = dS K through an fp32 accumulator; with GQA dK and dV per query head into scratch
//   [kv rows, heads_q, head_dim], then summed over each group.
#ifndef HSAP_LIB_CUDA_CUDNN_SDPA_GRAPH_H_
#define HSAP_LIB_CUDA_CUDNN_SDPA_GRAPH_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/dtype.h"
#include "lib/cuda/cudnn/attention_pieces.h"

namespace hsap::cuda {

// 4-d dims and strides in elements, cuDNN's [B, H, S, D] order.
using Dims4 = std::array<int64_t, 4>;

// Unique ids of the tensors a variant pack binds (virtual tensors count from kUidFirstVirtual).
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
  kUidLowestCausal = 12,  // the mask's select
  kUidDO = 13,
  kUidDQ = 14,
  kUidDK = 15,
  kUidDV = 16,
  kUidOne = 17,
  kUidLowestPadding2 = 18,  // the second padding select of cuDNN 9.0 - 9.9
  kUidSoftmaxSum = 19,      // scratch fp32 sum_row(dO * O), or a bound input
  kUidDQAccum = 20,         // scratch: fp32 dQ accumulator
  kUidDKFullHeads = 21,     // scratch (GQA): dK per query head
  kUidDVFullHeads = 22,     // scratch (GQA): dV per query head
  kUidLeftBound = 23,       // by-value int32: the mask's left bound
  kUidFirstVirtual = 100,
};

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
  kAdd,
  kDiv,
  kLog,
  kCmpGt,
};
enum class CudnnReduceMode { kAdd, kMax };

struct CudnnTensorNode {
  std::string name;
  int64_t uid = 0;
  CudnnDataKind dtype = CudnnDataKind::kFloat;
  Dims4 dims{}, strides{};
  bool is_virtual = false;
  bool by_value = false;          // a host scalar in the variant pack (kFloat or kInt32)
  int64_t ragged_offset_uid = 0;  // the int32 ragged-offset tensor, 0 for none
  size_t scratch_bytes = 0;       // > 0: device scratch the runner allocates for this tensor
};

struct CudnnOpNode {
  CudnnOpKind kind = CudnnOpKind::kPointwise;
  std::string name;
  CudnnPointwiseMode mode = CudnnPointwiseMode::kIdentity;  // kPointwise
  CudnnDataKind math = CudnnDataKind::kFloat;               // kPointwise: compute type
  CudnnReduceMode reduce = CudnnReduceMode::kAdd;           // kReduction
  int64_t axis = -1;                                        // kGenIndex
  // Tensor uids: matmul (A, B), pointwise (x[, b[, t]]), reduction and reshape (x).
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

// The plan is well formed: unique uids, virtual ids >= kUidFirstVirtual and bound ones below,
// every op input bound or produced by an earlier op, every op output produced once (virtual
// ones also consumed), matmul dims [B,H,M,K] x [B,H',K,N] -> [B,H'',M,N] with the heads of
// the inputs dividing the output's, pointwise inputs broadcastable to the output, reductions
// to a divisor of each dim, reshapes keeping the element count, GEN_INDEX giving int32, the
// comparisons and LOGICAL_AND booleans, BINARY_SELECT's mask boolean, ragged offsets naming
// int32 tensors. FailedPrecondition naming the first violation.
absl::Status ValidateGraphPlan(const CudnnGraphPlan& plan);

// What one graph is specialised on.
struct SdpaGraphSpec {
  DType dtype = DType::kBF16;  // kBF16 or kF16
  int head_dim = 0;            // multiple of 8, at most 256
  int heads_q = 0, heads_kv = 0;
  CudnnMask mask;
  int64_t batch = 0;                     // entries
  int64_t max_q_len = 0, max_k_len = 0;  // S_q, S_kv
  // Rows of the query and key buffers the offsets address (at least the last entry's end):
  // sizes the backward's scratch (dQ accumulator, GQA full heads).
  int64_t q_rows = 0, k_rows = 0;
  int version = 0;                 // cudnnGetVersion() of the library the graph is for
  bool softmax_sum_input = false;  // backward: softmax_sum bound (no O in the graph)
};

// InvalidArgument for what no graph takes (dtype, heads, head dim, empty or negative extents,
// buffer rows shorter than the longest entry, element offsets beyond int32, a left bound < 1
// on a banded mask or one on another); FailedPrecondition when `version` is older than the
// mask needs (MinCudnnVersion).
absl::Status CheckSdpaGraphSpec(const SdpaGraphSpec& spec);

// The forward with Stats, and the backward, for `spec` (CheckSdpaGraphSpec's errors).
absl::StatusOr<CudnnGraphPlan> SdpaForwardPlan(const SdpaGraphSpec& spec);
absl::StatusOr<CudnnGraphPlan> SdpaBackwardPlan(const SdpaGraphSpec& spec);

// Offsets of a plan's scratch tensors inside one allocation (256-byte aligned); `total` gets
// its size.
std::map<int64_t, size_t> ScratchLayout(const CudnnGraphPlan& plan, size_t* total);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_CUDNN_SDPA_GRAPH_H_
