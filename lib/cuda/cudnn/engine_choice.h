// Which engine computes each piece of a step's attention work: cuDNN's fused attention or the
// JIT kernels (docs/gpu_backend.md, "Attention engines").
//
// $HSAP_ATTENTION_ENGINE (base/params.h) sets the mode:
//   auto  (default) of the pieces cuDNN can run, each on the engine that is faster for it by
//          the calibration of the device's kind (engine_rates.h), cuDNN on a tie; every such
//          piece on cuDNN where the kind lacks either engine's figures; the JIT kernels for
//          the rest. A piece's speed is its engines' forward + backward FLOP/s (weights
//          forward 1, backward 2.5, as the planner's) at its block length (BlockTokensOf:
//          2 pairs / query rows) and the batch's head dim;
//   cudnn  cuDNN for every piece it can run, the JIT kernels for the rest, and a batch that
//          cuDNN cannot run at all is an error at its creation
//          (FailedPrecondition saying why), not a silent fall-back; pieces whose mask the
//          loaded cuDNN lacks still run on the JIT kernels, each reported;
//   jit    the JIT kernels only (what hsap did before the cuDNN engine).
// cuDNN runs a batch at all when libcudnn.so.9 is loaded on a device of compute capability
// 8.0 or newer, in bf16 or fp16, with a head dim that is a multiple of 8 and at most what its
// backward takes on that device (256 on sm_90, 128 elsewhere), query heads a multiple of the
// K/V heads read in groups (query head h reads K/V head h / (Hq / Hkv): a plan's arbitrary
// head map is not), on ragged inputs (THD: cuDNN 9.18.1 below sm_90), and not on cuDNN
// 9.10.0 / 9.10.1 (whose bf16/fp16 forward cudnn-frontend refuses for known bugs). Then each
// piece runs on cuDNN when the loaded version takes its mask (MinCudnnVersion).
//
// Every decision carries its reason, and EngineTally sums them per engine (pieces, pairs,
// FLOPs, the reasons of the JIT pieces): what a batch reports. A piece that `auto` puts on
// the JIT kernels because they are faster says so per power-of-two bucket of block lengths
// ("auto: jit faster than cudnn at block length [256, 512), d 128 (H200 calibration)"), so
// that the tally groups such pieces; the piece's own figures are in its PieceDecision.
#ifndef HSAP_LIB_CUDA_CUDNN_ENGINE_CHOICE_H_
#define HSAP_LIB_CUDA_CUDNN_ENGINE_CHOICE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/dtype.h"
#include "attention/worklist.h"
#include "lib/cuda/cudnn/attention_pieces.h"

namespace hsap::cuda {

enum class AttentionEngine { kJit = 0, kCudnn = 1 };
const char* AttentionEngineName(AttentionEngine engine);  // "jit", "cudnn"

enum class EngineMode { kAuto, kCudnn, kJit };
const char* EngineModeName(EngineMode mode);  // "auto", "cudnn", "jit"

// "auto", "cudnn" or "jit" (any case); InvalidArgument naming `what` (the variable or flag)
// and the accepted values otherwise.
absl::StatusOr<EngineMode> ParseEngineMode(absl::string_view text, absl::string_view what);
// $HSAP_ATTENTION_ENGINE, auto when unset.
absl::StatusOr<EngineMode> EngineModeFromEnvironment();

// cudnnGetVersion()'s number as text: 91002 -> "9.10.2".
std::string CudnnVersionString(int version);

// What cuDNN offers on a device.
struct CudnnAvailability {
  absl::Status loaded = absl::UnimplementedError("cuDNN was not looked for");  // OK: loaded
  int version = 0;                                                             // cudnnGetVersion()
  int sm = 0;  // the device's compute capability, major * 10 + minor (90 for sm_90)
};

// A batch's attention as the engines see it.
struct EngineShape {
  DType dtype = DType::kBF16;
  int head_dim = 0;
  int heads_q = 0, heads_kv = 0;
  bool grouped_heads = true;  // false: a kv-head map other than h / (heads_q / heads_kv)
};

// OK when cuDNN can run the batch's pieces at all (see the header comment), else
// FailedPrecondition saying what is missing.
absl::Status CudnnTakesBatch(const EngineShape& shape, const CudnnAvailability& cudnn);

// Under kCudnn, a batch that cuDNN cannot run is an error (FailedPrecondition naming
// $HSAP_ATTENTION_ENGINE, the reason and the fix); OK otherwise.
absl::Status CheckEngineMode(EngineMode mode, const absl::Status& batch_ok);

struct EngineRates;  // engine_rates.h

struct PieceDecision {
  AttentionEngine engine = AttentionEngine::kJit;
  // Why: the mask cuDNN runs ("causal bottom-right"), or why not ("HSAP_ATTENTION_ENGINE=jit",
  // "window 64 bottom-right needs cuDNN 9.6.0 (loaded 9.2.1)", CudnnTakesBatch's message,
  // "auto: jit faster than cudnn at block length [256, 512), d 128 (H200 calibration)").
  std::string reason;
  // Where `auto` compared the engines' rates: the piece's block length and each engine's
  // forward + backward FLOP/s there (by AttentionEngine); 0 where it did not.
  double block_tokens = 0;
  double rates[2] = {0, 0};
};

// The engine of `piece` under `mode`, given CudnnTakesBatch's answer and the loaded version.
// Under `auto`, `rates` (may be null) with known() and a positive `head_dim` (the batch's)
// choose between the engines where cuDNN can run the piece; other modes ignore them.
PieceDecision DecidePiece(const AttentionPiece& piece, EngineMode mode,
                          const absl::Status& batch_ok, int cudnn_version,
                          const EngineRates* rates = nullptr, int head_dim = 0);

// One step's work split between the engines.
struct StepEngines {
  std::vector<AttentionPiece> pieces;    // DecomposeWorkList
  std::vector<PieceDecision> decisions;  // one per piece
  std::vector<CudnnCall> cudnn_calls;    // the cuDNN pieces, GroupIntoCalls
  std::vector<size_t> jit_pieces;        // indices of the JIT pieces, increasing
};
absl::StatusOr<StepEngines> SplitStep(const WorkList& work, EngineMode mode,
                                      const absl::Status& batch_ok, int cudnn_version,
                                      const EngineRates* rates = nullptr, int head_dim = 0);

// Sums of decisions over the steps of a batch.
struct EngineTally {
  int64_t pieces[2] = {0, 0};  // by AttentionEngine
  int64_t pairs[2] = {0, 0};   // visible pairs per head
  int64_t cudnn_calls = 0;
  std::map<std::string, int64_t> jit_reasons;  // reason -> pieces
  // What `auto` chose by (EngineRates::Describe; BatchEngines sets it), said once; may be empty.
  std::string auto_choice;

  void Add(const StepEngines& step);
  // Forward FLOPs, 4 * head_dim * heads_q per pair (QK^T and PV), as the benches count.
  double ForwardFlops(AttentionEngine engine, int heads_q, int head_dim) const;
  // "cudnn 12 pieces in 4 calls (97.1% of FLOPs), jit 2 pieces (2.9%): 2 x left band 3
  // top-left needs cuDNN 9.10.2 (loaded 9.6.0)", then " [auto_choice]" when it is set.
  std::string ToString() const;
};

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_CUDNN_ENGINE_CHOICE_H_
