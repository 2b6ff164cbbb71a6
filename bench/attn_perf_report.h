// hsap_attn_perf's table (bench/hsap_attn_perf.cc), in the layout of nccl-tests: the '#'
// preamble that says what every column means, the column header, one line per row (with the
// plan's, the nodes' and the GPU's extra columns), and the footer with the averages.
#ifndef HSAP_BENCH_ATTN_PERF_REPORT_H_
#define HSAP_BENCH_ATTN_PERF_REPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/attn_perf_cudnn.h"
#include "bench/attn_perf_row.h"

namespace hsap::bench::attn_perf {

// "512B", "1.50KB", "2.00MB", ...
std::string HumanBytes(double b);

// What TransformerEngine's a2a+p2p would receive per rank in one forward for this row:
// the symmetric arrangement with as many groups as the plan (A ranks per group, P = R/A
// groups; A = R/G, or the largest divisor of R below it), every document padded to a
// multiple of 2 * R, equal shards, KV heads replicated up to A when fewer. All-to-all: Q,
// K, V of the other A-1 ranks' shards for this rank's heads, and out back; p2p: the other
// P-1 groups' full K/V blocks for this rank's KV heads.
struct TeBytes {
  double a2a = 0, p2p = 0;
  int a = 1, p = 1;
};
TeBytes TransformerEngineBytes(const std::vector<int64_t>& lengths, int R, int G, int hq, int hkv,
                               int D, size_t es);

// The preamble up to the cuDNN line: what runs, the plan, the GPU columns.
void PrintPreamble(const Setup& s, int version, int threads_per_rank, bool fused_forward);

// The rest of the preamble (time, FLOP/s, bytes, #wrong, the nodes' columns) and the column
// header.
void PrintTableHeader(const Setup& s);

// A row's figures: the slowest rank's times, FLOP/s over visible pairs, the K/V bytes received
// against a naive ring.
struct RowFigures {
  double fwd_flop = 0;      // forward FLOPs over visible pairs
  double fwd = 0, bwd = 0;  // seconds per call, the slowest rank's
  double fwd_tflops = 0, bwd_tflops = 0;
  double bytes_max = 0, bytes_mean = 0, ring = 0, ratio = 0;
  int64_t split = 0;  // documents cut across ranks
};
RowFigures FiguresOf(const Setup& s, const Row& row, const RankRuns& runs);

// The row's line of the table (`wrong_col`: its #wrong, '-' when not checked). False after
// printing why when the direct schedules of --nodes cannot be built.
bool PrintRowLine(const Setup& s, const Row& row, const RankRuns& runs, const RowFigures& f,
                  bool fused_forward, const char* wrong_col);

// The sums behind the footer.
struct Totals {
  int64_t wrong = 0;
  size_t max_pool = 0;  // device pool of a rank (CUDA backend)
  double sum_fwd_tflops = 0, sum_bwd_tflops = 0, sum_ratio = 0;
  int rows = 0;
  CudnnTotals cudnn;
};

// The footer: out-of-bounds count, averages, the device pool, cuDNN's averages.
void PrintFooter(const Setup& s, const Totals& t);

}  // namespace hsap::bench::attn_perf

#endif  // HSAP_BENCH_ATTN_PERF_REPORT_H_
