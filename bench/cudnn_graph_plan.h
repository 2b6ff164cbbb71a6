// The host side of the cuDNN attention baseline (bench/cudnn_attention.h): the ragged (THD)
// geometry of a packed row as cuDNN takes it, the bench's FLOP convention, and the backward's
// operation graphs of the whole row (lib/cuda/cudnn/sdpa_graph.h's, one entry per document).
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
#include "lib/cuda/cudnn/sdpa_graph.h"

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

using cuda::Dims4;

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

// The graph as data (lib/cuda/cudnn/sdpa_graph.h, shared with libhsap's cuDNN piece runner).
using cuda::CudnnDataKind;
using cuda::CudnnGraphPlan;
using cuda::CudnnOpKind;
using cuda::CudnnOpNode;
using cuda::CudnnPointwiseMode;
using cuda::CudnnTensorNode;
using cuda::ValidateGraphPlan;
using enum cuda::CudnnTensorUid;

// The whole row as one ragged batch (its geometry from MakeRaggedGeometry: the documents are
// the entries, S_q = S_kv = the longest, causal top-left or no mask) for cuDNN `version`
// (cudnnGetVersion(), e.g. 91900).
cuda::SdpaGraphSpec RowGraphSpec(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g,
                                 int version);

// The forward and backward graphs of the row (cuda::SdpaForwardPlan / SdpaBackwardPlan of
// RowGraphSpec): 9.0 - 9.9 need the padding applied again after the Stats subtraction, as
// cudnn-frontend does. InvalidArgument for what MakeRaggedGeometry rejects.
absl::StatusOr<CudnnGraphPlan> ForwardGraphPlan(const CudnnAttentionShape& shape, int version);
absl::StatusOr<CudnnGraphPlan> BackwardGraphPlan(const CudnnAttentionShape& shape, int version);

}  // namespace hsap::bench

#endif  // HSAP_BENCH_CUDNN_GRAPH_PLAN_H_
