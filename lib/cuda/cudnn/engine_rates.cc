#include "lib/cuda/cudnn/engine_rates.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/planner/cluster.h"

namespace hsap::cuda {

double EngineRates::CombinedRate(AttentionEngine engine, double block_tokens, int head_dim) const {
  const AttentionRates& rates = engine == AttentionEngine::kCudnn ? *cudnn : *jit;
  return CombinedAttentionRate(rates, block_tokens, head_dim);
}

std::string EngineRates::Describe() const {
  if (known()) {
    return absl::StrCat("auto by calibration ", calibration, ", kind ", kind,
                        ": per piece the faster engine");
  }
  if (missing.empty()) return "";
  return absl::StrCat("auto: no calibration for ", missing, ": cuDNN wherever it can run");
}

std::string CalibratedKindOf(const Calibration& calibration, absl::string_view device_name) {
  std::set<std::string> kinds;
  for (const CalibrationRate& r : calibration.rates) kinds.insert(r.device_kind);
  std::string best;
  for (const std::string& kind : kinds) {
    if (kind.size() > best.size() && NamesKind(device_name, kind)) best = kind;
  }
  return best;
}

EngineRates EngineRatesFor(const Calibration& calibration, absl::string_view device_name) {
  EngineRates rates;
  rates.calibration = calibration.name;
  rates.kind = CalibratedKindOf(calibration, device_name);
  if (rates.kind.empty()) {
    rates.missing =
        absl::StrCat(device_name, " (no kind of calibration ", calibration.name, " names it)");
    return rates;
  }
  std::shared_ptr<const AttentionRates> jit = CalibratedRates(calibration, rates.kind, "jit");
  std::shared_ptr<const AttentionRates> cudnn = CalibratedRates(calibration, rates.kind, "cudnn");
  if (jit == nullptr || cudnn == nullptr) {
    rates.missing = absl::StrCat(rates.kind, " (calibration ", calibration.name, " lacks ",
                                 jit == nullptr && cudnn == nullptr ? "jit's and cudnn's"
                                 : jit == nullptr                   ? "jit's"
                                                                    : "cudnn's",
                                 " forward or backward figures for it)");
    return rates;
  }
  rates.jit = std::move(jit);
  rates.cudnn = std::move(cudnn);
  return rates;
}

}  // namespace hsap::cuda
