#include "bench/attn_perf_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "bench/bench_util.h"
#include "lib/api/handles.h"

namespace hsap::bench::attn_perf {

int64_t CountWrong(DType dtype, const uint8_t* got, const std::vector<double>& ref,
                   const std::vector<double>& naive) {
  double naive_err = 0.0, magnitude = 1.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    naive_err = std::max(naive_err, std::abs(naive[i] - ref[i]));
    magnitude = std::max(magnitude, std::abs(ref[i]));
  }
  const double tol = hsap::ToleranceBound(naive_err, magnitude, hsap::StorageFloor(dtype));
  int64_t wrong = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(hsap::LoadAsFloat(dtype, got, i) - ref[i]);
    if (!(e <= tol)) ++wrong;
  }
  return wrong;
}

double MaxAbsError(DType dtype, const uint8_t* got, const std::vector<double>& ref) {
  double max_err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(hsap::LoadAsFloat(dtype, got, i) - ref[i]);
    if (std::isnan(e)) return e;
    max_err = std::max(max_err, e);
  }
  return max_err;
}

double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double max_err = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::abs(a[i] - b[i]);
    if (std::isnan(e)) return e;
    max_err = std::max(max_err, e);
  }
  return max_err;
}

RowCheck CheckRow(const Setup& s, Row& row, double fwd_gflop, std::string* gpu_error,
                  CudnnRow* cudnn) {
  const Options& o = *s.o;
  const DType dtype = s.dtype;
  const int R = s.R;
  const int64_t T = row.T;
  const size_t q_row = row.q_row, kv_row = row.kv_row;
  const hsapPartition_t part = row.part;
  const hsapLayout_t layout = row.layout;
  Bytes &q = row.q, &k = row.k, &v = row.v, &dout = row.dout;
  hsap::ReferenceInputs in;
  in.dims.heads_q = o.heads;
  in.dims.heads_kv = o.kv_heads;
  in.dims.head_dim = o.head_dim;
  in.dims.scale = 1.0f / std::sqrt(static_cast<float>(o.head_dim));
  in.dtype = dtype;
  in.q = q.ptr();
  in.k = k.ptr();
  in.v = v.ptr();
  const hsap::Layout& l = layout->layout;
  RowCheck c;
  ObtainedReference got = ObtainRowReference(
      o.reference_policy(), s.on_gpu, fwd_gflop,
      [&](ReferenceSite site) { return ComputeRowReference(site, l, in, dout.ptr()); }, gpu_error);
  c.note = std::move(got.note);
  if (!got.ref.has_value()) return c;
  const RowReference& reference = *got.ref;
  c.site = reference.site;
  c.seconds = reference.seconds;
  Bytes out(T * q_row), dq(T * q_row), dk(T * kv_row), dv(T * kv_row);
  std::vector<const void*> ptrs(R);
  auto gather = [&](Shards& shards, size_t row_bytes, Bytes& into) {
    for (int r = 0; r < R; ++r) ptrs[r] = shards.p[r];
    Must(hsapPartitionGather(part, ptrs.data(), row_bytes, into.ptr()), "hsapPartitionGather");
  };
  gather(row.sout, q_row, out);
  gather(row.sdq, q_row, dq);
  gather(row.sdk, kv_row, dk);
  gather(row.sdv, kv_row, dv);
  const hsap::ReferenceForwardResult &ref = reference.ref, &naive = reference.naive;
  const hsap::ReferenceGradients &gref = reference.gref, &gnaive = reference.gnaive;
  c.wrong = CountWrong(dtype, out.data.data(), ref.out, naive.out) +
            CountWrong(dtype, dq.data.data(), gref.dq, gnaive.dq) +
            CountWrong(dtype, dk.data.data(), gref.dk, gnaive.dk) +
            CountWrong(dtype, dv.data.data(), gref.dv, gnaive.dv);
  const Bytes* ours[4] = {&out, &dq, &dk, &dv};
  const std::vector<double>* refs[4] = {&ref.out, &gref.dq, &gref.dk, &gref.dv};
  const std::vector<double>* naives[4] = {&naive.out, &gnaive.dq, &gnaive.dk, &gnaive.dv};
  for (int t = 0; t < 4; ++t) {
    c.ours_err[t] = MaxAbsError(dtype, ours[t]->data.data(), *refs[t]);
    c.naive_err[t] = MaxAbsDiff(*naives[t], *refs[t]);
  }
  if (cudnn->fwd_ran) {
    // cuDNN's out under the same rule (not added to the table's #wrong).
    const int64_t cw = CountWrong(dtype, cudnn->out.data.data(), ref.out, naive.out);
    std::snprintf(cudnn->wrong, sizeof(cudnn->wrong), "%lld", (long long)cw);
    std::snprintf(cudnn->err, sizeof(cudnn->err), "%.3g",
                  MaxAbsError(dtype, cudnn->out.data.data(), ref.out));
  }
  if (cudnn->bwd_ran) {
    // cuDNN's dq, dk, dv under the same rule (not added to the table's #wrong).
    const int64_t cw = CountWrong(dtype, cudnn->dq.data.data(), gref.dq, gnaive.dq) +
                       CountWrong(dtype, cudnn->dk.data.data(), gref.dk, gnaive.dk) +
                       CountWrong(dtype, cudnn->dv.data.data(), gref.dv, gnaive.dv);
    std::snprintf(cudnn->bwd_wrong, sizeof(cudnn->bwd_wrong), "%lld", (long long)cw);
    double max_err = 0;  // NaN stays NaN
    for (double e : {MaxAbsError(dtype, cudnn->dq.data.data(), gref.dq),
                     MaxAbsError(dtype, cudnn->dk.data.data(), gref.dk),
                     MaxAbsError(dtype, cudnn->dv.data.data(), gref.dv)}) {
      max_err = std::isnan(e) ? e : std::max(max_err, e);
    }
    std::snprintf(cudnn->bwd_err, sizeof(cudnn->bwd_err), "%.3g", max_err);
  }
  return c;
}

std::string CheckLine(int64_t T, const RowCheck& c) {
  if (c.site == ReferenceSite::kNone) {
    return absl::StrFormat("# check %9d ref -     %s", T, c.note);
  }
  std::string line = absl::StrFormat("# check %9d ref %-4s %8.3fs max|err| out,dq,dk,dv: ours", T,
                                     ReferenceSiteName(c.site), c.seconds);
  for (double e : c.ours_err) absl::StrAppendFormat(&line, " %.2e", e);
  absl::StrAppend(&line, " same-precision");
  for (double e : c.naive_err) absl::StrAppendFormat(&line, " %.2e", e);
  if (!c.note.empty()) absl::StrAppend(&line, "; ", c.note);
  return line;
}

}  // namespace hsap::bench::attn_perf
