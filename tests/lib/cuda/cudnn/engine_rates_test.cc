// The `auto` engine choice by calibration: the device's kind from its name, the two engines'
// rates, and the per-piece choice, checked against the rule recomputed here from the
// curves' own points (log-linear in the block length between them, flat past the longest,
// proportional to the length below the shortest, kernel_rates.h), not through the library's
// interpolation.
#include "lib/cuda/cudnn/engine_rates.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/cuda/cudnn/engine_choice.h"
#include "lib/planner/calibration.h"
#include "tests/support/random_layouts.h"

namespace hsap::cuda {
namespace {

using ::testing::HasSubstr;
using Points = std::vector<std::pair<double, double>>;  // (block tokens, TFLOP/s)

constexpr int kJit = static_cast<int>(AttentionEngine::kJit);
constexpr int kCudnn = static_cast<int>(AttentionEngine::kCudnn);

TEST(EngineRatesTest, TheDeviceNameNamesTheKindAsAWholeWord) {
  const Calibration& builtin = BuiltinCalibration();
  const std::vector<std::pair<const char*, const char*>> cases = {
      {"NVIDIA H200", "H200"},
      {"NVIDIA H100 80GB HBM3", "H100"},
      {"NVIDIA A100-SXM4-80GB", "A100"},
      {"NVIDIA A800-SXM4-80GB", "A800"},
      {"NVIDIA L40S", "L40S"},
      {"H200", "H200"},
      // Not one of the calibration's kinds: a kind inside a longer word names nothing.
      {"NVIDIA H1000", ""},
      {"NVIDIA RTX A1000", ""},
      {"NVIDIA A10", ""},
      {"NVIDIA L40", ""},
      {"NVIDIA GH200 480GB", ""},
      {"Tesla V100-SXM2-16GB", ""},
      {"", ""},
  };
  for (const auto& [name, kind] : cases) {
    EXPECT_EQ(CalibratedKindOf(builtin, name), kind) << name;
  }
  // The longest kind named wins, whatever the order of the rates.
  Calibration c;
  c.name = "two kinds";
  for (const char* kind : {"H100", "H100 NVL"}) {
    c.rates.push_back({kind, "jit", false, 1024, 128, 100, ""});
  }
  EXPECT_EQ(CalibratedKindOf(c, "NVIDIA H100 NVL"), "H100 NVL");
  EXPECT_EQ(CalibratedKindOf(c, "NVIDIA H100 80GB HBM3"), "H100");
  EXPECT_EQ(CalibratedKindOf(c, "NVIDIA H100NVL"), "");
}

TEST(EngineRatesTest, RatesOfBothEnginesOrNone) {
  const EngineRates h200 = EngineRatesFor(BuiltinCalibration(), "NVIDIA H200");
  ASSERT_TRUE(h200.known());
  EXPECT_EQ(h200.kind, "H200");
  EXPECT_EQ(h200.calibration, "built-in");
  EXPECT_EQ(h200.Describe(),
            "auto by calibration built-in, kind H200: per piece the faster engine");
  // The built-in H200 figures at 32K (docs/cost_model.md), weighted 1 : 2.5.
  const double cudnn = 3.5 / (1 / 586.77 + 2.5 / 516.72) * 1e12;
  const double jit = 3.5 / (1 / 137.28 + 2.5 / 92.65) * 1e12;
  // Rule: the same doubles combined in another order agree to a few ulps.
  EXPECT_NEAR(h200.CombinedRate(AttentionEngine::kCudnn, 32768, 128), cudnn, 1e-12 * cudnn);
  EXPECT_NEAR(h200.CombinedRate(AttentionEngine::kJit, 32768, 128), jit, 1e-12 * jit);

  const EngineRates rtx = EngineRatesFor(BuiltinCalibration(), "NVIDIA RTX 6000 Ada Generation");
  EXPECT_FALSE(rtx.known());
  EXPECT_EQ(rtx.jit, nullptr);
  EXPECT_EQ(rtx.cudnn, nullptr);
  EXPECT_THAT(rtx.Describe(), HasSubstr("auto: no calibration for NVIDIA RTX 6000 Ada Generation"));
  EXPECT_THAT(rtx.Describe(), HasSubstr("cuDNN wherever it can run"));

  Calibration only_cudnn;
  only_cudnn.name = "cudnn only";
  only_cudnn.rates = {{"H200", "cudnn", false, 4096, 128, 500, ""},
                      {"H200", "cudnn", true, 4096, 128, 400, ""},
                      {"H200", "jit", false, 4096, 128, 900, ""}};  // no backward: unusable
  const EngineRates half = EngineRatesFor(only_cudnn, "NVIDIA H200");
  EXPECT_FALSE(half.known());
  EXPECT_EQ(half.kind, "H200");
  EXPECT_THAT(half.missing, HasSubstr("cudnn only lacks jit's forward or backward figures"));
  EXPECT_EQ(EngineRates().Describe(), "");  // none looked up: nothing to say
}

// The built-in figures: cuDNN is faster than the JIT kernels on every built-in kind at every
// block length and head dim, so `auto` on them is what it was before the calibration.
TEST(EngineRatesTest, BuiltinFiguresPutEveryPieceCudnnCanRunOnCudnn) {
  for (const char* name : {"NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                           "NVIDIA A800-SXM4-80GB", "NVIDIA L40S"}) {
    const EngineRates rates = EngineRatesFor(BuiltinCalibration(), name);
    ASSERT_TRUE(rates.known()) << name;
    for (double block = 1; block <= (1 << 22); block *= 1.5) {
      for (int d : {64, 128, 256}) {
        EXPECT_GT(rates.CombinedRate(AttentionEngine::kCudnn, block, d),
                  rates.CombinedRate(AttentionEngine::kJit, block, d))
            << name << " block " << block << " d " << d;
      }
    }
  }
  const EngineRates h200 = EngineRatesFor(BuiltinCalibration(), "NVIDIA H200");
  for (uint64_t seed : {1u, 2u, 3u}) {
    const Layout layout = testing::RandomLayout(3000, testing::DocMix::kLongTail, seed, false);
    const int64_t n = layout.num_tokens();
    const WorkList work =
        *BuildWorkList(layout.slices(), {TokenRun{n / 2, 0, n - n / 2}}, {TokenRun{0, 0, n}}, 64);
    const StepEngines step =
        *SplitStep(work, EngineMode::kAuto, absl::OkStatus(), 91900, &h200, 128);
    ASSERT_FALSE(step.pieces.empty());
    EXPECT_TRUE(step.jit_pieces.empty());
    for (size_t i = 0; i < step.pieces.size(); ++i) {
      EXPECT_EQ(step.decisions[i].reason, step.pieces[i].mask.ToString());  // as before
      EXPECT_GT(step.decisions[i].block_tokens, 0);
      EXPECT_GT(step.decisions[i].rates[kCudnn], step.decisions[i].rates[kJit]);
    }
  }
}

// Hand-made curves on "H200": at d 128 the JIT kernels are faster on short blocks and slower
// on long ones (they cross between 256 and 4096 tokens); at d 64 cuDNN is faster everywhere.
const Points kJitFwd = {{256, 400}, {4096, 100}};
const Points kJitBwd = {{256, 300}, {4096, 60}};
const Points kCudnnFwd = {{256, 100}, {4096, 400}};
const Points kCudnnBwd = {{256, 80}, {4096, 350}};

Calibration CrossingCurves() {
  Calibration c;
  c.name = "crossing curves";
  auto add = [&](const char* engine, bool backward, int d, const Points& points) {
    for (auto [block, tflops] : points)
      c.rates.push_back({"H200", engine, backward, block, d, tflops, ""});
  };
  add("jit", false, 128, kJitFwd);
  add("jit", true, 128, kJitBwd);
  add("cudnn", false, 128, kCudnnFwd);
  add("cudnn", true, 128, kCudnnBwd);
  add("jit", false, 64, {{1024, 50}});
  add("jit", true, 64, {{1024, 40}});
  add("cudnn", false, 64, {{1024, 500}});
  add("cudnn", true, 64, {{1024, 450}});
  return c;
}

// The rule of kernel_rates.h written out over two points: log-linear between them, flat past
// the second, proportional to the length below the first (both engines' built-in short-block
// shapes are proportional below 512 tokens, and the first point is at 256).
double At(const Points& p, double block) {
  if (block >= p[1].first) return p[1].second;
  if (block <= p[0].first) return p[0].second * block / p[0].first;
  const double t = std::log(block / p[0].first) / std::log(p[1].first / p[0].first);
  return p[0].second + t * (p[1].second - p[0].second);
}
// Time per forward FLOP of the forward and backward (2.5x the FLOPs) together.
double Time(const Points& fwd, const Points& bwd, double block) {
  return 1 / At(fwd, block) + 2.5 / At(bwd, block);
}
bool JitFasterAt(double block) {
  return Time(kJitFwd, kJitBwd, block) < Time(kCudnnFwd, kCudnnBwd, block);
}

TEST(EngineRatesTest, CrossingCurvesSplitAWorkListAsTheyCross) {
  // The crossing lies between 500 and 2000 tokens (checked on the rule itself).
  ASSERT_TRUE(JitFasterAt(301) && JitFasterAt(501));
  ASSERT_FALSE(JitFasterAt(2001) || JitFasterAt(3001) || JitFasterAt(8001));
  const EngineRates rates = EngineRatesFor(CrossingCurves(), "NVIDIA H200");
  ASSERT_TRUE(rates.known());
  // Causal documents of 300, 500, 2000, 3000 and 8000 tokens; then the queries from token
  // 150 on against the whole row (the cut document's later rows: a bottom-right piece); then
  // a random row of every mask kind (windows, prefixes, full documents), cut in the middle.
  const Layout layout = *Layout::FromDocuments({0, 300, 800, 2800, 5800, 13800});
  const int64_t n = layout.num_tokens();
  const WorkList local =
      *BuildWorkList(layout.slices(), {TokenRun{0, 0, n}}, {TokenRun{0, 0, n}}, 64);
  const StepEngines whole =
      *SplitStep(local, EngineMode::kAuto, absl::OkStatus(), 91900, &rates, 128);
  int64_t jit_pairs = 0;
  for (size_t i = 0; i < whole.pieces.size(); ++i) {
    if (whole.decisions[i].engine == AttentionEngine::kJit) jit_pairs += whole.pieces[i].pairs;
  }
  EXPECT_EQ(jit_pairs, 300 * 301 / 2 + 500 * 501 / 2);  // the two short documents, no more

  const WorkList remote =
      *BuildWorkList(layout.slices(), {TokenRun{150, 0, n - 150}}, {TokenRun{0, 0, n}}, 64);
  const Layout mixed = testing::RandomLayout(6000, testing::DocMix::kLongTail, 5, false);
  const int64_t m = mixed.num_tokens();
  const WorkList mixed_half =
      *BuildWorkList(mixed.slices(), {TokenRun{m / 2, 0, m - m / 2}}, {TokenRun{0, 0, m}}, 64);
  int jit = 0, cudnn = 0;
  for (const WorkList* work : {&local, &remote, &mixed_half}) {
    const StepEngines step =
        *SplitStep(*work, EngineMode::kAuto, absl::OkStatus(), 91900, &rates, 128);
    std::vector<size_t> expected_jit;
    for (size_t i = 0; i < step.pieces.size(); ++i) {
      const AttentionPiece& p = step.pieces[i];
      const double block = 2.0 * static_cast<double>(p.pairs) / static_cast<double>(p.q_len);
      const PieceDecision& d = step.decisions[i];
      EXPECT_DOUBLE_EQ(d.block_tokens, std::max(1.0, block));
      // Rule: the library's interpolation and this one agree to rounding (1e-9 relative).
      const double want_jit = 3.5 / Time(kJitFwd, kJitBwd, block) * 1e12;
      const double want_cudnn = 3.5 / Time(kCudnnFwd, kCudnnBwd, block) * 1e12;
      EXPECT_NEAR(d.rates[kJit], want_jit, 1e-9 * want_jit);
      EXPECT_NEAR(d.rates[kCudnn], want_cudnn, 1e-9 * want_cudnn);
      if (JitFasterAt(block)) {
        expected_jit.push_back(i);
        ++jit;
        const double low = std::exp2(std::floor(std::log2(block)));
        EXPECT_EQ(d.reason, "auto: jit faster than cudnn at block length [" +
                                std::to_string(static_cast<int64_t>(low)) + ", " +
                                std::to_string(static_cast<int64_t>(2 * low)) +
                                "), d 128 (H200 calibration)");
      } else {
        ++cudnn;
        EXPECT_EQ(d.engine, AttentionEngine::kCudnn);
        EXPECT_EQ(d.reason, p.mask.ToString());
      }
    }
    EXPECT_EQ(step.jit_pieces, expected_jit);
    size_t on_cudnn = 0;
    for (const CudnnCall& call : step.cudnn_calls) on_cudnn += call.entries.size();
    EXPECT_EQ(on_cudnn, step.pieces.size() - expected_jit.size());
  }
  EXPECT_GT(jit, 3);  // both engines chosen, on every step's kinds of pieces
  EXPECT_GT(cudnn, 3);

  // At d 64 (the nearest curves to a batch of d 64 or 80) cuDNN wins every piece.
  for (int d : {64, 80}) {
    const StepEngines step =
        *SplitStep(local, EngineMode::kAuto, absl::OkStatus(), 91900, &rates, d);
    EXPECT_TRUE(step.jit_pieces.empty()) << d;
  }
}

// Without rates for the kind, `auto` is what it was; `cudnn` and `jit` ignore rates; pieces
// cuDNN cannot run stay on the JIT kernels for their own reason.
TEST(EngineRatesTest, WithoutRatesAndInTheForcingModes) {
  const EngineRates crossing = EngineRatesFor(CrossingCurves(), "NVIDIA H200");
  const EngineRates none = EngineRatesFor(CrossingCurves(), "NVIDIA A100-SXM4-80GB");
  ASSERT_FALSE(none.known());
  const Layout layout = *Layout::FromDocuments({0, 300, 800, 2800});
  const WorkList work =
      *BuildWorkList(layout.slices(), {TokenRun{0, 0, 2800}}, {TokenRun{0, 0, 2800}}, 64);
  const StepEngines before = *SplitStep(work, EngineMode::kAuto, absl::OkStatus(), 91900);
  EXPECT_TRUE(before.jit_pieces.empty());
  for (const EngineRates* rates : {&none, static_cast<const EngineRates*>(nullptr)}) {
    const StepEngines step =
        *SplitStep(work, EngineMode::kAuto, absl::OkStatus(), 91900, rates, 128);
    ASSERT_EQ(step.pieces, before.pieces);
    EXPECT_TRUE(step.jit_pieces.empty());
    for (const PieceDecision& d : step.decisions) EXPECT_EQ(d.block_tokens, 0);
  }
  const StepEngines forced =
      *SplitStep(work, EngineMode::kCudnn, absl::OkStatus(), 91900, &crossing, 128);
  EXPECT_TRUE(forced.jit_pieces.empty());
  const StepEngines jit =
      *SplitStep(work, EngineMode::kJit, absl::OkStatus(), 91900, &crossing, 128);
  EXPECT_EQ(jit.jit_pieces.size(), jit.pieces.size());
  for (const PieceDecision& d : jit.decisions) EXPECT_EQ(d.reason, "HSAP_ATTENTION_ENGINE=jit");
  // With the crossing rates, `auto` moves the short documents only where cuDNN could run them.
  const StepEngines chosen =
      *SplitStep(work, EngineMode::kAuto, absl::OkStatus(), 91900, &crossing, 128);
  EXPECT_EQ(chosen.jit_pieces.size(), 2u);
  // Equal rates are a tie, and a tie stays on cuDNN.
  Calibration same;
  same.name = "equal engines";
  for (const char* engine : {"jit", "cudnn"}) {
    for (bool backward : {false, true}) {
      same.rates.push_back({"H200", engine, backward, 256, 128, 300, ""});
      same.rates.push_back({"H200", engine, backward, 8192, 128, 500, ""});
    }
  }
  const EngineRates tie = EngineRatesFor(same, "NVIDIA H200");
  ASSERT_TRUE(tie.known());
  const StepEngines tied = *SplitStep(work, EngineMode::kAuto, absl::OkStatus(), 91900, &tie, 128);
  EXPECT_TRUE(tied.jit_pieces.empty());
  for (const PieceDecision& d : tied.decisions) EXPECT_EQ(d.rates[kJit], d.rates[kCudnn]);
  const StepEngines no_batch = *SplitStep(
      work, EngineMode::kAuto, absl::FailedPreconditionError("no GPU"), 91900, &crossing, 128);
  for (const PieceDecision& d : no_batch.decisions) EXPECT_EQ(d.reason, "no GPU");
}

}  // namespace
}  // namespace hsap::cuda
