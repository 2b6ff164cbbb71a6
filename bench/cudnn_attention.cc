#include "bench/cudnn_attention.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/params.h"
#include "base/status_macros.h"

#if defined(HSAP_HAVE_CUDNN_HEADERS)
#include <cudnn_graph.h>
#endif

namespace hsap::bench {

// ---------------------------------------------------------------------------------------
// Host logic.

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

const CudnnTensorNode* CudnnGraphPlan::Find(int64_t uid) const {
  for (const CudnnTensorNode& t : tensors) {
    if (t.uid == uid) return &t;
  }
  return nullptr;
}

std::vector<int64_t> CudnnGraphPlan::BoundUids() const {
  std::vector<int64_t> uids;
  for (const CudnnTensorNode& t : tensors) {
    if (!t.is_virtual) uids.push_back(t.uid);
  }
  std::sort(uids.begin(), uids.end());
  return uids;
}

namespace {

// Builds a plan: tensors by uid, ops in order.
class PlanWriter {
 public:
  explicit PlanWriter(CudnnGraphPlan* plan) : plan_(plan) {}

  int64_t Bound(std::string name, int64_t uid, CudnnDataKind dtype, const Dims4& dims,
                const Dims4& strides, int64_t ragged_offset_uid = 0) {
    plan_->tensors.push_back(
        {std::move(name), uid, dtype, dims, strides, false, false, ragged_offset_uid});
    return uid;
  }
  int64_t Scalar(std::string name, int64_t uid) {
    const Dims4 one = {1, 1, 1, 1};
    plan_->tensors.push_back({std::move(name), uid, CudnnDataKind::kFloat, one, one, false, true});
    return uid;
  }
  int64_t Scratch(std::string name, int64_t uid, CudnnDataKind dtype, const Dims4& dims,
                  const Dims4& strides, int64_t ragged_offset_uid, size_t bytes) {
    plan_->tensors.push_back(
        {std::move(name), uid, dtype, dims, strides, false, false, ragged_offset_uid, bytes});
    return uid;
  }
  int64_t Virtual(std::string name, CudnnDataKind dtype, const Dims4& dims, const Dims4& strides,
                  int64_t ragged_offset_uid = 0) {
    const int64_t uid = next_virtual_++;
    plan_->tensors.push_back(
        {std::move(name), uid, dtype, dims, strides, true, false, ragged_offset_uid});
    return uid;
  }

  void Pointwise(std::string name, CudnnPointwiseMode mode, CudnnDataKind math,
                 std::vector<int64_t> inputs, int64_t output, int64_t axis = -1) {
    CudnnOpNode op;
    op.kind = CudnnOpKind::kPointwise;
    op.name = std::move(name);
    op.mode = mode;
    op.math = math;
    op.axis = axis;
    op.inputs = std::move(inputs);
    op.output = output;
    plan_->ops.push_back(std::move(op));
  }
  void Unary(std::string name, CudnnOpKind kind, int64_t x, int64_t output) {
    CudnnOpNode op;
    op.kind = kind;
    op.name = std::move(name);
    op.inputs = {x};
    op.output = output;
    plan_->ops.push_back(std::move(op));
  }
  void Matmul(std::string name, int64_t a, int64_t b, int64_t c, int64_t m_override,
              int64_t n_override, int64_t k_override) {
    CudnnOpNode op;
    op.kind = CudnnOpKind::kMatmul;
    op.name = std::move(name);
    op.inputs = {a, b};
    op.output = c;
    op.m_override = m_override;
    op.n_override = n_override;
    op.k_override = k_override;
    plan_->ops.push_back(std::move(op));
  }

  // Padding mask of `s`: keep (row < seq_len_q) && (col < seq_len_kv), else `lowest`.
  int64_t PaddingMask(const std::string& tag, int64_t s, int64_t lowest, const Dims4& sd,
                      const Dims4& ss) {
    using M = CudnnPointwiseMode;
    using D = CudnnDataKind;
    const int64_t row = Virtual(tag + "_row_index", D::kInt32, sd, ss);
    const int64_t col = Virtual(tag + "_col_index", D::kInt32, sd, ss);
    const int64_t row_ok = Virtual(tag + "_row_lt_seq_q", D::kBool, sd, ss);
    const int64_t col_ok = Virtual(tag + "_col_lt_seq_kv", D::kBool, sd, ss);
    const int64_t keep = Virtual(tag + "_keep", D::kBool, sd, ss);
    const int64_t out = Virtual("S_" + tag, D::kFloat, sd, ss);
    Pointwise(tag + "_row_index", M::kGenIndex, D::kInt32, {s}, row, /*axis=*/2);
    Pointwise(tag + "_col_index", M::kGenIndex, D::kInt32, {s}, col, /*axis=*/3);
    Pointwise(tag + "_row_lt_seq_q", M::kCmpLt, D::kBool, {row, kUidSeqLenQ}, row_ok);
    Pointwise(tag + "_col_lt_seq_kv", M::kCmpLt, D::kBool, {col, kUidSeqLenKv}, col_ok);
    Pointwise(tag + "_and", M::kLogicalAnd, D::kBool, {row_ok, col_ok}, keep);
    Pointwise(tag + "_select", M::kBinarySelect, D::kFloat, {s, lowest, keep}, out);
    return out;
  }

