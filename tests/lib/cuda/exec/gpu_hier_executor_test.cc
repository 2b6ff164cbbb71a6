// The GPU hierarchical executor (lib/cuda/exec/gpu_hier_executor.h) on an emulated device (the
// CUDA kernels run by the CPU emulator, host memory as device memory, ranks over the host
// transport), against the fp64 reference under the project's rule, for plans with groups of
// several sizes, uneven and non-contiguous heads, GQA with KV heads held by several members
// (fp32 dK/dV sums), Ulysses and groups of one; plus the bytes (equal to the host runtime's
// prediction), NCCL semantics of the posted stages, no allocation inside a call, and the
// same on asynchronous emulated streams. On several nodes: the node fan-outs of
// hierarchy.h 5., bytes by link class equal to the host plan executor's and fewer
// inter-node bytes than direct delivery; one node is the direct hierarchy. Groups sharing a
// node: the node stores of hierarchy.h 6., bytes by link class equal to the rank's program
// (lib/sched/transfers.h).
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
#include "lib/exec/runner.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/transfers.h"
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
  std::vector<LinkTraffic> forward_links, backward_links;
  std::vector<P2pProgram> posted_forward, posted_backward;
  int fan_outs = 0;  // steps with a node fan-out, all ranks
  // Ranks whose owner sums of dK partials unpack in several rounds (one element received
  // from several members: exchange_program.h).
  int summing_rounds = 0;
};

