// CudnnSteps (lib/cuda/exec/cudnn_steps.h) at batch creation, on an emulated device: which
// steps have calls and which work list the JIT kernels get, and the refusals (offsets beyond
// int32, before anything is allocated; a step count that does not match the choice; no
// runner). The per-step flow and the uploaded call arrays (which the fake checks against
// cuDNN's ragged layout) are checked end to end in gpu_cudnn_emulated_test.cc.
#include "lib/cuda/exec/cudnn_steps.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/emulated_device.h"
#include "tests/support/fake_cudnn_runner.h"

namespace hsap::cuda {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<testing::FakeCudnnRunner> Fake() {
  return std::make_shared<testing::FakeCudnnRunner>([](cudaStream, std::function<void()> op) {
    op();
    return absl::OkStatus();
  });
}

EngineSetup CudnnSetup(EngineMode mode, int version) {
  EngineSetup setup;
  setup.mode = mode;
  setup.cudnn = {absl::OkStatus(), version, 90};
  setup.has_piece_runner = true;
  setup.runner = Fake();
  return setup;
}

struct Steps {
  Layout layout;
  WorkList local, later;  // a causal document's first half, and its second half against it
  std::vector<const WorkList*> lists() const { return {&local, &later}; }
};

Steps TwoSteps() {
  Steps s{*Layout::FromDocuments({0, 100}, {MaskKind::kSlidingWindow}, {30}), {}, {}};
  s.local = *BuildWorkList(s.layout.slices(), {TokenRun{0, 0, 50}}, {TokenRun{0, 0, 50}}, 64);
  s.later = *BuildWorkList(s.layout.slices(), {TokenRun{50, 0, 50}}, {TokenRun{0, 0, 50}}, 64);
  return s;
}

TEST(CudnnStepsTest, CallsArraysAndJitWork) {
  testing::EmulatedDevice device;
  const cudaStream stream = *device.CreateStream();
  const Steps s = TwoSteps();
  const EngineShape shape{DType::kBF16, 32, 4, 2, true};
  // cuDNN 9.2: the local window (top-left) on cuDNN; the later queries' band against earlier
  // keys (a left bound only) on the JIT kernels.
  absl::StatusOr<BatchEngines> engines =
      BatchEngines::Decide(CudnnSetup(EngineMode::kAuto, 90200), shape, s.lists());
  ASSERT_TRUE(engines.ok()) << engines.status();
  ASSERT_EQ(engines->step(0).cudnn_calls.size(), 1u);
  ASSERT_TRUE(engines->step(1).cudnn_calls.empty());
  absl::StatusOr<std::unique_ptr<CudnnSteps>> steps = CudnnSteps::Build(
      device, *engines, s.lists(), {DType::kBF16, 32, 4, 2, 0.2f}, Fake(), stream);
  ASSERT_TRUE(steps.ok()) << steps.status();
  EXPECT_TRUE((*steps)->HasCalls(0));
  EXPECT_FALSE((*steps)->HasCalls(1));
  EXPECT_FALSE((*steps)->HasCalls(7));
  const DeviceWorkLists::List all{nullptr, nullptr, 5};
  EXPECT_EQ((*steps)->JitWork(1, all).num_blocks, 5);  // no call: the whole list
  EXPECT_EQ((*steps)->JitWork(0, all).num_blocks, 0);  // every piece on cuDNN
  EXPECT_EQ((*steps)->runner().name(), "host fake");
}

TEST(CudnnStepsTest, OffsetsBeyondInt32AreRefused) {
  testing::EmulatedDevice device;
  const cudaStream stream = *device.CreateStream();
  const Steps s = TwoSteps();
  // 50 rows of 2^18 heads x 256: beyond int32 element offsets.
  const EngineShape shape{DType::kBF16, 256, 1 << 18, 1 << 18, true};
  absl::StatusOr<BatchEngines> engines =
      BatchEngines::Decide(CudnnSetup(EngineMode::kCudnn, 91900), shape, s.lists());
  ASSERT_TRUE(engines.ok()) << engines.status();
  absl::StatusOr<std::unique_ptr<CudnnSteps>> steps = CudnnSteps::Build(
      device, *engines, s.lists(), {DType::kBF16, 256, 1 << 18, 1 << 18, 0.1f}, Fake(), stream);
  ASSERT_FALSE(steps.ok());
  EXPECT_EQ(steps.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(steps.status().message(), HasSubstr("int32"));
  EXPECT_THAT(steps.status().message(), HasSubstr("HSAP_ATTENTION_ENGINE=jit"));
  EXPECT_EQ(device.allocations(), 0);  // refused before any upload
}

TEST(CudnnStepsTest, StepsMustMatchTheChoice) {
  testing::EmulatedDevice device;
  const cudaStream stream = *device.CreateStream();
  const Steps s = TwoSteps();
  const EngineShape shape{DType::kBF16, 32, 4, 2, true};
  absl::StatusOr<BatchEngines> engines =
      BatchEngines::Decide(CudnnSetup(EngineMode::kCudnn, 91900), shape, s.lists());
  ASSERT_TRUE(engines.ok()) << engines.status();
  const std::vector<const WorkList*> one = {&s.local};
  absl::StatusOr<std::unique_ptr<CudnnSteps>> steps =
      CudnnSteps::Build(device, *engines, one, {DType::kBF16, 32, 4, 2, 0.2f}, Fake(), stream);
  ASSERT_FALSE(steps.ok());
  EXPECT_THAT(steps.status().message(), HasSubstr("1 work lists for 2 steps"));
  steps = CudnnSteps::Build(device, *engines, s.lists(), {DType::kBF16, 32, 4, 2, 0.2f}, nullptr,
                            stream);
  ASSERT_FALSE(steps.ok());
  EXPECT_THAT(steps.status().message(), HasSubstr("no piece runner"));
}

}  // namespace
}  // namespace hsap::cuda