 private:
  CudnnGraphPlan* plan_;
  int64_t next_virtual_ = kUidFirstVirtual;
};

}  // namespace

absl::StatusOr<CudnnGraphPlan> BackwardGraphPlan(const CudnnAttentionShape& shape, int version) {
  HSAP_ASSIGN_OR_RETURN(const CudnnRaggedGeometry g, MakeRaggedGeometry(shape));
  using M = CudnnPointwiseMode;
  using D = CudnnDataKind;
  CudnnGraphPlan plan;
  PlanWriter w(&plan);
  const int64_t b = g.batch, s = g.max_seq_len, hq = shape.heads_q, hkv = shape.heads_kv;
  const int64_t d = shape.head_dim, t = g.total_tokens;
  const Dims4 one = {1, 1, 1, 1};
  const Dims4 seq_dims = {b, 1, 1, 1}, off_dims = {b + 1, 1, 1, 1};

  // Bound tensors: index tensors, the forward's inputs and outputs, the gradients.
  w.Bound("seq_len_q", kUidSeqLenQ, D::kInt32, seq_dims, one);
  w.Bound("seq_len_kv", kUidSeqLenKv, D::kInt32, seq_dims, one);
  w.Bound("ragged_offset_qo", kUidOffsetQo, D::kInt32, off_dims, one);
  w.Bound("ragged_offset_kv", kUidOffsetKv, D::kInt32, off_dims, one);
  const int64_t q = w.Bound("Q", kUidQ, D::kIo, g.q_dims, g.q_strides, kUidOffsetQo);
  const int64_t kt = w.Bound("K^T", kUidK, D::kIo, g.kt_dims, g.kt_strides, kUidOffsetKv);
  const int64_t vt = w.Bound("V^T", kUidV, D::kIo, g.kt_dims, g.kt_strides, kUidOffsetKv);
  const int64_t o = w.Bound("O", kUidO, D::kIo, g.q_dims, g.q_strides, kUidOffsetQo);
  const int64_t dout = w.Bound("dO", kUidDO, D::kIo, g.q_dims, g.q_strides, kUidOffsetQo);
  const int64_t stats = w.Bound("Stats", kUidStats, D::kFloat, g.stats_dims, g.stats_strides);
  const int64_t dq = w.Bound("dQ", kUidDQ, D::kIo, g.q_dims, g.q_strides, kUidOffsetQo);
  const int64_t dk = w.Bound("dK", kUidDK, D::kIo, g.v_dims, g.v_strides, kUidOffsetKv);
  const int64_t dv = w.Bound("dV", kUidDV, D::kIo, g.v_dims, g.v_strides, kUidOffsetKv);
  const int64_t scale = w.Scalar("attn_scale", kUidScale);
  const int64_t unit = w.Scalar("one", kUidOne);

  const Dims4& sd = g.score_dims;
  const Dims4& ss = g.score_strides;
  // Transposed scores [B, Hq, S_kv, S_q] over the same memory: the A operand of dV and dK.
  const Dims4 st_strides = {hq * s * s, s * s, 1, s};
  // fp32 [T, Hq, D] scratch in our packed layout (dQ accumulator, GQA full heads).
  const size_t q_scratch_bytes = static_cast<size_t>(t * hq * d) * sizeof(float);

  // softmax_sum = sum_row(dO * O) * 1: the row term of dS (fp32 scratch [B, Hq, S, 1]).
  const int64_t do_o = w.Virtual("dO_times_O", D::kFloat, g.q_dims, {hq * s * d, s * d, hq * d, 1});
  const int64_t do_o_sum = w.Virtual("sum_dO_times_O", D::kFloat, g.stats_dims, g.stats_strides);
  const int64_t softmax_sum =
      w.Scratch("softmax_sum", kUidSoftmaxSum, D::kFloat, g.stats_dims, g.stats_strides, 0,
                static_cast<size_t>(g.stats_elements) * sizeof(float));
  w.Pointwise("mul_dO_O", M::kMul, D::kFloat, {dout, o}, do_o);
  w.Unary("reduce_dO_O", CudnnOpKind::kReduction, do_o, do_o_sum);
  w.Pointwise("scale_one", M::kMul, D::kFloat, {do_o_sum, unit}, softmax_sum);

  // S = Q K^T * scale, masked as in the forward, E = exp(S - Stats).
  const int64_t s_raw = w.Virtual("S", D::kFloat, sd, ss);
  const int64_t s_scaled = w.Virtual("S_scaled", D::kFloat, sd, ss);
  w.Matmul("matmul_Q_KT", q, kt, s_raw, kUidSeqLenQ, kUidSeqLenKv, 0);
  w.Pointwise("mul_S_scale", M::kMul, D::kFloat, {s_raw, scale}, s_scaled);
  int64_t s_masked =
      w.PaddingMask("padding", s_scaled, w.Scalar("lowest (padding)", kUidLowestPadding), sd, ss);
  if (shape.causal) {
    // Keep row >= col inside each document (equal q and kv lengths: top-left = bottom-right).
    const int64_t row = w.Virtual("causal_row_index", D::kInt32, sd, ss);
    const int64_t col = w.Virtual("causal_col_index", D::kInt32, sd, ss);
    const int64_t keep = w.Virtual("causal_keep", D::kBool, sd, ss);
    const int64_t out = w.Virtual("S_causal", D::kFloat, sd, ss);
    const int64_t lowest = w.Scalar("lowest (causal)", kUidLowestCausal);
    w.Pointwise("causal_row_index", M::kGenIndex, D::kInt32, {s_masked}, row, /*axis=*/2);
    w.Pointwise("causal_col_index", M::kGenIndex, D::kInt32, {s_masked}, col, /*axis=*/3);
    w.Pointwise("row_ge_col", M::kCmpGe, D::kBool, {row, col}, keep);
    w.Pointwise("causal_select", M::kBinarySelect, D::kFloat, {s_masked, lowest, keep}, out);
    s_masked = out;
  }
  int64_t s_sub = w.Virtual("S_minus_stats", D::kFloat, sd, ss);
  w.Pointwise("sub_S_stats", M::kSub, D::kFloat, {s_masked, stats}, s_sub);
  if (version >= 90000 && version < 91000) {
    // cuDNN 9.0 - 9.9 lose the padding through the Stats subtraction (cudnn-frontend
    // applies it again there for those versions).
    s_sub = w.PaddingMask("padding2", s_sub, w.Scalar("lowest (padding 2)", kUidLowestPadding2), sd,
                          ss);
  }
  const int64_t e = w.Virtual("E", D::kFloat, sd, ss);
  w.Pointwise("exp_S", M::kExp, D::kFloat, {s_sub}, e);

  // dV = E^T dO (per query head, then summed over each GQA group).
  const int64_t et = w.Virtual("E^T", D::kIo, sd, st_strides);
  w.Unary("reshape_E", CudnnOpKind::kReshape, e, et);
  const Dims4 full_dims = {b, hq, s, d};
  const Dims4 full_strides = {s * hq * d, d, hq * d, 1};
  if (hq == hkv) {
    w.Matmul("matmul_ET_dO", et, dout, dv, kUidSeqLenKv, 0, kUidSeqLenQ);
  } else {
    const int64_t dv_full = w.Scratch("dV_full_heads", kUidDVFullHeads, D::kIo, full_dims,
                                      full_strides, kUidOffsetKv, q_scratch_bytes);
    w.Matmul("matmul_ET_dO", et, dout, dv_full, kUidSeqLenKv, 0, kUidSeqLenQ);
    w.Unary("reduce_dV_heads", CudnnOpKind::kReduction, dv_full, dv);
  }

  // dS = (dO V^T - softmax_sum) * E * scale.
  const int64_t dp = w.Virtual("dP", D::kFloat, sd, ss);
  const int64_t dp_sub = w.Virtual("dP_minus_sum", D::kFloat, sd, ss);
  const int64_t dp_e = w.Virtual("dP_times_E", D::kFloat, sd, ss);
  const int64_t ds = w.Virtual("dS", D::kFloat, sd, ss);
  w.Matmul("matmul_dO_VT", dout, vt, dp, kUidSeqLenQ, kUidSeqLenKv, 0);
  w.Pointwise("sub_dP_softmax_sum", M::kSub, D::kFloat, {dp, softmax_sum}, dp_sub);
  w.Pointwise("mul_dP_E", M::kMul, D::kFloat, {dp_sub, e}, dp_e);
  w.Pointwise("mul_dS_scale", M::kMul, D::kFloat, {dp_e, scale}, ds);

  // dK = dS^T Q (per query head, then summed over each GQA group).
  const int64_t dst = w.Virtual("dS^T", D::kIo, sd, st_strides);
  w.Unary("reshape_dS", CudnnOpKind::kReshape, ds, dst);
  if (hq == hkv) {
    w.Matmul("matmul_dST_Q", dst, q, dk, kUidSeqLenKv, 0, kUidSeqLenQ);
  } else {
    const int64_t dk_full = w.Scratch("dK_full_heads", kUidDKFullHeads, D::kIo, full_dims,
                                      full_strides, kUidOffsetKv, q_scratch_bytes);
    w.Matmul("matmul_dST_Q", dst, q, dk_full, kUidSeqLenKv, 0, kUidSeqLenQ);
    w.Unary("reduce_dK_heads", CudnnOpKind::kReduction, dk_full, dk);
  }

  // dQ = dS K, accumulated in fp32 scratch, then cast into dQ.
  const int64_t k = w.Virtual("K", D::kIo, g.v_dims, g.v_strides, kUidOffsetKv);
  w.Unary("reshape_K", CudnnOpKind::kReshape, kt, k);
  const int64_t dq_accum = w.Scratch("dQ_accum", kUidDQAccum, D::kFloat, g.q_dims, g.q_strides,
                                     kUidOffsetQo, q_scratch_bytes);
  w.Matmul("matmul_dS_K", ds, k, dq_accum, kUidSeqLenQ, 0, kUidSeqLenKv);
  w.Pointwise("identity_dQ", M::kIdentity, D::kFloat, {dq_accum}, dq);
  return plan;
}

absl::Status ValidateGraphPlan(const CudnnGraphPlan& plan) {
  auto fail = [](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat("cuDNN graph plan: ", parts...));
  };
  std::map<int64_t, const CudnnTensorNode*> by_uid;
  std::map<int64_t, int> produced, consumed;
  for (const CudnnTensorNode& t : plan.tensors) {
    if (!by_uid.emplace(t.uid, &t).second) return fail("uid ", t.uid, " used twice");
    if (t.is_virtual != (t.uid >= kUidFirstVirtual)) {
      return fail("tensor ", t.name, ": uid ", t.uid, (t.is_virtual ? " is virtual" : " is bound"),
                  " on the wrong side of ", static_cast<int64_t>(kUidFirstVirtual));
    }
    for (int i = 0; i < 4; ++i) {
      if (t.dims[i] <= 0 || t.strides[i] <= 0) return fail("tensor ", t.name, ": dims/strides");
    }
  }
  for (const CudnnTensorNode& t : plan.tensors) {
    if (t.ragged_offset_uid == 0) continue;
    auto it = by_uid.find(t.ragged_offset_uid);
    if (it == by_uid.end() || it->second->dtype != CudnnDataKind::kInt32 ||
        it->second->is_virtual) {
      return fail("tensor ", t.name, ": its ragged offset is not a bound int32 tensor");
    }
    ++consumed[t.ragged_offset_uid];
  }
  auto numel = [](const Dims4& d) { return d[0] * d[1] * d[2] * d[3]; };
  for (const CudnnOpNode& op : plan.ops) {
    std::vector<const CudnnTensorNode*> in;
    for (int64_t uid : op.inputs) {
      auto it = by_uid.find(uid);
      if (it == by_uid.end()) return fail(op.name, ": input ", uid, " is not a tensor");
      if (it->second->is_virtual && produced.count(uid) == 0) {
        return fail(op.name, ": reads ", it->second->name, " before any op writes it");
      }
      ++consumed[uid];
      in.push_back(it->second);
    }
    auto out_it = by_uid.find(op.output);
    if (out_it == by_uid.end()) return fail(op.name, ": output ", op.output, " is not a tensor");
    const CudnnTensorNode& out = *out_it->second;
    if (out.by_value) return fail(op.name, ": writes the scalar ", out.name);
    if (++produced[op.output] > 1) return fail(op.name, ": ", out.name, " written twice");
    for (int64_t uid : {op.m_override, op.n_override, op.k_override}) {
      if (uid == 0) continue;
      auto it = by_uid.find(uid);
      if (it == by_uid.end() || it->second->dtype != CudnnDataKind::kInt32) {
        return fail(op.name, ": a GEMM override is not an int32 tensor");
      }
      ++consumed[uid];
    }
    switch (op.kind) {
      case CudnnOpKind::kMatmul: {
        if (in.size() != 2) return fail(op.name, ": a matmul takes two inputs");
        const Dims4 &a = in[0]->dims, &bb = in[1]->dims, &c = out.dims;
        const bool heads_ok =
            c[1] % a[1] == 0 && c[1] % bb[1] == 0 && c[1] == std::max(a[1], bb[1]);
        if (a[0] != bb[0] || a[0] != c[0] || !heads_ok || a[3] != bb[2] || c[2] != a[2] ||
            c[3] != bb[3]) {
          return fail(op.name, ": [", absl::StrJoin(a, ","), "] x [", absl::StrJoin(bb, ","),
                      "] -> [", absl::StrJoin(c, ","), "] does not multiply");
        }
        break;
      }
      case CudnnOpKind::kPointwise: {
        const size_t arity =
            op.mode == CudnnPointwiseMode::kBinarySelect ? 3
            : (op.mode == CudnnPointwiseMode::kExp || op.mode == CudnnPointwiseMode::kIdentity ||
               op.mode == CudnnPointwiseMode::kGenIndex)
                ? 1
                : 2;
        if (in.size() != arity) return fail(op.name, ": takes ", arity, " inputs");
        for (const CudnnTensorNode* x : in) {
          for (int i = 0; i < 4; ++i) {
            if (x->dims[i] != out.dims[i] && x->dims[i] != 1) {
              return fail(op.name, ": ", x->name, " does not broadcast to ", out.name);
            }
          }
        }
        const bool boolean_out = op.mode == CudnnPointwiseMode::kCmpLt ||
                                 op.mode == CudnnPointwiseMode::kCmpGe ||
                                 op.mode == CudnnPointwiseMode::kLogicalAnd;
        if (op.mode == CudnnPointwiseMode::kGenIndex &&
            (out.dtype != CudnnDataKind::kInt32 || op.axis < 0 || op.axis > 3)) {
          return fail(op.name, ": GEN_INDEX needs an axis and an int32 output");
        }
        if (boolean_out && out.dtype != CudnnDataKind::kBool) {
          return fail(op.name, ": a comparison writes booleans");
        }
        if (op.mode == CudnnPointwiseMode::kBinarySelect && in[2]->dtype != CudnnDataKind::kBool) {
          return fail(op.name, ": BINARY_SELECT's mask is not boolean");
        }
        break;
      }
      case CudnnOpKind::kReduction:
        if (in.size() != 1) return fail(op.name, ": a reduction takes one input");
        for (int i = 0; i < 4; ++i) {
          if (in[0]->dims[i] % out.dims[i] != 0) {
            return fail(op.name, ": ", out.name, " is not a reduction of ", in[0]->name);
          }
        }
        break;
      case CudnnOpKind::kReshape:
        if (in.size() != 1 || numel(in[0]->dims) != numel(out.dims)) {
          return fail(op.name, ": a reshape keeps the element count");
        }
        break;
    }
  }
  for (const CudnnTensorNode& t : plan.tensors) {
    if (t.is_virtual && (produced.count(t.uid) == 0 || consumed.count(t.uid) == 0)) {
      return fail("virtual tensor ", t.name,
                  produced.count(t.uid) ? " is never read" : " is never written");
    }
    if (!t.is_virtual && produced.count(t.uid) == 0 && consumed.count(t.uid) == 0) {
      return fail("bound tensor ", t.name, " is not used");
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> CudnnLibrarySearchPath() {
  if (GetParam(Param::kCudaLibPath).has_value()) return cuda::CudaLibrarySearchPath();
  std::vector<std::string> dirs = cuda::CudaLibrarySearchPath();  // ends with "" (default)
  dirs.insert(dirs.end() - 1, "/usr/local/cuda-13.0/lib");
  return dirs;
}

// ---------------------------------------------------------------------------------------
// Device side.

#if defined(HSAP_HAVE_CUDNN_HEADERS)

namespace {

// Status propagation inside this file.
#define HSAP_CUDNN_RETURN_IF_ERROR(expr)      \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (0)
#define HSAP_CUDNN_CONCAT_INNER(a, b) a##b
#define HSAP_CUDNN_CONCAT(a, b) HSAP_CUDNN_CONCAT_INNER(a, b)
#define HSAP_CUDNN_ASSIGN_OR_RETURN(lhs, expr) \
  HSAP_CUDNN_ASSIGN_OR_RETURN_IMPL(HSAP_CUDNN_CONCAT(_statusor_, __LINE__), lhs, expr)
#define HSAP_CUDNN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return tmp.status();                    \
  lhs = *std::move(tmp)

}  // namespace

// The functions of libcudnn.so.9 this file calls, typed by cudnn_graph.h.
class CudnnApi {
 public:
  std::string path;
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;  // may be null
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) BackendCreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) BackendDestroyDescriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) BackendSetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) BackendGetAttribute = nullptr;
  decltype(&cudnnBackendFinalize) BackendFinalize = nullptr;
  decltype(&cudnnBackendExecute) BackendExecute = nullptr;

  // "<what> failed: CUDNN_STATUS_NOT_SUPPORTED (3000): <last error>"; OK for success.
  absl::Status Check(cudnnStatus_t status, absl::string_view what) const {
    if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
    const char* text = GetErrorString != nullptr ? GetErrorString(status) : nullptr;
    std::string msg = absl::StrCat(what, " failed: ", text != nullptr ? text : "unknown status",
                                   " (", static_cast<int>(status), ")");
    if (GetLastErrorString != nullptr) {
      char last[1024] = {0};
      GetLastErrorString(last, sizeof(last));
      if (last[0] != '\0') absl::StrAppend(&msg, ": ", last);
    }
    if (status == CUDNN_STATUS_NOT_SUPPORTED ||
        (static_cast<int>(status) >= 3000 && static_cast<int>(status) < 4000)) {
      return absl::UnimplementedError(msg);
    }
    if (status == CUDNN_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
    return absl::InternalError(msg);
  }
};

