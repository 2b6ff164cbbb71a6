// The engine choice of a whole batch: the setup from the environment, the piece runner's
// absence (what this version has) and presence, the refusal under `cudnn`, and the tally
// over the steps against the steps' own decompositions.
#include "lib/cuda/cudnn/batch_engines.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/planner/calibration.h"
#include "tests/support/random_layouts.h"
#include "tests/support/scoped_env.h"
#include "tests/support/test_files.h"

namespace hsap::cuda {
namespace {

using ::testing::HasSubstr;

constexpr int kJit = static_cast<int>(AttentionEngine::kJit);
constexpr int kCudnn = static_cast<int>(AttentionEngine::kCudnn);

EngineSetup H200Setup(EngineMode mode, bool runner) {
  EngineSetup setup;
  setup.mode = mode;
  setup.cudnn = {absl::OkStatus(), 91900, 90};
  setup.has_piece_runner = runner;
  return setup;
}
EngineShape Bf16d128() { return {DType::kBF16, 128, 16, 4, true}; }

// Two steps over a random packed row cut in the middle of its longest causal slice: the
// second part's queries against their own keys, and against the whole row (the cut slice's
// later queries against all its keys: a bottom-right piece).
struct TwoSteps {
  WorkList local, remote;
  std::vector<const WorkList*> steps() const { return {&local, &remote}; }
  int64_t pairs() const { return local.visible_pairs + remote.visible_pairs; }
};
TwoSteps StepsOf(uint64_t seed) {
  const Layout layout = testing::RandomLayout(600, testing::DocMix::kLongTail, seed, false);
  const int64_t n = layout.num_tokens();
  int64_t cut = n / 2, longest = 0;
  for (const MaskSlice& s : layout.slices()) {
    if (s.diag_hi == 0 && s.q_begin == s.k_begin && s.q_end - s.q_begin > longest) {
      longest = s.q_end - s.q_begin;
      cut = s.q_begin + longest / 2;
    }
  }
  EXPECT_GE(longest, 2) << "no causal slice to cut";
  TwoSteps t;
  t.local =
      *BuildWorkList(layout.slices(), {TokenRun{cut, 0, n - cut}}, {TokenRun{cut, 0, n - cut}}, 64);
  t.remote = *BuildWorkList(layout.slices(), {TokenRun{cut, 0, n - cut}}, {TokenRun{0, 0, n}}, 64);
  return t;
}

TEST(BatchEnginesTest, WithoutAPieceRunnerEveryPieceRunsOnTheJitKernels) {
  const TwoSteps t = StepsOf(7);
  absl::StatusOr<BatchEngines> e =
      BatchEngines::Decide(H200Setup(EngineMode::kAuto, false), Bf16d128(), t.steps());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->cudnn_status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(e->cudnn_status().message(), HasSubstr("no cuDNN piece runner"));
  EXPECT_THAT(e->cudnn_status().message(), HasSubstr("cuDNN 9.19.0 could run this batch"));
  ASSERT_EQ(e->num_steps(), 2u);
  EXPECT_EQ(e->tally().pieces[kCudnn], 0);
  EXPECT_EQ(e->tally().cudnn_calls, 0);
  EXPECT_EQ(e->tally().pairs[kJit], t.pairs());
  EXPECT_EQ(e->tally().pieces[kJit],
            static_cast<int64_t>(e->step(0).pieces.size() + e->step(1).pieces.size()));
  EXPECT_THAT(e->tally().ToString(), HasSubstr("no cuDNN piece runner"));
}

TEST(BatchEnginesTest, ForcedCudnnWithoutAPieceRunnerIsRefused) {
  const TwoSteps t = StepsOf(8);
  const absl::Status s =
      BatchEngines::Decide(H200Setup(EngineMode::kCudnn, false), Bf16d128(), t.steps()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("HSAP_ATTENTION_ENGINE=cudnn"));
  EXPECT_THAT(s.message(), HasSubstr("no cuDNN piece runner"));
  EXPECT_THAT(s.message(), HasSubstr("auto or jit"));
  // What cuDNN itself cannot run is named before the runner.
  const absl::Status f32 = BatchEngines::Decide(H200Setup(EngineMode::kCudnn, true),
                                                {DType::kF32, 128, 16, 4, true}, t.steps())
                               .status();
  EXPECT_THAT(f32.message(), HasSubstr("not fp32"));
}

TEST(BatchEnginesTest, WithAPieceRunnerTheMappedPiecesGoToCudnn) {
  for (uint64_t seed : {9u, 10u, 11u}) {
    const TwoSteps t = StepsOf(seed);
    for (EngineMode mode : {EngineMode::kAuto, EngineMode::kCudnn}) {
      absl::StatusOr<BatchEngines> e =
          BatchEngines::Decide(H200Setup(mode, true), Bf16d128(), t.steps());
      ASSERT_TRUE(e.ok()) << e.status();
      EXPECT_TRUE(e->cudnn_status().ok());
      EXPECT_EQ(e->mode(), mode);
      EXPECT_EQ(e->tally().pieces[kJit], 0) << e->tally().ToString();  // 9.19 takes every mask
      EXPECT_EQ(e->tally().pairs[kCudnn], t.pairs());
      int64_t calls = 0;
      for (size_t i = 0; i < e->num_steps(); ++i) calls += e->step(i).cudnn_calls.size();
      EXPECT_EQ(e->tally().cudnn_calls, calls);
      EXPECT_GT(calls, 0);
    }
    // On cuDNN 9.5 the bottom-right pieces (rank 1's halves of split documents) and the
    // left bands stay on JIT, each with the version it needs.
    EngineSetup old = H200Setup(EngineMode::kAuto, true);
    old.cudnn.version = 90500;
    absl::StatusOr<BatchEngines> e = BatchEngines::Decide(old, Bf16d128(), t.steps());
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->tally().pairs[kJit] + e->tally().pairs[kCudnn], t.pairs());
    EXPECT_GT(e->tally().pieces[kJit], 0);
    bool bottom_right = false;
    for (const auto& [reason, count] : e->tally().jit_reasons) {
      EXPECT_THAT(reason, HasSubstr(" (loaded 9.5.0)"));
      bottom_right |= reason.find("bottom-right needs cuDNN 9.6.0") != std::string::npos;
    }
    EXPECT_TRUE(bottom_right) << e->tally().ToString();
  }
}

TEST(BatchEnginesTest, JitModeDecidesWithoutCudnn) {
  const TwoSteps t = StepsOf(12);
  EngineSetup setup;  // cuDNN not looked for
  setup.mode = EngineMode::kJit;
  absl::StatusOr<BatchEngines> e = BatchEngines::Decide(setup, Bf16d128(), t.steps());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->tally().pairs[kJit], t.pairs());
  ASSERT_EQ(e->tally().jit_reasons.size(), 1u);
  EXPECT_EQ(e->tally().jit_reasons.begin()->first, "HSAP_ATTENTION_ENGINE=jit");
}

