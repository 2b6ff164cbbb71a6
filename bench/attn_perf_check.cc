#include "bench/attn_perf_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

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

int64_t CheckRow(const Setup& s, Row& row, CudnnRow* cudnn) {
  const Options& o = *s.o;
  const DType dtype = s.dtype;
  const int R = s.R;
  const int64_t T = row.T;
  const size_t q_row = row.q_row, kv_row = row.kv_row;
  const hsapPartition_t part = row.part;
  const hsapLayout_t layout = row.layout;
  Bytes &q = row.q, &k = row.k, &v = row.v, &dout = row.dout;
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
  const hsap::ReferenceForwardResult ref = hsap::ReferenceForward(l, in);
  const hsap::ReferenceForwardResult naive = hsap::NaiveForward(l, in);
  const hsap::ReferenceGradients gref = hsap::ReferenceBackward(l, in, dout.ptr());
  const hsap::ReferenceGradients gnaive = hsap::NaiveBackward(l, in, dout.ptr());
  const int64_t wrong = CountWrong(dtype, out.data.data(), ref.out, naive.out) +
                        CountWrong(dtype, dq.data.data(), gref.dq, gnaive.dq) +
                        CountWrong(dtype, dk.data.data(), gref.dk, gnaive.dk) +
                        CountWrong(dtype, dv.data.data(), gref.dv, gnaive.dv);
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
  return wrong;
}

}  // namespace hsap::bench::attn_perf