namespace {

absl::StatusOr<std::unique_ptr<CudnnApi>> LoadCudnnImpl() {
  auto api = std::make_unique<CudnnApi>();
  std::vector<std::string> tried;
  void* handle = nullptr;
  for (const std::string& dir : CudnnLibrarySearchPath()) {
    const std::string candidate = dir.empty() ? "libcudnn.so.9" : dir + "/libcudnn.so.9";
    handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      api->path = candidate;
      break;
    }
    tried.push_back(candidate);
  }
  if (handle == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("libcudnn.so.9 not found: no cuDNN 9 (tried ", absl::StrJoin(tried, ", "),
                     "; set $HSAP_CUDA_LIB_PATH to the directory that holds it)"));
  }
  auto bind = [&](const char* symbol, auto* out, bool optional = false) -> absl::Status {
    void* p = dlsym(handle, symbol);
    if (p == nullptr && !optional) {
      return absl::UnimplementedError(
          absl::StrCat(api->path, " lacks ", symbol, ": not a cuDNN 9 library"));
    }
    *out = reinterpret_cast<std::remove_pointer_t<decltype(out)>>(p);
    return absl::OkStatus();
  };
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnGetVersion", &api->GetVersion));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnGetErrorString", &api->GetErrorString));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnGetLastErrorString", &api->GetLastErrorString, true));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnCreate", &api->Create));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnDestroy", &api->Destroy));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnSetStream", &api->SetStream));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendCreateDescriptor", &api->BackendCreateDescriptor));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendDestroyDescriptor", &api->BackendDestroyDescriptor));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendSetAttribute", &api->BackendSetAttribute));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendGetAttribute", &api->BackendGetAttribute));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendFinalize", &api->BackendFinalize));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendExecute", &api->BackendExecute));
  const size_t version = api->GetVersion();
  if (version < 90000) {
    return absl::UnimplementedError(
        absl::StrCat(api->path, " is cuDNN ", version, "; the ragged graph needs cuDNN 9"));
  }
  return api;
}

// Loaded once per search path and never unloaded (as lib/cuda/runtime/cuda_loader.cc does).
absl::StatusOr<const CudnnApi*> LoadCudnn() {
  static std::mutex mu;
  static auto* cache = new std::map<std::string, absl::StatusOr<const CudnnApi*>>();
  const std::string key = absl::StrJoin(CudnnLibrarySearchPath(), ":");
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache->find(key); it != cache->end()) return it->second;
  absl::StatusOr<std::unique_ptr<CudnnApi>> api = LoadCudnnImpl();
  absl::StatusOr<const CudnnApi*> result =
      api.ok() ? absl::StatusOr<const CudnnApi*>(api->release()) : api.status();
  cache->emplace(key, result);
  return result;
}

// One backend descriptor, destroyed with the object.
class Desc {
 public:
  Desc(const CudnnApi* api, cudnnBackendDescriptor_t d) : api_(api), d_(d) {}
  Desc(Desc&& o) noexcept : api_(o.api_), d_(std::exchange(o.d_, nullptr)) {}
  Desc& operator=(Desc&& o) noexcept {
    if (this != &o) {
      Reset();
      api_ = o.api_;
      d_ = std::exchange(o.d_, nullptr);
    }
    return *this;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  ~Desc() { Reset(); }
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  void Reset() {
    if (d_ != nullptr) api_->BackendDestroyDescriptor(d_);
    d_ = nullptr;
  }
  const CudnnApi* api_;
  cudnnBackendDescriptor_t d_;
};

// cudaMalloc'ed bytes, freed with the object.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : rt_(o.rt_), p_(std::exchange(o.p_, nullptr)), bytes_(o.bytes_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      rt_ = o.rt_;
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = o.bytes_;
    }
    return *this;
  }
  ~DeviceBuffer() { Reset(); }

  static absl::StatusOr<DeviceBuffer> Allocate(const cuda::CudaRuntimeApi* rt, size_t bytes,
                                               absl::string_view what) {
    DeviceBuffer b;
    b.rt_ = rt;
    b.bytes_ = bytes;
    if (bytes == 0) return b;
    HSAP_CUDNN_RETURN_IF_ERROR(rt->Check(rt->Malloc(&b.p_, bytes),
                                         absl::StrCat("cudaMalloc(", bytes, " bytes) for ", what)));
    return b;
  }
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (p_ != nullptr) rt_->Free(p_);
    p_ = nullptr;
  }
  const cuda::CudaRuntimeApi* rt_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

