#include "bench/cudnn_graph_plan.h"

#include <algorithm>
#include <map>
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

// BackwardGraphPlan's steps, in the order their tensors and ops enter the plan.
class BackwardPlanBuilder {
 public:
  BackwardPlanBuilder(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g, int version)
      : shape_(shape),
        g_(g),
        version_(version),
        w_(&plan_),
        b_(g.batch),
        s_(g.max_seq_len),
        hq_(shape.heads_q),
        hkv_(shape.heads_kv),
        d_(shape.head_dim),
        sd_(g.score_dims),
        ss_(g.score_strides),
        // Transposed scores [B, Hq, S_kv, S_q] over the same memory: the A operand of dV, dK.
        st_strides_{hq_ * s_ * s_, s_ * s_, 1, s_},
        // fp32 [T, Hq, D] scratch in our packed layout (dQ accumulator, GQA full heads).
        q_scratch_bytes_(static_cast<size_t>(g.total_tokens * hq_ * d_) * sizeof(float)),
        full_dims_{b_, hq_, s_, d_},
        full_strides_{s_ * hq_ * d_, d_, hq_ * d_, 1} {}

  CudnnGraphPlan Build() {
    BindTensors();
    SoftmaxSum();
    Probabilities();
    GradV();
    GradScores();
    GradK();
    GradQ();
    return std::move(plan_);
  }

 private:
  using M = CudnnPointwiseMode;
  using D = CudnnDataKind;

  // Bound tensors: index tensors, the forward's inputs and outputs, the gradients.
  void BindTensors() {
    const Dims4 one = {1, 1, 1, 1};
    const Dims4 seq_dims = {b_, 1, 1, 1}, off_dims = {b_ + 1, 1, 1, 1};
    const CudnnRaggedGeometry& g = g_;
    w_.Bound("seq_len_q", kUidSeqLenQ, D::kInt32, seq_dims, one);
    w_.Bound("seq_len_kv", kUidSeqLenKv, D::kInt32, seq_dims, one);
    w_.Bound("ragged_offset_qo", kUidOffsetQo, D::kInt32, off_dims, one);
    w_.Bound("ragged_offset_kv", kUidOffsetKv, D::kInt32, off_dims, one);
    q_ = w_.Bound("Q", kUidQ, D::kIo, g.q_dims, g.q_strides, kUidOffsetQo);
    kt_ = w_.Bound("K^T", kUidK, D::kIo, g.kt_dims, g.kt_strides, kUidOffsetKv);
    vt_ = w_.Bound("V^T", kUidV, D::kIo, g.kt_dims, g.kt_strides, kUidOffsetKv);
    o_ = w_.Bound("O", kUidO, D::kIo, g.q_dims, g.q_strides, kUidOffsetQo);
    dout_ = w_.Bound("dO", kUidDO, D::kIo, g.q_dims, g.q_strides, kUidOffsetQo);
    stats_ = w_.Bound("Stats", kUidStats, D::kFloat, g.stats_dims, g.stats_strides);
    dq_ = w_.Bound("dQ", kUidDQ, D::kIo, g.q_dims, g.q_strides, kUidOffsetQo);
    dk_ = w_.Bound("dK", kUidDK, D::kIo, g.v_dims, g.v_strides, kUidOffsetKv);
    dv_ = w_.Bound("dV", kUidDV, D::kIo, g.v_dims, g.v_strides, kUidOffsetKv);
    scale_ = w_.Scalar("attn_scale", kUidScale);
    unit_ = w_.Scalar("one", kUidOne);
  }

  // softmax_sum = sum_row(dO * O) * 1: the row term of dS (fp32 scratch [B, Hq, S, 1]).
  void SoftmaxSum() {
    const CudnnRaggedGeometry& g = g_;
    const int64_t hq = hq_, s = s_, d = d_;
    const int64_t do_o =
        w_.Virtual("dO_times_O", D::kFloat, g.q_dims, {hq * s * d, s * d, hq * d, 1});
    const int64_t do_o_sum = w_.Virtual("sum_dO_times_O", D::kFloat, g.stats_dims, g.stats_strides);
    softmax_sum_ =
        w_.Scratch("softmax_sum", kUidSoftmaxSum, D::kFloat, g.stats_dims, g.stats_strides, 0,
                   static_cast<size_t>(g.stats_elements) * sizeof(float));
    w_.Pointwise("mul_dO_O", M::kMul, D::kFloat, {dout_, o_}, do_o);
    w_.Unary("reduce_dO_O", CudnnOpKind::kReduction, do_o, do_o_sum);
    w_.Pointwise("scale_one", M::kMul, D::kFloat, {do_o_sum, unit_}, softmax_sum_);
  }

