#include "bench/cudnn_graph_plan.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace hsap::bench {

absl::StatusOr<CudnnRaggedGeometry> MakeRaggedGeometry(const CudnnAttentionShape& shape) {
  if (shape.dtype != DType::kBF16 && shape.dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN fused attention takes bf16 or fp16, not ",
                                                   std::string(DTypeName(shape.dtype))));
  }
  if (shape.heads_q <= 0 || shape.heads_kv <= 0 || shape.heads_q % shape.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: query heads (", shape.heads_q,
                                                   ") must be a positive multiple of kv heads (",
                                                   shape.heads_kv, ")"));
  }
  if (shape.head_dim <= 0 || shape.head_dim % 8 != 0 || shape.head_dim > 256) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: head dim ", shape.head_dim,
                                                   " is not a multiple of 8 in 8..256"));
  }
  CudnnRaggedGeometry g;
  const int64_t hq = shape.heads_q, hkv = shape.heads_kv, d = shape.head_dim;
  g.qo_offsets.push_back(0);
  g.kv_offsets.push_back(0);
  for (int64_t l : shape.doc_lengths) {
    if (l < 0) return absl::InvalidArgumentError("cuDNN attention: negative document length");
    g.total_tokens += l;
    if (l == 0) continue;  // nothing to attend; cuDNN gets only non-empty documents
    // Element offsets must fit the int32 ragged-offset tensors.
    if (l > std::numeric_limits<int32_t>::max() ||
        g.total_tokens * hq * d > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: ", g.total_tokens,
                                                     " tokens x ", hq, " heads x ", d,
                                                     " elements exceed the int32 ragged offsets"));
    }
    g.seq_lens.push_back(static_cast<int32_t>(l));
    g.qo_offsets.push_back(static_cast<int32_t>(g.total_tokens * hq * d));
    g.kv_offsets.push_back(static_cast<int32_t>(g.total_tokens * hkv * d));
    g.max_seq_len = std::max(g.max_seq_len, l);
  }
  g.batch = static_cast<int64_t>(g.seq_lens.size());
  if (g.batch == 0) return absl::InvalidArgumentError("cuDNN attention: the row has no token");
  const int64_t b = g.batch, s = g.max_seq_len;
  g.q_dims = {b, hq, s, d};
  g.q_strides = {s * hq * d, d, hq * d, 1};
  g.kt_dims = {b, hkv, d, s};
  g.kt_strides = {s * hkv * d, d, 1, hkv * d};
  g.v_dims = {b, hkv, s, d};
  g.v_strides = {s * hkv * d, d, hkv * d, 1};
  g.score_dims = {b, hq, s, s};
  g.score_strides = {hq * s * s, s * s, s, 1};
  g.stats_dims = {b, hq, s, 1};
  g.stats_strides = {hq * s, s, 1, 1};
  g.stats_elements = b * hq * s;
  return g;
}

double VisiblePairs(absl::Span<const int64_t> doc_lengths, bool causal) {
  double pairs = 0;
  for (int64_t l : doc_lengths) {
    const double x = static_cast<double>(std::max<int64_t>(l, 0));
    pairs += causal ? x * (x + 1) / 2 : x * x;
  }
  return pairs;
}

double ForwardFlops(absl::Span<const int64_t> doc_lengths, int heads_q, int head_dim, bool causal) {
  return 4.0 * head_dim * heads_q * VisiblePairs(doc_lengths, causal);
}

double BackwardFlops(absl::Span<const int64_t> doc_lengths, int heads_q, int head_dim,
                     bool causal) {
  return 2.5 * ForwardFlops(doc_lengths, heads_q, head_dim, causal);
}

cuda::SdpaGraphSpec RowGraphSpec(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g,
                                 int version) {
  cuda::SdpaGraphSpec spec;
  spec.dtype = shape.dtype;
  spec.head_dim = shape.head_dim;
  spec.heads_q = shape.heads_q;
  spec.heads_kv = shape.heads_kv;
  spec.mask.kind = shape.causal ? cuda::CudnnMaskKind::kCausalTopLeft : cuda::CudnnMaskKind::kNone;
  spec.batch = g.batch;
  spec.max_q_len = spec.max_k_len = g.max_seq_len;
  spec.q_rows = spec.k_rows = g.total_tokens;
  spec.version = version;
  return spec;
}

absl::StatusOr<CudnnGraphPlan> ForwardGraphPlan(const CudnnAttentionShape& shape, int version) {
  HSAP_ASSIGN_OR_RETURN(const CudnnRaggedGeometry g, MakeRaggedGeometry(shape));
  return cuda::SdpaForwardPlan(RowGraphSpec(shape, g, version));
}

absl::StatusOr<CudnnGraphPlan> BackwardGraphPlan(const CudnnAttentionShape& shape, int version) {
  HSAP_ASSIGN_OR_RETURN(const CudnnRaggedGeometry g, MakeRaggedGeometry(shape));
  return cuda::SdpaBackwardPlan(RowGraphSpec(shape, g, version));
}

}  // namespace hsap::bench
