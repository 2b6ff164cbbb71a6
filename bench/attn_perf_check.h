// hsap_attn_perf's check of a row (-c 1): the ranks' outputs gathered and compared with the
// single-device fp64 reference (the host's or the GPU's, bench/gpu_reference.h) under the
// tolerance rule of the tests (attention/tolerance.h), cuDNN's under the same rule, and the
// '# check' line that says what checked the row and how far ours and the same-precision
// baseline are from fp64.
#ifndef HSAP_BENCH_ATTN_PERF_CHECK_H_
#define HSAP_BENCH_ATTN_PERF_CHECK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "attention/dtype.h"
#include "bench/attn_perf_cudnn.h"
#include "bench/attn_perf_row.h"
#include "bench/gpu_reference.h"

namespace hsap::bench::attn_perf {

// Elements of `got` outside the tolerance rule of the tests (attention/tolerance.h) for
// results stored in `dtype`.
int64_t CountWrong(DType dtype, const uint8_t* got, const std::vector<double>& ref,
                   const std::vector<double>& naive);

// max |got - ref| over the elements of `got` (stored in `dtype`); NaN when one is NaN.
double MaxAbsError(DType dtype, const uint8_t* got, const std::vector<double>& ref);

// max |a - b| over the elements; NaN when one is NaN.
double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b);

// What the check of a row found.
struct RowCheck {
  ReferenceSite site = ReferenceSite::kNone;  // what checked the row; kNone: not checked
  double seconds = 0;                         // the reference's wall time
  int64_t wrong = 0;                          // ours outside the rule (out, dq, dk, dv)
  // max |x - fp64| of ours and of the same-precision single-device baseline (NaiveForward/
  // Backward), for out, dq, dk, dv.
  double ours_err[4] = {}, naive_err[4] = {};
  std::string note;  // why not checked, or why the host stood in for the GPU
};

// The row (of `fwd_gflop` forward work) against the reference that s.o's policy picks
// (ObtainRowReference; *gpu_error as there): the elements of out, dq, dk, dv gathered from
// the ranks that are outside the rule, and the max errors; fills cuDNN's check columns (not
// counted here) for the passes that ran.
RowCheck CheckRow(const Setup& s, Row& row, double fwd_gflop, std::string* gpu_error,
                  CudnnRow* cudnn);

// The '# check' line printed after the row's line (no newline):
//   # check      4096 ref host    0.412s max|err| out,dq,dk,dv: ours 1.95e-03 ... same-precision
//   ...
// or "# check  <T> ref -  not checked: <why>"; a note of a stand-in host follows after "; ".
std::string CheckLine(int64_t T, const RowCheck& c);

}  // namespace hsap::bench::attn_perf

#endif  // HSAP_BENCH_ATTN_PERF_CHECK_H_
