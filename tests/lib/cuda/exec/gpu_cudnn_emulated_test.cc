// The cuDNN engine inside the GPU executors (lib/cuda/exec/cudnn_steps.h), on emulated
// devices: ring batches and plan batches whose engine choice gives pieces to cuDNN run them
// through a CudnnPieceRunner -- here the host fake of tests/support/fake_cudnn_runner.h,
// which evaluates cuDNN's definition in fp64 -- and the JIT kernels (run by the emulator) the
// rest, merged by LSE (merge_entries) and added (add_entries) by the emulated helper kernels.
// Checked:
//   - forward and backward match the fp64 reference under the tolerance rule, bf16, GQA,
//     random layouts of every mask kind (causal, full, prefix-LM, sliding window) and of
//     user slices, fixed seeds; under `cudnn` with cuDNN 9.19 (every piece on cuDNN) and
//     under `auto` with cuDNN 9.2 (bottom-right and left-band pieces on the JIT kernels);
//   - the fake was handed exactly the pieces the tally gives cuDNN (calls and pairs per
//     forward and backward call), and the tally covers every pair of the schedule;
//   - the bytes moved are the schedule's prediction (as under the JIT kernels alone);
//   - under `cudnn`, a batch cuDNN cannot run (fp32) is refused at creation, saying why.
// clang-format off
#include "tests/support/emulated_device.h"
// clang-format on

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "attention/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/comm/communicator.h"
#include "lib/cuda/cudnn/batch_engines.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/exec/batch.h"
#include "lib/exec/executor.h"
#include "lib/exec/runner.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/fake_cudnn_runner.h"
#include "tests/support/hier_plans.h"
#include "tests/support/random_layouts.h"
#include "tests/support/tolerance.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::DocMix;
using ::hsap::testing::EmulatedDevice;
using ::hsap::testing::EmulatedKernels;
using ::hsap::testing::FakeCudnnRunner;
using ::hsap::testing::HostTensor;
using ::testing::HasSubstr;

using Cfg = testing::SmallTileCfg<hsap_dev::bf16, 2, true>;
constexpr int kHeadsQ = 4, kHeadsKv = 2, kDim = 32;
constexpr int kCudnn = static_cast<int>(AttentionEngine::kCudnn);
constexpr int kJit = static_cast<int>(AttentionEngine::kJit);

struct EngineCase {
  EngineMode mode = EngineMode::kCudnn;
  int cudnn_version = 91900;
};

// What each rank's batch reported and its fake saw.
struct RankReport {
  EngineTally tally;
  int64_t schedule_pairs = 0;  // over the rank's steps
  int64_t forward_calls = 0, backward_calls = 0, forward_pairs = 0, backward_pairs = 0;
  int64_t refused_calls = 0;
  std::string fake_error;
  std::string report;  // EngineReportOf after both passes
  absl::Status forward, backward;
  uint64_t moved = 0;  // bytes sent, forward and backward
};

struct BatchRun {
  testing::RowOutputs outputs;
  std::vector<RankReport> ranks;
};

