// The GPU hierarchical executor (lib/cuda/exec/gpu_hier_executor.h) on an emulated device (the
// CUDA kernels run by the CPU emulator, host memory as device memory, ranks over the host
// transport), against the fp64 reference under the project's rule, for plans with groups of
// several sizes, uneven and non-contiguous heads, GQA with KV heads held by several members
// (fp32 dK/dV sums), Ulysses and groups of one; plus the bytes (equal to the host runtime's
// prediction), NCCL semantics of the posted stages, no allocation inside a call, and the
// same on asynchronous emulated streams.
// clang-format off
#include "tests/support/emulated_device.h"
// clang-format on

#include "lib/cuda/exec/gpu_hier_executor.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "attention/reference.h"
#include "gtest/gtest.h"
#include "lib/comm/communicator.h"
#include "lib/comm/host_transport.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/cuda/exec/nccl_lowering.h"
#include "lib/cuda/runtime/buffer_pool.h"
#include "lib/exec/batch.h"
#include "lib/sched/hierarchy.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/hier_plans.h"
#include "tests/support/random_layouts.h"
#include "tests/support/recording_transport.h"
#include "tests/support/tolerance.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::DocMix;
using ::hsap::testing::EmulatedDevice;
using ::hsap::testing::EmulatedKernels;
using ::hsap::testing::HeadSplit;
using ::hsap::testing::HostTensor;
using ::hsap::testing::MakePlan;
using ::hsap::testing::PlanSpec;

// The emulator's configuration; the heads come from the kv-head map, so the GQA ratio of
// the configuration is unused.
using Cfg = testing::SmallTileCfg<float, 1, true>;
constexpr int kDim = 32;

struct RunResult {
  testing::RowOutputs outputs;
  std::vector<HierTraffic> forward, backward, predicted_forward, predicted_backward;
  std::vector<P2pProgram> posted_forward, posted_backward;
};

