#include "lib/cuda/cudnn/sdpa_graph.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "lib/cuda/cudnn/engine_choice.h"

namespace hsap::cuda {

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

absl::Status CheckSdpaGraphSpec(const SdpaGraphSpec& spec) {
  if (spec.dtype != DType::kBF16 && spec.dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN fused attention takes bf16 or fp16, not ",
                                                   std::string(DTypeName(spec.dtype))));
  }
  if (spec.heads_q <= 0 || spec.heads_kv <= 0 || spec.heads_q % spec.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: query heads (", spec.heads_q,
                                                   ") must be a positive multiple of kv heads (",
                                                   spec.heads_kv, ")"));
  }
  if (spec.head_dim <= 0 || spec.head_dim % 8 != 0 || spec.head_dim > 256) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: head dim ", spec.head_dim,
                                                   " is not a multiple of 8 in 8..256"));
  }
  if (spec.batch <= 0 || spec.max_q_len <= 0 || spec.max_k_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuDNN attention: a graph needs entries and lengths (batch ", spec.batch,
                     ", max lengths ", spec.max_q_len, " x ", spec.max_k_len, ")"));
  }
  if (spec.q_rows < spec.max_q_len || spec.k_rows < spec.max_k_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuDNN attention: buffers of ", spec.q_rows, " query and ", spec.k_rows,
        " key rows cannot hold entries of ", spec.max_q_len, " x ", spec.max_k_len, " rows"));
  }
  const int64_t q_elems = spec.q_rows * spec.heads_q * spec.head_dim;
  if (q_elems > std::numeric_limits<int32_t>::max() ||
      spec.k_rows * spec.heads_q * spec.head_dim > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuDNN attention: ", std::max(spec.q_rows, spec.k_rows), " rows x ", spec.heads_q,
        " heads x ", spec.head_dim, " elements exceed the int32 ragged offsets"));
  }
  const bool banded = spec.mask.kind == CudnnMaskKind::kWindowTopLeft ||
                      spec.mask.kind == CudnnMaskKind::kWindowBottomRight ||
                      spec.mask.kind == CudnnMaskKind::kLeftBandTopLeft;
  if (banded
          ? spec.mask.left_bound < 1 || spec.mask.left_bound > std::numeric_limits<int32_t>::max()
          : spec.mask.left_bound != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: mask ", spec.mask.ToString(),
                                                   " has left bound ", spec.mask.left_bound,
                                                   banded ? " (needs >= 1)" : " (needs 0)"));
  }
  if (spec.version < MinCudnnVersion(spec.mask.kind)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuDNN attention: mask ", spec.mask.ToString(), " needs cuDNN ",
                     CudnnVersionString(MinCudnnVersion(spec.mask.kind)), " (graph for ",
                     CudnnVersionString(spec.version), ")"));
  }
  return absl::OkStatus();
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
  int64_t Scalar(std::string name, int64_t uid, CudnnDataKind dtype = CudnnDataKind::kFloat) {
    const Dims4 one = {1, 1, 1, 1};
    plan_->tensors.push_back({std::move(name), uid, dtype, one, one, false, true});
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
  void Unary(std::string name, CudnnOpKind kind, int64_t x, int64_t output,
             CudnnReduceMode reduce = CudnnReduceMode::kAdd) {
    CudnnOpNode op;
    op.kind = kind;
    op.name = std::move(name);
    op.reduce = reduce;
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

 private:
  CudnnGraphPlan* plan_;
  int64_t next_virtual_ = kUidFirstVirtual;
};

// The forward's and the backward's steps, in the order their tensors and ops enter the plan.
class SdpaPlanBuilder {
 public:
  explicit SdpaPlanBuilder(const SdpaGraphSpec& spec)
      : spec_(spec),
        w_(&plan_),
        b_(spec.batch),
        sq_(spec.max_q_len),
        sk_(spec.max_k_len),
        hq_(spec.heads_q),
        hkv_(spec.heads_kv),
        d_(spec.head_dim),
        q_dims_{b_, hq_, sq_, d_},
        q_strides_{sq_ * hq_ * d_, d_, hq_ * d_, 1},
        kt_dims_{b_, hkv_, d_, sk_},
        kt_strides_{sk_ * hkv_ * d_, d_, 1, hkv_ * d_},
        v_dims_{b_, hkv_, sk_, d_},
        v_strides_{sk_ * hkv_ * d_, d_, hkv_ * d_, 1},
        sd_{b_, hq_, sq_, sk_},
        ss_{hq_ * sq_ * sk_, sq_ * sk_, sk_, 1},
        // Transposed scores [B, Hq, S_kv, S_q] over the same memory: the A operand of dV, dK.
        st_dims_{b_, hq_, sk_, sq_},
        st_strides_{hq_ * sq_ * sk_, sq_ * sk_, 1, sk_},
        rd_{b_, hq_, sq_, 1},
        rs_{hq_ * sq_, sq_, 1, 1} {}

  CudnnGraphPlan Forward() {
    BindIndexTensors();
    q_ = w_.Bound("Q", kUidQ, D::kIo, q_dims_, q_strides_, kUidOffsetQo);
    kt_ = w_.Bound("K^T", kUidK, D::kIo, kt_dims_, kt_strides_, kUidOffsetKv);
    vt_ = w_.Bound("V", kUidV, D::kIo, v_dims_, v_strides_, kUidOffsetKv);
    o_ = w_.Bound("O", kUidO, D::kIo, q_dims_, q_strides_, kUidOffsetQo);
    stats_ = w_.Bound("Stats", kUidStats, D::kFloat, rd_, rs_);
    scale_ = w_.Scalar("attn_scale", kUidScale);
    const int64_t s = MaskedScores();
    const int64_t row_max = w_.Virtual("row_max", D::kFloat, rd_, rs_);
    const int64_t s_sub = w_.Virtual("S_minus_max", D::kFloat, sd_, ss_);
    const int64_t e = w_.Virtual("exp", D::kFloat, sd_, ss_);
    const int64_t row_sum = w_.Virtual("row_sum", D::kFloat, rd_, rs_);
    const int64_t row_log = w_.Virtual("log_row_sum", D::kFloat, rd_, rs_);
    const int64_t p = w_.Virtual("P", D::kIo, sd_, ss_);
    w_.Unary("row_max", CudnnOpKind::kReduction, s, row_max, CudnnReduceMode::kMax);
    w_.Pointwise("sub_max", M::kSub, D::kFloat, {s, row_max}, s_sub);
    w_.Pointwise("exp", M::kExp, D::kFloat, {s_sub}, e);
    w_.Unary("row_sum", CudnnOpKind::kReduction, e, row_sum);
    w_.Pointwise("log", M::kLog, D::kFloat, {row_sum}, row_log);
    w_.Pointwise("stats", M::kAdd, D::kFloat, {row_max, row_log}, stats_);
    w_.Pointwise("div_sum", M::kDiv, D::kFloat, {e, row_sum}, p);
    w_.Matmul("bmm2 (P V)", p, vt_, o_, kUidSeqLenQ, 0, kUidSeqLenKv);
    return std::move(plan_);
  }

  CudnnGraphPlan Backward() {
    BindIndexTensors();
    q_ = w_.Bound("Q", kUidQ, D::kIo, q_dims_, q_strides_, kUidOffsetQo);
    kt_ = w_.Bound("K^T", kUidK, D::kIo, kt_dims_, kt_strides_, kUidOffsetKv);
    vt_ = w_.Bound("V^T", kUidV, D::kIo, kt_dims_, kt_strides_, kUidOffsetKv);
    if (!spec_.softmax_sum_input)
      o_ = w_.Bound("O", kUidO, D::kIo, q_dims_, q_strides_, kUidOffsetQo);
    dout_ = w_.Bound("dO", kUidDO, D::kIo, q_dims_, q_strides_, kUidOffsetQo);
    stats_ = w_.Bound("Stats", kUidStats, D::kFloat, rd_, rs_);
    dq_ = w_.Bound("dQ", kUidDQ, D::kIo, q_dims_, q_strides_, kUidOffsetQo);
    dk_ = w_.Bound("dK", kUidDK, D::kIo, v_dims_, v_strides_, kUidOffsetKv);
    dv_ = w_.Bound("dV", kUidDV, D::kIo, v_dims_, v_strides_, kUidOffsetKv);
    scale_ = w_.Scalar("attn_scale", kUidScale);
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

  void BindIndexTensors() {
    const Dims4 one = {1, 1, 1, 1};
    const Dims4 seq_dims = {b_, 1, 1, 1}, off_dims = {b_ + 1, 1, 1, 1};
    w_.Bound("seq_len_q", kUidSeqLenQ, D::kInt32, seq_dims, one);
    w_.Bound("seq_len_kv", kUidSeqLenKv, D::kInt32, seq_dims, one);
    w_.Bound("ragged_offset_qo", kUidOffsetQo, D::kInt32, off_dims, one);
    w_.Bound("ragged_offset_kv", kUidOffsetKv, D::kInt32, off_dims, one);
  }

  // Padding of `s`: keep (row < seq_len_q) && (col < seq_len_kv), else `lowest`.
  int64_t PaddingMask(const std::string& tag, int64_t s, int64_t lowest) {
    const int64_t row = w_.Virtual(tag + "_row_index", D::kInt32, sd_, ss_);
    const int64_t col = w_.Virtual(tag + "_col_index", D::kInt32, sd_, ss_);
    const int64_t row_ok = w_.Virtual(tag + "_row_lt_seq_q", D::kBool, sd_, ss_);
    const int64_t col_ok = w_.Virtual(tag + "_col_lt_seq_kv", D::kBool, sd_, ss_);
    const int64_t keep = w_.Virtual(tag + "_keep", D::kBool, sd_, ss_);
    const int64_t out = w_.Virtual("S_" + tag, D::kFloat, sd_, ss_);
    w_.Pointwise(tag + "_row_index", M::kGenIndex, D::kInt32, {s}, row, /*axis=*/2);
    w_.Pointwise(tag + "_col_index", M::kGenIndex, D::kInt32, {s}, col, /*axis=*/3);
    w_.Pointwise(tag + "_row_lt_seq_q", M::kCmpLt, D::kBool, {row, kUidSeqLenQ}, row_ok);
    w_.Pointwise(tag + "_col_lt_seq_kv", M::kCmpLt, D::kBool, {col, kUidSeqLenKv}, col_ok);
    w_.Pointwise(tag + "_and", M::kLogicalAnd, D::kBool, {row_ok, col_ok}, keep);
    w_.Pointwise(tag + "_select", M::kBinarySelect, D::kFloat, {s, lowest, keep}, out);
    return out;
  }

  // The diagonal mask of `s` (the header's rule; the op names keep "causal" for the right
  // bound, as cudnn-frontend's graphs do).
  int64_t DiagonalMask(int64_t s) {
    const CudnnMaskKind kind = spec_.mask.kind;
    if (kind == CudnnMaskKind::kNone) return s;
    const bool bottom_right =
        kind == CudnnMaskKind::kCausalBottomRight || kind == CudnnMaskKind::kWindowBottomRight;
    const bool right = kind != CudnnMaskKind::kLeftBandTopLeft;
    const bool left = kind == CudnnMaskKind::kWindowTopLeft ||
                      kind == CudnnMaskKind::kWindowBottomRight ||
                      kind == CudnnMaskKind::kLeftBandTopLeft;
    int64_t row = w_.Virtual("causal_row_index", D::kInt32, sd_, ss_);
    const int64_t col = w_.Virtual("causal_col_index", D::kInt32, sd_, ss_);
    w_.Pointwise("causal_row_index", M::kGenIndex, D::kInt32, {s}, row, /*axis=*/2);
    w_.Pointwise("causal_col_index", M::kGenIndex, D::kInt32, {s}, col, /*axis=*/3);
    if (bottom_right) {
      const Dims4 seq_dims = {b_, 1, 1, 1}, one = {1, 1, 1, 1};
      const int64_t shift = w_.Virtual("seq_kv_minus_seq_q", D::kInt32, seq_dims, one);
      const int64_t shifted = w_.Virtual("row_index_bottom_right", D::kInt32, sd_, ss_);
      w_.Pointwise("seq_kv_minus_seq_q", M::kSub, D::kInt32, {kUidSeqLenKv, kUidSeqLenQ}, shift);
      w_.Pointwise("row_plus_shift", M::kAdd, D::kInt32, {row, shift}, shifted);
      row = shifted;
    }
    int64_t keep = 0;
    if (right) {
      keep = w_.Virtual(left ? "right_keep" : "causal_keep", D::kBool, sd_, ss_);
      w_.Pointwise("row_ge_col", M::kCmpGe, D::kBool, {row, col}, keep);
    }
    if (left) {
      const int64_t bound = w_.Scalar("left_bound", kUidLeftBound, D::kInt32);
      const int64_t row_minus = w_.Virtual("row_minus_left_bound", D::kInt32, sd_, ss_);
      const int64_t left_keep = w_.Virtual(right ? "left_keep" : "causal_keep", D::kBool, sd_, ss_);
      w_.Pointwise("row_minus_left_bound", M::kSub, D::kInt32, {row, bound}, row_minus);
      w_.Pointwise("col_gt_row_minus_left", M::kCmpGt, D::kBool, {col, row_minus}, left_keep);
      if (right) {
        const int64_t both = w_.Virtual("causal_keep", D::kBool, sd_, ss_);
        w_.Pointwise("band_and", M::kLogicalAnd, D::kBool, {keep, left_keep}, both);
        keep = both;
      } else {
        keep = left_keep;
      }
    }
    const int64_t lowest = w_.Scalar("lowest (causal)", kUidLowestCausal);
    const int64_t out = w_.Virtual("S_causal", D::kFloat, sd_, ss_);
    w_.Pointwise("causal_select", M::kBinarySelect, D::kFloat, {s, lowest, keep}, out);
    return out;
  }

  // S = Q K^T * scale, padded and masked.
  int64_t MaskedScores() {
    const int64_t s_raw = w_.Virtual("S", D::kFloat, sd_, ss_);
    const int64_t s_scaled = w_.Virtual("S_scaled", D::kFloat, sd_, ss_);
    w_.Matmul("matmul_Q_KT", q_, kt_, s_raw, kUidSeqLenQ, kUidSeqLenKv, 0);
    w_.Pointwise("mul_S_scale", M::kMul, D::kFloat, {s_raw, scale_}, s_scaled);
    const int64_t padded =
        PaddingMask("padding", s_scaled, w_.Scalar("lowest (padding)", kUidLowestPadding));
    return DiagonalMask(padded);
  }

  // softmax_sum = sum_row(dO * O) * 1 (fp32 scratch [B, Hq, S_q, 1]), or bound.
  void SoftmaxSum() {
    if (spec_.softmax_sum_input) {
      softmax_sum_ = w_.Bound("softmax_sum", kUidSoftmaxSum, D::kFloat, rd_, rs_);
      return;
    }
    const int64_t hq = hq_, s = sq_, d = d_;
    const int64_t unit = w_.Scalar("one", kUidOne);
    const int64_t do_o =
        w_.Virtual("dO_times_O", D::kFloat, q_dims_, {hq * s * d, s * d, hq * d, 1});
    const int64_t do_o_sum = w_.Virtual("sum_dO_times_O", D::kFloat, rd_, rs_);
    softmax_sum_ = w_.Scratch("softmax_sum", kUidSoftmaxSum, D::kFloat, rd_, rs_, 0,
                              static_cast<size_t>(b_ * hq_ * sq_) * sizeof(float));
    w_.Pointwise("mul_dO_O", M::kMul, D::kFloat, {dout_, o_}, do_o);
    w_.Unary("reduce_dO_O", CudnnOpKind::kReduction, do_o, do_o_sum);
    w_.Pointwise("scale_one", M::kMul, D::kFloat, {do_o_sum, unit}, softmax_sum_);
  }

  // S masked as in the forward, E = exp(S - Stats).
  void Probabilities() {
    const int64_t s_masked = MaskedScores();
    int64_t s_sub = w_.Virtual("S_minus_stats", D::kFloat, sd_, ss_);
    w_.Pointwise("sub_S_stats", M::kSub, D::kFloat, {s_masked, stats_}, s_sub);
    if (spec_.version >= 90000 && spec_.version < 91000) {
      // cuDNN 9.0 - 9.9 lose the padding through the Stats subtraction (cudnn-frontend
      // applies it again there for those versions).
      s_sub = PaddingMask("padding2", s_sub, w_.Scalar("lowest (padding 2)", kUidLowestPadding2));
    }
    e_ = w_.Virtual("E", D::kFloat, sd_, ss_);
    w_.Pointwise("exp_S", M::kExp, D::kFloat, {s_sub}, e_);
  }

  // GQA: a gradient per query head into [kv rows, Hq, D] scratch on the kv offsets, then
  // summed over each group; MHA: straight into `out`.
  void GradKv(const std::string& tag, int64_t a, int64_t b, int64_t out, int64_t full_uid) {
    if (hq_ == hkv_) {
      w_.Matmul("matmul_" + tag, a, b, out, kUidSeqLenKv, 0, kUidSeqLenQ);
      return;
    }
    const std::string grad = out == dv_ ? "dV" : "dK";
    const int64_t full = w_.Scratch(grad + "_full_heads", full_uid, D::kIo, {b_, hq_, sk_, d_},
                                    {sk_ * hq_ * d_, d_, hq_ * d_, 1}, kUidOffsetKv,
                                    static_cast<size_t>(spec_.k_rows * hq_ * d_) * sizeof(float));
    w_.Matmul("matmul_" + tag, a, b, full, kUidSeqLenKv, 0, kUidSeqLenQ);
    w_.Unary("reduce_" + grad + "_heads", CudnnOpKind::kReduction, full, out);
  }

  // dV = E^T dO.
  void GradV() {
    const int64_t et = w_.Virtual("E^T", D::kIo, st_dims_, st_strides_);
    w_.Unary("reshape_E", CudnnOpKind::kReshape, e_, et);
    GradKv("ET_dO", et, dout_, dv_, kUidDVFullHeads);
  }

  // dS = (dO V^T - softmax_sum) * E * scale.
  void GradScores() {
    const int64_t dp = w_.Virtual("dP", D::kFloat, sd_, ss_);
    const int64_t dp_sub = w_.Virtual("dP_minus_sum", D::kFloat, sd_, ss_);
    const int64_t dp_e = w_.Virtual("dP_times_E", D::kFloat, sd_, ss_);
    ds_ = w_.Virtual("dS", D::kFloat, sd_, ss_);
    w_.Matmul("matmul_dO_VT", dout_, vt_, dp, kUidSeqLenQ, kUidSeqLenKv, 0);
    w_.Pointwise("sub_dP_softmax_sum", M::kSub, D::kFloat, {dp, softmax_sum_}, dp_sub);
    w_.Pointwise("mul_dP_E", M::kMul, D::kFloat, {dp_sub, e_}, dp_e);
    w_.Pointwise("mul_dS_scale", M::kMul, D::kFloat, {dp_e, scale_}, ds_);
  }

  // dK = dS^T Q.
  void GradK() {
    const int64_t dst = w_.Virtual("dS^T", D::kIo, st_dims_, st_strides_);
    w_.Unary("reshape_dS", CudnnOpKind::kReshape, ds_, dst);
    GradKv("dST_Q", dst, q_, dk_, kUidDKFullHeads);
  }

  // dQ = dS K, accumulated in fp32 scratch, then cast into dQ.
  void GradQ() {
    const int64_t k = w_.Virtual("K", D::kIo, v_dims_, v_strides_, kUidOffsetKv);
    w_.Unary("reshape_K", CudnnOpKind::kReshape, kt_, k);
    const int64_t dq_accum =
        w_.Scratch("dQ_accum", kUidDQAccum, D::kFloat, q_dims_, q_strides_, kUidOffsetQo,
                   static_cast<size_t>(spec_.q_rows * hq_ * d_) * sizeof(float));
    w_.Matmul("matmul_dS_K", ds_, k, dq_accum, kUidSeqLenQ, 0, kUidSeqLenKv);
    w_.Pointwise("identity_dQ", M::kIdentity, D::kFloat, {dq_accum}, dq_);
  }

  const SdpaGraphSpec& spec_;
  CudnnGraphPlan plan_;
  PlanWriter w_;
  const int64_t b_, sq_, sk_, hq_, hkv_, d_;
  const Dims4 q_dims_, q_strides_, kt_dims_, kt_strides_, v_dims_, v_strides_;
  const Dims4 sd_, ss_, st_dims_, st_strides_, rd_, rs_;
  // Tensor uids, set by the steps in order.
  int64_t q_ = 0, kt_ = 0, vt_ = 0, o_ = 0, dout_ = 0, stats_ = 0, dq_ = 0, dk_ = 0, dv_ = 0;
  int64_t scale_ = 0, softmax_sum_ = 0, e_ = 0, ds_ = 0;
};

}  // namespace

absl::StatusOr<CudnnGraphPlan> SdpaForwardPlan(const SdpaGraphSpec& spec) {
  HSAP_RETURN_IF_ERROR(CheckSdpaGraphSpec(spec));
  return SdpaPlanBuilder(spec).Forward();
}

absl::StatusOr<CudnnGraphPlan> SdpaBackwardPlan(const SdpaGraphSpec& spec) {
  HSAP_RETURN_IF_ERROR(CheckSdpaGraphSpec(spec));
  return SdpaPlanBuilder(spec).Backward();
}

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
             op.mode == CudnnPointwiseMode::kGenIndex || op.mode == CudnnPointwiseMode::kLog)
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
      const bool boolean_out =
          op.mode == CudnnPointwiseMode::kCmpLt || op.mode == CudnnPointwiseMode::kCmpGe ||
          op.mode == CudnnPointwiseMode::kCmpGt || op.mode == CudnnPointwiseMode::kLogicalAnd;
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

}  // namespace hsap::cuda
