// hsap_attn_perf's command line (bench/hsap_attn_perf.cc): its options, their parsing and
// checks (a usage error exits 2 with the usage), and the workload they describe: the row's
// document lengths and the plan of a rank arrangement.
#ifndef HSAP_BENCH_ATTN_PERF_OPTIONS_H_
#define HSAP_BENCH_ATTN_PERF_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "bench/gpu_reference.h"
#include "hsap/hsap.h"

namespace hsap::bench::attn_perf {

struct Options {
  int64_t tokens_begin = 4096;
  int64_t tokens_end = 4096;
  double factor = 2.0;
  int ranks = 4;
  std::string docs_dist = "longtail";  // longtail | uniform | single | tiny
  int64_t tokens_per_doc = 1024;       // mean document length (longtail, uniform)
  std::string mask = "causal";         // causal | mixed
  int heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  std::string dtype = "bf16";
  std::vector<double> weights;  // empty: equal
  int threads = 0;              // compute threads per rank; 0: hardware threads / ranks
  int nodes = 0;                // >0: ranks in that many equal nodes (consecutive ranks)
  int iters = 5;
  int warmup = 1;
  int check = 1;
  double ref_max_gflop = ReferencePolicy{}.host_max_gflop;
  ReferenceChoice reference = ReferenceChoice::kAuto;  // where rows are checked
  double gpu_ref_max_gflop = ReferencePolicy{}.gpu_max_gflop;
  int timeout_ms = 600000;
  uint32_t seed = 1;
  // Rank arrangement (a plan): group sizes, per-rank query head counts per group (heads
  // assigned contiguously in rank order), sequence weights per group, token weights per
  // rank; or a plan file.
  std::vector<int> groups;
  std::vector<std::vector<int>> group_heads;
  std::vector<double> seq_weights, token_weights;
  std::string plan_file;
  std::string backend = "host";  // host | cuda-loopback
  int cudnn = -1;                // cuDNN comparison; -1: on with cuda-loopback
  int fused = -1;      // cuda-loopback: 1 forward through peer windows, 0 stages, -1 hsap's choice
  std::string engine;  // cuda-loopback: auto | cudnn | jit ($HSAP_ATTENTION_ENGINE); "": unset
  // cuda-loopback, one rank, no plan: the measured TFLOP/s of each row written there as a
  // calibration file (lib/planner/calibration.h) for hsap_plan --calibration.
  std::string calibration_out;
  bool ranks_set = false;
  bool plan_mode() const { return !groups.empty() || !plan_file.empty(); }
  // The choice of reference of --reference, --ref-max-gflop and --gpu-ref-max-gflop.
  ReferencePolicy reference_policy() const {
    return ReferencePolicy{reference, ref_max_gflop, gpu_ref_max_gflop};
  }
};

// Prints the error (or, for null, the usage on stderr) and exits: 2 after an error, else 0.
[[noreturn]] void Usage(const char* error);

// The options of argv, checked.
Options ParseOptions(int argc, char** argv);

// "a,b,c" -> numbers (all > 0 unless allow_zero).
std::vector<double> ParseList(const std::string& value, const char* what, bool allow_zero);

// Document lengths summing to `tokens` with the chosen distribution and a fixed seed.
std::vector<int64_t> DocumentLengths(const Options& o, int64_t tokens);

// The plan of --groups/--heads/--seq-weights/--token-weights, or of --plan (whose shape
// then sets o.ranks, o.heads and o.kv_heads). Exits 2 when the plan file cannot be read, 1
// when the C API refuses the plan.
hsapPlan_t MakePlan(Options& o);

}  // namespace hsap::bench::attn_perf

#endif  // HSAP_BENCH_ATTN_PERF_OPTIONS_H_