  // S = Q K^T * scale, masked as in the forward, E = exp(S - Stats).
  void Probabilities() {
    const Dims4& sd = sd_;
    const Dims4& ss = ss_;
    const int64_t s_raw = w_.Virtual("S", D::kFloat, sd, ss);
    const int64_t s_scaled = w_.Virtual("S_scaled", D::kFloat, sd, ss);
    w_.Matmul("matmul_Q_KT", q_, kt_, s_raw, kUidSeqLenQ, kUidSeqLenKv, 0);
    w_.Pointwise("mul_S_scale", M::kMul, D::kFloat, {s_raw, scale_}, s_scaled);
    int64_t s_masked = w_.PaddingMask("padding", s_scaled,
                                      w_.Scalar("lowest (padding)", kUidLowestPadding), sd, ss);
    if (shape_.causal) {
      // Keep row >= col inside each document (equal q and kv lengths: top-left = bottom-right).
      const int64_t row = w_.Virtual("causal_row_index", D::kInt32, sd, ss);
      const int64_t col = w_.Virtual("causal_col_index", D::kInt32, sd, ss);
      const int64_t keep = w_.Virtual("causal_keep", D::kBool, sd, ss);
      const int64_t out = w_.Virtual("S_causal", D::kFloat, sd, ss);
      const int64_t lowest = w_.Scalar("lowest (causal)", kUidLowestCausal);
      w_.Pointwise("causal_row_index", M::kGenIndex, D::kInt32, {s_masked}, row, /*axis=*/2);
      w_.Pointwise("causal_col_index", M::kGenIndex, D::kInt32, {s_masked}, col, /*axis=*/3);
      w_.Pointwise("row_ge_col", M::kCmpGe, D::kBool, {row, col}, keep);
      w_.Pointwise("causal_select", M::kBinarySelect, D::kFloat, {s_masked, lowest, keep}, out);
      s_masked = out;
    }
    int64_t s_sub = w_.Virtual("S_minus_stats", D::kFloat, sd, ss);
    w_.Pointwise("sub_S_stats", M::kSub, D::kFloat, {s_masked, stats_}, s_sub);
    if (version_ >= 90000 && version_ < 91000) {
      // cuDNN 9.0 - 9.9 lose the padding through the Stats subtraction (cudnn-frontend
      // applies it again there for those versions).
      s_sub = w_.PaddingMask("padding2", s_sub, w_.Scalar("lowest (padding 2)", kUidLowestPadding2),
                             sd, ss);
    }
    e_ = w_.Virtual("E", D::kFloat, sd, ss);
    w_.Pointwise("exp_S", M::kExp, D::kFloat, {s_sub}, e_);
  }

  // dV = E^T dO (per query head, then summed over each GQA group).
  void GradV() {
    const int64_t et = w_.Virtual("E^T", D::kIo, sd_, st_strides_);
    w_.Unary("reshape_E", CudnnOpKind::kReshape, e_, et);
    if (hq_ == hkv_) {
      w_.Matmul("matmul_ET_dO", et, dout_, dv_, kUidSeqLenKv, 0, kUidSeqLenQ);
    } else {
      const int64_t dv_full = w_.Scratch("dV_full_heads", kUidDVFullHeads, D::kIo, full_dims_,
                                         full_strides_, kUidOffsetKv, q_scratch_bytes_);
      w_.Matmul("matmul_ET_dO", et, dout_, dv_full, kUidSeqLenKv, 0, kUidSeqLenQ);
      w_.Unary("reduce_dV_heads", CudnnOpKind::kReduction, dv_full, dv_);
    }
  }

  // dS = (dO V^T - softmax_sum) * E * scale.
  void GradScores() {
    const Dims4& sd = sd_;
    const Dims4& ss = ss_;
    const int64_t dp = w_.Virtual("dP", D::kFloat, sd, ss);
    const int64_t dp_sub = w_.Virtual("dP_minus_sum", D::kFloat, sd, ss);
    const int64_t dp_e = w_.Virtual("dP_times_E", D::kFloat, sd, ss);
    ds_ = w_.Virtual("dS", D::kFloat, sd, ss);
    w_.Matmul("matmul_dO_VT", dout_, vt_, dp, kUidSeqLenQ, kUidSeqLenKv, 0);
    w_.Pointwise("sub_dP_softmax_sum", M::kSub, D::kFloat, {dp, softmax_sum_}, dp_sub);
    w_.Pointwise("mul_dP_E", M::kMul, D::kFloat, {dp_sub, e_}, dp_e);
    w_.Pointwise("mul_dS_scale", M::kMul, D::kFloat, {dp_e, scale_}, ds_);
  }