RunResult RunGpuHier(const Layout& layout, const Plan& plan, uint64_t seed, bool async) {
  RunResult res;
  const int R = plan.num_ranks;
  const int64_t T = layout.num_tokens();
  testing::DistCase c;
  c.heads_q = plan.heads_q;
  c.heads_kv = plan.heads_kv;
  c.head_dim = kDim;
  testing::RowInputs in(c, T, seed);
  testing::RowOutputs& o = res.outputs;
  o.out = HostTensor(DType::kF32, T, plan.heads_q, kDim);
  o.dq = HostTensor(DType::kF32, T, plan.heads_q, kDim);
  o.dk = HostTensor(DType::kF32, T, plan.heads_kv, kDim);
  o.dv = HostTensor(DType::kF32, T, plan.heads_kv, kDim);
  o.lse.assign(static_cast<size_t>(T) * plan.heads_q, 0.0f);
  res.forward.resize(R);
  res.backward.resize(R);
  res.predicted_forward.resize(R);
  res.predicted_backward.resize(R);
  res.posted_forward.resize(R);
  res.posted_backward.resize(R);

  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan);
  EXPECT_TRUE(h.ok()) << h.status();
  if (!h.ok()) return res;
  auto transports = CreateHostTransports(R, absl::Seconds(120));
  EXPECT_TRUE(transports.ok()) << transports.status();
  std::vector<std::unique_ptr<EmulatedDevice>> devices;
  std::vector<std::unique_ptr<RecordingTransport>> recorders;
  for (auto& t : *transports) {
    devices.push_back(std::make_unique<EmulatedDevice>(async));
    if (async) {
      t = std::make_unique<testing::EmulatedDeviceTransport>(std::move(t), *devices.back());
    }
    recorders.push_back(std::make_unique<RecordingTransport>(std::move(t)));
  }
  AttentionDims dims{plan.heads_q, plan.heads_kv, kDim, 1.0f / std::sqrt(float{kDim}), {}};

  testing::OnEveryRank(R, [&](int r) {
    absl::StatusOr<RankHierarchy> rh = h->BuildRank(layout, r);
    ASSERT_TRUE(rh.ok()) << rh.status();
    EmulatedDevice& device = *devices[r];
    EmulatedKernels<Cfg> kernels(&device);
    const cudaStream stream = *device.CreateStream();
    auto program = DeviceHierProgram::Build(device, *rh, dims, DType::kF32, stream);
    ASSERT_TRUE(program.ok()) << program.status();
    DeviceBufferPool pool(device);
    ASSERT_TRUE(pool.Reserve((*program)->pool_bytes()).ok());

    const std::vector<TokenRange>& shard = h->shard(r);
    testing::ShardTensors t(in, o, shard, plan.heads_q);
    GpuHierContext ctx;
    ctx.device = &device;
    ctx.kernels = &kernels;
    ctx.transport = recorders[r].get();
    ctx.program = program->get();
    ctx.pool = pool.base();
    ctx.pool_bytes = pool.size();
    ctx.call_id = 1;
    ctx.stream = stream;
    const int64_t allocations = device.allocations();
    absl::Status s = GpuHierarchicalForward(ctx, t.q.data(), t.k.data(), t.v.data(), t.out.data(),
                                            t.lse.data(), &res.forward[r]);
    res.posted_forward[r] = recorders[r]->TakeRecorded();
    if (s.ok()) s = device.Synchronize(stream, absl::InfiniteFuture(), "forward");
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
    ctx.call_id = 2;
    s = GpuHierarchicalBackward(ctx, t.dout.data(), t.q.data(), t.k.data(), t.v.data(),
                                t.out.data(), t.lse.data(), t.dq.data(), t.dk.data(), t.dv.data(),
                                &res.backward[r]);
    res.posted_backward[r] = recorders[r]->TakeRecorded();
    if (s.ok()) s = device.Synchronize(stream, absl::InfiniteFuture(), "backward");
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
    EXPECT_EQ(kernels.error(), "") << "rank " << r;
    EXPECT_EQ(device.allocations(), allocations) << "rank " << r << " allocated in a call";
    res.predicted_forward[r] = PredictForwardTraffic(*rh, kDim, DType::kF32);
    res.predicted_backward[r] = PredictBackwardTraffic(*rh, kDim, DType::kF32);

    t.Unslice(o);
  });

  const ReferenceInputs ri = in.Reference(dims, DType::kF32);
  testing::ExpectMatchesReference(layout, ri, in.dout.bytes.data(), o, /*backward=*/true,
                                  testing::kCudaKernelFloor);
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(res.forward[r], res.predicted_forward[r]) << "forward bytes of rank " << r;
    EXPECT_EQ(res.backward[r], res.predicted_backward[r]) << "backward bytes of rank " << r;
  }
  uint64_t ring = 0;
  for (const HierTraffic& t : res.forward) ring += t.ring_received;
  if (plan.groups.size() > 1) {
    EXPECT_GT(ring, 0u) << "no sub-ring step: the layout tests nothing";
  }
  EXPECT_TRUE(CheckNcclPrograms(res.posted_forward).ok()) << CheckNcclPrograms(res.posted_forward);
  EXPECT_TRUE(CheckNcclPrograms(res.posted_backward).ok())
      << CheckNcclPrograms(res.posted_backward);
  return res;
}

struct Case {
  PlanSpec spec;
  int64_t tokens;
  DocMix mix;
};

class GpuHierTest : public ::testing::TestWithParam<Case> {};

TEST_P(GpuHierTest, MatchesReference) {
  const Case& c = GetParam();
  const Plan plan = MakePlan(c.spec);
  const Layout layout = testing::RandomLayout(c.tokens, c.mix, c.spec.seed * 7 + 3, false);
  RunGpuHier(layout, plan, c.spec.seed, /*async=*/false);
}