// Runs `plan` on emulated devices. `nodes` (empty: one node): the node of every rank, by
// which the messages are classified; `fan_out`: the hierarchy is built with them (node
// fan-outs), else it delivers directly.
RunResult RunGpuHier(const Layout& layout, const Plan& plan, uint64_t seed, bool async,
                     const std::vector<int>& nodes = {}, bool fan_out = true) {
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
  res.forward_links.resize(R);
  res.backward_links.resize(R);
  std::vector<int> fan_outs(R, 0), summing_rounds(R, 0);

  absl::StatusOr<Hierarchy> h =
      Hierarchy::Create(layout, plan, fan_out ? nodes : std::vector<int>());
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
    summing_rounds[r] = (*program)->out_dk().program.unpack_rounds.size() > 1;
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
    ctx.node_of_rank = &nodes;
    for (const SubRingStep& st : rh->steps) {
      fan_outs[r] += !st.fan_out_send.empty() || !st.fan_out_recv.empty();
    }
    const int64_t allocations = device.allocations();
    absl::Status s = GpuHierarchicalForward(ctx, t.q.data(), t.k.data(), t.v.data(), t.out.data(),
                                            t.lse.data(), &res.forward[r], &res.forward_links[r]);
    res.posted_forward[r] = recorders[r]->TakeRecorded();
    if (s.ok()) s = device.Synchronize(stream, absl::InfiniteFuture(), "forward");
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
    ctx.call_id = 2;
    s = GpuHierarchicalBackward(ctx, t.dout.data(), t.q.data(), t.k.data(), t.v.data(),
                                t.out.data(), t.lse.data(), t.dq.data(), t.dk.data(), t.dv.data(),
                                &res.backward[r], &res.backward_links[r]);
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
    // The link classes split the same messages.
    for (auto [links, all] : {std::pair{res.forward_links[r], res.forward[r]},
                              std::pair{res.backward_links[r], res.backward[r]}}) {
      EXPECT_EQ(links.intra_node_sent + links.inter_node_sent, all.sent()) << "rank " << r;
      EXPECT_EQ(links.intra_node_received + links.inter_node_received, all.received())
          << "rank " << r;
    }
    res.fan_outs += fan_outs[r];
    res.summing_rounds += summing_rounds[r];
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
  auto comms = Communicator::CreateHostWorld(
      R, CommOptions{.timeout = absl::Seconds(120), .num_threads = 1, .rank_nodes = {}});
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

// A batch under `plan` through Batch::CreateWithPlan on a host world whose ranks sit on
// `nodes`, run by the GPU runners on emulated devices (`gpu`) or by the host's; checked
// against the fp64 reference. Returns each rank's bytes by link class (Batch::Links).
struct BatchRun {
  testing::RowOutputs outputs;
  std::vector<LinkTraffic> forward, backward;
};
BatchRun RunPlanBatch(const Layout& layout, const Plan& plan, const std::vector<int>& nodes,
                      uint64_t seed, bool gpu) {
  BatchRun res;
  const int R = plan.num_ranks;
  const int64_t T = layout.num_tokens();
  CommOptions comm_options;
  comm_options.timeout = absl::Seconds(120);
  comm_options.num_threads = 1;
  comm_options.rank_nodes = nodes;
  auto comms = Communicator::CreateHostWorld(R, comm_options);
  EXPECT_TRUE(comms.ok()) << comms.status();
  if (!comms.ok()) return res;
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
  testing::RowInputs in(c, T, seed);
  testing::RowOutputs& o = res.outputs;
  o.out = HostTensor(DType::kF32, T, plan.heads_q, kDim);
  o.dq = HostTensor(DType::kF32, T, plan.heads_q, kDim);
  o.dk = HostTensor(DType::kF32, T, plan.heads_kv, kDim);
  o.dv = HostTensor(DType::kF32, T, plan.heads_kv, kDim);
  o.lse.assign(static_cast<size_t>(T) * plan.heads_q, 0.0f);
  res.forward.resize(R);
  res.backward.resize(R);
  testing::OnEveryRank(R, [&](int r) {
    std::shared_ptr<GpuComm> device;
    std::unique_ptr<RunnerFactory> runners;
    if (gpu) {
      auto made = GpuComm::Create(std::make_unique<EmulatedDevice>(), nullptr, absl::Seconds(120));
      ASSERT_TRUE(made.ok()) << made.status();
      device = *made;
      runners = NewGpuRunners(device, kernels);
    } else {
      runners = HostRunners(HandWrittenKernels());
    }
    auto batch = Batch::CreateWithPlan(*(*comms)[r], layout, plan, options, *runners);
    ASSERT_TRUE(batch.ok()) << batch.status();
    const std::vector<TokenRange> shard = (*batch)->partition()->ranges(r);
    testing::ShardTensors t(in, o, shard, plan.heads_q);
    ASSERT_TRUE(
        (*batch)->Forward(t.q.data(), t.k.data(), t.v.data(), t.out.data(), t.lse.data()).ok());
    ASSERT_TRUE((*batch)
                    ->Backward(t.dout.data(), t.q.data(), t.k.data(), t.v.data(), t.out.data(),
                               t.lse.data(), t.dq.data(), t.dk.data(), t.dv.data())
                    .ok());
    absl::StatusOr<LinkTraffic> fwd = (*batch)->Links((*batch)->traffic().forward);
    absl::StatusOr<LinkTraffic> bwd = (*batch)->Links((*batch)->traffic().backward);
    ASSERT_TRUE(fwd.ok() && bwd.ok()) << fwd.status() << bwd.status();
    res.forward[r] = *fwd;
    res.backward[r] = *bwd;
    t.Unslice(o);
  });
  const ReferenceInputs ri = in.Reference(*DimsFromOptions(options), DType::kF32);
  testing::ExpectMatchesReference(layout, ri, in.dout.bytes.data(), o, /*backward=*/true,
                                  testing::kCudaKernelFloor);
  return res;
}

uint64_t InterNodeReceived(const std::vector<LinkTraffic>& links) {
  uint64_t n = 0;
  for (const LinkTraffic& l : links) n += l.inter_node_received;
  return n;
}

struct NodeCase {
  PlanSpec spec;
  std::vector<int> nodes;
  int64_t tokens;
  DocMix mix;
};

// Names the cases of a parameterised test by their place in its list.
std::string CaseName(const ::testing::TestParamInfo<size_t>& info) {
  return absl::StrCat("case", info.param);
}

std::vector<NodeCase> NodeFanOutCases() {
  return {
      // MQA, two groups of four: group 0 spans nodes 0 and 1, group 1 is node 2.
      {{{4, 4}, 4, 1, HeadSplit::kRoundRobin, false, 3},
       {0, 0, 1, 1, 2, 2, 2, 2},
       192,
       DocMix::kOneHuge},
      // Uneven groups, GQA, every group across nodes, non-contiguous node numbers.
      {{{3, 2, 3}, 6, 2, HeadSplit::kRoundRobin, true, 5},
       {7, 2, 7, 2, 2, 9, 9, 7},
       200,
       DocMix::kOneHuge},
  };
}

// Plans on several nodes with KV heads shared by several members of a node (GQA / MQA with
// more members than KV heads, groups spanning nodes): the GPU plan executor runs the node
// fan-outs of hierarchy.h 5. Results against the fp64 reference (RunGpuHier, RunPlanBatch),
// NCCL semantics of the posted stages, and the bytes by
// link class equal to the host plan executor's, with fewer inter-node bytes than direct.
// One test per case, so that each stays well inside a minute.
class GpuHierNodeFanOuts : public ::testing::TestWithParam<size_t> {};
TEST_P(GpuHierNodeFanOuts, CrossAsTheHostPlanExecutor) {
  const NodeCase c = NodeFanOutCases().at(GetParam());
  SCOPED_TRACE(::testing::Message()
               << c.spec.Name() << ", nodes " << ::testing::PrintToString(c.nodes));
  const Plan plan = MakePlan(c.spec);
  const Layout layout = testing::RandomLayout(c.tokens, c.mix, c.spec.seed * 7 + 3, false);
  const RunResult fan = RunGpuHier(layout, plan, c.spec.seed, /*async=*/false, c.nodes);
  EXPECT_GT(fan.fan_outs, 0) << "no node fan-out: the case tests nothing";
  // Owners add several members' partials of the same rows: in rounds, or CTAs of one launch
  // would add into the same elements at once (lost updates, seen under load in CI).
  EXPECT_GT(fan.summing_rounds, 0);
  const RunResult direct =
      RunGpuHier(layout, plan, c.spec.seed, /*async=*/false, c.nodes, /*fan_out=*/false);
  EXPECT_LT(InterNodeReceived(fan.forward_links), InterNodeReceived(direct.forward_links));
  EXPECT_LT(InterNodeReceived(fan.backward_links), InterNodeReceived(direct.backward_links));

  // Through Batch::CreateWithPlan: the GPU factory builds the hierarchy with the
  // communicator's nodes, and every rank moves the host plan executor's bytes per link.
  const BatchRun gpu = RunPlanBatch(layout, plan, c.nodes, c.spec.seed, /*gpu=*/true);
  const BatchRun host = RunPlanBatch(layout, plan, c.nodes, c.spec.seed, /*gpu=*/false);
  ASSERT_EQ(gpu.forward.size(), c.nodes.size());
  ASSERT_EQ(host.forward.size(), c.nodes.size());
  for (size_t r = 0; r < c.nodes.size(); ++r) {
    EXPECT_EQ(gpu.forward[r], host.forward[r]) << "forward links of rank " << r;
    EXPECT_EQ(gpu.backward[r], host.backward[r]) << "backward links of rank " << r;
    EXPECT_EQ(gpu.forward[r], fan.forward_links[r]) << "forward links of rank " << r;
    EXPECT_EQ(gpu.backward[r], fan.backward_links[r]) << "backward links of rank " << r;
  }
}
INSTANTIATE_TEST_SUITE_P(Cases, GpuHierNodeFanOuts,
                         ::testing::Range<size_t>(0, NodeFanOutCases().size()), CaseName);

// The chunk kernels' rule (one launch, disjoint destinations: exchange_program.h), which
// the emulator enforces so that a program breaking it fails every time, not under load.
TEST(GpuHier, EmulatorRefusesChunksThatMeetInTheDestination) {
  EmulatedDevice device;
  EmulatedKernels<Cfg> kernels(&device);
  const cudaStream stream = *device.CreateStream();
  std::vector<float> src(64, 1.0f), dst(64, 0.0f);
  std::vector<hsap_dev::CopyChunk> chunks = {{0, 0, 128}, {128, 64, 128}};
  const hsap_dev::ChunksParams p{src.data(), dst.data(), chunks.data(), 2};
  for (bool add : {true, false}) {
    const absl::Status s = add ? kernels.AddChunks(p, stream) : kernels.CopyChunks(p, stream);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find("two chunks meet in the destination at 64"), std::string::npos) << s;
  }
  EXPECT_EQ(dst, std::vector<float>(64, 0.0f));
  chunks[1].dst = 128;
  ASSERT_TRUE(kernels.AddChunks(p, stream).ok());
  ASSERT_TRUE(device.Synchronize(stream, absl::InfiniteFuture(), "add").ok());
  EXPECT_EQ(dst, std::vector<float>(64, 1.0f));
}

