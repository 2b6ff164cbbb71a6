// hsap_attn_perf's check of a row (-c 1, rows up to --ref-max-gflop of forward work): the
// ranks' outputs gathered and compared with the single-device fp64 reference under the
// tolerance rule of the tests (attention/tolerance.h), and cuDNN's under the same rule.
#ifndef HSAP_BENCH_ATTN_PERF_CHECK_H_
#define HSAP_BENCH_ATTN_PERF_CHECK_H_

#include <cstdint>
#include <vector>

#include "attention/dtype.h"
#include "bench/attn_perf_cudnn.h"
#include "bench/attn_perf_row.h"

namespace hsap::bench::attn_perf {

// Elements of `got` outside the tolerance rule of the tests (attention/tolerance.h) for
// results stored in `dtype`.
int64_t CountWrong(DType dtype, const uint8_t* got, const std::vector<double>& ref,
                   const std::vector<double>& naive);

// max |got - ref| over the elements of `got` (stored in `dtype`); NaN when one is NaN.
double MaxAbsError(DType dtype, const uint8_t* got, const std::vector<double>& ref);

// The elements of out, dq, dk, dv gathered from the ranks that are outside the rule; fills
// cuDNN's check columns (not counted here) for the passes that ran.
int64_t CheckRow(const Setup& s, Row& row, CudnnRow* cudnn);

}  // namespace hsap::bench::attn_perf

#endif  // HSAP_BENCH_ATTN_PERF_CHECK_H_