  // dK = dS^T Q (per query head, then summed over each GQA group).
  void GradK() {
    const int64_t dst = w_.Virtual("dS^T", D::kIo, sd_, st_strides_);
    w_.Unary("reshape_dS", CudnnOpKind::kReshape, ds_, dst);
    if (hq_ == hkv_) {
      w_.Matmul("matmul_dST_Q", dst, q_, dk_, kUidSeqLenKv, 0, kUidSeqLenQ);
    } else {
      const int64_t dk_full = w_.Scratch("dK_full_heads", kUidDKFullHeads, D::kIo, full_dims_,
                                         full_strides_, kUidOffsetKv, q_scratch_bytes_);
      w_.Matmul("matmul_dST_Q", dst, q_, dk_full, kUidSeqLenKv, 0, kUidSeqLenQ);
      w_.Unary("reduce_dK_heads", CudnnOpKind::kReduction, dk_full, dk_);
    }
  }

  // dQ = dS K, accumulated in fp32 scratch, then cast into dQ.
  void GradQ() {
    const CudnnRaggedGeometry& g = g_;
    const int64_t k = w_.Virtual("K", D::kIo, g.v_dims, g.v_strides, kUidOffsetKv);
    w_.Unary("reshape_K", CudnnOpKind::kReshape, kt_, k);
    const int64_t dq_accum = w_.Scratch("dQ_accum", kUidDQAccum, D::kFloat, g.q_dims, g.q_strides,
                                        kUidOffsetQo, q_scratch_bytes_);
    w_.Matmul("matmul_dS_K", ds_, k, dq_accum, kUidSeqLenQ, 0, kUidSeqLenKv);
    w_.Pointwise("identity_dQ", M::kIdentity, D::kFloat, {dq_accum}, dq_);
  }

  const CudnnAttentionShape& shape_;
  const CudnnRaggedGeometry& g_;
  const int version_;
  CudnnGraphPlan plan_;
  PlanWriter w_;
  const int64_t b_, s_, hq_, hkv_, d_;
  const Dims4& sd_;
  const Dims4& ss_;
  const Dims4 st_strides_;
  const size_t q_scratch_bytes_;
  const Dims4 full_dims_, full_strides_;
  // Tensor uids, set by the steps in order.
  int64_t q_ = 0, kt_ = 0, vt_ = 0, o_ = 0, dout_ = 0, stats_ = 0, dq_ = 0, dk_ = 0, dv_ = 0;
  int64_t scale_ = 0, unit_ = 0, softmax_sum_ = 0, e_ = 0, ds_ = 0;
};

}  // namespace

absl::StatusOr<CudnnGraphPlan> BackwardGraphPlan(const CudnnAttentionShape& shape, int version) {
  HSAP_ASSIGN_OR_RETURN(const CudnnRaggedGeometry g, MakeRaggedGeometry(shape));
  return BackwardPlanBuilder(shape, g, version).Build();
}

namespace {

// The shapes and types of one op: its inputs `in` and its output `out` as its kind needs
// them (see ValidateGraphPlan).
absl::Status CheckOpShapes(const CudnnOpNode& op, const std::vector<const CudnnTensorNode*>& in,
                           const CudnnTensorNode& out) {
  auto fail = [](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat("cuDNN graph plan: ", parts...));
  };
  auto numel = [](const Dims4& d) { return d[0] * d[1] * d[2] * d[3]; };
  switch (op.kind) {
    case CudnnOpKind::kMatmul: {
      if (in.size() != 2) return fail(op.name, ": a matmul takes two inputs");
      const Dims4 &a = in[0]->dims, &bb = in[1]->dims, &c = out.dims;
      const bool heads_ok = c[1] % a[1] == 0 && c[1] % bb[1] == 0 && c[1] == std::max(a[1], bb[1]);
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
  return absl::OkStatus();
}

}  // namespace

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
    HSAP_RETURN_IF_ERROR(CheckOpShapes(op, in, out));
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

}  // namespace hsap::bench
