// Single-device host attention at the C ABI: hsapAttentionForwardLocal/BackwardLocal on the
// hand-written kernels. Every argument is checked before any output is written; the
// kernels write into fp32 scratch buffers that are converted into the caller's tensors only
// once they have succeeded.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "jit/host_jit_kernels.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"

namespace hsap {
namespace {

// Everything a local attention call needs once its arguments are known to be good.
struct LocalProblem {
  const Layout* layout = nullptr;
  DType dtype = DType::kF32;
  AttentionDims dims;
  int64_t tokens = 0;
  int num_threads = 0;
};

absl::Status WithNote(absl::Status status, absl::string_view note) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(status.message(), " (", note, ")"));
}

absl::Status CheckAttentionConfig(const hsapAttentionConfig_t* config, int head_dim, float* scale,
                                  int* num_threads) {
  *scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  *num_threads = 0;
  if (config == nullptr) return absl::OkStatus();
  HSAP_RETURN_IF_ERROR(CheckConfigHeader(*config, "config", sizeof(hsapAttentionConfig_t),
                                         "HSAP_ATTENTION_CONFIG_INITIALIZER"));
  if (!std::isfinite(config->softmaxScale) || config->softmaxScale < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("config->softmaxScale is ", config->softmaxScale,
                     "; use a finite positive scale, or 0 for 1/sqrt(headDim)"));
  }
  if (config->numThreads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("config->numThreads is ", config->numThreads,
                                                   "; use 0 (every hardware thread) or more"));
  }
  if (config->softmaxScale > 0.0f) *scale = config->softmaxScale;
  *num_threads = config->numThreads;
  return absl::OkStatus();
}

// `t` is non-null and has the dtype of `ref` (named ref_name), which is known to be valid.
absl::Status CheckSameDType(const hsapTensor_t* t, absl::string_view name, const hsapTensor_t* ref,
                            absl::string_view ref_name) {
  HSAP_RETURN_IF_ERROR(CheckNotNull(t, name));
  absl::StatusOr<DType> dtype = DTypeFromC(t->dtype, absl::StrCat(name, "->dtype"));
  if (!dtype.ok()) return dtype.status();
  const DType ref_dtype = *DTypeFromC(ref->dtype, ref_name);
  if (*dtype != ref_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("mismatched dtypes: ", name, " is ", std::string(DTypeName(*dtype)), " but ",
                     ref_name, " is ", std::string(DTypeName(ref_dtype)),
                     "; every tensor of the call must share one dtype"));
  }
  return absl::OkStatus();
}

// Checks the layout, q, k and the config: the tensors that define the problem's shape.
// `others` are the remaining tensors, checked for their dtype here (against q) and for
// their shape by the caller.
absl::StatusOr<LocalProblem> CheckProblem(
    const hsapAttentionConfig_t* config, hsapLayout_t layout, const hsapTensor_t* q,
    const hsapTensor_t* k,
    std::initializer_list<std::pair<const hsapTensor_t*, const char*>> others) {
  LocalProblem p;
  if (layout == nullptr) {
    return absl::InvalidArgumentError(
        "layout is null; create one with hsapLayoutCreate or hsapLayoutCreateFromSlices");
  }
  p.layout = &layout->layout;
  p.tokens = p.layout->num_tokens();
  HSAP_RETURN_IF_ERROR(CheckNotNull(q, "q"));
  HSAP_ASSIGN_OR_RETURN(DType dtype, DTypeFromC(q->dtype, "q->dtype"));
  p.dtype = dtype;
  HSAP_RETURN_IF_ERROR(CheckSameDType(k, "k", q, "q"));
  for (const auto& [t, name] : others) {
    HSAP_RETURN_IF_ERROR(CheckSameDType(t, name, q, "q"));
  }

  if (q->numTokens != p.tokens) {
    return absl::InvalidArgumentError(absl::StrCat("q has ", q->numTokens, " tokens, expected ",
                                                   p.tokens, " (the layout's token count)"));
  }
  if (q->numHeads <= 0 || q->numHeads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("q has ", q->numHeads, " heads; it needs [1, ", kMaxHeads, "]"));
  }
  if (q->headDim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q has head dim ", q->headDim, "; it must be positive"));
  }
  if (q->headDim < 32 || q->headDim > 256 || q->headDim % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q has head dim ", q->headDim,
        ", which is not supported: the head dim must be a multiple of 8 in [32, 256]"));
  }
  if (k->numTokens != p.tokens) {
    return absl::InvalidArgumentError(absl::StrCat("k has ", k->numTokens, " tokens, expected ",
                                                   p.tokens, " (the layout's token count)"));
  }
  if (k->numHeads <= 0 || k->numHeads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("k has ", k->numHeads, " heads; it needs [1, ", kMaxHeads, "]"));
  }
  if (q->numHeads % k->numHeads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q has ", q->numHeads, " heads, not a multiple of k's ", k->numHeads,
                     " heads; grouped-query attention needs numHeads(q) = g * numHeads(k)"));
  }
  if (k->headDim != q->headDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("k has head dim ", k->headDim, ", expected ", q->headDim, " (q's head dim)"));
  }
  // Guards the element counts below against overflow of int64/size_t.
  const double elements = static_cast<double>(p.tokens) * q->numHeads * q->headDim;
  if (elements > static_cast<double>(int64_t{1} << 48)) {
    return absl::InvalidArgumentError(absl::StrCat("q has ", p.tokens, " x ", q->numHeads, " x ",
                                                   q->headDim, " elements, too many"));
  }
  HSAP_RETURN_IF_ERROR(CheckTensor(q, "q", p.dtype, p.tokens, q->numHeads, q->headDim));
  HSAP_RETURN_IF_ERROR(CheckTensor(k, "k", p.dtype, p.tokens, k->numHeads, k->headDim));

  p.dims.heads_q = q->numHeads;
  p.dims.heads_kv = k->numHeads;
  p.dims.head_dim = q->headDim;
  HSAP_RETURN_IF_ERROR(CheckAttentionConfig(config, q->headDim, &p.dims.scale, &p.num_threads));
  HSAP_RETURN_IF_ERROR(ValidateDims(p.dims));
  return p;
}