struct TensorSpec {
  const char* name;
  int64_t uid;
  cudnnDataType_t dtype;
  Dims4 dims;
  Dims4 strides;
  bool is_virtual = false;
  bool by_value = false;
  cudnnBackendDescriptor_t ragged_offset = nullptr;
};

// Builds backend descriptors, each checked, each kept alive in `keep` until the owner goes.
class Builder {
 public:
  Builder(const CudnnApi* api, std::vector<Desc>* keep) : api_(api), keep_(keep) {}

  absl::StatusOr<cudnnBackendDescriptor_t> Make(cudnnBackendDescriptorType_t type,
                                                absl::string_view what) {
    cudnnBackendDescriptor_t d = nullptr;
    HSAP_CUDNN_RETURN_IF_ERROR(
        api_->Check(api_->BackendCreateDescriptor(type, &d),
                    absl::StrCat("cudnnBackendCreateDescriptor(", what, ")")));
    keep_->emplace_back(api_, d);
    return d;
  }
  absl::Status Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr,
                   cudnnBackendAttributeType_t type, int64_t count, const void* value,
                   absl::string_view what) {
    return api_->Check(api_->BackendSetAttribute(d, attr, type, count, value),
                       absl::StrCat("cudnnBackendSetAttribute(", what, ", attribute ",
                                    static_cast<int>(attr), ")"));
  }
  absl::Status SetDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr,
                       cudnnBackendDescriptor_t value, absl::string_view what) {
    return Set(d, attr, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
  }
  absl::Status Finalize(cudnnBackendDescriptor_t d, absl::string_view what) {
    return api_->Check(api_->BackendFinalize(d), absl::StrCat("cudnnBackendFinalize(", what, ")"));
  }

  absl::StatusOr<cudnnBackendDescriptor_t> Tensor(const TensorSpec& t) {
    const std::string what = absl::StrCat("tensor ", t.name);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t d,
                                Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, what));
    const int64_t alignment = 16;
    const bool is_virtual = t.is_virtual, by_value = t.by_value;
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &t.dtype, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, t.dims.data(), what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, t.strides.data(), what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t.uid, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, what));
    if (by_value) {
      HSAP_CUDNN_RETURN_IF_ERROR(
          Set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, what));
    }
    if (t.ragged_offset != nullptr) {
      HSAP_CUDNN_RETURN_IF_ERROR(
          SetDesc(d, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, t.ragged_offset, what));
    }
    HSAP_CUDNN_RETURN_IF_ERROR(Finalize(d, what));
    return d;
  }

  // y = op(x[, b[, t]]) with the given math precision; axis only for GEN_INDEX.
  absl::StatusOr<cudnnBackendDescriptor_t> Pointwise(
      const char* name, cudnnPointwiseMode_t mode, cudnnDataType_t math_prec,
      cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
      cudnnBackendDescriptor_t y, int64_t axis = -1) {
    const std::string what = absl::StrCat("pointwise ", name);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t pw,
                                Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math_prec, what));
    if (axis >= 0) {
      HSAP_CUDNN_RETURN_IF_ERROR(
          Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what));
    }
    HSAP_CUDNN_RETURN_IF_ERROR(Finalize(pw, what));
    const std::string op_what = absl::StrCat("operation ", what);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                                Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, op_what));
    if (b != nullptr) {
      HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, op_what));
    }
    if (t != nullptr) {
      HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, op_what));
    }
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(Finalize(op, op_what));
    return op;
  }

  // y = reduce(x) over the last axis (y's last dim is 1), fp32.
  absl::StatusOr<cudnnBackendDescriptor_t> Reduction(const char* name, cudnnReduceTensorOp_t mode,
                                                     cudnnBackendDescriptor_t x,
                                                     cudnnBackendDescriptor_t y) {
    const std::string what = absl::StrCat("reduction ", name);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t red,
                                Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what));
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    HSAP_CUDNN_RETURN_IF_ERROR(Set(red, CUDNN_ATTR_REDUCTION_OPERATOR,
                                   CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what));
    HSAP_CUDNN_RETURN_IF_ERROR(Finalize(red, what));
    const std::string op_what = absl::StrCat("operation ", what);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                                Make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, red, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(Finalize(op, op_what));
    return op;
  }

  // c = a @ b (fp32 accumulation), with optional GEMM M/N/K overrides (seq_len tensors).
  absl::StatusOr<cudnnBackendDescriptor_t> Matmul(const char* name, cudnnBackendDescriptor_t a,
                                                  cudnnBackendDescriptor_t b,
                                                  cudnnBackendDescriptor_t c,
                                                  cudnnBackendDescriptor_t m_override,
                                                  cudnnBackendDescriptor_t n_override,
                                                  cudnnBackendDescriptor_t k_override) {
    const std::string what = absl::StrCat("matmul ", name);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t mm,
                                Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, what));
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what));
    HSAP_CUDNN_RETURN_IF_ERROR(Finalize(mm, what));
    const std::string op_what = absl::StrCat("operation ", what);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                                Make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, op_what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, op_what));
    if (m_override != nullptr) {
      HSAP_CUDNN_RETURN_IF_ERROR(
          SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override, op_what));
    }
    if (n_override != nullptr) {
      HSAP_CUDNN_RETURN_IF_ERROR(
          SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override, op_what));
    }
    if (k_override != nullptr) {
      HSAP_CUDNN_RETURN_IF_ERROR(
          SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override, op_what));
    }
    HSAP_CUDNN_RETURN_IF_ERROR(Finalize(op, op_what));
    return op;
  }

  // y = x seen through y's dims and strides (a transpose, or a cast of a virtual tensor).
  absl::StatusOr<cudnnBackendDescriptor_t> Reshape(const char* name, cudnnBackendDescriptor_t x,
                                                   cudnnBackendDescriptor_t y) {
    const std::string what = absl::StrCat("operation reshape ", name);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                                Make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, what));
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, what));
    HSAP_CUDNN_RETURN_IF_ERROR(Finalize(op, what));
    return op;
  }

 private:
  const CudnnApi* api_;
  std::vector<Desc>* keep_;
};

// Bytes of `n` int32 values rounded up to 16.
size_t Aligned16(size_t n) { return (n * sizeof(int32_t) + 15) / 16 * 16; }

cudnnDataType_t CudnnDataType(CudnnDataKind kind, cudnnDataType_t io) {
  switch (kind) {
    case CudnnDataKind::kIo:
      return io;
    case CudnnDataKind::kFloat:
      return CUDNN_DATA_FLOAT;
    case CudnnDataKind::kInt32:
      return CUDNN_DATA_INT32;
    case CudnnDataKind::kBool:
      return CUDNN_DATA_BOOLEAN;
  }
  return CUDNN_DATA_FLOAT;
}

cudnnPointwiseMode_t CudnnPointwise(CudnnPointwiseMode mode) {
  switch (mode) {
    case CudnnPointwiseMode::kMul:
      return CUDNN_POINTWISE_MUL;
    case CudnnPointwiseMode::kSub:
      return CUDNN_POINTWISE_SUB;
    case CudnnPointwiseMode::kExp:
      return CUDNN_POINTWISE_EXP;
    case CudnnPointwiseMode::kIdentity:
      return CUDNN_POINTWISE_IDENTITY;
    case CudnnPointwiseMode::kGenIndex:
      return CUDNN_POINTWISE_GEN_INDEX;
    case CudnnPointwiseMode::kCmpLt:
      return CUDNN_POINTWISE_CMP_LT;
    case CudnnPointwiseMode::kCmpGe:
      return CUDNN_POINTWISE_CMP_GE;
    case CudnnPointwiseMode::kLogicalAnd:
      return CUDNN_POINTWISE_LOGICAL_AND;
    case CudnnPointwiseMode::kBinarySelect:
      return CUDNN_POINTWISE_BINARY_SELECT;
  }
  return CUDNN_POINTWISE_IDENTITY;
}

