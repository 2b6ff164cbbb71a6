// hsap_attn_perf: distributed attention over one packed row on N host ranks (threads of
// this process), in the style of nccl-tests. For each row length it partitions the row,
// runs hsapAttentionForward and hsapAttentionBackward on every rank, and reports time,
// achieved FLOP/s over visible pairs, the K/V bytes each rank moved against the bytes a
// naive ring would move, and (with -c 1) the elements outside the tolerance rule against
// the single-device fp64 reference: the host's, or for GPU-sized rows the GPU's
// (--reference, bench/gpu_reference.h), with a '# check' line after each row.
//
//   hsap_attn_perf -b 4096 -e 65536 -f 2 --ranks 4 --docs-dist longtail --heads 8
//       --kv-heads 2 --head-dim 64 --dtype bf16 --weights 3,1,1,3 -n 5 -w 1 -c 1
//
// With a rank arrangement (--groups, or --plan FILE.json from hsap_plan) the batch runs
// under a plan (hsapBatchCreateWithPlan: all-to-all inside head-parallel groups,
// sequence-aware sub-rings across them), and the table also reports the all-to-all and the
// sub-ring bytes separately, next to what TransformerEngine's a2a+p2p would move:
//
//   hsap_attn_perf -b 8192 --groups 4,2 --heads 20,12:16,16 --kv-heads 4 --seq-weights 2,1
//
// The pieces: the command line in bench/attn_perf_options.h, a row and the ranks' runs in
// bench/attn_perf_row.h, the check against the reference in bench/attn_perf_check.h, the
// cuDNN comparison in bench/attn_perf_cudnn.h and the table in bench/attn_perf_report.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "attention/dtype.h"
#include "bench/attn_perf_check.h"
#include "bench/attn_perf_cudnn.h"
#include "bench/attn_perf_options.h"
#include "bench/attn_perf_report.h"
#include "bench/attn_perf_row.h"
#include "bench/bench_util.h"
#include "bench/gpu_reference.h"
#include "hsap/hsap.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace {

using ::hsap::bench::Must;
using ::hsap::bench::PickReference;
using ::hsap::bench::ReferenceSite;
using ::hsap::bench::attn_perf::CheckLine;
using ::hsap::bench::attn_perf::CheckRow;
using ::hsap::bench::attn_perf::CudnnComparisonOn;
using ::hsap::bench::attn_perf::CudnnRow;
using ::hsap::bench::attn_perf::FiguresOf;
using ::hsap::bench::attn_perf::MakePlan;
using ::hsap::bench::attn_perf::MakeRow;
using ::hsap::bench::attn_perf::Options;
using ::hsap::bench::attn_perf::ParseOptions;
using ::hsap::bench::attn_perf::PrintCudnnLines;
using ::hsap::bench::attn_perf::PrintFooter;
using ::hsap::bench::attn_perf::PrintPreamble;
using ::hsap::bench::attn_perf::PrintRowLine;
using ::hsap::bench::attn_perf::PrintTableHeader;
using ::hsap::bench::attn_perf::RankRuns;
using ::hsap::bench::attn_perf::Row;
using ::hsap::bench::attn_perf::RowCheck;
using ::hsap::bench::attn_perf::RowFigures;
using ::hsap::bench::attn_perf::RunCudnnOnRow;
using ::hsap::bench::attn_perf::RunRanks;
using ::hsap::bench::attn_perf::Setup;
using ::hsap::bench::attn_perf::Totals;

// The communicators of the ranks (loopback ranks on GPU 0 with cuda-loopback, host threads
// else), described as nodes with --nodes.
void InitComms(const Options& o, Setup* s) {
  const int R = s->R;
  s->comms.assign(R, nullptr);
  hsapCommConfig_t cc = HSAP_COMM_CONFIG_INITIALIZER;
  cc.timeoutMs = o.timeout_ms;
  cc.numThreads = o.threads;
  for (int r = 0; o.nodes > 0 && r < R; ++r) s->rank_nodes.push_back(r / (R / o.nodes));
  cc.rankNodes = s->rank_nodes.empty() ? nullptr : s->rank_nodes.data();
  if (s->on_gpu) {
    Must(hsapCommInitLoopback(s->comms.data(), R, &cc), "hsapCommInitLoopback");
  } else {
    Must(hsapCommInitAll(s->comms.data(), R, &cc), "hsapCommInitAll");
  }
  s->cuda_rt = s->on_gpu ? *hsap::cuda::LoadCudaRuntime() : nullptr;  // the communicators exist
}