// One batch on R host-world ranks with emulated devices: a ring batch (plan == null) or a
// batch under `plan`; forward once, backward once, checked against the reference (`check`;
// else a rank stops at its first failing call). `answer`: the fake's answer to each call
// (none: it runs them all).
BatchRun RunBatch(const Layout& layout, int R, const Plan* plan, EngineCase engine, uint64_t seed,
                  bool check = true, FakeCudnnRunner::Answer answer = {}) {
  BatchRun res;
  const int64_t T = layout.num_tokens();
  CommOptions comm_options;
  comm_options.timeout = absl::Seconds(120);
  comm_options.num_threads = 1;
  auto comms = Communicator::CreateHostWorld(R, comm_options);
  EXPECT_TRUE(comms.ok()) << comms.status();
  if (!comms.ok()) return res;
  auto kernels = std::make_shared<const EmulatedKernels<Cfg>>();
  BatchOptions options;
  options.dtype = DType::kBF16;
  options.heads_q = kHeadsQ;
  options.heads_kv = kHeadsKv;
  options.head_dim = kDim;
  testing::DistCase c;
  c.dtype = DType::kBF16;
  c.heads_q = kHeadsQ;
  c.heads_kv = kHeadsKv;
  c.head_dim = kDim;
  testing::RowInputs in(c, T, seed);
  testing::RowOutputs& o = res.outputs;
  o.out = HostTensor(DType::kBF16, T, kHeadsQ, kDim);
  o.dq = HostTensor(DType::kBF16, T, kHeadsQ, kDim);
  o.dk = HostTensor(DType::kBF16, T, kHeadsKv, kDim);
  o.dv = HostTensor(DType::kBF16, T, kHeadsKv, kDim);
  o.lse.assign(static_cast<size_t>(T) * kHeadsQ, 0.0f);
  res.ranks.resize(R);
  testing::OnEveryRank(R, [&](int r) {
    auto gpu = GpuComm::Create(std::make_unique<EmulatedDevice>(), nullptr, absl::Seconds(120));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    // The synchronous emulated device runs each operation at once, in call order.
    auto fake = std::make_shared<FakeCudnnRunner>([](cudaStream, std::function<void()> op) {
      op();
      return absl::OkStatus();
    });
    EngineSetup setup;
    setup.mode = engine.mode;
    setup.cudnn = {absl::OkStatus(), engine.cudnn_version, 90};
    setup.runner = fake;
    if (answer) fake->set_answer(answer);
    std::unique_ptr<RunnerFactory> runners = NewGpuRunners(*gpu, kernels, setup);
    absl::StatusOr<std::unique_ptr<Batch>> batch =
        plan == nullptr ? Batch::Create(*(*comms)[r], layout, {}, options, *runners)
                        : Batch::CreateWithPlan(*(*comms)[r], layout, *plan, options, *runners);
    ASSERT_TRUE(batch.ok()) << "rank " << r << ": " << batch.status();
    RankReport& report = res.ranks[r];
    const BatchEngines* engines = EnginesOf((*batch)->runner());
    ASSERT_NE(engines, nullptr);
    report.tally = engines->tally();
    if (plan == nullptr) {
      const Schedule& s = *(*batch)->schedule();
      report.schedule_pairs = s.local_work.visible_pairs;
      for (const Stage& st : s.stages) report.schedule_pairs += st.recv_work.visible_pairs;
    } else {
      const RankHierarchy& h = *(*batch)->hierarchy();
      report.schedule_pairs = h.local_work.visible_pairs;
      for (const SubRingStep& st : h.steps) report.schedule_pairs += st.recv_work.visible_pairs;
    }
    const std::vector<TokenRange> shard = (*batch)->partition()->ranges(r);
    testing::ShardTensors t(in, o, shard, kHeadsQ);
    absl::Status f =
        (*batch)->Forward(t.q.data(), t.k.data(), t.v.data(), t.out.data(), t.lse.data());
    report.forward = f;
    if (!check && !f.ok()) return;
    ASSERT_TRUE(f.ok()) << "rank " << r << ": " << f;
    report.forward_calls = fake->forward_calls();
    report.forward_pairs = fake->forward_pairs();
    absl::Status b =
        (*batch)->Backward(t.dout.data(), t.q.data(), t.k.data(), t.v.data(), t.out.data(),
                           t.lse.data(), t.dq.data(), t.dk.data(), t.dv.data());
    ASSERT_TRUE(b.ok()) << "rank " << r << ": " << b;
    report.backward_calls = fake->backward_calls();
    report.backward_pairs = fake->backward_pairs();
    report.refused_calls = fake->refused_calls();
    report.report = EngineReportOf((*batch)->runner());
    report.fake_error = fake->error();
    // The bytes moved are the schedule's prediction, whichever engine computed.
    const CallTraffic& fwd = (*batch)->traffic().forward;
    const CallTraffic& bwd = (*batch)->traffic().backward;
    if (plan == nullptr) {
      const AttentionDims dims = *DimsFromOptions(options);
      const ExecTraffic pf = ForwardTraffic(*(*batch)->schedule(), dims, DType::kBF16);
      const ExecTraffic pb = BackwardTraffic(*(*batch)->schedule(), dims, DType::kBF16);
      EXPECT_EQ(fwd.ring_sent, pf.bytes_sent) << "rank " << r;
      EXPECT_EQ(fwd.ring_received, pf.bytes_received) << "rank " << r;
      EXPECT_EQ(bwd.ring_sent, pb.bytes_sent) << "rank " << r;
      EXPECT_EQ(bwd.ring_received, pb.bytes_received) << "rank " << r;
    } else {
      const RankHierarchy& h = *(*batch)->hierarchy();
      EXPECT_EQ(static_cast<const HierTraffic&>(fwd), PredictForwardTraffic(h, kDim, DType::kBF16))
          << "rank " << r;
      EXPECT_EQ(static_cast<const HierTraffic&>(bwd), PredictBackwardTraffic(h, kDim, DType::kBF16))
          << "rank " << r;
    }
    report.moved = fwd.sent() + bwd.sent();
    t.Unslice(o);
  });
  EXPECT_EQ(kernels->error(), "");
  if (check) {
    const ReferenceInputs ri = in.Reference(*DimsFromOptions(options), DType::kBF16);
    testing::ExpectMatchesReference(layout, ri, in.dout.bytes.data(), o, /*backward=*/true,
                                    testing::kCudaKernelFloor);
  }
  return res;
}

