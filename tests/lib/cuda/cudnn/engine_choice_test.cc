// Every engine decision: the mode ($HSAP_ATTENTION_ENGINE), what cuDNN offers, the batch's
// shape and each mask's version, with the reasons a batch reports.
#include "lib/cuda/cudnn/engine_choice.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_env.h"

namespace hsap::cuda {
namespace {

using ::testing::HasSubstr;

CudnnAvailability H200(int version = 91900) { return {absl::OkStatus(), version, 90}; }
EngineShape Bf16d128() { return {DType::kBF16, 128, 16, 4, true}; }

TEST(EngineModeTest, ParsesTheThreeModes) {
  EXPECT_EQ(*ParseEngineMode("auto", "x"), EngineMode::kAuto);
  EXPECT_EQ(*ParseEngineMode("CUDNN", "x"), EngineMode::kCudnn);
  EXPECT_EQ(*ParseEngineMode("jit", "x"), EngineMode::kJit);
  const absl::Status bad = ParseEngineMode("flash", "--engine").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("--engine = 'flash'"));
  EXPECT_THAT(bad.message(), HasSubstr("auto"));
  EXPECT_STREQ(EngineModeName(EngineMode::kCudnn), "cudnn");
}

TEST(EngineModeTest, ReadsTheEnvironment) {
  {
    testing::ScopedEnv env("HSAP_ATTENTION_ENGINE", nullptr);
    EXPECT_EQ(*EngineModeFromEnvironment(), EngineMode::kAuto);
  }
  {
    testing::ScopedEnv env("HSAP_ATTENTION_ENGINE", "jit");
    EXPECT_EQ(*EngineModeFromEnvironment(), EngineMode::kJit);
  }
  testing::ScopedEnv env("HSAP_ATTENTION_ENGINE", "fast");
  EXPECT_THAT(EngineModeFromEnvironment().status().message(),
              HasSubstr("$HSAP_ATTENTION_ENGINE = 'fast'"));
}

TEST(EngineChoiceTest, VersionStrings) {
  EXPECT_EQ(CudnnVersionString(91002), "9.10.2");
  EXPECT_EQ(CudnnVersionString(90600), "9.6.0");
}

TEST(EngineChoiceTest, CudnnTakesAnH200Batch) {
  EXPECT_TRUE(CudnnTakesBatch(Bf16d128(), H200()).ok());
  EXPECT_TRUE(CudnnTakesBatch({DType::kF16, 256, 8, 8, true}, H200()).ok());
  EXPECT_TRUE(CudnnTakesBatch(Bf16d128(), {absl::OkStatus(), 91801, 80}).ok());
}

// Each reason cuDNN cannot run a batch, named.
TEST(EngineChoiceTest, WhyCudnnCannotRunABatch) {
  struct Case {
    EngineShape shape;
    CudnnAvailability cudnn;
    const char* says;
  };
  const std::vector<Case> cases = {
      {Bf16d128(),
       {absl::UnimplementedError("libcudnn.so.9 not found"), 0, 0},
       "libcudnn.so.9 not found"},
      {Bf16d128(),
       {absl::OkStatus(), 91900, 75},
       "compute capability 8.0 or newer (this device: 7.5)"},
      {Bf16d128(), H200(91000), "9.10.0 has known bugs"},
      {Bf16d128(), H200(91001), "9.10.1 has known bugs"},
      {Bf16d128(), {absl::OkStatus(), 91800, 86}, "ragged (THD) inputs below sm_90 from 9.18.1"},
      {{DType::kF32, 128, 16, 4, true}, H200(), "bf16 or fp16, not fp32"},
      {{DType::kBF16, 100, 16, 4, true}, H200(), "multiples of 8 up to 256"},
      {{DType::kBF16, 264, 16, 4, true}, H200(), "not 264"},
      {{DType::kBF16, 256, 16, 4, true}, {absl::OkStatus(), 91900, 80}, "up to 128 on this device"},
      {{DType::kBF16, 128, 6, 4, true}, H200(), "multiple of K/V heads (4)"},
      {{DType::kBF16, 128, 16, 4, false}, H200(), "kv-head map differs"},
  };
  for (const Case& c : cases) {
    const absl::Status s = CudnnTakesBatch(c.shape, c.cudnn);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << c.says;
    EXPECT_THAT(s.message(), HasSubstr(c.says));
  }
}

TEST(EngineChoiceTest, ForcedCudnnFailsWhereItCannotRun) {
  const absl::Status no = CudnnTakesBatch({DType::kF32, 128, 4, 4, true}, H200());
  EXPECT_TRUE(CheckEngineMode(EngineMode::kAuto, no).ok());
  EXPECT_TRUE(CheckEngineMode(EngineMode::kJit, no).ok());
  EXPECT_TRUE(CheckEngineMode(EngineMode::kCudnn, absl::OkStatus()).ok());
  const absl::Status forced = CheckEngineMode(EngineMode::kCudnn, no);
  EXPECT_EQ(forced.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(forced.message(), HasSubstr("HSAP_ATTENTION_ENGINE=cudnn"));
  EXPECT_THAT(forced.message(), HasSubstr("not fp32"));
  EXPECT_THAT(forced.message(), HasSubstr("auto or jit"));
}

// A piece of each mask against the version that brings it, one below it, and the modes.
TEST(EngineChoiceTest, EachMaskNeedsItsVersion) {
  for (int k = 0; k < kNumCudnnMaskKinds; ++k) {
    const auto kind = static_cast<CudnnMaskKind>(k);
    const bool bounded = kind == CudnnMaskKind::kWindowTopLeft ||
                         kind == CudnnMaskKind::kWindowBottomRight ||
                         kind == CudnnMaskKind::kLeftBandTopLeft;
    const AttentionPiece piece{0, 64, 0, 96, {kind, bounded ? 8 : 0}, 100};
    const int needs = MinCudnnVersion(kind);
    const PieceDecision at = DecidePiece(piece, EngineMode::kAuto, absl::OkStatus(), needs);
    EXPECT_EQ(at.engine, AttentionEngine::kCudnn) << piece.mask.ToString();
    EXPECT_EQ(at.reason, piece.mask.ToString());
    const PieceDecision forced = DecidePiece(piece, EngineMode::kCudnn, absl::OkStatus(), needs);
    EXPECT_EQ(forced.engine, AttentionEngine::kCudnn);
    const PieceDecision jit = DecidePiece(piece, EngineMode::kJit, absl::OkStatus(), needs);
    EXPECT_EQ(jit.engine, AttentionEngine::kJit);
    EXPECT_EQ(jit.reason, "HSAP_ATTENTION_ENGINE=jit");
    const PieceDecision no_batch =
        DecidePiece(piece, EngineMode::kAuto, absl::FailedPreconditionError("no GPU"), needs);
    EXPECT_EQ(no_batch.engine, AttentionEngine::kJit);
    EXPECT_EQ(no_batch.reason, "no GPU");
    if (needs > 90000) {
      const PieceDecision old = DecidePiece(piece, EngineMode::kCudnn, absl::OkStatus(), needs - 1);
      EXPECT_EQ(old.engine, AttentionEngine::kJit) << piece.mask.ToString();
      EXPECT_THAT(old.reason, HasSubstr(" needs cuDNN " + CudnnVersionString(needs) + " (loaded " +
                                        CudnnVersionString(needs - 1) + ")"));
    }
  }
}

// A step split by version: on cuDNN 9.5 the bottom-right piece of a causal band runs on the
// JIT kernels, its fully visible rows on cuDNN; the tally says so.
TEST(EngineChoiceTest, SplitStepAndTally) {
  const Layout layout = *Layout::FromDocuments({0, 100});
  const WorkList work =
      *BuildWorkList(layout.slices(), {TokenRun{50, 0, 50}}, {TokenRun{0, 0, 60}}, 64);
  const StepEngines old = *SplitStep(work, EngineMode::kAuto, absl::OkStatus(), 90501);
  ASSERT_EQ(old.pieces.size(), 2u);
  EXPECT_EQ(old.decisions[0].engine, AttentionEngine::kJit);
  EXPECT_EQ(old.decisions[1].engine, AttentionEngine::kCudnn);
  EXPECT_EQ(old.jit_pieces, (std::vector<size_t>{0}));
  ASSERT_EQ(old.cudnn_calls.size(), 1u);
  EXPECT_EQ(old.cudnn_calls[0].entries, (std::vector<size_t>{1}));

  const StepEngines now = *SplitStep(work, EngineMode::kAuto, absl::OkStatus(), 91900);
  EXPECT_TRUE(now.jit_pieces.empty());
  EXPECT_EQ(now.cudnn_calls.size(), 2u);  // two masks: two ragged batches

  EngineTally tally;
  tally.Add(old);
  tally.Add(now);
  EXPECT_EQ(tally.pieces[0], 1);
  EXPECT_EQ(tally.pieces[1], 3);
  EXPECT_EQ(tally.cudnn_calls, 3);
  EXPECT_EQ(tally.pairs[0] + tally.pairs[1], 2 * work.visible_pairs);
  EXPECT_DOUBLE_EQ(tally.ForwardFlops(AttentionEngine::kJit, 16, 128),
                   4.0 * 128 * 16 * static_cast<double>(old.pieces[0].pairs));
  EXPECT_EQ(tally.jit_reasons.size(), 1u);
  EXPECT_THAT(tally.ToString(), HasSubstr("jit 1 pieces ("));
  EXPECT_THAT(tally.ToString(),
              HasSubstr("1 x causal bottom-right needs cuDNN 9.6.0 (loaded 9.5.1)"));
  EXPECT_THAT(tally.ToString(), HasSubstr("cudnn 3 pieces in 3 calls"));
}

}  // namespace
}  // namespace hsap::cuda
