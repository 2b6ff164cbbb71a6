#include "lib/cuda/cudnn/engine_choice.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "lib/cuda/cudnn/engine_rates.h"
#include "lib/planner/kernel_rates.h"

namespace hsap::cuda {
namespace {

constexpr int kCudnnThdBelowSm90 = 91801;  // ragged (THD) inputs on sm_8x

}  // namespace

const char* AttentionEngineName(AttentionEngine engine) {
  return engine == AttentionEngine::kCudnn ? "cudnn" : "jit";
}

const char* EngineModeName(EngineMode mode) {
  switch (mode) {
    case EngineMode::kAuto:
      return "auto";
    case EngineMode::kCudnn:
      return "cudnn";
    case EngineMode::kJit:
      return "jit";
  }
  return "?";
}

absl::StatusOr<EngineMode> ParseEngineMode(absl::string_view text, absl::string_view what) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (lower == "auto") return EngineMode::kAuto;
  if (lower == "cudnn") return EngineMode::kCudnn;
  if (lower == "jit") return EngineMode::kJit;
  return absl::InvalidArgumentError(absl::StrCat(
      what, " = '", text,
      "' is not an attention engine: auto (per piece the faster of cuDNN and the JIT kernels by "
      "the calibration, cuDNN where it can without one), cudnn "
      "(cuDNN, an error where it cannot run the batch) or jit (the JIT kernels only)"));
}

absl::StatusOr<EngineMode> EngineModeFromEnvironment() {
  const std::optional<std::string> value = GetParam(Param::kAttentionEngine);
  if (!value.has_value() || value->empty()) return EngineMode::kAuto;
  return ParseEngineMode(*value, "$HSAP_ATTENTION_ENGINE");
}

std::string CudnnVersionString(int version) {
  return absl::StrFormat("%d.%d.%d", version / 10000, version / 100 % 100, version % 100);
}

absl::Status CudnnTakesBatch(const EngineShape& shape, const CudnnAvailability& cudnn) {
  if (!cudnn.loaded.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuDNN is not available: ", cudnn.loaded.message()));
  }
  const std::string loaded = CudnnVersionString(cudnn.version);
  if (cudnn.sm < 80) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuDNN's fused attention needs compute capability 8.0 or newer (this device: %d.%d)",
        cudnn.sm / 10, cudnn.sm % 10));
  }
  if (cudnn.version == 91000 || cudnn.version == 91001) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN ", loaded,
        " has known bugs in its bf16/fp16 fused attention (cudnn-frontend refuses it); use "
        "9.10.2 or newer"));
  }
  if (cudnn.sm < 90 && cudnn.version < kCudnnThdBelowSm90) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuDNN takes ragged (THD) inputs below sm_90 from ",
                     CudnnVersionString(kCudnnThdBelowSm90), " (loaded ", loaded, ")"));
  }
  if (shape.dtype != DType::kBF16 && shape.dtype != DType::kF16) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN's fused attention takes bf16 or fp16, not ", std::string(DTypeName(shape.dtype))));
  }
  const int max_dim = cudnn.sm == 90 ? 256 : 128;  // its backward's limit on the device
  if (shape.head_dim <= 0 || shape.head_dim % 8 != 0 || shape.head_dim > max_dim) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuDNN's fused attention (forward and backward) takes head dims that are "
                     "multiples of 8 up to ",
                     max_dim, " on this device, not ", shape.head_dim));
  }
  if (shape.heads_q <= 0 || shape.heads_kv <= 0 || shape.heads_q % shape.heads_kv != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cuDNN needs query heads (", shape.heads_q,
                                                      ") a multiple of K/V heads (", shape.heads_kv,
                                                      ")"));
  }
  if (!shape.grouped_heads) {
    return absl::FailedPreconditionError(
        "cuDNN reads K/V head h / (Hq / Hkv) for query head h; this rank's kv-head map differs");
  }
  return absl::OkStatus();
}

absl::Status CheckEngineMode(EngineMode mode, const absl::Status& batch_ok) {
  if (mode != EngineMode::kCudnn || batch_ok.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "$HSAP_ATTENTION_ENGINE=cudnn, but cuDNN cannot run this batch: ", batch_ok.message(),
      "; set HSAP_ATTENTION_ENGINE to auto or jit"));
}