// Every rank's fake ran exactly the tally's cuDNN calls and pairs, once per pass, and the
// tally covers the rank's pairs. Returns the pairs on each engine over the ranks.
std::pair<int64_t, int64_t> ExpectFakeRanTheTally(const BatchRun& run) {
  int64_t on_cudnn = 0, on_jit = 0;
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    const RankReport& x = run.ranks[r];
    EXPECT_EQ(x.fake_error, "");
    EXPECT_EQ(x.tally.pairs[kCudnn] + x.tally.pairs[kJit], x.schedule_pairs);
    EXPECT_EQ(x.forward_calls, x.tally.cudnn_calls);
    EXPECT_EQ(x.backward_calls, x.tally.cudnn_calls);
    EXPECT_EQ(x.forward_pairs, x.tally.pairs[kCudnn]);
    EXPECT_EQ(x.backward_pairs, x.tally.pairs[kCudnn]);
    on_cudnn += x.tally.pairs[kCudnn];
    on_jit += x.tally.pairs[kJit];
  }
  return {on_cudnn, on_jit};
}

TEST(GpuCudnnEngine, RingBatchesUnderCudnnRunEveryPieceOnTheRunner) {
  for (auto [tokens, mix, seed] :
       {std::tuple{96, DocMix::kLongTail, 301}, {130, DocMix::kOneHuge, 302}}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens, seed " << seed);
    const Layout layout = testing::RandomLayout(tokens, mix, seed, /*causal_only=*/false);
    const BatchRun run = RunBatch(layout, 3, nullptr, {EngineMode::kCudnn, 91900}, seed);
    const auto [on_cudnn, on_jit] = ExpectFakeRanTheTally(run);
    EXPECT_GT(on_cudnn, 0);
    EXPECT_EQ(on_jit, 0);  // 9.19 takes every mask kind
  }
}