TEST(GpuHier, NodeFanOutsOnAsynchronousStreams) {
  const Plan plan = MakePlan({{4, 4}, 4, 1, HeadSplit::kRoundRobin, false, 13});
  const Layout layout = testing::RandomLayout(170, DocMix::kOneHuge, 131, false);
  const RunResult res =
      RunGpuHier(layout, plan, 13, /*async=*/true, std::vector<int>{0, 0, 1, 1, 2, 2, 2, 2});
  EXPECT_GT(res.fan_outs, 0);
}

// Runs rank `rank`'s pass of `program` with a pool one byte short of program.pool_bytes():
// refused with kInternal, naming the pool, before anything moves (no peer is needed).
template <typename Kernels>
void ExpectShortPoolRefused(EmulatedDevice& device, Kernels& kernels, cudaStream stream,
                            const DeviceHierProgram& program, int num_ranks, int rank,
                            bool backward) {
  DeviceBufferPool pool(device);
  ASSERT_TRUE(pool.Reserve(program.pool_bytes()).ok());
  auto transports = CreateHostTransports(num_ranks, absl::Seconds(5));
  ASSERT_TRUE(transports.ok());
  GpuHierContext ctx;
  ctx.device = &device;
  ctx.kernels = &kernels;
  ctx.transport = (*transports)[rank].get();
  ctx.program = &program;
  ctx.pool = pool.base();
  ctx.pool_bytes = program.pool_bytes() - 1;
  ctx.stream = stream;
  std::vector<char> none(1 << 16);
  char* x = none.data();
  const absl::Status s =
      backward ? GpuHierarchicalBackward(ctx, x, x, x, x, x, nullptr, x, x, x, nullptr)
               : GpuHierarchicalForward(ctx, x, x, x, x, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("pool holds"), std::string::npos) << s;
}