absl::Status CheckLikeQ(const LocalProblem& p, const hsapTensor_t* t, absl::string_view name) {
  return WithNote(CheckTensor(t, name, p.dtype, p.tokens, p.dims.heads_q, p.dims.head_dim),
                  absl::StrCat(name, " must have the shape of q: [", p.tokens, ", ", p.dims.heads_q,
                               ", ", p.dims.head_dim, "]"));
}

absl::Status CheckLikeK(const LocalProblem& p, const hsapTensor_t* t, absl::string_view name) {
  return WithNote(CheckTensor(t, name, p.dtype, p.tokens, p.dims.heads_kv, p.dims.head_dim),
                  absl::StrCat(name, " must have the shape of k: [", p.tokens, ", ",
                               p.dims.heads_kv, ", ", p.dims.head_dim, "]"));
}

absl::Status CheckLse(const LocalProblem& p, const float* lse) {
  if (lse == nullptr && p.tokens > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lse is null; it must point to float32 [numHeadsQ, numTokens] = [",
                     p.dims.heads_q, ", ", p.tokens, "]"));
  }
  return absl::OkStatus();
}

// Rounds an fp32 buffer into a tensor of dtype `dtype`.
void StoreConverted(DType dtype, const std::vector<float>& from, void* to) {
  DispatchDType(dtype, [&]<typename T>() {
    T* out = static_cast<T*>(to);
    for (size_t i = 0; i < from.size(); ++i) out[i] = FromFloat<T>(from[i]);
  });
}

size_t Elements(int64_t tokens, int heads, int head_dim) {
  return static_cast<size_t>(tokens) * static_cast<size_t>(heads) * static_cast<size_t>(head_dim);
}

// The host kernels for this problem: the JIT set (compiled on the first call for a
// configuration, then reused from memory or the disk cache), or the hand-written kernels
// where the JIT cannot run or $HSAP_HOST_KERNELS=handwritten.
absl::StatusOr<std::shared_ptr<const KernelSet>> LocalKernels(const LocalProblem& p) {
  return jit::HostKernelsForBatch(p.dims, p.dtype, *p.layout);
}

absl::Status ForwardLocal(const hsapAttentionConfig_t* config, hsapLayout_t layout,
                          const hsapTensor_t* q, const hsapTensor_t* k, const hsapTensor_t* v,
                          hsapTensor_t* out, float* lse) {
  HSAP_ASSIGN_OR_RETURN(LocalProblem problem,
                        CheckProblem(config, layout, q, k, {{v, "v"}, {out, "out"}}));
  const LocalProblem& p = problem;
  HSAP_RETURN_IF_ERROR(CheckLikeK(p, v, "v"));
  HSAP_RETURN_IF_ERROR(CheckLikeQ(p, out, "out"));
  HSAP_RETURN_IF_ERROR(CheckLse(p, lse));
  if (p.tokens == 0) return absl::OkStatus();

  HSAP_ASSIGN_OR_RETURN(WorkList work, BuildWorkList(*p.layout, kKernelBlockQ));
  std::vector<float> out_f32(Elements(p.tokens, p.dims.heads_q, p.dims.head_dim));
  std::vector<float> lse_f32(static_cast<size_t>(p.tokens) * p.dims.heads_q);
  InitPartial(out_f32.data(), lse_f32.data(), p.tokens, p.dims.heads_q, p.dims.head_dim);

  ForwardArgs args;
  args.dims = p.dims;
  args.dtype = p.dtype;
  args.q = q->data;
  args.q_rows = p.tokens;
  args.k = k->data;
  args.v = v->data;
  args.k_rows = p.tokens;
  args.out = out_f32.data();
  args.lse = lse_f32.data();
  HSAP_ASSIGN_OR_RETURN(std::shared_ptr<const KernelSet> kernels, LocalKernels(p));
  HSAP_RETURN_IF_ERROR(kernels->Forward(args, work, p.num_threads));

  StoreConverted(p.dtype, out_f32, out->data);
  std::copy(lse_f32.begin(), lse_f32.end(), lse);
  return absl::OkStatus();
}