// Rates under which the JIT kernels are 10x faster at every length: `auto` moves every piece
// cuDNN could run to them, says so once in the report, and `cudnn` ignores the rates.
TEST(BatchEnginesTest, AutoChoosesByTheSetupsRates) {
  Calibration fast_jit;
  fast_jit.name = "fast jit";
  for (bool backward : {false, true}) {
    fast_jit.rates.push_back({"H200", "jit", backward, 1024, 128, 1000, ""});
    fast_jit.rates.push_back({"H200", "cudnn", backward, 1024, 128, 100, ""});
  }
  const TwoSteps t = StepsOf(13);
  EngineSetup setup = H200Setup(EngineMode::kAuto, true);
  setup.rates = EngineRatesFor(fast_jit, "NVIDIA H200");
  absl::StatusOr<BatchEngines> e = BatchEngines::Decide(setup, Bf16d128(), t.steps());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->tally().pairs[kJit], t.pairs());
  EXPECT_EQ(e->tally().cudnn_calls, 0);
  EXPECT_EQ(e->tally().auto_choice,
            "auto by calibration fast jit, kind H200: per piece the faster engine");
  for (const auto& [reason, count] : e->tally().jit_reasons) {
    EXPECT_THAT(reason, ::testing::MatchesRegex(
                            "auto: jit faster than cudnn at block length \\[[0-9]+, [0-9]+\\), "
                            "d 128 \\(H200 calibration\\)"));
  }
  const std::string report = e->tally().ToString();
  EXPECT_THAT(report, HasSubstr(" [auto by calibration fast jit, kind H200"));

  setup.mode = EngineMode::kCudnn;
  e = BatchEngines::Decide(setup, Bf16d128(), t.steps());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->tally().pairs[kCudnn], t.pairs());
  EXPECT_EQ(e->tally().auto_choice, "");

  // No figures for the device: cuDNN wherever it runs, and the report says why, once.
  setup.mode = EngineMode::kAuto;
  setup.rates = EngineRatesFor(fast_jit, "NVIDIA L40S");
  e = BatchEngines::Decide(setup, Bf16d128(), t.steps());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->tally().pairs[kCudnn], t.pairs());
  const std::string none = e->tally().ToString();
  EXPECT_THAT(none, HasSubstr("[auto: no calibration for NVIDIA L40S (no kind of calibration "
                              "fast jit names it): cuDNN wherever it can run]"));
  EXPECT_EQ(none.find("no calibration"), none.rfind("no calibration"));
}