// One row of T tokens: the ranks' runs, cuDNN's, the check, the table line, the '# check'
// line and the cuDNN lines. False (after printing why) when the row cannot run.
// *gpu_ref_error: the GPU reference's failure, kept across rows (bench/gpu_reference.h).
bool RunRow(const Setup& s, int64_t T, bool fused_forward, bool* use_cudnn, bool* use_cudnn_bwd,
            std::string* gpu_ref_error, Totals* totals) {
  const Options& o = *s.o;
  Row row;
  if (!MakeRow(s, T, &row)) return false;
  RankRuns runs;
  if (!RunRanks(s, row, &runs)) return false;
  const RowFigures f = FiguresOf(s, row, runs);
  const double fwd_gflop = f.fwd_flop * 1e-9;
  const bool check_row = o.check != 0 && PickReference(o.reference_policy(), s.on_gpu, fwd_gflop) !=
                                             ReferenceSite::kNone;
  // cuDNN on the whole row (same inputs, one GPU), after our row.
  CudnnRow cudnn;
  RunCudnnOnRow(s, row, check_row, use_cudnn, use_cudnn_bwd, &cudnn);
  totals->max_pool =
      std::max(totals->max_pool, *std::max_element(runs.pool_bytes.begin(), runs.pool_bytes.end()));
  char wrong_col[32] = "-";
  RowCheck check;
  if (o.check != 0) {
    check = CheckRow(s, row, fwd_gflop, gpu_ref_error, &cudnn);
    if (check.site != ReferenceSite::kNone) {
      totals->wrong += check.wrong;
      std::snprintf(wrong_col, sizeof(wrong_col), "%lld", (long long)check.wrong);
    }
  }
  if (!PrintRowLine(s, row, runs, f, fused_forward, wrong_col)) return false;
  if (o.check != 0) std::printf("%s\n", CheckLine(T, check).c_str());
  PrintCudnnLines(cudnn, T, f.fwd_flop, f.fwd_tflops, f.bwd_tflops, &totals->cudnn);
  std::fflush(stdout);
  totals->sum_fwd_tflops += f.fwd_tflops;
  totals->sum_bwd_tflops += f.bwd_tflops;
  totals->sum_ratio += f.ratio;
  ++totals->rows;
  Must(hsapPartitionDestroy(row.part), "hsapPartitionDestroy");
  Must(hsapLayoutDestroy(row.layout), "hsapLayoutDestroy");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = ParseOptions(argc, argv);
  // Before any hsap call: hsap reads its environment once per process (base/params.h).
  if (o.backend == "cuda-loopback" && o.fused >= 0) {
    setenv("HSAP_FUSED_FORWARD", o.fused != 0 ? "1" : "0", /*overwrite=*/1);
  }
  Setup s;
  s.plan = o.plan_mode() ? MakePlan(o) : nullptr;
  if (s.plan != nullptr) {
    Must(hsapPlanGetShape(s.plan, nullptr, nullptr, nullptr, &s.plan_groups), "hsapPlanGetShape");
  }
  s.o = &o;
  s.dtype = hsap::bench::ParseDType(o.dtype);
  s.esize = hsap::DTypeSize(s.dtype);
  s.R = o.ranks;
  s.on_gpu = o.backend == "cuda-loopback";
  s.weights = o.weights.empty() ? nullptr : o.weights.data();
  int version = 0;
  Must(hsapGetVersion(&version), "hsapGetVersion");
  InitComms(o, &s);
  const int threads_per_rank =
      o.threads > 0 ? o.threads
                    : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / s.R);

  // Forward through peer windows: loopback batches without a plan where asked for (several
  // loopback ranks share one GPU: stages unless --fused 1, lib/cuda/transport/loopback_transport.h).
  const bool fused_forward = s.on_gpu && s.plan == nullptr && (o.fused == 1 || s.R == 1);
  PrintPreamble(s, version, threads_per_rank, fused_forward);
  bool use_cudnn = CudnnComparisonOn(s);
  PrintTableHeader(s);

  Totals totals;
  bool use_cudnn_bwd = true;  // off after the backward graph fails once
  std::string gpu_ref_error;  // the GPU reference's failure: not tried again
  for (double t = static_cast<double>(o.tokens_begin);
       t <= static_cast<double>(o.tokens_end) * 1.0000001; t *= o.factor) {
    const int64_t T = static_cast<int64_t>(std::llround(t));
    if (!RunRow(s, T, fused_forward, &use_cudnn, &use_cudnn_bwd, &gpu_ref_error, &totals)) {
      return 1;
    }
  }
  for (hsapComm_t c : s.comms) Must(hsapCommDestroy(c), "hsapCommDestroy");
  if (s.plan != nullptr) Must(hsapPlanDestroy(s.plan), "hsapPlanDestroy");
  PrintFooter(s, totals);
  return totals.wrong == 0 ? 0 : 1;
}