// Creates and finalizes the tensor and operation descriptors of `plan` (kept in `keep`); the
// operations in plan order.
absl::StatusOr<std::vector<cudnnBackendDescriptor_t>> LowerPlan(const CudnnApi* api,
                                                                const CudnnGraphPlan& plan,
                                                                DType dtype,
                                                                std::vector<Desc>* keep) {
  Builder b(api, keep);
  const cudnnDataType_t io = dtype == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  // Tensors: those without a ragged offset first (the others name their offset tensor).
  std::map<int64_t, cudnnBackendDescriptor_t> made;
  for (bool ragged : {false, true}) {
    for (const CudnnTensorNode& t : plan.tensors) {
      if ((t.ragged_offset_uid != 0) != ragged) continue;
      HSAP_CUDNN_ASSIGN_OR_RETURN(
          made[t.uid],
          b.Tensor({t.name.c_str(), t.uid, CudnnDataType(t.dtype, io), t.dims, t.strides,
                    t.is_virtual, t.by_value, ragged ? made.at(t.ragged_offset_uid) : nullptr}));
    }
  }
  auto tensor = [&](int64_t uid) -> cudnnBackendDescriptor_t {
    return uid == 0 ? nullptr : made.at(uid);
  };
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const CudnnOpNode& node : plan.ops) {
    auto input = [&](size_t i) {
      return i < node.inputs.size() ? tensor(node.inputs[i]) : nullptr;
    };
    const char* name = node.name.c_str();
    absl::StatusOr<cudnnBackendDescriptor_t> op;
    switch (node.kind) {
      case CudnnOpKind::kMatmul:
        op = b.Matmul(name, input(0), input(1), tensor(node.output), tensor(node.m_override),
                      tensor(node.n_override), tensor(node.k_override));
        break;
      case CudnnOpKind::kPointwise:
        op = b.Pointwise(name, CudnnPointwise(node.mode), CudnnDataType(node.math, io), input(0),
                         input(1), input(2), tensor(node.output), node.axis);
        break;
      case CudnnOpKind::kReduction:
        op = b.Reduction(name, CUDNN_REDUCE_TENSOR_ADD, input(0), tensor(node.output));
        break;
      case CudnnOpKind::kReshape:
        op = b.Reshape(name, input(0), tensor(node.output));
        break;
    }
    if (!op.ok()) return op.status();
    ops.push_back(*op);
  }
  return ops;
}

// Offsets of the backward's scratch tensors inside one allocation (256-byte aligned).
std::map<int64_t, size_t> ScratchLayout(const CudnnGraphPlan& plan, size_t* total) {
  std::map<int64_t, size_t> offsets;
  size_t at = 0;
  for (const CudnnTensorNode& t : plan.tensors) {
    if (t.scratch_bytes == 0) continue;
    offsets[t.uid] = at;
    at += (t.scratch_bytes + 255) / 256 * 256;
  }
  *total = at;
  return offsets;
}

}  // namespace

struct CudnnAttention::Impl {
  const CudnnApi* api = nullptr;
  const cuda::CudaRuntimeApi* rt = nullptr;
  cudnnHandle_t handle = nullptr;
  std::vector<Desc> descs;  // tensors, operations, graph, engine configs
  std::vector<Desc> plan;   // the execution plan (at most one), destroyed first
  DeviceBuffer index;       // seq_lens, qo offsets, kv offsets
  DeviceBuffer workspace;
  void* seq_lens_dev = nullptr;
  void* qo_offsets_dev = nullptr;
  void* kv_offsets_dev = nullptr;
  // Host values of the by-value scalars (their addresses go into every variant pack).
  float scale = 1.0f;
  float lowest = std::numeric_limits<float>::lowest();
  float one = 1.0f;
  // The backward: its plan, its scratch tensors (uid -> device address) in one allocation.
  CudnnGraphPlan backward_plan;
  DeviceBuffer scratch;
  std::map<int64_t, void*> scratch_dev;
  bool zero_dq_accum = false;  // cuDNN < 9.6 expects the caller to zero the dQ accumulator

  ~Impl() {
    plan.clear();
    // Engine configs and operations reference each other; destroy newest first.
    while (!descs.empty()) descs.pop_back();
    if (handle != nullptr) api->Destroy(handle);
  }

  absl::Status Build(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g);
  absl::Status BuildBackward(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g,
                             int version);
  // Finalizes the graph of `ops`, picks the plan, allocates the workspace, uploads the index
  // tensors and sets the scale.
  absl::Status FinishBuild(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g,
                           const std::vector<cudnnBackendDescriptor_t>& ops);
  absl::Status PickPlan(cudnnBackendDescriptor_t graph, size_t* workspace_bytes);
  // Binds `uids` to `ptrs` in a variant pack and executes the plan on `stream`.
  absl::Status Execute(absl::Span<const int64_t> uids, absl::Span<void* const> ptrs,
                       cuda::cudaStream stream, absl::string_view what);
};

absl::Status CudnnAttention::Impl::Build(const CudnnAttentionShape& shape,
                                         const CudnnRaggedGeometry& g) {
  Builder b(api, &descs);
  const cudnnDataType_t io = shape.dtype == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  const int64_t batch = g.batch;
  const Dims4 one = {1, 1, 1, 1};
  int64_t next_virtual = kUidFirstVirtual;
  auto virt = [&](const char* name, cudnnDataType_t dtype, const Dims4& dims,
                  const Dims4& strides) {
    return b.Tensor({name, next_virtual++, dtype, dims, strides, /*is_virtual=*/true});
  };

  // Index tensors (device int32): seq lens [B,1,1,1], ragged offsets [B+1,1,1,1].
  const Dims4 seq_dims = {batch, 1, 1, 1}, off_dims = {batch + 1, 1, 1, 1};
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto seq_q, b.Tensor({"seq_len_q", kUidSeqLenQ, CUDNN_DATA_INT32, seq_dims, one}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto seq_kv, b.Tensor({"seq_len_kv", kUidSeqLenKv, CUDNN_DATA_INT32, seq_dims, one}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto off_qo, b.Tensor({"ragged_offset_qo", kUidOffsetQo, CUDNN_DATA_INT32, off_dims, one}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto off_kv, b.Tensor({"ragged_offset_kv", kUidOffsetKv, CUDNN_DATA_INT32, off_dims, one}));

  // Inputs and outputs in our packed layout.
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto q, b.Tensor({"Q", kUidQ, io, g.q_dims, g.q_strides, false, false, off_qo}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto kt, b.Tensor({"K^T", kUidK, io, g.kt_dims, g.kt_strides, false, false, off_kv}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto v, b.Tensor({"V", kUidV, io, g.v_dims, g.v_strides, false, false, off_kv}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto o, b.Tensor({"O", kUidO, io, g.q_dims, g.q_strides, false, false, off_qo}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto stats, b.Tensor({"Stats", kUidStats, CUDNN_DATA_FLOAT, g.stats_dims, g.stats_strides}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto scale_t, b.Tensor({"attn_scale", kUidScale, CUDNN_DATA_FLOAT,
                                                      one, one, false, /*by_value=*/true}));

  std::vector<cudnnBackendDescriptor_t> ops;
  const Dims4& sd = g.score_dims;
  const Dims4& ss = g.score_strides;

  // S = Q K^T over each document's seq_len x seq_len block.
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_raw, virt("S", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto bmm1,
                              b.Matmul("bmm1 (Q K^T)", q, kt, s_raw, seq_q, seq_kv, nullptr));
  ops.push_back(bmm1);
  // S *= 1/sqrt(D).
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_scaled, virt("S_scaled", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto mul, b.Pointwise("attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s_raw, scale_t,
                            nullptr, s_scaled));
  ops.push_back(mul);

  // Padding mask: keep (row < seq_len_q) && (col < seq_len_kv), else the lowest float.
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_p, virt("pad_row_index", CUDNN_DATA_INT32, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_p, virt("pad_col_index", CUDNN_DATA_INT32, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_ok, virt("row_lt_seq_q", CUDNN_DATA_INT32, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_ok, virt("col_lt_seq_kv", CUDNN_DATA_INT32, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto keep_p, virt("pad_keep", CUDNN_DATA_BOOLEAN, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto lowest_p, b.Tensor({"lowest (padding)", kUidLowestPadding, CUDNN_DATA_FLOAT, one, one,
                               false, /*by_value=*/true}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_padded, virt("S_padded", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto op, b.Pointwise("pad_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s_scaled,
                           nullptr, nullptr, row_p, /*axis=*/2));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("pad_col_index", CUDNN_POINTWISE_GEN_INDEX,
                                              CUDNN_DATA_INT32, s_scaled, nullptr, nullptr, col_p,
                                              /*axis=*/3));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("row_lt_seq_q", CUDNN_POINTWISE_CMP_LT,
                                              CUDNN_DATA_INT32, row_p, seq_q, nullptr, row_ok));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("col_lt_seq_kv", CUDNN_POINTWISE_CMP_LT,
                                              CUDNN_DATA_INT32, col_p, seq_kv, nullptr, col_ok));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("pad_and", CUDNN_POINTWISE_LOGICAL_AND,
                                              CUDNN_DATA_BOOLEAN, row_ok, col_ok, nullptr, keep_p));
  ops.push_back(op);
  // BINARY_SELECT: y = t ? x : b.
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      op, b.Pointwise("pad_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s_scaled,
                      lowest_p, keep_p, s_padded));
  ops.push_back(op);
  cudnnBackendDescriptor_t s_masked = s_padded;

  // Causal mask inside each document: keep row >= col (q and kv lengths are equal, so top-left
  // and bottom-right alignments coincide).
  if (shape.causal) {
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_c, virt("causal_row_index", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_c, virt("causal_col_index", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto keep_c, virt("causal_keep", CUDNN_DATA_BOOLEAN, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        auto lowest_c, b.Tensor({"lowest (causal)", kUidLowestCausal, CUDNN_DATA_FLOAT, one, one,
                                 false, /*by_value=*/true}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_causal, virt("S_causal", CUDNN_DATA_FLOAT, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("causal_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s_padded,
                        nullptr, nullptr, row_c, /*axis=*/2));
    ops.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("causal_col_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s_padded,
                        nullptr, nullptr, col_c, /*axis=*/3));
    ops.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("row_ge_col", CUDNN_POINTWISE_CMP_GE,
                                                CUDNN_DATA_BOOLEAN, row_c, col_c, nullptr, keep_c));
    ops.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("causal_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s_padded,
                        lowest_c, keep_c, s_causal));
    ops.push_back(op);
    s_masked = s_causal;
  }

  // Softmax with its log-sum-exp: M = max, E = exp(S - M), Z = sum E, Stats = M + log Z,
  // P = E / Z (in the I/O type: what the second matmul takes).
  const Dims4& rd = g.stats_dims;
  const Dims4& rs = g.stats_strides;
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_max, virt("row_max", CUDNN_DATA_FLOAT, rd, rs));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_sub, virt("S_minus_max", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_exp, virt("exp", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_sum, virt("row_sum", CUDNN_DATA_FLOAT, rd, rs));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_log, virt("log_row_sum", CUDNN_DATA_FLOAT, rd, rs));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto p, virt("P", io, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(op,
                              b.Reduction("row_max", CUDNN_REDUCE_TENSOR_MAX, s_masked, row_max));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("sub_max", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT,
                                              s_masked, row_max, nullptr, s_sub));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, s_sub,
                                              nullptr, nullptr, s_exp));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Reduction("row_sum", CUDNN_REDUCE_TENSOR_ADD, s_exp, row_sum));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("log", CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, row_sum,
                                              nullptr, nullptr, row_log));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("stats", CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT,
                                              row_max, row_log, nullptr, stats));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("div_sum", CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT,
                                              s_exp, row_sum, nullptr, p));
  ops.push_back(op);

  // O = P V over each document.
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Matmul("bmm2 (P V)", p, v, o, seq_q, nullptr, seq_kv));
  ops.push_back(op);
  return FinishBuild(shape, g, ops);
}