TEST(GpuCudnnEngine, RingBatchesUnderAutoSplitPiecesBetweenTheEngines) {
  // cuDNN 9.2: no mask, top-left causal and top-left windows on cuDNN; bottom-right pieces and
  // left bands (a window document's queries against a previous rank's keys) on the JIT
  // kernels, in the same steps. Long window and causal documents split over the ranks, and
  // a random layout.
  const Layout split = *Layout::FromDocuments(
      {0, 130, 160}, {MaskKind::kSlidingWindow, MaskKind::kPrefixLM}, {13, 11});
  const Layout random = testing::RandomLayout(120, DocMix::kOneHuge, 311, false);
  for (const Layout* layout : {&split, &random}) {
    SCOPED_TRACE(::testing::Message() << layout->num_tokens() << " tokens");
    const BatchRun run = RunBatch(*layout, 3, nullptr, {EngineMode::kAuto, 90200}, 311);
    const auto [on_cudnn, on_jit] = ExpectFakeRanTheTally(run);
    EXPECT_GT(on_cudnn, 0);
    if (layout == &split) {
      EXPECT_GT(on_jit, 0);
    }
    for (const RankReport& x : run.ranks) {
      for (const auto& [reason, count] : x.tally.jit_reasons) {
        EXPECT_THAT(reason, HasSubstr("(loaded 9.2.0)"));
      }
    }
  }
}

TEST(GpuCudnnEngine, SliceLayoutsOnTwoRanks) {
  const Layout layout = testing::RandomSliceLayout(110, 321);
  const BatchRun run = RunBatch(layout, 2, nullptr, {EngineMode::kAuto, 91900}, 321);
  const auto [on_cudnn, on_jit] = ExpectFakeRanTheTally(run);
  EXPECT_GT(on_cudnn, 0);
  EXPECT_EQ(on_jit, 0);
}

TEST(GpuCudnnEngine, PlanBatchesUnderBothModes) {
  // Head-parallel groups of two and one: ranks of 2 query heads and their K/V head, and one
  // rank of all 4 and both K/V heads.
  const Plan plan = testing::MakePlan({{2, 1},
                                       kHeadsQ,
                                       kHeadsKv,
                                       testing::HeadSplit::kContiguous,
                                       /*uneven=*/true,
                                       331});
  const Layout layout = testing::RandomLayout(72, DocMix::kOneHuge, 331, false);
  for (EngineCase engine : {EngineCase{EngineMode::kCudnn, 91900}, {EngineMode::kAuto, 90200}}) {
    SCOPED_TRACE(EngineModeName(engine.mode));
    const BatchRun run = RunBatch(layout, plan.num_ranks, &plan, engine, 331);
    const auto [on_cudnn, on_jit] = ExpectFakeRanTheTally(run);
    EXPECT_GT(on_cudnn, 0);
    if (engine.cudnn_version == 91900) {
      EXPECT_EQ(on_jit, 0);
    }
    uint64_t moved = 0;
    for (const RankReport& x : run.ranks) moved += x.moved;
    EXPECT_GT(moved, 0u);
  }
}

// Calls the runner refuses (Unimplemented: cuDNN builds no graph for them) run on the JIT
// kernels with the same results, in ring and plan batches, forward and backward; the report
// says so. Refused here: every backward call, and the forward calls of masked pieces.
TEST(GpuCudnnEngine, RefusedCallsRunOnTheJitKernels) {
  const FakeCudnnRunner::Answer refuse = [](const cuda::SdpaCall& call, bool backward) {
    if (!backward && call.mask.kind == CudnnMaskKind::kNone) return absl::OkStatus();
    return absl::UnimplementedError("host fake: no graph for this call");
  };
  const Plan plan = testing::MakePlan(
      {{2, 1}, kHeadsQ, kHeadsKv, testing::HeadSplit::kContiguous, /*uneven=*/true, 341});
  const Layout layout = testing::RandomLayout(120, DocMix::kOneHuge, 341, false);
  for (const Plan* p : {static_cast<const Plan*>(nullptr), &plan}) {
    SCOPED_TRACE(p == nullptr ? "ring" : "plan");
    const int R = p == nullptr ? 3 : p->num_ranks;
    // RunBatch checks the results against the fp64 reference.
    const BatchRun run = RunBatch(layout, R, p, {EngineMode::kCudnn, 91900}, 341, true, refuse);
    int64_t refused = 0, ran = 0;
    for (const RankReport& x : run.ranks) {
      EXPECT_EQ(x.fake_error, "");
      EXPECT_EQ(x.backward_calls, 0);
      EXPECT_EQ(x.forward_calls + x.refused_calls, 2 * x.tally.cudnn_calls);
      refused += x.refused_calls;
      ran += x.forward_calls;
      if (x.refused_calls > 0) {
        EXPECT_THAT(x.report, HasSubstr(absl::StrCat("; at run time ", x.refused_calls,
                                                     " cuDNN call")));
        EXPECT_THAT(x.report, HasSubstr("ran on the JIT kernels instead (first: host fake: no "
                                        "graph for this call)"));
      }
    }
    EXPECT_GT(refused, 0);
    EXPECT_GT(ran, 0);  // some forward calls did run on the fake
  }
}

