#include "lib/cuda/cudnn/batch_engines.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/cuda/cudnn/cudnn_library.h"

namespace hsap::cuda {

absl::StatusOr<EngineSetup> EngineSetupFromEnvironment() {
  EngineSetup setup;
  HSAP_ASSIGN_OR_RETURN(setup.mode, EngineModeFromEnvironment());
  if (setup.mode != EngineMode::kJit) setup.cudnn = ProbeCudnn();
  return setup;
}

absl::Status BatchCudnnStatus(const EngineSetup& setup, const EngineShape& shape) {
  HSAP_RETURN_IF_ERROR(CudnnTakesBatch(shape, setup.cudnn));
  if (!setup.has_piece_runner) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN ", CudnnVersionString(setup.cudnn.version),
        " could run this batch, but this build of hsap has no cuDNN piece runner yet (the GPU "
        "executors run every piece on the JIT kernels; docs/gpu_backend.md, \"Attention "
        "engines\")"));
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
  for (const WorkList* work : steps) {
    HSAP_ASSIGN_OR_RETURN(StepEngines step,
                          SplitStep(*work, setup.mode, engines.cudnn_status_, setup.cudnn.version));
    engines.tally_.Add(step);
    engines.steps_.push_back(std::move(step));
  }
  return engines;
}

}  // namespace hsap::cuda