absl::Status CudnnAttention::Impl::BuildBackward(const CudnnAttentionShape& shape,
                                                 const CudnnRaggedGeometry& g, int version) {
  HSAP_CUDNN_ASSIGN_OR_RETURN(backward_plan, BackwardGraphPlan(shape, version));
  HSAP_CUDNN_RETURN_IF_ERROR(ValidateGraphPlan(backward_plan));
  HSAP_CUDNN_ASSIGN_OR_RETURN(const std::vector<cudnnBackendDescriptor_t> ops,
                              LowerPlan(api, backward_plan, shape.dtype, &descs));
  HSAP_CUDNN_RETURN_IF_ERROR(FinishBuild(shape, g, ops));

  // Scratch tensors (softmax_sum, the dQ accumulator, GQA full heads): one allocation.
  size_t scratch_bytes = 0;
  const std::map<int64_t, size_t> offsets = ScratchLayout(backward_plan, &scratch_bytes);
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      scratch, DeviceBuffer::Allocate(rt, scratch_bytes, "the cuDNN backward's scratch tensors"));
  for (const auto& [uid, offset] : offsets) {
    scratch_dev[uid] = static_cast<uint8_t*>(scratch.get()) + offset;
  }
  zero_dq_accum = version < 90600;
  return absl::OkStatus();
}

absl::Status CudnnAttention::Impl::FinishBuild(const CudnnAttentionShape& shape,
                                               const CudnnRaggedGeometry& g,
                                               const std::vector<cudnnBackendDescriptor_t>& ops) {
  Builder b(api, &descs);
  // The operation graph.
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto graph,
                              b.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                   &handle, "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
                                   ops.data(), "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Finalize(graph, "operation graph"));
  size_t workspace_bytes = 0;
  HSAP_CUDNN_RETURN_IF_ERROR(PickPlan(graph, &workspace_bytes));
  HSAP_CUDNN_ASSIGN_OR_RETURN(workspace,
                              DeviceBuffer::Allocate(rt, workspace_bytes, "the cuDNN workspace"));

  // Seq lens and ragged offsets on the device.
  const size_t seq_bytes = Aligned16(g.seq_lens.size());
  const size_t off_bytes = Aligned16(g.qo_offsets.size());
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      index, DeviceBuffer::Allocate(rt, seq_bytes + 2 * off_bytes, "seq lens and ragged offsets"));
  std::vector<uint8_t> host(index.bytes(), 0);
  std::memcpy(host.data(), g.seq_lens.data(), g.seq_lens.size() * sizeof(int32_t));
  std::memcpy(host.data() + seq_bytes, g.qo_offsets.data(), g.qo_offsets.size() * sizeof(int32_t));
  std::memcpy(host.data() + seq_bytes + off_bytes, g.kv_offsets.data(),
              g.kv_offsets.size() * sizeof(int32_t));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->Memcpy(index.get(), host.data(), host.size(), cuda::kCudaMemcpyDefault),
                "cudaMemcpy (seq lens and ragged offsets)"));
  uint8_t* base = static_cast<uint8_t*>(index.get());
  seq_lens_dev = base;
  qo_offsets_dev = base + seq_bytes;
  kv_offsets_dev = base + seq_bytes + off_bytes;
  scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  return absl::OkStatus();
}

absl::Status CudnnAttention::Impl::PickPlan(cudnnBackendDescriptor_t graph,
                                            size_t* workspace_bytes) {
  Builder b(api, &descs);
  std::vector<std::string> rejected;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "A" : "fallback";
    const std::string what = absl::StrCat("engine heuristics (mode ", mode_name, ")");
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto heur, b.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, what));
    HSAP_CUDNN_RETURN_IF_ERROR(b.SetDesc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        b.Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, what));
    if (absl::Status s = b.Finalize(heur, what); !s.ok()) {
      rejected.push_back(std::string(s.message()));
      continue;
    }
    int64_t count = 0;
    HSAP_CUDNN_RETURN_IF_ERROR(
        api->Check(api->BackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                            CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
                   absl::StrCat("cudnnBackendGetAttribute(", what, ", result count)")));
    if (count <= 0) {
      rejected.push_back(absl::StrCat(what, ": no engine configuration"));
      continue;
    }
    std::vector<cudnnBackendDescriptor_t> cfgs;
    for (int64_t i = 0; i < count; ++i) {
      HSAP_CUDNN_ASSIGN_OR_RETURN(auto cfg,
                                  b.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
      cfgs.push_back(cfg);
    }
    int64_t returned = 0;
    HSAP_CUDNN_RETURN_IF_ERROR(api->Check(
        api->BackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                 count, &returned, cfgs.data()),
        absl::StrCat("cudnnBackendGetAttribute(", what, ", results)")));
    for (int64_t i = 0; i < std::min(returned, count); ++i) {
      cudnnBackendDescriptor_t d = nullptr;
      HSAP_CUDNN_RETURN_IF_ERROR(
          api->Check(api->BackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &d),
                     "cudnnBackendCreateDescriptor(execution plan)"));
      Desc candidate(api, d);
      absl::Status s = b.Set(d, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle,
                             "execution plan");
      if (s.ok())
        s = b.SetDesc(d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[i], "execution plan");
      if (s.ok()) s = b.Finalize(d, absl::StrCat("execution plan of engine config ", i));
      if (!s.ok()) {
        rejected.push_back(std::string(s.message()));
        continue;  // `candidate` destroys the descriptor
      }
      int64_t ws = 0;
      HSAP_CUDNN_RETURN_IF_ERROR(
          api->Check(api->BackendGetAttribute(d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                              CUDNN_TYPE_INT64, 1, nullptr, &ws),
                     "cudnnBackendGetAttribute(execution plan, workspace size)"));
      *workspace_bytes = static_cast<size_t>(std::max<int64_t>(ws, 0));
      plan.push_back(std::move(candidate));
      return absl::OkStatus();
    }
  }
  // Keep the message readable: the first few reasons.
  if (rejected.size() > 4) rejected.resize(4);
  return absl::NotFoundError(absl::StrCat("no cuDNN engine supports the fused attention graph: ",
                                          absl::StrJoin(rejected, "; ")));
}

absl::Status CudnnAttention::Impl::Execute(absl::Span<const int64_t> uids,
                                           absl::Span<void* const> ptrs, cuda::cudaStream stream,
                                           absl::string_view what) {
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->SetStream(handle, reinterpret_cast<cudaStream_t>(stream)), "cudnnSetStream"));
  cudnnBackendDescriptor_t d = nullptr;
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &d),
                 "cudnnBackendCreateDescriptor(variant pack)"));
  Desc pack(api, d);
  void* workspace_ptr = workspace.get();
  const int64_t n = static_cast<int64_t>(uids.size());
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                          n, uids.data()),
                 "cudnnBackendSetAttribute(variant pack, unique ids)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                          CUDNN_TYPE_VOID_PTR, n, ptrs.data()),
                 "cudnnBackendSetAttribute(variant pack, data pointers)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR,
                                          1, &workspace_ptr),
                 "cudnnBackendSetAttribute(variant pack, workspace)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendFinalize(d), "cudnnBackendFinalize(variant pack)"));
  return api->Check(api->BackendExecute(handle, plan.front().get(), d),
                    absl::StrCat("cudnnBackendExecute(", what, ")"));
}