std::vector<Case> Cases() {
  return {
      // Two groups of two, contiguous heads, GQA 2.
      {{{2, 2}, 4, 2, HeadSplit::kContiguous, false, 1}, 170, DocMix::kOneHuge},
      // Uneven groups and weights, round-robin heads: KV heads held by several members.
      {{{3, 1}, 6, 2, HeadSplit::kRoundRobin, true, 2}, 180, DocMix::kOneHuge},
      // One group: Ulysses (no sub-ring).
      {{{4}, 4, 4, HeadSplit::kContiguous, false, 3}, 160, DocMix::kOneHuge},
      // Groups of one: the sequence-aware ring through the hierarchical runtime.
      {{{1, 1, 1}, 2, 1, HeadSplit::kContiguous, false, 4}, 180, DocMix::kLongTail},
      // Random (uneven, maybe empty) head sets.
      {{{2, 3}, 6, 3, HeadSplit::kRandom, true, 5}, 200, DocMix::kSingle},
  };
}

INSTANTIATE_TEST_SUITE_P(Plans, GpuHierTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.spec.Name(); });

TEST(GpuHier, AsynchronousStreams) {
  const Plan plan = MakePlan({{2, 2}, 4, 2, HeadSplit::kRoundRobin, true, 11});
  const Layout layout = testing::RandomLayout(170, DocMix::kOneHuge, 111, false);
  RunGpuHier(layout, plan, 11, /*async=*/true);
}

// A batch under a plan on emulated devices, through Batch::CreateWithPlan (as
// hsapBatchCreateWithPlan does on CUDA communicators).
TEST(GpuHier, BatchUnderAPlan) {
  const Plan plan = MakePlan({{2, 1}, 4, 2, HeadSplit::kRoundRobin, true, 21});
  const Layout layout = testing::RandomLayout(150, DocMix::kOneHuge, 121, false);
  const int R = plan.num_ranks;
  const int64_t T = layout.num_tokens();
  auto comms = Communicator::CreateHostWorld(R, CommOptions{absl::Seconds(120), 1});
  ASSERT_TRUE(comms.ok()) << comms.status();
  auto kernels = std::make_shared<const EmulatedKernels<Cfg>>();
  BatchOptions options;
  options.dtype = DType::kF32;
  options.heads_q = plan.heads_q;
  options.heads_kv = plan.heads_kv;
  options.head_dim = kDim;
  testing::DistCase c;
  c.heads_q = plan.heads_q;
  c.heads_kv = plan.heads_kv;
  c.head_dim = kDim;
  testing::RowInputs in(c, T, 21);
  testing::RowOutputs o;
  o.out = HostTensor(DType::kF32, T, plan.heads_q, kDim);
  o.dq = HostTensor(DType::kF32, T, plan.heads_q, kDim);
  o.dk = HostTensor(DType::kF32, T, plan.heads_kv, kDim);
  o.dv = HostTensor(DType::kF32, T, plan.heads_kv, kDim);
  o.lse.assign(static_cast<size_t>(T) * plan.heads_q, 0.0f);
  testing::OnEveryRank(R, [&](int r) {
    auto gpu = GpuComm::Create(std::make_unique<EmulatedDevice>(), nullptr, absl::Seconds(120));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto batch =
        Batch::CreateWithPlan(*(*comms)[r], layout, plan, options, *NewGpuRunners(*gpu, kernels));
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_GT((*gpu)->pool_bytes(), 0u);
    const std::vector<TokenRange> shard = (*batch)->partition()->ranges(r);
    testing::ShardTensors t(in, o, shard, plan.heads_q);
    ASSERT_TRUE(
        (*batch)->Forward(t.q.data(), t.k.data(), t.v.data(), t.out.data(), t.lse.data()).ok());
    ASSERT_TRUE((*batch)
                    ->Backward(t.dout.data(), t.q.data(), t.k.data(), t.v.data(), t.out.data(),
                               t.lse.data(), t.dq.data(), t.dk.data(), t.dv.data())
                    .ok());
    EXPECT_EQ((*batch)->traffic().forward,
              PredictForwardTraffic(*(*batch)->hierarchy(), kDim, DType::kF32));
    t.Unslice(o);
  });
  const ReferenceInputs ri = in.Reference(*DimsFromOptions(options), DType::kF32);
  testing::ExpectMatchesReference(layout, ri, in.dout.bytes.data(), o, /*backward=*/true,
                                  testing::kCudaKernelFloor);
}

}  // namespace
}  // namespace hsap::cuda
