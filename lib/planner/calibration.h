// Calibration of the cost model: what each attention engine sustains on each device kind
// (TFLOP/s by direction, block length and head dim), what the dense GEMMs sustain, and what
// ring steps and messages cost beyond FLOPs and bytes. The built-in figures are the H200
// measurements of 2026-12 and published figures (sources in docs/cost_model.md, section 1);
// a calibration file (written by hsap_attn_perf --calibration-out, read by hsap_plan
// --calibration and the C ABI's planning entry points) replaces the built-in figures it
// names.
//
// File format (JSON; only "rates" is required, each entry's source optional):
//   {"format": "hsap-calibration", "version": 1, "name": "hsap_attn_perf on H200, 2026-12-05",
//    "rates": [{"device_kind": "H200", "engine": "cudnn", "direction": "forward",
//               "block_tokens": 32768, "head_dim": 128, "tflops": 586.8}, ...],
//    "gemm_efficiency": {"H200": 0.70},        // fraction of the kind's dense peak
//    "nccl_compute_fraction": {"H200": 0.06},  // compute NCCL takes while transfers overlap
//    "network": {"step_overhead_us": 10, "link_efficiency": 0.85, "half_bandwidth_kib": 256}}
// block_tokens is the length of the one causal document the rate was measured on (or the
// block length of a packed row, kernel_rates.h); engines: jit, cudnn, fa2, fa3.
#ifndef HSAP_LIB_PLANNER_CALIBRATION_H_
#define HSAP_LIB_PLANNER_CALIBRATION_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lib/planner/cluster.h"

namespace hsap {

// The attention engine a plan is priced for. kJit and kCudnn are what the runtime runs
// (HSAP_ATTENTION_ENGINE=jit|cudnn); kAuto is its default: cuDNN on the kinds calibrated
// for it, else the JIT kernels. kFa2 and kFa3 are what-ifs (FlashAttention-2/3-class
// kernels, published figures); a kind without figures for the engine asked falls back
// fa3 -> fa2 -> cudnn -> jit.
enum class Engine { kAuto, kJit, kCudnn, kFa2, kFa3 };
const char* EngineName(Engine engine);
// "auto", "jit", "cudnn", "fa2", "fa3"; InvalidArgument naming them otherwise.
absl::StatusOr<Engine> ParseEngine(absl::string_view name);

// One measured or published rate.
struct CalibrationRate {
  std::string device_kind;  // a kind name of the cluster description ("H200")
  std::string engine;       // "jit", "cudnn", "fa2", "fa3"
  bool backward = false;
  double block_tokens = 0;  // > 0
  int head_dim = 0;         // > 0
  double tflops = 0;        // > 0
  std::string source;       // where the figure comes from; empty: the calibration's name
};

struct Calibration {
  std::string name;  // "built-in", or the file's name
  std::vector<CalibrationRate> rates;
  std::map<std::string, double> gemm_efficiency;        // per kind, (0, 1]
  std::map<std::string, double> nccl_compute_fraction;  // per kind, [0, 1)
  double step_overhead_us = 0;
  double link_efficiency = 1;  // (0, 1]
  double half_bandwidth_kib = 0;
};

// The built-in calibration (figures and sources in docs/cost_model.md).
const Calibration& BuiltinCalibration();

// A calibration file's text. Errors name the entry and the field.
absl::StatusOr<Calibration> CalibrationFromJsonText(absl::string_view text);
// The built-in calibration with a file's figures over it: the file's rates replace the
// built-in ones of every (kind, engine, direction, head dim) they name; its GEMM, NCCL and
// network figures replace the built-in ones they name. Errors name the path.
absl::StatusOr<Calibration> LoadCalibrationOverBuiltin(const std::string& path);
// $HSAP_CALIBRATION (base/params.h): its file over the built-in figures
// (LoadCalibrationOverBuiltin), or the built-in calibration when it is unset or empty; what
// the runtime's `auto` engine choice reads (lib/cuda/cudnn/engine_rates.h). InvalidArgument
// naming the variable, the path and the problem (a file that does not open, bad JSON, a bad
// entry) otherwise.
absl::StatusOr<Calibration> CalibrationFromEnvironment();
// Overlays `over` on `base` as LoadCalibrationOverBuiltin does; the name says both.
Calibration OverlayCalibration(const Calibration& base, const Calibration& over);
// The file form of `calibration` (its rates, GEMM, NCCL and network figures).
std::string CalibrationToJsonText(const Calibration& calibration);

// Prices `cluster`'s kinds with `engine`'s rates from `calibration`: each kind gets the
// rates of the engine (or its fallback), its GEMM efficiency and NCCL share; the cluster
// gets the step and message costs. A kind whose description gave attention_efficiency
// keeps it, flat; a kind without figures for any engine of the chain stays flat, and the
// description says so. Sets and returns cluster->pricing, e.g. "engine cudnn, calibration
// built-in H200 (measured 2026-12)".
absl::StatusOr<std::string> ApplyCalibration(const Calibration& calibration, Engine engine,
                                             Cluster* cluster);

// The rates of `engine` ("jit", "cudnn", "fa2", "fa3") on the device kind `kind` from
// `calibration`'s figures (no fallback to another engine), with the engine's built-in
// short-block shapes; null unless the calibration has both directions of it.
std::shared_ptr<AttentionRates> CalibratedRates(const Calibration& calibration,
                                                const std::string& kind, const std::string& engine);

// The forward + backward rate (3.5 F over F / forward + 2.5 F / backward) of `kind` at
// `block_tokens` and `head_dim`.
double CombinedAttentionRate(const DeviceKind& kind, double block_tokens, int head_dim);
// The same weights over an engine's own rates.
double CombinedAttentionRate(const AttentionRates& rates, double block_tokens, int head_dim);

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_CALIBRATION_H_