// The fan-out buffers are pool regions of a gateway's batch, and a pool short of the batch's
// size by a byte is refused before anything moves.
TEST(GpuHier, FanOutBuffersComeFromThePool) {
  const Plan plan = MakePlan({{4, 4}, 4, 1, HeadSplit::kRoundRobin, false, 3});
  const Layout layout = testing::RandomLayout(192, DocMix::kOneHuge, 24, false);
  const std::vector<int> nodes = {0, 0, 1, 1, 2, 2, 2, 2};
  absl::StatusOr<Hierarchy> fan = Hierarchy::Create(layout, plan, nodes);
  ASSERT_TRUE(fan.ok());
  AttentionDims dims{plan.heads_q, plan.heads_kv, kDim, 1.0f / std::sqrt(float{kDim}), {}};
  EmulatedDevice device(/*async=*/false);
  EmulatedKernels<Cfg> kernels(&device);
  const cudaStream stream = *device.CreateStream();
  int gateways = 0;
  for (int r = 0; r < plan.num_ranks; ++r) {
    absl::StatusOr<RankHierarchy> a = fan->BuildRank(layout, r);
    ASSERT_TRUE(a.ok());
    bool gateway = false;
    for (const SubRingStep& st : a->steps) gateway |= !st.fan_out_send.empty();
    if (!gateway) continue;
    ++gateways;
    auto with = DeviceHierProgram::Build(device, *a, dims, DType::kF32, stream);
    ASSERT_TRUE(with.ok()) << with.status();
    EXPECT_GT((*with)->sizes().fan_send, 0u) << "rank " << r;
    EXPECT_GT((*with)->sizes().fan_grad_recv, 0u) << "rank " << r;
    ExpectShortPoolRefused(device, kernels, stream, **with, plan.num_ranks, r,
                           /*backward=*/false);
  }
  EXPECT_GT(gateways, 0);
}

LinkTraffic AsLinkTraffic(const LinkBytes& b) {
  return {b.intra_sent, b.intra_received, b.inter_sent, b.inter_received};
}

// What the node stores of a hierarchy make its ranks do, all ranks together.
struct StoreUse {
  int store_sends = 0, store_fills = 0, store_forwards = 0;
  int forwards_without_receive = 0;  // fan-outs at steps that receive nothing
  int only_store_sends = 0;          // steps that only send store segments
};
StoreUse StoreUseOf(const Hierarchy& h, const Layout& layout, int ranks) {
  StoreUse u;
  for (int r = 0; r < ranks; ++r) {
    absl::StatusOr<RankHierarchy> rh = h.BuildRank(layout, r);
    EXPECT_TRUE(rh.ok()) << rh.status();
    if (!rh.ok()) continue;
    for (const SubRingStep& st : rh->steps) {
      u.store_sends += static_cast<int>(st.store_send.size());
      u.store_fills += static_cast<int>(st.store_fill.size());
      u.store_forwards += static_cast<int>(st.store_fan_send.size());
      u.forwards_without_receive += st.recv_group < 0 && !st.store_fan_send.empty();
      u.only_store_sends += st.recv_group < 0 && st.send_group < 0 && !st.store_send.empty();
    }
  }
  return u;
}

