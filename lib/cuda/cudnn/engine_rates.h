// What HSAP_ATTENTION_ENGINE=auto chooses by (engine_choice.h): the calibrated rates of the
// JIT kernels and of cuDNN's fused attention on the device's kind, from the calibration the
// planner prices with (lib/planner/calibration.h: the built-in figures, or $HSAP_CALIBRATION's
// file over them).
//
// The device's kind is the calibration's: of the kind names its rates carry ("H200", "A100",
// whatever a calibration file names), the longest that the CUDA device's name names as a
// whole word (lib/planner/cluster.h, NamesKind): "NVIDIA H100 80GB HBM3" is an H100,
// "NVIDIA A100-SXM4-80GB" an A100, an "NVIDIA RTX A1000" no A100. A device whose kind has
// the figures of both engines (forward and backward) gets both engines' rates; any other has
// none, and `auto` then runs cuDNN wherever it can, as it did before the calibration.
#ifndef HSAP_LIB_CUDA_CUDNN_ENGINE_RATES_H_
#define HSAP_LIB_CUDA_CUDNN_ENGINE_RATES_H_

#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "lib/cuda/cudnn/engine_choice.h"
#include "lib/planner/calibration.h"
#include "lib/planner/kernel_rates.h"

namespace hsap::cuda {

struct EngineRates {
  std::string calibration;  // the calibration's name ("built-in", "<file> over built-in")
  std::string kind;         // the calibration's kind of the device; empty: none matched
  // Both engines' rates, or neither (see above).
  std::shared_ptr<const AttentionRates> jit, cudnn;
  // Why there are no rates (known() false): "NVIDIA RTX 6000 (no kind of calibration
  // built-in)"; empty on a default EngineRates (none was looked up).
  std::string missing;

  bool known() const { return jit != nullptr && cudnn != nullptr; }
  // `engine`'s forward + backward FLOP/s at `block_tokens` (kernel_rates.h, BlockTokensOf)
  // and `head_dim`, weighted as the planner weighs them (CombinedAttentionRate: forward F,
  // backward 2.5 F). known() only.
  double CombinedRate(AttentionEngine engine, double block_tokens, int head_dim) const;
  // What `auto` chooses by, for a batch's report: "auto by calibration built-in, kind H200:
  // per piece the faster engine", "auto: no calibration for NVIDIA RTX 6000 (...): cuDNN
  // wherever it can run"; empty when none was looked up.
  std::string Describe() const;
};

// The longest kind name of `calibration`'s rates that `device_name` names as a whole word
// (NamesKind); empty when none does.
std::string CalibratedKindOf(const Calibration& calibration, absl::string_view device_name);

// The JIT kernels' and cuDNN's rates on the kind of the device named `device_name` (the
// driver's name: "NVIDIA H200"); without rates (missing says why) when no kind matches or
// the kind lacks either engine's figures.
EngineRates EngineRatesFor(const Calibration& calibration, absl::string_view device_name);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_CUDNN_ENGINE_RATES_H_
