// The engine choice of one CUDA batch, made once at its creation (engine_choice.h decides one
// piece; this decides every piece of every step of a batch and keeps the tally it reports).
//
// EngineSetup is what the choice starts from: the mode ($HSAP_ATTENTION_ENGINE), what cuDNN
// offers on the device (ProbeCudnn; not probed under `jit`) and whether the GPU executors
// have a cuDNN piece runner to hand the cuDNN pieces to (EngineSetup::runner, which the GPU
// executors call through lib/cuda/exec/cudnn_steps.h): libhsap's own setup
// (EngineSetupFromEnvironment) makes libcudnn's runner (libcudnn_runner.h) where cuDNN loads
// on an sm_80+ device; the tests give the executors a host fake. Without a runner
// BatchCudnnStatus says why, under `auto` every piece runs on the JIT kernels with that
// reason in the tally, and under `cudnn` batch creation fails (FailedPrecondition naming the
// variable, the reason and the fix). The decisions therefore always describe what actually
// runs. Under `auto`, EngineSetup::rates (engine_rates.h) choose between the engines per
// piece; the tally says once what they come from, or that there are none for the device.
#ifndef HSAP_LIB_CUDA_CUDNN_BATCH_ENGINES_H_
#define HSAP_LIB_CUDA_CUDNN_BATCH_ENGINES_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/worklist.h"
#include "lib/cuda/cudnn/engine_choice.h"
#include "lib/cuda/cudnn/engine_rates.h"
#include "lib/cuda/cudnn/piece_runner.h"

namespace hsap::cuda {

struct EngineSetup {
  EngineMode mode = EngineMode::kAuto;
  CudnnAvailability cudnn;        // default: "cuDNN was not looked for"
  bool has_piece_runner = false;  // whether the executors can run cuDNN pieces
  // What runs the cuDNN pieces in the GPU executors (lib/cuda/exec/cudnn_steps.h); the GPU
  // runners (NewGpuRunners) set has_piece_runner to whether there is one.
  std::shared_ptr<CudnnPieceRunner> runner;
  // Why there is no runner (when there is none).
  absl::Status runner_status = absl::UnimplementedError("none was given");
  // What `auto` chooses between the engines by (engine_rates.h); default: no rates, cuDNN
  // wherever it can run a piece.
  EngineRates rates;
};

// The mode from $HSAP_ATTENTION_ENGINE (InvalidArgument for a bad value) and, unless it is
// `jit`, ProbeCudnn()'s answer on the current device and, where cuDNN loaded on an sm_80+
// device, libcudnn's piece runner for it (SharedLibCudnnPieceRunner; when that fails,
// runner_status says why and has_piece_runner is false). Under `auto` also the rates: the
// calibration (CalibrationFromEnvironment: $HSAP_CALIBRATION's file over the built-in
// figures; InvalidArgument naming the variable, the path and the problem for a bad file,
// whatever the device) and, where cuDNN loaded, the current device's name
// (CurrentCudaDeviceName) looked up in it (EngineRatesFor).
// `shape` (may be null): the batch's; no runner is made for a batch cuDNN cannot run.
absl::StatusOr<EngineSetup> EngineSetupFromEnvironment(const EngineShape* shape = nullptr);

// OK when cuDNN can run a batch of `shape` here: CudnnTakesBatch, then the piece runner
// (FailedPrecondition "... but there is no cuDNN piece runner: <runner_status> ..." without
// one).
absl::Status BatchCudnnStatus(const EngineSetup& setup, const EngineShape& shape);

// Every step's pieces with their engines, and the tally over them.
class BatchEngines {
 public:
  BatchEngines() = default;  // no steps; an empty tally

  // `steps`: the work lists of the batch's steps (a ring batch: local work, then each
  // stage's; a plan batch: local work, then each sub-ring step's), in the order the
  // executors run them. Under `auto`, setup.rates choose per piece at shape.head_dim
  // (DecidePiece) and the tally's auto_choice says what they are (where cuDNN can run the
  // batch). FailedPrecondition under `cudnn` when BatchCudnnStatus fails (CheckEngineMode's
  // message); InternalError from DecomposeWorkList.
  static absl::StatusOr<BatchEngines> Decide(const EngineSetup& setup, const EngineShape& shape,
                                             absl::Span<const WorkList* const> steps);

  EngineMode mode() const { return mode_; }
  // BatchCudnnStatus's answer (why every piece is on the JIT kernels when not OK).
  const absl::Status& cudnn_status() const { return cudnn_status_; }
  size_t num_steps() const { return steps_.size(); }
  const StepEngines& step(size_t i) const { return steps_[i]; }
  const EngineTally& tally() const { return tally_; }

 private:
  EngineMode mode_ = EngineMode::kAuto;
  absl::Status cudnn_status_ = absl::UnimplementedError("no engine choice was made");
  std::vector<StepEngines> steps_;
  EngineTally tally_;
};

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_CUDNN_BATCH_ENGINES_H_