std::vector<NodeCase> NodeStoreCases() {
  return {
      // Groups of one: three ring positions per node receive the same rows of the others.
      {{{1, 1, 1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, false, 3},
       {0, 0, 0, 1, 1, 1},
       200,
       DocMix::kSingle},
      // Uneven groups over two nodes, GQA with round-robin heads, scrambled ranks.
      {{{2, 1, 2, 1}, 6, 2, HeadSplit::kRoundRobin, true, 5},
       {4, 4, 9, 9, 4, 9},
       200,
       DocMix::kOneHuge},
      // Three nodes of two: a keeper forwards at a step where it receives nothing, and a
      // holder has a step that only sends store segments.
      {{{1, 1, 1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, false, 3},
       {0, 0, 1, 1, 2, 2},
       200,
       DocMix::kLongTail},
  };
}

// Several groups with members on one node that receive the same rows (hierarchy.h 6.): the
// rows cross into the node once, into a keeper's store, which fills its own buffers and
// forwards them to the other groups' receivers at their steps; backward, the partials are
// summed in the store and returned once, in the last participant's gradient group. Results
// against the fp64 reference (RunGpuHier, RunPlanBatch), NCCL semantics of the posted
// stages, and every rank's bytes by link class equal to its program's (ProgramOf) and to
// the host plan executor's, on synchronous and asynchronous streams.
// One test per case, so that each stays well inside a minute.
class GpuHierNodeStores : public ::testing::TestWithParam<size_t> {};
TEST_P(GpuHierNodeStores, CrossIntoTheNodeOnce) {
  const NodeCase c = NodeStoreCases().at(GetParam());
  SCOPED_TRACE(::testing::Message()
               << c.spec.Name() << ", nodes " << ::testing::PrintToString(c.nodes));
  const Plan plan = MakePlan(c.spec);
  const Layout layout = testing::RandomLayout(c.tokens, c.mix, c.spec.seed * 7 + 3, false);
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan, c.nodes);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_FALSE(h->stores().empty()) << "no node store: the case tests nothing";
  const StoreUse u = StoreUseOf(*h, layout, plan.num_ranks);
  EXPECT_GT(u.store_sends, 0);
  EXPECT_GT(u.store_fills + u.store_forwards, 0);

  std::vector<RankProgram> programs;
  for (int r = 0; r < plan.num_ranks; ++r) {
    absl::StatusOr<RankHierarchy> rh = h->BuildRank(layout, r);
    ASSERT_TRUE(rh.ok()) << rh.status();
    programs.push_back(ProgramOf(*rh, kDim, DType::kF32, c.nodes));
  }
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "asynchronous streams" : "synchronous streams");
    const RunResult res = RunGpuHier(layout, plan, c.spec.seed, async, c.nodes);
    for (int r = 0; r < plan.num_ranks; ++r) {
      EXPECT_EQ(res.forward_links[r], AsLinkTraffic(programs[r].forward.Links()))
          << "forward links of rank " << r;
      EXPECT_EQ(res.backward_links[r], AsLinkTraffic(programs[r].backward.Links()))
          << "backward links of rank " << r;
    }
  }
  // Through Batch::CreateWithPlan: the GPU factory builds the stores from the
  // communicator's nodes.
  const BatchRun gpu = RunPlanBatch(layout, plan, c.nodes, c.spec.seed, /*gpu=*/true);
  const BatchRun host = RunPlanBatch(layout, plan, c.nodes, c.spec.seed, /*gpu=*/false);
  ASSERT_EQ(gpu.forward.size(), c.nodes.size());
  ASSERT_EQ(host.forward.size(), c.nodes.size());
  for (size_t r = 0; r < c.nodes.size(); ++r) {
    EXPECT_EQ(gpu.forward[r], AsLinkTraffic(programs[r].forward.Links()))
        << "forward links of rank " << r;
    EXPECT_EQ(gpu.backward[r], AsLinkTraffic(programs[r].backward.Links()))
        << "backward links of rank " << r;
    EXPECT_EQ(gpu.forward[r], host.forward[r]) << "forward links of rank " << r;
    EXPECT_EQ(gpu.backward[r], host.backward[r]) << "backward links of rank " << r;
  }
}
INSTANTIATE_TEST_SUITE_P(Cases, GpuHierNodeStores,
                         ::testing::Range<size_t>(0, NodeStoreCases().size()), CaseName);