absl::Status FinalizePlanDescriptors(const CudnnGraphPlan& plan, DType dtype) {
  HSAP_RETURN_IF_ERROR(ValidateGraphPlan(plan));
  HSAP_ASSIGN_OR_RETURN(const CudnnApi* api, LoadCudnn());
  std::vector<Desc> keep;
  absl::Status status = LowerPlan(api, plan, dtype, &keep).status();
  while (!keep.empty()) keep.pop_back();  // newest first, as ~Impl does
  return status;
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    const CudnnAttentionShape& shape, CudnnPass pass) {
  HSAP_CUDNN_ASSIGN_OR_RETURN(CudnnRaggedGeometry geometry, MakeRaggedGeometry(shape));
  HSAP_CUDNN_ASSIGN_OR_RETURN(const CudnnApi* api, LoadCudnn());
  if (absl::Status s = cuda::CheckCudaDevice(); !s.ok()) {
    return absl::UnimplementedError(absl::StrCat("cuDNN attention: ", s.message()));
  }
  HSAP_CUDNN_ASSIGN_OR_RETURN(const cuda::CudaRuntimeApi* rt, cuda::LoadCudaRuntime());
  int device = 0, major = 0, minor = 0;
  HSAP_CUDNN_RETURN_IF_ERROR(rt->Check(rt->GetDevice(&device), "cudaGetDevice"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->DeviceGetAttribute(&major, cuda::kCudaDevAttrComputeCapabilityMajor, device),
                "cudaDeviceGetAttribute(compute capability)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->DeviceGetAttribute(&minor, cuda::kCudaDevAttrComputeCapabilityMinor, device),
                "cudaDeviceGetAttribute(compute capability)"));
  if (major < 8) {
    return absl::UnimplementedError(absl::StrCat("cuDNN fused attention needs sm80 or newer; GPU ",
                                                 device, " is sm", major, minor));
  }

  std::unique_ptr<CudnnAttention> self(new CudnnAttention());
  self->geometry_ = std::move(geometry);
  self->version_ = static_cast<int>(api->GetVersion());
  self->library_path_ = api->path;
  self->causal_ = shape.causal;
  self->pass_ = pass;
  self->impl_ = std::make_unique<Impl>();
  Impl& impl = *self->impl_;
  impl.api = api;
  impl.rt = rt;
  HSAP_CUDNN_RETURN_IF_ERROR(api->Check(api->Create(&impl.handle), "cudnnCreate"));
  if (pass == CudnnPass::kForward) {
    HSAP_CUDNN_RETURN_IF_ERROR(impl.Build(shape, self->geometry_));
  } else {
    HSAP_CUDNN_RETURN_IF_ERROR(impl.BuildBackward(shape, self->geometry_, self->version_));
  }
  self->workspace_bytes_ = impl.workspace.bytes();
  self->scratch_bytes_ = impl.scratch.bytes();
  return self;
}

CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Forward(const void* q, const void* k, const void* v, void* o,
                                     float* stats, cuda::cudaStream stream) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || stats == nullptr) {
    return absl::InvalidArgumentError("cuDNN attention forward: a null tensor");
  }
  if (pass_ != CudnnPass::kForward) {
    return absl::FailedPreconditionError("cuDNN attention: Forward on a backward instance");
  }
  Impl& impl = *impl_;
  const int64_t uids[] = {
      kUidQ,        kUidK,        kUidV,        kUidO,     kUidStats,         kUidSeqLenQ,
      kUidSeqLenKv, kUidOffsetQo, kUidOffsetKv, kUidScale, kUidLowestPadding, kUidLowestCausal};
  void* ptrs[] = {const_cast<void*>(q),
                  const_cast<void*>(k),
                  const_cast<void*>(v),
                  o,
                  stats,
                  impl.seq_lens_dev,
                  impl.seq_lens_dev,
                  impl.qo_offsets_dev,
                  impl.kv_offsets_dev,
                  &impl.scale,
                  &impl.lowest,
                  &impl.lowest};
  // The causal select's scalar is not in a non-causal graph.
  const size_t n = causal_ ? 12 : 11;
  return impl.Execute(absl::MakeConstSpan(uids, n), absl::MakeConstSpan(ptrs, n), stream,
                      "fused attention forward");
}

absl::Status CudnnAttention::Backward(const void* q, const void* k, const void* v, const void* o,
                                      const void* dout, const float* stats, void* dq, void* dk,
                                      void* dv, cuda::cudaStream stream) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || dout == nullptr ||
      stats == nullptr || dq == nullptr || dk == nullptr || dv == nullptr) {
    return absl::InvalidArgumentError("cuDNN attention backward: a null tensor");
  }
  if (pass_ != CudnnPass::kBackward) {
    return absl::FailedPreconditionError("cuDNN attention: Backward on a forward instance");
  }
  Impl& impl = *impl_;
  const std::vector<int64_t> uids = impl.backward_plan.BoundUids();
  std::vector<void*> ptrs;
  for (int64_t uid : uids) {
    void* p = nullptr;
    switch (uid) {
      case kUidQ:
        p = const_cast<void*>(q);
        break;
      case kUidK:
        p = const_cast<void*>(k);
        break;
      case kUidV:
        p = const_cast<void*>(v);
        break;
      case kUidO:
        p = const_cast<void*>(o);
        break;
      case kUidDO:
        p = const_cast<void*>(dout);
        break;
      case kUidStats:
        p = const_cast<float*>(stats);
        break;
      case kUidDQ:
        p = dq;
        break;
      case kUidDK:
        p = dk;
        break;
      case kUidDV:
        p = dv;
        break;
      case kUidSeqLenQ:
      case kUidSeqLenKv:
        p = impl.seq_lens_dev;
        break;
      case kUidOffsetQo:
        p = impl.qo_offsets_dev;
        break;
      case kUidOffsetKv:
        p = impl.kv_offsets_dev;
        break;
      case kUidScale:
        p = &impl.scale;
        break;
      case kUidOne:
        p = &impl.one;
        break;
      case kUidLowestPadding:
      case kUidLowestCausal:
      case kUidLowestPadding2:
        p = &impl.lowest;
        break;
      default:
        if (auto it = impl.scratch_dev.find(uid); it != impl.scratch_dev.end()) p = it->second;
    }
    if (p == nullptr) {
      return absl::InternalError(
          absl::StrCat("cuDNN attention backward: tensor uid ", uid, " has no address"));
    }
    ptrs.push_back(p);
  }
  if (impl.zero_dq_accum) {
    const CudnnTensorNode* accum = impl.backward_plan.Find(kUidDQAccum);
    HSAP_CUDNN_RETURN_IF_ERROR(impl.rt->Check(
        impl.rt->MemsetAsync(impl.scratch_dev.at(kUidDQAccum), 0, accum->scratch_bytes, stream),
        "cudaMemsetAsync (cuDNN dQ accumulator)"));
  }
  return impl.Execute(uids, ptrs, stream, "fused attention backward");
}

#else  // !HSAP_HAVE_CUDNN_HEADERS

class CudnnApi {};
struct CudnnAttention::Impl {};

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    const CudnnAttentionShape& shape, CudnnPass) {
  absl::StatusOr<CudnnRaggedGeometry> geometry = MakeRaggedGeometry(shape);
  if (!geometry.ok()) return geometry.status();
  return absl::UnimplementedError(
      "cuDNN attention: built without cudnn_graph.h (configure with the cuDNN 9 headers in the "
      "CUDA include directory or $CUDNN_HOME/include)");
}