namespace {

// A JIT piece's reason when `auto` finds the JIT kernels faster: its block length's
// power-of-two bucket, so that the tally groups such pieces.
std::string FasterJitReason(double block_tokens, int head_dim, const std::string& kind) {
  const double low = std::exp2(std::floor(std::log2(std::max(1.0, block_tokens))));
  return absl::StrFormat(
      "auto: jit faster than cudnn at block length [%.0f, %.0f), d %d (%s calibration)", low,
      2 * low, head_dim, kind);
}

}  // namespace

PieceDecision DecidePiece(const AttentionPiece& piece, EngineMode mode,
                          const absl::Status& batch_ok, int cudnn_version, const EngineRates* rates,
                          int head_dim) {
  if (mode == EngineMode::kJit) return {AttentionEngine::kJit, "HSAP_ATTENTION_ENGINE=jit"};
  if (!batch_ok.ok()) return {AttentionEngine::kJit, std::string(batch_ok.message())};
  const int needs = MinCudnnVersion(piece.mask.kind);
  if (cudnn_version < needs) {
    return {AttentionEngine::kJit,
            absl::StrCat(piece.mask.ToString(), " needs cuDNN ", CudnnVersionString(needs),
                         " (loaded ", CudnnVersionString(cudnn_version), ")")};
  }
  PieceDecision d{AttentionEngine::kCudnn, piece.mask.ToString()};
  if (mode != EngineMode::kAuto || rates == nullptr || !rates->known() || head_dim <= 0) return d;
  d.block_tokens =
      BlockTokensOf(static_cast<double>(piece.pairs), static_cast<double>(piece.q_len));
  for (AttentionEngine e : {AttentionEngine::kJit, AttentionEngine::kCudnn}) {
    d.rates[static_cast<int>(e)] = rates->CombinedRate(e, d.block_tokens, head_dim);
  }
  if (d.rates[static_cast<int>(AttentionEngine::kJit)] >
      d.rates[static_cast<int>(AttentionEngine::kCudnn)]) {  // a tie stays on cuDNN
    d.engine = AttentionEngine::kJit;
    d.reason = FasterJitReason(d.block_tokens, head_dim, rates->kind);
  }
  return d;
}

absl::StatusOr<StepEngines> SplitStep(const WorkList& work, EngineMode mode,
                                      const absl::Status& batch_ok, int cudnn_version,
                                      const EngineRates* rates, int head_dim) {
  StepEngines step;
  HSAP_ASSIGN_OR_RETURN(step.pieces, DecomposeWorkList(work));
  std::vector<size_t> on_cudnn;
  for (size_t i = 0; i < step.pieces.size(); ++i) {
    step.decisions.push_back(
        DecidePiece(step.pieces[i], mode, batch_ok, cudnn_version, rates, head_dim));
    (step.decisions.back().engine == AttentionEngine::kCudnn ? on_cudnn : step.jit_pieces)
        .push_back(i);
  }
  step.cudnn_calls = GroupIntoCalls(step.pieces, on_cudnn);
  return step;
}

void EngineTally::Add(const StepEngines& step) {
  for (size_t i = 0; i < step.pieces.size(); ++i) {
    const int e = static_cast<int>(step.decisions[i].engine);
    ++pieces[e];
    pairs[e] += step.pieces[i].pairs;
    if (step.decisions[i].engine == AttentionEngine::kJit) ++jit_reasons[step.decisions[i].reason];
  }
  cudnn_calls += static_cast<int64_t>(step.cudnn_calls.size());
}

double EngineTally::ForwardFlops(AttentionEngine engine, int heads_q, int head_dim) const {
  return 4.0 * head_dim * heads_q * static_cast<double>(pairs[static_cast<int>(engine)]);
}

std::string EngineTally::ToString() const {
  const double total = static_cast<double>(pairs[0]) + static_cast<double>(pairs[1]);
  auto share = [&](int e) { return total > 0 ? 100.0 * static_cast<double>(pairs[e]) / total : 0; };
  std::string out =
      absl::StrFormat("cudnn %d pieces in %d calls (%.1f%% of FLOPs), jit %d pieces (%.1f%%)",
                      pieces[1], cudnn_calls, share(1), pieces[0], share(0));
  const char* sep = ": ";
  for (const auto& [reason, count] : jit_reasons) {
    absl::StrAppend(&out, sep, count, " x ", reason);
    sep = "; ";
  }
  if (!auto_choice.empty()) absl::StrAppend(&out, " [", auto_choice, "]");
  return out;
}

}  // namespace hsap::cuda