// Any other runner error fails the call (part of it may have been enqueued).
TEST(GpuCudnnEngine, OtherRunnerErrorsFailTheCall) {
  const FakeCudnnRunner::Answer fail = [](const cuda::SdpaCall&, bool) {
    return absl::InternalError("host fake: execution failed");
  };
  const Layout layout = testing::RandomLayout(96, DocMix::kLongTail, 351, false);
  const BatchRun run =
      RunBatch(layout, 2, nullptr, {EngineMode::kCudnn, 91900}, 351, /*check=*/false, fail);
  ASSERT_EQ(run.ranks.size(), 2u);
  for (const RankReport& x : run.ranks) {
    ASSERT_GT(x.tally.cudnn_calls, 0);
    EXPECT_EQ(x.forward.code(), absl::StatusCode::kInternal) << x.forward;
    EXPECT_THAT(x.forward.message(), HasSubstr("host fake: execution failed"));
  }
}

// With a runner, `cudnn` still refuses what cuDNN cannot run, naming why and the fix.
TEST(GpuCudnnEngine, CudnnRefusesAnFp32BatchAtCreation) {
  const Layout layout = testing::RandomLayout(40, DocMix::kUniform, 351, false);
  auto comms = Communicator::CreateHostWorld(
      2, CommOptions{.timeout = absl::Seconds(60), .num_threads = 1, .rank_nodes = {}});
  ASSERT_TRUE(comms.ok()) << comms.status();
  auto kernels = std::make_shared<const EmulatedKernels<testing::SmallTileCfg<float, 2, true>>>();
  BatchOptions options;
  options.dtype = DType::kF32;
  options.heads_q = kHeadsQ;
  options.heads_kv = kHeadsKv;
  options.head_dim = kDim;
  testing::OnEveryRank(2, [&](int r) {
    auto gpu = GpuComm::Create(std::make_unique<EmulatedDevice>(), nullptr, absl::Seconds(60));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EngineSetup setup;
    setup.mode = EngineMode::kCudnn;
    setup.cudnn = {absl::OkStatus(), 91900, 90};
    setup.runner = std::make_shared<FakeCudnnRunner>(
        [](cudaStream, std::function<void()>) { return absl::OkStatus(); });
    auto batch =
        Batch::Create(*(*comms)[r], layout, {}, options, *NewGpuRunners(*gpu, kernels, setup));
    ASSERT_FALSE(batch.ok());
    EXPECT_THAT(batch.status().message(), HasSubstr("HSAP_ATTENTION_ENGINE=cudnn"));
    EXPECT_THAT(batch.status().message(), HasSubstr("not fp32"));
    EXPECT_THAT(batch.status().message(), HasSubstr("set HSAP_ATTENTION_ENGINE to auto or jit"));
  });
}

}  // namespace
}  // namespace hsap::cuda