absl::Status FinalizePlanDescriptors(const CudnnGraphPlan& plan, DType) {
  HSAP_RETURN_IF_ERROR(ValidateGraphPlan(plan));
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Forward(const void*, const void*, const void*, void*, float*,
                                     cuda::cudaStream) {
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

absl::Status CudnnAttention::Backward(const void*, const void*, const void*, const void*,
                                      const void*, const float*, void*, void*, void*,
                                      cuda::cudaStream) {
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

#endif  // HSAP_HAVE_CUDNN_HEADERS

// ---------------------------------------------------------------------------------------
// The bench's timed run.

namespace {

// Device memory, streams and events of a timed run, released on every path.
struct RunResources {
  const cuda::CudaRuntimeApi* rt = nullptr;
  std::vector<void*> buffers;
  cuda::cudaStream stream = nullptr;
  cuda::cudaEvent start = nullptr, stop = nullptr;
  ~RunResources() {
    if (stream != nullptr) rt->StreamSynchronize(stream);
    if (start != nullptr) rt->EventDestroy(start);
    if (stop != nullptr) rt->EventDestroy(stop);
    if (stream != nullptr) rt->StreamDestroy(stream);
    for (void* p : buffers) rt->Free(p);
  }
  absl::StatusOr<void*> Alloc(size_t bytes, absl::string_view what) {
    void* p = nullptr;
    HSAP_RETURN_IF_ERROR(rt->Check(rt->Malloc(&p, std::max<size_t>(bytes, 16)),
                                   absl::StrCat("cudaMalloc(", bytes, " bytes) for ", what)));
    buffers.push_back(p);
    return p;
  }
  // A stream of its own and the two timing events.
  absl::Status StartTiming() {
    HSAP_RETURN_IF_ERROR(rt->Check(rt->StreamCreateWithFlags(&stream, cuda::kCudaStreamNonBlocking),
                                   "cudaStreamCreateWithFlags"));
    HSAP_RETURN_IF_ERROR(rt->Check(rt->EventCreateWithFlags(&start, 0), "cudaEventCreate"));
    return rt->Check(rt->EventCreateWithFlags(&stop, 0), "cudaEventCreate");
  }
  // Runs `call` warmup + iters times; the mean ms of the timed ones.
  template <typename Call>
  absl::StatusOr<double> Time(int warmup, int iters, Call call, absl::string_view what) {
    for (int i = 0; i < warmup; ++i) HSAP_RETURN_IF_ERROR(call());
    HSAP_RETURN_IF_ERROR(rt->Check(rt->EventRecord(start, stream), "cudaEventRecord"));
    for (int i = 0; i < iters; ++i) HSAP_RETURN_IF_ERROR(call());
    HSAP_RETURN_IF_ERROR(rt->Check(rt->EventRecord(stop, stream), "cudaEventRecord"));
    HSAP_RETURN_IF_ERROR(
        rt->Check(rt->EventSynchronize(stop), absl::StrCat("cudaEventSynchronize (", what, ")")));
    float ms = 0;
    HSAP_RETURN_IF_ERROR(rt->Check(rt->EventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"));
    return static_cast<double>(ms) / iters;
  }
};

}  // namespace

absl::StatusOr<CudnnForwardRun> RunCudnnForward(const CudnnAttentionShape& shape,
                                                const void* q_host, const void* k_host,
                                                const void* v_host, int warmup, int iters,
                                                void* out_host) {
  if (iters < 1) return absl::InvalidArgumentError("cuDNN attention: iters must be at least 1");
  absl::StatusOr<std::unique_ptr<CudnnAttention>> runner = CudnnAttention::Create(shape);
  if (!runner.ok()) return runner.status();
  absl::StatusOr<const cuda::CudaRuntimeApi*> rt_or = cuda::LoadCudaRuntime();
  if (!rt_or.ok()) return rt_or.status();
  const cuda::CudaRuntimeApi* rt = *rt_or;
  CudnnAttention& attn = **runner;
  const int64_t T = attn.geometry().total_tokens;
  const size_t es = DTypeSize(shape.dtype);
  const size_t q_bytes = static_cast<size_t>(T) * shape.heads_q * shape.head_dim * es;
  const size_t kv_bytes = static_cast<size_t>(T) * shape.heads_kv * shape.head_dim * es;

  RunResources res;
  res.rt = rt;
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *stats = nullptr;
  {
    absl::StatusOr<void*> p = res.Alloc(q_bytes, "Q");
    if (!p.ok()) return p.status();
    q = *p;
    if (p = res.Alloc(kv_bytes, "K"); !p.ok()) return p.status();
    k = *p;
    if (p = res.Alloc(kv_bytes, "V"); !p.ok()) return p.status();
    v = *p;
    if (p = res.Alloc(q_bytes, "O"); !p.ok()) return p.status();
    o = *p;
    if (p = res.Alloc(attn.StatsBytes(), "the softmax stats"); !p.ok()) return p.status();
    stats = *p;
  }
  auto check = [&](cuda::cudaError e, absl::string_view what) { return rt->Check(e, what); };
  for (auto [dst, src, bytes] : {std::tuple<void*, const void*, size_t>{q, q_host, q_bytes},
                                 {k, k_host, kv_bytes},
                                 {v, v_host, kv_bytes}}) {
    HSAP_RETURN_IF_ERROR(
        check(rt->Memcpy(dst, src, bytes, cuda::kCudaMemcpyDefault), "cudaMemcpy (cuDNN inputs)"));
  }
  HSAP_RETURN_IF_ERROR(check(rt->StreamCreateWithFlags(&res.stream, cuda::kCudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags"));
  HSAP_RETURN_IF_ERROR(check(rt->EventCreateWithFlags(&res.start, 0), "cudaEventCreate"));
  HSAP_RETURN_IF_ERROR(check(rt->EventCreateWithFlags(&res.stop, 0), "cudaEventCreate"));
  for (int i = 0; i < warmup; ++i) {
    HSAP_RETURN_IF_ERROR(attn.Forward(q, k, v, o, static_cast<float*>(stats), res.stream));
  }
  HSAP_RETURN_IF_ERROR(check(rt->EventRecord(res.start, res.stream), "cudaEventRecord"));
  for (int i = 0; i < iters; ++i) {
    HSAP_RETURN_IF_ERROR(attn.Forward(q, k, v, o, static_cast<float*>(stats), res.stream));
  }
  HSAP_RETURN_IF_ERROR(check(rt->EventRecord(res.stop, res.stream), "cudaEventRecord"));
  HSAP_RETURN_IF_ERROR(
      check(rt->EventSynchronize(res.stop), "cudaEventSynchronize (cuDNN attention forward)"));
  float ms = 0;
  HSAP_RETURN_IF_ERROR(
      check(rt->EventElapsedTime(&ms, res.start, res.stop), "cudaEventElapsedTime"));
  if (out_host != nullptr) {
    HSAP_RETURN_IF_ERROR(check(rt->Memcpy(out_host, o, q_bytes, cuda::kCudaMemcpyDefault),
                               "cudaMemcpy (cuDNN output)"));
  }
  CudnnForwardRun run;
  run.forward_ms = static_cast<double>(ms) / iters;
  run.version = attn.version();
  run.workspace_bytes = attn.WorkspaceBytes();
  return run;
}

absl::StatusOr<CudnnBackwardRun> RunCudnnBackward(const CudnnAttentionShape& shape,
                                                  const void* q_host, const void* k_host,
                                                  const void* v_host, const void* dout_host,
                                                  int warmup, int iters, void* dq_host,
                                                  void* dk_host, void* dv_host) {
  if (iters < 1) return absl::InvalidArgumentError("cuDNN attention: iters must be at least 1");
  // The forward leaves O and the Stats the backward reads.
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<CudnnAttention> forward,
                        CudnnAttention::Create(shape, CudnnPass::kForward));
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<CudnnAttention> backward,
                        CudnnAttention::Create(shape, CudnnPass::kBackward));
  HSAP_ASSIGN_OR_RETURN(const cuda::CudaRuntimeApi* rt, cuda::LoadCudaRuntime());
  const int64_t T = backward->geometry().total_tokens;
  const size_t es = DTypeSize(shape.dtype);
  const size_t q_bytes = static_cast<size_t>(T) * shape.heads_q * shape.head_dim * es;
  const size_t kv_bytes = static_cast<size_t>(T) * shape.heads_kv * shape.head_dim * es;

  RunResources res;
  res.rt = rt;
  HSAP_ASSIGN_OR_RETURN(void* q, res.Alloc(q_bytes, "Q"));
  HSAP_ASSIGN_OR_RETURN(void* k, res.Alloc(kv_bytes, "K"));
  HSAP_ASSIGN_OR_RETURN(void* v, res.Alloc(kv_bytes, "V"));
  HSAP_ASSIGN_OR_RETURN(void* o, res.Alloc(q_bytes, "O"));
  HSAP_ASSIGN_OR_RETURN(void* dout, res.Alloc(q_bytes, "dO"));
  HSAP_ASSIGN_OR_RETURN(void* stats, res.Alloc(forward->StatsBytes(), "the softmax stats"));
  HSAP_ASSIGN_OR_RETURN(void* dq, res.Alloc(q_bytes, "dQ"));
  HSAP_ASSIGN_OR_RETURN(void* dk, res.Alloc(kv_bytes, "dK"));
  HSAP_ASSIGN_OR_RETURN(void* dv, res.Alloc(kv_bytes, "dV"));
  for (auto [dst, src, bytes] : {std::tuple<void*, const void*, size_t>{q, q_host, q_bytes},
                                 {k, k_host, kv_bytes},
                                 {v, v_host, kv_bytes},
                                 {dout, dout_host, q_bytes}}) {
    HSAP_RETURN_IF_ERROR(rt->Check(rt->Memcpy(dst, src, bytes, cuda::kCudaMemcpyDefault),
                                   "cudaMemcpy (cuDNN backward inputs)"));
  }
  HSAP_RETURN_IF_ERROR(res.StartTiming());
  float* stats_f = static_cast<float*>(stats);
  HSAP_RETURN_IF_ERROR(forward->Forward(q, k, v, o, stats_f, res.stream));
  HSAP_ASSIGN_OR_RETURN(
      const double ms,
      res.Time(
          warmup, iters,
          [&] { return backward->Backward(q, k, v, o, dout, stats_f, dq, dk, dv, res.stream); },
          "cuDNN attention backward"));
  for (auto [dst, src, bytes] : {std::tuple<void*, const void*, size_t>{dq_host, dq, q_bytes},
                                 {dk_host, dk, kv_bytes},
                                 {dv_host, dv, kv_bytes}}) {
    if (dst == nullptr) continue;
    HSAP_RETURN_IF_ERROR(rt->Check(rt->Memcpy(dst, src, bytes, cuda::kCudaMemcpyDefault),
                                   "cudaMemcpy (cuDNN gradients)"));
  }
  CudnnBackwardRun run;
  run.backward_ms = ms;
  run.version = backward->version();
  run.workspace_bytes = backward->WorkspaceBytes();
  run.scratch_bytes = backward->ScratchBytes();
  return run;
}

}  // namespace hsap::bench