TEST(BatchEnginesTest, SetupFromTheEnvironment) {
  testing::ScopedEnv lib_path("HSAP_CUDA_LIB_PATH", HSAP_SOURCE_DIR "/tests/no-such-dir");
  {
    testing::ScopedEnv env("HSAP_ATTENTION_ENGINE", "jit");
    absl::StatusOr<EngineSetup> s = EngineSetupFromEnvironment();
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->mode, EngineMode::kJit);
    EXPECT_THAT(s->cudnn.loaded.message(), HasSubstr("not looked for"));
    EXPECT_FALSE(s->has_piece_runner);
  }
  {
    testing::ScopedEnv env("HSAP_ATTENTION_ENGINE", nullptr);
    absl::StatusOr<EngineSetup> s = EngineSetupFromEnvironment();
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->mode, EngineMode::kAuto);
    EXPECT_FALSE(s->cudnn.loaded.ok());  // nothing to load from that directory
    EXPECT_THAT(s->cudnn.loaded.message(), HasSubstr("libcudnn.so.9"));
    EXPECT_THAT(BatchCudnnStatus(*s, Bf16d128()).message(), HasSubstr("cuDNN is not available"));
  }
  testing::ScopedEnv env("HSAP_ATTENTION_ENGINE", "fastest");
  EXPECT_EQ(EngineSetupFromEnvironment().status().code(), absl::StatusCode::kInvalidArgument);
}

// $HSAP_CALIBRATION under `auto`: a file that cannot be read or is not a calibration fails
// the setup (batch creation) naming the variable, the path and the problem; a good one does
// not; the forcing modes do not read it.
TEST(BatchEnginesTest, CalibrationFromTheEnvironment) {
  testing::ScopedEnv lib_path("HSAP_CUDA_LIB_PATH", HSAP_SOURCE_DIR "/tests/no-such-dir");
  testing::ScopedEnv mode("HSAP_ATTENTION_ENGINE", nullptr);
  const std::string dir = testing::MakeTestTempDir("engine_calibration");
  const std::string missing = dir + "/missing.json", bad_json = dir + "/bad.json",
                    bad_entry = dir + "/entry.json", good = dir + "/good.json";
  testing::WriteFile(bad_json, "{\"rates\": [");
  testing::WriteFile(bad_entry, R"({"rates": [{"device_kind": "H200", "engine": "jit",
      "direction": "forward", "block_tokens": 4096, "head_dim": 128, "tflops": -1}]})");
  testing::WriteFile(good, R"({"name": "mine", "rates": [{"device_kind": "H200",
      "engine": "jit", "direction": "forward", "block_tokens": 4096, "head_dim": 128,
      "tflops": 150}]})");
  testing::ScopedEnv calibration("HSAP_CALIBRATION", missing.c_str());
  for (const auto& [path, problem] : std::vector<std::pair<std::string, std::string>>{
           {missing, "cannot open"}, {bad_json, "JSON"}, {bad_entry, "rates[0].tflops"}}) {
    calibration.Set(path.c_str());
    const absl::Status s = EngineSetupFromEnvironment().status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_THAT(s.message(), HasSubstr("$HSAP_CALIBRATION = '" + path + "'"));
    EXPECT_THAT(s.message(), HasSubstr(problem));
  }
  calibration.Set(good.c_str());
  EXPECT_TRUE(EngineSetupFromEnvironment().ok());
  calibration.Set("");  // the built-in figures
  EXPECT_TRUE(EngineSetupFromEnvironment().ok());
  calibration.Set(bad_json.c_str());
  for (const char* forcing : {"jit", "cudnn"}) {
    mode.Set(forcing);
    EXPECT_TRUE(EngineSetupFromEnvironment().ok()) << forcing;
  }
}

}  // namespace
}  // namespace hsap::cuda