absl::Status BackwardLocal(const hsapAttentionConfig_t* config, hsapLayout_t layout,
                           const hsapTensor_t* dout, const hsapTensor_t* q, const hsapTensor_t* k,
                           const hsapTensor_t* v, const hsapTensor_t* out, const float* lse,
                           hsapTensor_t* dq, hsapTensor_t* dk, hsapTensor_t* dv) {
  HSAP_ASSIGN_OR_RETURN(
      LocalProblem problem,
      CheckProblem(config, layout, q, k,
                   {{dout, "dout"}, {v, "v"}, {out, "out"}, {dq, "dq"}, {dk, "dk"}, {dv, "dv"}}));
  const LocalProblem& p = problem;
  HSAP_RETURN_IF_ERROR(CheckLikeK(p, v, "v"));
  HSAP_RETURN_IF_ERROR(CheckLikeQ(p, out, "out"));
  HSAP_RETURN_IF_ERROR(CheckLikeQ(p, dout, "dout"));
  HSAP_RETURN_IF_ERROR(CheckLse(p, lse));
  HSAP_RETURN_IF_ERROR(CheckLikeQ(p, dq, "dq"));
  HSAP_RETURN_IF_ERROR(CheckLikeK(p, dk, "dk"));
  HSAP_RETURN_IF_ERROR(CheckLikeK(p, dv, "dv"));
  if (p.tokens == 0) return absl::OkStatus();

  HSAP_ASSIGN_OR_RETURN(WorkList work, BuildWorkList(*p.layout, kKernelBlockQ));
  std::vector<float> delta(static_cast<size_t>(p.tokens) * p.dims.heads_q);
  ComputeDelta(p.dtype, dout->data, out->data, p.tokens, p.dims.heads_q, p.dims.head_dim,
               delta.data());
  std::vector<float> dq_f32(Elements(p.tokens, p.dims.heads_q, p.dims.head_dim), 0.0f);
  std::vector<float> dk_f32(Elements(p.tokens, p.dims.heads_kv, p.dims.head_dim), 0.0f);
  std::vector<float> dv_f32(dk_f32.size(), 0.0f);

  BackwardArgs args;
  args.dims = p.dims;
  args.dtype = p.dtype;
  args.q = q->data;
  args.dout = dout->data;
  args.lse = lse;
  args.delta = delta.data();
  args.q_rows = p.tokens;
  args.k = k->data;
  args.v = v->data;
  args.k_rows = p.tokens;
  args.dq = dq_f32.data();
  args.dk = dk_f32.data();
  args.dv = dv_f32.data();
  HSAP_ASSIGN_OR_RETURN(std::shared_ptr<const KernelSet> kernels, LocalKernels(p));
  HSAP_RETURN_IF_ERROR(kernels->Backward(args, work, p.num_threads));

  StoreConverted(p.dtype, dq_f32, dq->data);
  StoreConverted(p.dtype, dk_f32, dk->data);
  StoreConverted(p.dtype, dv_f32, dv->data);
  return absl::OkStatus();
}

}  // namespace
}  // namespace hsap

extern "C" {

hsapResult_t hsapAttentionForwardLocal(const hsapAttentionConfig_t* config, hsapLayout_t layout,
                                       const hsapTensor_t* q, const hsapTensor_t* k,
                                       const hsapTensor_t* v, hsapTensor_t* out, float* lse) {
  return hsap::RunApi("hsapAttentionForwardLocal",
                      [&] { return hsap::ForwardLocal(config, layout, q, k, v, out, lse); });
}

hsapResult_t hsapAttentionBackwardLocal(const hsapAttentionConfig_t* config, hsapLayout_t layout,
                                        const hsapTensor_t* dout, const hsapTensor_t* q,
                                        const hsapTensor_t* k, const hsapTensor_t* v,
                                        const hsapTensor_t* out, const float* lse, hsapTensor_t* dq,
                                        hsapTensor_t* dk, hsapTensor_t* dv) {
  return hsap::RunApi("hsapAttentionBackwardLocal", [&] {
    return hsap::BackwardLocal(config, layout, dout, q, k, v, out, lse, dq, dk, dv);
  });
}

}  // extern "C"
