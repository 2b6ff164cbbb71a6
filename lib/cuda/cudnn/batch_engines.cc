#include "lib/cuda/cudnn/batch_engines.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/cuda/cudnn/cudnn_library.h"
#include "lib/cuda/cudnn/libcudnn_runner.h"
#include "lib/cuda/runtime/device.h"
#include "lib/planner/calibration.h"

namespace hsap::cuda {

absl::StatusOr<EngineSetup> EngineSetupFromEnvironment(const EngineShape* shape) {
  EngineSetup setup;
  HSAP_ASSIGN_OR_RETURN(setup.mode, EngineModeFromEnvironment());
  if (setup.mode == EngineMode::kJit) return setup;
  Calibration calibration;
  if (setup.mode == EngineMode::kAuto) {
    HSAP_ASSIGN_OR_RETURN(calibration, CalibrationFromEnvironment());
  }
  setup.cudnn = ProbeCudnn();
  if (setup.mode == EngineMode::kAuto && setup.cudnn.loaded.ok()) {
    if (absl::StatusOr<std::string> name = CurrentCudaDeviceName(); name.ok()) {
      setup.rates = EngineRatesFor(calibration, *name);
    } else {
      setup.rates.calibration = calibration.name;
      setup.rates.missing =
          absl::StrCat("this device (its name is unknown: ", name.status().message(), ")");
    }
  }
  if (!setup.cudnn.loaded.ok()) {
    setup.runner_status = setup.cudnn.loaded;
  } else if (setup.cudnn.sm < 80) {
    setup.runner_status = absl::UnimplementedError(absl::StrCat(
        "cuDNN's fused attention needs sm_80 or newer (the device is sm_", setup.cudnn.sm, ")"));
  } else if (absl::Status takes =
                 shape != nullptr ? CudnnTakesBatch(*shape, setup.cudnn) : absl::OkStatus();
             !takes.ok()) {
    setup.runner_status = takes;  // no runner for a batch cuDNN cannot run anyway
  } else if (absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> runner = SharedLibCudnnPieceRunner();
             runner.ok()) {
    setup.runner = *std::move(runner);
    setup.has_piece_runner = true;
  } else {
    setup.runner_status = runner.status();
  }
  return setup;
}

absl::Status BatchCudnnStatus(const EngineSetup& setup, const EngineShape& shape) {
  HSAP_RETURN_IF_ERROR(CudnnTakesBatch(shape, setup.cudnn));
  if (!setup.has_piece_runner) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuDNN ", CudnnVersionString(setup.cudnn.version),
                     " could run this batch, but there is no cuDNN piece runner: ",
                     setup.runner_status.message(),
                     " (the GPU executors run every piece on the JIT kernels; docs/gpu_backend.md, "
                     "\"Attention engines\")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BatchEngines> BatchEngines::Decide(const EngineSetup& setup,
                                                  const EngineShape& shape,
                                                  absl::Span<const WorkList* const> steps) {
  BatchEngines engines;
  engines.mode_ = setup.mode;
  engines.cudnn_status_ = setup.mode == EngineMode::kJit
                              ? absl::FailedPreconditionError("HSAP_ATTENTION_ENGINE=jit")
                              : BatchCudnnStatus(setup, shape);
  HSAP_RETURN_IF_ERROR(CheckEngineMode(setup.mode, engines.cudnn_status_));
  const bool by_rates = setup.mode == EngineMode::kAuto && engines.cudnn_status_.ok();
  if (by_rates) engines.tally_.auto_choice = setup.rates.Describe();
  for (const WorkList* work : steps) {
    HSAP_ASSIGN_OR_RETURN(StepEngines step,
                          SplitStep(*work, setup.mode, engines.cudnn_status_, setup.cudnn.version,
                                    by_rates ? &setup.rates : nullptr, shape.head_dim));
    engines.tally_.Add(step);
    engines.steps_.push_back(std::move(step));
  }
  return engines;
}

}  // namespace hsap::cuda