// Between them the cases fill from stores, forward from them (also at steps that receive
// nothing) and have steps that only send store segments.
TEST(GpuHier, NodeStoreCasesUseEveryStoreRole) {
  StoreUse all;
  for (const NodeCase& c : NodeStoreCases()) {
    const Plan plan = MakePlan(c.spec);
    const Layout layout = testing::RandomLayout(c.tokens, c.mix, c.spec.seed * 7 + 3, false);
    absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan, c.nodes);
    ASSERT_TRUE(h.ok()) << h.status();
    const StoreUse u = StoreUseOf(*h, layout, plan.num_ranks);
    all.store_fills += u.store_fills;
    all.store_forwards += u.store_forwards;
    all.forwards_without_receive += u.forwards_without_receive;
    all.only_store_sends += u.only_store_sends;
  }
  EXPECT_GT(all.store_fills, 0);
  EXPECT_GT(all.store_forwards, 0);
  EXPECT_GT(all.forwards_without_receive, 0);
  EXPECT_GT(all.only_store_sends, 0);
}

// A keeper's store and its partials are pool regions of its batch, and a pool short of the
// batch's size by a byte is refused before anything moves.
TEST(GpuHier, NodeStoresComeFromThePool) {
  const Plan plan = MakePlan({{1, 1, 1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, false, 3});
  const Layout layout = testing::RandomLayout(200, DocMix::kSingle, 24, false);
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan, {0, 0, 0, 1, 1, 1});
  ASSERT_TRUE(h.ok());
  AttentionDims dims{plan.heads_q, plan.heads_kv, kDim, 1.0f / std::sqrt(float{kDim}), {}};
  EmulatedDevice device(/*async=*/false);
  EmulatedKernels<Cfg> kernels(&device);
  const cudaStream stream = *device.CreateStream();
  int keepers = 0;
  for (int r = 0; r < plan.num_ranks; ++r) {
    absl::StatusOr<RankHierarchy> a = h->BuildRank(layout, r);
    ASSERT_TRUE(a.ok());
    if (a->store_rows == 0) continue;
    ++keepers;
    auto with = DeviceHierProgram::Build(device, *a, dims, DType::kF32, stream);
    ASSERT_TRUE(with.ok()) << with.status();
    EXPECT_EQ((*with)->sizes().store_kv, 2 * a->store_rows * kDim * sizeof(float)) << "rank " << r;
    EXPECT_EQ((*with)->sizes().store_grad, 2 * a->store_rows * kDim * sizeof(float))
        << "rank " << r;
    ExpectShortPoolRefused(device, kernels, stream, **with, plan.num_ranks, r,
                           /*backward=*/true);
  }
  EXPECT_GT(keepers, 0);
}

// Every rank on one node: the direct hierarchy, the same bytes and forward results as
// without nodes, all of them intra-node (the GPU's dK/dV are not bitwise reproducible).
TEST(GpuHier, OneNodeIsTheDirectHierarchy) {
  const Plan plan = MakePlan({{3, 2, 3}, 6, 2, HeadSplit::kRoundRobin, true, 5});
  const Layout layout = testing::RandomLayout(200, DocMix::kOneHuge, 38, false);
  const RunResult one = RunGpuHier(layout, plan, 5, /*async=*/false, std::vector<int>(8, 4));
  const RunResult none = RunGpuHier(layout, plan, 5, /*async=*/false);
  EXPECT_EQ(one.fan_outs, 0);
  EXPECT_EQ(InterNodeReceived(one.forward_links) + InterNodeReceived(one.backward_links), 0u);
  EXPECT_EQ(one.forward, none.forward);
  EXPECT_EQ(one.backward, none.backward);
  EXPECT_EQ(one.forward_links, none.forward_links);
  EXPECT_EQ(one.backward_links, none.backward_links);
  EXPECT_EQ(one.outputs.out.bytes, none.outputs.out.bytes);
}

}  // namespace
}  // namespace hsap::cuda
