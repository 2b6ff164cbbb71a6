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
//
// --calibration-out FILE (cuda-loopback, one rank): each row's forward and backward TFLOP/s,
// hsap's kernels as engine "jit" and cuDNN's as "cudnn", at the row's block length (2 x
// visible pairs / tokens: the row's length for one causal document) and head dim, for the
// device kind the GPU's name names, written as a calibration file (lib/planner/calibration.h)
// that hsap_plan --calibration and the C ABI's planner read.
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
#include "lib/planner/calibration.h"
#include "lib/planner/cluster.h"
#include "lib/planner/kernel_rates.h"

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

// The device kind of GPU 0 as the planner names it (an H200 is "H200"), or its driver name
// when it is none of the built-in kinds.
std::string DeviceKindOfGpu0() {
  absl::StatusOr<const hsap::cuda::CudaDriverApi*> driver = hsap::cuda::LoadCudaDriver();
  char name[256] = "unknown GPU";
  int device = 0;
  if (driver.ok() && (*driver)->DeviceGet(&device, 0) == 0) {
    (*driver)->DeviceGetName(name, sizeof(name), device);
  }
  absl::StatusOr<hsap::DeviceDescription> d = hsap::DescribeNamedDevice(name, 0, 0, 1);
  return d.ok() ? d->kind : std::string(name);
}

// --calibration-out: the GPU's kind and the rates measured so far.
struct Recording {
  std::string kind;
  hsap::Calibration calibration;
};

// Adds a row's measured rates (FLOP/s of the row's forward FLOPs and 2.5x them).
void RecordRates(const Options& o, const std::string& kind, const char* engine, double block,
                 double fwd_flop, double fwd_s, double bwd_s, hsap::Calibration* out) {
  if (fwd_s > 0) {
    out->rates.push_back({kind, engine, false, block, o.head_dim, fwd_flop / fwd_s * 1e-12, ""});
  }
  if (bwd_s > 0) {
    out->rates.push_back(
        {kind, engine, true, block, o.head_dim, 2.5 * fwd_flop / bwd_s * 1e-12, ""});
  }
}

// One row of T tokens: the ranks' runs, cuDNN's, the check, the table line, the '# check'
// line and the cuDNN lines. False (after printing why) when the row cannot run.
// *gpu_ref_error: the GPU reference's failure, kept across rows (bench/gpu_reference.h).
bool RunRow(const Setup& s, int64_t T, bool fused_forward, bool* use_cudnn, bool* use_cudnn_bwd,
            std::string* gpu_ref_error, Totals* totals, Recording* recording) {
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
  // Which engine ran hsap's pieces (rank 0; $HSAP_ATTENTION_ENGINE, --engine).
  if (s.on_gpu && !runs.engines.empty()) {
    std::printf("# engines %lld: rank 0: %s\n", (long long)T, runs.engines[0].c_str());
  }
  PrintCudnnLines(cudnn, T, f.fwd_flop, f.fwd_tflops, f.bwd_tflops, &totals->cudnn);
  if (recording != nullptr) {
    const double block =
        hsap::BlockTokensOf(static_cast<double>(row.pairs), static_cast<double>(T));
    hsap::Calibration* c = &recording->calibration;
    RecordRates(o, recording->kind, "jit", block, f.fwd_flop, f.fwd, f.bwd, c);
    RecordRates(o, recording->kind, "cudnn", block, f.fwd_flop,
                cudnn.fwd_ran ? cudnn.fwd.forward_ms * 1e-3 : 0,
                cudnn.bwd_ran ? cudnn.bwd.backward_ms * 1e-3 : 0, c);
  }
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
  if (!o.engine.empty()) setenv("HSAP_ATTENTION_ENGINE", o.engine.c_str(), /*overwrite=*/1);
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
  // loopback ranks share one GPU: stages unless --fused 1,
  // lib/cuda/transport/loopback_transport.h).
  const bool fused_forward = s.on_gpu && s.plan == nullptr && (o.fused == 1 || s.R == 1);
  PrintPreamble(s, version, threads_per_rank, fused_forward);
  bool use_cudnn = CudnnComparisonOn(s);
  PrintTableHeader(s);

  Totals totals;
  Recording recording;  // --calibration-out
  if (!o.calibration_out.empty()) recording.kind = DeviceKindOfGpu0();
  bool use_cudnn_bwd = true;  // off after the backward graph fails once
  std::string gpu_ref_error;  // the GPU reference's failure: not tried again
  for (double t = static_cast<double>(o.tokens_begin);
       t <= static_cast<double>(o.tokens_end) * 1.0000001; t *= o.factor) {
    const int64_t T = static_cast<int64_t>(std::llround(t));
    if (!RunRow(s, T, fused_forward, &use_cudnn, &use_cudnn_bwd, &gpu_ref_error, &totals,
                o.calibration_out.empty() ? nullptr : &recording)) {
      return 1;
    }
  }
  if (!o.calibration_out.empty()) {
    hsap::Calibration& calibration = recording.calibration;
    calibration.name = "hsap_attn_perf on " + recording.kind + " (measured)";
    calibration.link_efficiency = 0;  // network and GEMM figures: not measured here
    calibration.step_overhead_us = calibration.half_bandwidth_kib = -1;
    FILE* out = std::fopen(o.calibration_out.c_str(), "w");
    const std::string text = hsap::CalibrationToJsonText(calibration) + "\n";
    if (out == nullptr || std::fputs(text.c_str(), out) < 0 || std::fclose(out) != 0) {
      std::fprintf(stderr, "hsap_attn_perf: cannot write %s\n", o.calibration_out.c_str());
      return 1;
    }
    std::printf("# calibration: %zu rates written to %s (hsap_plan --calibration %s)\n",
                calibration.rates.size(), o.calibration_out.c_str(), o.calibration_out.c_str());
  }
  for (hsapComm_t c : s.comms) Must(hsapCommDestroy(c), "hsapCommDestroy");
  if (s.plan != nullptr) Must(hsapPlanDestroy(s.plan), "hsapPlanDestroy");
  PrintFooter(s, totals);
  return totals.wrong == 0 ? 0 : 1;
}
