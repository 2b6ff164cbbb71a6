// hsap_attn_perf's comparison with cuDNN's fused attention (bench/cudnn_attention.h), with
// --backend cuda-loopback: whether it runs (and the preamble line that says what it is),
// cuDNN's forward and backward on each whole row with the same inputs, and the '# cuDNN'
// lines printed after the row with the averages at the end.
#ifndef HSAP_BENCH_ATTN_PERF_CUDNN_H_
#define HSAP_BENCH_ATTN_PERF_CUDNN_H_

#include <cstdint>

#include "bench/attn_perf_row.h"
#include "bench/cudnn_attention.h"

namespace hsap::bench::attn_perf {

// Whether the comparison runs: on with cuda-loopback unless --cudnn 0; off (saying why) for
// --mask mixed or fp32. Prints the preamble line that describes the cuDNN lines when on.
bool CudnnComparisonOn(const Setup& s);

// cuDNN's results on one row; the check columns ('-' unless CheckRow fills them).
struct CudnnRow {
  Bytes out;  // cuDNN's forward output
  CudnnForwardRun fwd;
  bool fwd_ran = false;
  Bytes dq, dk, dv;  // cuDNN's gradients (when the row is checked)
  CudnnBackwardRun bwd;
  bool bwd_ran = false;
  char wrong[32] = "-", err[32] = "-";          // of out
  char bwd_wrong[32] = "-", bwd_err[32] = "-";  // of dq, dk, dv together
};

// cuDNN's forward, then its backward, on the whole row (same inputs, one GPU), after ours.
// A forward that fails turns the comparison off (*use_cudnn) after saying why once; a
// backward that fails turns the backward off (*use_cudnn_bwd). The gradients come back only
// when the row is checked.
void RunCudnnOnRow(const Setup& s, Row& row, bool check_row, bool* use_cudnn, bool* use_cudnn_bwd,
                   CudnnRow* out);

// The sums behind the averages of the cuDNN lines.
struct CudnnTotals {
  double sum_tflops = 0, sum_ours_vs = 0;
  double sum_bwd_tflops = 0, sum_ours_vs_bwd = 0;
  int rows = 0, bwd_rows = 0;
};

// The '# cuDNN' lines of a row (the version and workspace before the first), against our
// fwd_tflops and bwd_tflops for the row's forward FLOPs `fwd_flop`.
void PrintCudnnLines(const CudnnRow& c, int64_t T, double fwd_flop, double fwd_tflops,
                     double bwd_tflops, CudnnTotals* totals);

// The averages at the end, for the passes that ran.
void PrintCudnnAverages(const CudnnTotals& totals);

}  // namespace hsap::bench::attn_perf

#endif  // HSAP_BENCH_ATTN_PERF_CUDNN_H_
