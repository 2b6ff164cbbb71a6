// Batches on loopback ranks through the real CUDA-facing code -- the loopback transport
// (lib/cuda/transport/loopback_transport.h), CudaDevice (lib/cuda/runtime/device.h), the peer
// windows and the GPU runners (lib/cuda/exec/gpu_batch.h) -- on the emulated CUDA runtime
// (tests/support/emulated_cuda_runtime.h), which refuses what the driver refuses. The
// kernels of jit/device run on the CPU (tests/support/emulated_device.h) as launches on the
// runtime's streams. What the H200 ran as CudaGpu.LoopbackBatchesMatchTheReference, without a
// GPU: batch creation (its host AllGathers), forward with stages or fused through the peer
// windows, backward, against the fp64 reference; then nothing is left on the device.
// clang-format off
#include "tests/support/emulated_device.h"
// clang-format on

#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/comm/communicator.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/cuda/runtime/device.h"
#include "lib/cuda/transport/loopback_transport.h"
#include "lib/exec/batch.h"
#include "lib/sched/schedule.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/emulated_cuda_runtime.h"
#include "tests/support/fake_cudnn_runner.h"
#include "tests/support/random_layouts.h"
#include "tests/support/scoped_env.h"
#include "tests/support/tolerance.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::DocMix;
using ::hsap::testing::EmulatedCudaRuntime;
using ::hsap::testing::EmulatedKernels;
using ::hsap::testing::HostTensor;

constexpr int kHeadsQ = 4, kHeadsKv = 2, kDim = 32;

// The emulated kernels as launches of a module loaded on the device current at construction
// (as LoadJitDeviceKernels loads into the current device's context): each runs when its
// stream reaches it, and a launch on a stream of another device fails as on the driver. The
// buffers a kernel is handed must be memory a GPU kernel can dereference -- device memory of
// that device or pinned host memory; pageable host memory faults on a GPU ("an illegal
// memory access was encountered"), here the launch fails.
template <class Cfg>
class RuntimeKernels : public DeviceKernels {
 public:
  explicit RuntimeKernels(EmulatedCudaRuntime& emu) : emu_(emu) {
    emu.runtime().GetDevice(&device_);
  }

  absl::Status Forward(const hsap_dev::FwdParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(
        Reachable("forward", {p.q, p.k, p.v, p.out, p.lse, p.blocks, p.segments, p.kv_head_of_q}));
    return Launch(s, [this, p, s] { (void)inner_.Forward(p, s); });
  }
  absl::Status Backward(const hsap_dev::BwdParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("backward", {p.q, p.k, p.v, p.dout, p.lse, p.delta, p.dq, p.dk,
                                                p.dv, p.blocks, p.segments, p.kv_head_of_q}));
    return Launch(s, [this, p, s] { (void)inner_.Backward(p, s); });
  }
  absl::Status Delta(const hsap_dev::DeltaParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("delta", {p.dout, p.out, p.delta}));
    return Launch(s, [this, p, s] { (void)inner_.Delta(p, s); });
  }
  absl::Status Init(const hsap_dev::InitParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("init", {p.out, p.lse}));
    return Launch(s, [this, p, s] { (void)inner_.Init(p, s); });
  }
  absl::Status Convert(const hsap_dev::ConvertParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("convert", {p.src, p.dst}));
    return Launch(s, [this, p, s] { (void)inner_.Convert(p, s); });
  }
  absl::Status Accumulate(const hsap_dev::AccumulateParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("accumulate", {p.dst, p.src}));
    return Launch(s, [this, p, s] { (void)inner_.Accumulate(p, s); });
  }
  absl::Status CopyChunks(const hsap_dev::ChunksParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("copy chunks", {p.src, p.dst, p.chunks}));
    return Launch(s, [this, p, s] { (void)inner_.CopyChunks(p, s); });
  }
  absl::Status AddChunks(const hsap_dev::ChunksParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("add chunks", {p.src, p.dst, p.chunks}));
    return Launch(s, [this, p, s] { (void)inner_.AddChunks(p, s); });
  }
  absl::Status MergeEntries(const hsap_dev::EntryMergeParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("merge entries", {p.out, p.lse, p.o, p.stats, p.entries}));
    return Launch(s, [this, p, s] { (void)inner_.MergeEntries(p, s); });
  }
  absl::Status GatherStats(const hsap_dev::StatsGatherParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("gather stats", {p.lse, p.stats, p.entries}));
    return Launch(s, [this, p, s] { (void)inner_.GatherStats(p, s); });
  }
  absl::Status AddEntries(const hsap_dev::EntryAddParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(Reachable("add entries", {p.dst, p.src, p.entries}));
    return Launch(s, [this, p, s] { (void)inner_.AddEntries(p, s); });
  }
  int max_fused_steps() const override { return inner_.max_fused_steps(); }
  int fused_copy_ctas() const override { return inner_.fused_copy_ctas(); }
  int fused_resident_ctas() const override { return inner_.fused_resident_ctas(); }
  absl::Status FusedForward(const FusedForwardLaunch& launch, cudaStream s) const override {
    for (const hsap_dev::FusedStep& step : launch.steps) {
      HSAP_RETURN_IF_ERROR(Reachable(
          "fused forward", {step.k_src, step.v_src, step.ready_flag, step.consumed_flag}));
    }
    return Launch(s, [this, launch, s] { (void)inner_.FusedForward(launch, s); });
  }
  // The first error a kernel reported ("" when none).
  std::string error() const { return inner_.error(); }

 private:
  // Every non-null pointer is device memory of this device or pinned host memory (a pointer
  // just past an allocation's end stands for an empty range).
  absl::Status Reachable(const char* what, std::initializer_list<const void*> pointers) const {
    int i = 0;
    for (const void* p : pointers) {
      ++i;
      if (p == nullptr) continue;
      EmulatedCudaRuntime::Pointer at = emu_.Query(p);
      if (at.memory == EmulatedCudaRuntime::Memory::kPageable) {
        at = emu_.Query(static_cast<const char*>(p) - 1);
      }
      const bool ok = at.memory == EmulatedCudaRuntime::Memory::kPinnedHost ||
                      (at.memory == EmulatedCudaRuntime::Memory::kDevice && at.device == device_);
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, " kernel: pointer argument ", i, " (", absl::Hex(reinterpret_cast<uintptr_t>(p)),
            ") is not memory of device ", device_, " (an illegal address on a GPU)"));
      }
    }
    return absl::OkStatus();
  }
  absl::Status Launch(cudaStream s, std::function<void()> kernel) const {
    return emu_.runtime().Check(emu_.Launch(device_, s, std::move(kernel)), "kernel launch");
  }

  EmulatedCudaRuntime& emu_;
  int device_ = 0;
  EmulatedKernels<Cfg> inner_;  // runs each kernel at once: on the stream's worker here
};

// A rank's tensor in device memory of the emulated runtime.
class OnDevice {
 public:
  template <typename T>
  OnDevice(const CudaRuntimeApi& rt, const std::vector<T>& host)
      : rt_(rt), bytes_(host.size() * sizeof(T)) {
    EXPECT_EQ(rt.Malloc(&p_, bytes_), 0);
    EXPECT_EQ(rt.Memcpy(p_, host.data(), bytes_, kCudaMemcpyHostToDevice), 0);
    // cudaMemcpy from pageable memory returns before the DMA is done; the batch's streams
    // are non-blocking.
    EXPECT_EQ(rt.StreamSynchronize(nullptr), 0);
  }
  ~OnDevice() { rt_.Free(p_); }
  template <typename T>
  void Download(std::vector<T>& host) const {
    EXPECT_EQ(rt_.Memcpy(host.data(), p_, bytes_, kCudaMemcpyDeviceToHost), 0);
  }
  void* get() const { return p_; }
  float* f() const { return static_cast<float*>(p_); }

 private:
  const CudaRuntimeApi& rt_;
  size_t bytes_;
  void* p_ = nullptr;
};

std::vector<TokenRange> ShardOf(const Schedule& s) {
  std::vector<TokenRange> shard;
  for (const TokenRun& r : s.local_runs)
    shard.push_back({r.global_begin, r.global_begin + r.length});
  return shard;
}

// The engine choice made at creation (NewGpuRunners' default setup: cuDNN not looked for):
// every piece of every step on the JIT kernels, its pairs those of the schedule's steps.
void ExpectEveryPairOnTheJitKernels(const BatchRunner* runner, const Schedule& schedule) {
  const BatchEngines* engines = EnginesOf(runner);
  ASSERT_NE(engines, nullptr);
  int64_t pairs = schedule.local_work.visible_pairs;
  for (const Stage& stage : schedule.stages) pairs += stage.recv_work.visible_pairs;
  const EngineTally& tally = engines->tally();
  EXPECT_EQ(engines->num_steps(), schedule.stages.size() + 1);
  EXPECT_EQ(tally.pieces[static_cast<int>(AttentionEngine::kCudnn)], 0);
  EXPECT_EQ(tally.pairs[static_cast<int>(AttentionEngine::kJit)], pairs);
  EXPECT_THAT(tally.ToString(), ::testing::HasSubstr("cuDNN was not looked for"));
}

struct RankSetup {
  int devices = 1;        // emulated GPUs
  int device = 0;         // the communicators'
  int caller_device = 0;  // current on the threads that drive the ranks
  // Each communicator gets a non-blocking stream of the caller's (hsapCommConfig_t::
  // cudaStream): calls return once enqueued, and the results are read after that stream.
  bool caller_streams = false;
};

// R loopback ranks as `setup` says: two batches (the second needs larger peer windows), each
// forward twice and backward once, against the reference.
template <class Cfg>
void RunLoopbackBatches(int R, bool fused, RankSetup setup = RankSetup()) {
  // Several loopback ranks on one GPU use peer windows only when asked for.
  testing::ScopedEnv fused_env("HSAP_FUSED_FORWARD", fused ? "1" : nullptr);
  const int device = setup.device, caller_device = setup.caller_device;
  EmulatedCudaRuntime::Options options;
  options.devices = setup.devices;
  options.watchdog = absl::Seconds(60);
  EmulatedCudaRuntime emu(options);
  const CudaRuntimeApi& rt = emu.runtime();
  const absl::Duration timeout = absl::Seconds(60);
  ASSERT_EQ(rt.SetDevice(device), 0);
  {
    auto transports = CreateLoopbackTransports(rt, R, timeout);
    ASSERT_TRUE(transports.ok()) << transports.status();
    std::vector<std::unique_ptr<Communicator>> comms;
    std::vector<std::shared_ptr<GpuComm>> gpus;
    std::vector<cudaStream> streams(R, nullptr);
    for (int r = 0; r < R; ++r) {
      comms.push_back(std::make_unique<Communicator>(std::move((*transports)[r]), timeout, 1));
      absl::StatusOr<std::unique_ptr<Device>> d = CreateCudaDevice(rt, emu.driver());
      ASSERT_TRUE(d.ok()) << d.status();
      if (setup.caller_streams) {
        ASSERT_EQ(rt.StreamCreateWithFlags(&streams[r], kCudaStreamNonBlocking), 0);
      }
      auto gpu = GpuComm::Create(*std::move(d), streams[r], timeout);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      gpus.push_back(*std::move(gpu));
    }
    auto kernels = std::make_shared<const RuntimeKernels<Cfg>>(emu);
    const bool expect_fused = fused && Cfg::kMaxSteps > 0;
    for (auto [tokens, seed] : {std::pair{64, 61}, {100, 62}}) {
      SCOPED_TRACE(::testing::Message() << tokens << " tokens");
      const Layout layout = testing::RandomLayout(tokens, DocMix::kLongTail, seed, false);
      BatchOptions opts;
      opts.dtype = DType::kF32;
      opts.heads_q = kHeadsQ;
      opts.heads_kv = kHeadsKv;
      opts.head_dim = kDim;
      testing::DistCase c;
      c.dtype = DType::kF32;
      c.heads_q = kHeadsQ;
      c.heads_kv = kHeadsKv;
      c.head_dim = kDim;
      testing::RowInputs in(c, layout.num_tokens(), seed);
      testing::RowOutputs got;
      got.out = HostTensor(DType::kF32, layout.num_tokens(), kHeadsQ, kDim);
      got.dq = HostTensor(DType::kF32, layout.num_tokens(), kHeadsQ, kDim);
      got.dk = HostTensor(DType::kF32, layout.num_tokens(), kHeadsKv, kDim);
      got.dv = HostTensor(DType::kF32, layout.num_tokens(), kHeadsKv, kDim);
      got.lse.assign(layout.num_tokens() * kHeadsQ, 0.0f);
      testing::OnEveryRank(R, [&](int r) {
        ASSERT_EQ(rt.SetDevice(caller_device), 0);
        std::unique_ptr<RunnerFactory> runners = NewGpuRunners(gpus[r], kernels);
        auto batch = Batch::Create(*comms[r], layout, {}, opts, *runners);
        ASSERT_TRUE(batch.ok()) << "rank " << r << ": " << batch.status();
        EXPECT_EQ(UsesFusedForward((*batch)->runner()), expect_fused) << "rank " << r;
        ExpectEveryPairOnTheJitKernels((*batch)->runner(), *(*batch)->schedule());
        testing::ShardTensors t(in, got, ShardOf(*(*batch)->schedule()), kHeadsQ);
        // The tensors live on the communicator's GPU (the kernels there cannot read another
        // GPU's memory); the calls come from the caller's device.
        ASSERT_EQ(rt.SetDevice(device), 0);
        OnDevice q(rt, t.q), k(rt, t.k), v(rt, t.v), dout(rt, t.dout), out(rt, t.out),
            lse(rt, t.lse), dq(rt, t.dq), dk(rt, t.dk), dv(rt, t.dv);
        ASSERT_EQ(rt.SetDevice(caller_device), 0);
        for (int call = 0; call < 2; ++call) {
          absl::Status f = (*batch)->Forward(q.get(), k.get(), v.get(), out.get(), lse.f());
          ASSERT_TRUE(f.ok()) << "rank " << r << ": " << f;
        }
        absl::Status b = (*batch)->Backward(dout.get(), q.get(), k.get(), v.get(), out.get(),
                                            lse.f(), dq.get(), dk.get(), dv.get());
        ASSERT_TRUE(b.ok()) << "rank " << r << ": " << b;
        if (streams[r] != nullptr) {
          ASSERT_EQ(rt.StreamSynchronize(streams[r]), 0);
        }
        out.Download(t.out);
        lse.Download(t.lse);
        dq.Download(t.dq);
        dk.Download(t.dk);
        dv.Download(t.dv);
        t.Unslice(got);
        int current = -1;
        rt.GetDevice(&current);
        EXPECT_EQ(current, caller_device) << "rank " << r << ": the thread's device changed";
      });
      EXPECT_EQ(kernels->error(), "");
      const ReferenceInputs ri = in.Reference(*DimsFromOptions(opts), DType::kF32);
      testing::ExpectMatchesReference(layout, ri, in.dout.bytes.data(), got, /*backward=*/true,
                                      testing::kCudaKernelFloor);
    }
    gpus.clear();
    for (cudaStream s : streams) {
      if (s != nullptr) {
        EXPECT_EQ(rt.StreamDestroy(s), 0);
      }
    }
  }
  // Batches, communicators and transports gone: nothing left on the device.
  EXPECT_EQ(emu.live_allocations(), 0u);
  EXPECT_EQ(emu.live_streams(), 0);
  EXPECT_EQ(emu.live_events(), 0);
  EXPECT_THAT(emu.TakeFailures(), ::testing::IsEmpty());
}

TEST(EmulatedLoopbackBatch, StagesMatchTheReference) {
  RunLoopbackBatches<testing::SmallTileCfg<float, 2, true>>(3, /*fused=*/false);
}

// Without $HSAP_FUSED_FORWARD, several ranks on one GPU move forward's K/V in transfer
// stages, also with kernels that have the fused forward (loopback_transport.h says why).
TEST(EmulatedLoopbackBatch, SeveralRanksOnOneGpuUseStagesByDefault) {
  RunLoopbackBatches<testing::SmallTileCfg<float, 2, true, 2>>(3, /*fused=*/false);
}

TEST(EmulatedLoopbackBatch, FusedForwardThroughPeerWindowsMatchesTheReference) {
  RunLoopbackBatches<testing::SmallTileCfg<float, 2, true, 2>>(3, /*fused=*/true);
}

// The communicator on GPU 1 of two, its ranks driven from threads bound to GPU 0.
TEST(EmulatedLoopbackBatch, RanksOnAnotherGpuThanTheCallers) {
  RankSetup setup;
  setup.devices = 2;
  setup.device = 1;
  setup.caller_device = 0;
  RunLoopbackBatches<testing::SmallTileCfg<float, 2, true, 2>>(2, /*fused=*/true, setup);
}

// Communicators with a caller's stream: forward and backward return once enqueued, and the
// transfers meet that stream through events only.
TEST(EmulatedLoopbackBatch, CallersStreamsWithStages) {
  RankSetup setup;
  setup.caller_streams = true;
  RunLoopbackBatches<testing::SmallTileCfg<float, 2, true>>(3, /*fused=*/false, setup);
}

TEST(EmulatedLoopbackBatch, CallersStreamsWithTheFusedForward) {
  RankSetup setup;
  setup.caller_streams = true;
  RunLoopbackBatches<testing::SmallTileCfg<float, 2, true, 2>>(3, /*fused=*/true, setup);
}

// $HSAP_ATTENTION_ENGINE=cudnn where cuDNN cannot run the batch (here: fp32; and the emulated
// runtime has no cuDNN piece runner): creation fails on every rank, saying why, nothing is left.
TEST(EmulatedLoopbackBatch, ForcedCudnnIsRefusedAtCreation) {
  constexpr int R = 2;
  EmulatedCudaRuntime emu;
  const CudaRuntimeApi& rt = emu.runtime();
  const absl::Duration timeout = absl::Seconds(60);
  ASSERT_EQ(rt.SetDevice(0), 0);
  {
    auto transports = CreateLoopbackTransports(rt, R, timeout);
    ASSERT_TRUE(transports.ok()) << transports.status();
    std::vector<std::unique_ptr<Communicator>> comms;
    std::vector<std::shared_ptr<GpuComm>> gpus;
    for (int r = 0; r < R; ++r) {
      comms.push_back(std::make_unique<Communicator>(std::move((*transports)[r]), timeout, 1));
      absl::StatusOr<std::unique_ptr<Device>> d = CreateCudaDevice(rt, emu.driver());
      ASSERT_TRUE(d.ok()) << d.status();
      auto gpu = GpuComm::Create(*std::move(d), nullptr, timeout);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      gpus.push_back(*std::move(gpu));
    }
    auto kernels =
        std::make_shared<const RuntimeKernels<testing::SmallTileCfg<float, 2, true>>>(emu);
    const Layout layout = testing::RandomLayout(64, DocMix::kLongTail, 71, false);
    BatchOptions opts;
    opts.dtype = DType::kF32;
    opts.heads_q = kHeadsQ;
    opts.heads_kv = kHeadsKv;
    opts.head_dim = kDim;
    EngineSetup forced;
    forced.mode = EngineMode::kCudnn;
    forced.cudnn = {absl::OkStatus(), 91900, 90};
    testing::OnEveryRank(R, [&](int r) {
      std::unique_ptr<RunnerFactory> runners = NewGpuRunners(gpus[r], kernels, forced);
      auto batch = Batch::Create(*comms[r], layout, {}, opts, *runners);
      ASSERT_FALSE(batch.ok()) << "rank " << r;
      EXPECT_THAT(batch.status().message(), ::testing::HasSubstr("HSAP_ATTENTION_ENGINE=cudnn"));
      EXPECT_THAT(batch.status().message(), ::testing::HasSubstr("not fp32"));
    });
    gpus.clear();
  }
  EXPECT_EQ(emu.live_allocations(), 0u);
  EXPECT_THAT(emu.TakeFailures(), ::testing::IsEmpty());
}

// The cuDNN engine on loopback ranks (lib/cuda/exec/cudnn_steps.h): every piece to a host fake
// of cuDNN (tests/support/fake_cudnn_runner.h) launched on the rank's stream like a kernel, its
// results merged and added by the helper kernels on the same stream, bf16 with GQA, a window
// document and a causal one split over the ranks; against the reference, the fake handed
// exactly the tally's calls and pairs, nothing left on the device.
TEST(EmulatedLoopbackBatch, CudnnEngineWithAHostFake) {
  using Cfg = testing::SmallTileCfg<hsap_dev::bf16, 2, true>;
  constexpr int R = 3;
  EmulatedCudaRuntime::Options options;
  options.watchdog = absl::Seconds(60);
  EmulatedCudaRuntime emu(options);
  const CudaRuntimeApi& rt = emu.runtime();
  const absl::Duration timeout = absl::Seconds(60);
  ASSERT_EQ(rt.SetDevice(0), 0);
  const Layout layout =
      *Layout::FromDocuments({0, 70, 120}, {MaskKind::kSlidingWindow, MaskKind::kCausal}, {19, 0});
  const int64_t T = layout.num_tokens();
  BatchOptions opts;
  opts.dtype = DType::kBF16;
  opts.heads_q = kHeadsQ;
  opts.heads_kv = kHeadsKv;
  opts.head_dim = kDim;
  testing::DistCase c;
  c.dtype = DType::kBF16;
  c.heads_q = kHeadsQ;
  c.heads_kv = kHeadsKv;
  c.head_dim = kDim;
  testing::RowInputs in(c, T, 81);
  testing::RowOutputs got;
  got.out = HostTensor(DType::kBF16, T, kHeadsQ, kDim);
  got.dq = HostTensor(DType::kBF16, T, kHeadsQ, kDim);
  got.dk = HostTensor(DType::kBF16, T, kHeadsKv, kDim);
  got.dv = HostTensor(DType::kBF16, T, kHeadsKv, kDim);
  got.lse.assign(static_cast<size_t>(T) * kHeadsQ, 0.0f);
  {
    auto transports = CreateLoopbackTransports(rt, R, timeout);
    ASSERT_TRUE(transports.ok()) << transports.status();
    std::vector<std::unique_ptr<Communicator>> comms;
    std::vector<std::shared_ptr<GpuComm>> gpus;
    for (int r = 0; r < R; ++r) {
      comms.push_back(std::make_unique<Communicator>(std::move((*transports)[r]), timeout, 1));
      absl::StatusOr<std::unique_ptr<Device>> d = CreateCudaDevice(rt, emu.driver());
      ASSERT_TRUE(d.ok()) << d.status();
      auto gpu = GpuComm::Create(*std::move(d), nullptr, timeout);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      gpus.push_back(*std::move(gpu));
    }
    auto kernels = std::make_shared<const RuntimeKernels<Cfg>>(emu);
    testing::OnEveryRank(R, [&](int r) {
      ASSERT_EQ(rt.SetDevice(0), 0);
      auto fake = std::make_shared<testing::FakeCudnnRunner>(
          [&emu](cudaStream s, std::function<void()> op) {
            return emu.runtime().Check(emu.Launch(0, s, std::move(op)), "fake cuDNN launch");
          });
      EngineSetup setup;
      setup.mode = EngineMode::kCudnn;
      setup.cudnn = {absl::OkStatus(), 91900, 90};
      setup.runner = fake;
      std::unique_ptr<RunnerFactory> runners = NewGpuRunners(gpus[r], kernels, setup);
      auto batch = Batch::Create(*comms[r], layout, {}, opts, *runners);
      ASSERT_TRUE(batch.ok()) << "rank " << r << ": " << batch.status();
      EXPECT_FALSE(UsesFusedForward((*batch)->runner()));
      const EngineTally tally = EnginesOf((*batch)->runner())->tally();
      EXPECT_GT(tally.pieces[static_cast<int>(AttentionEngine::kCudnn)], 0) << "rank " << r;
      testing::ShardTensors t(in, got, ShardOf(*(*batch)->schedule()), kHeadsQ);
      OnDevice q(rt, t.q), k(rt, t.k), v(rt, t.v), dout(rt, t.dout), out(rt, t.out), lse(rt, t.lse),
          dq(rt, t.dq), dk(rt, t.dk), dv(rt, t.dv);
      absl::Status f = (*batch)->Forward(q.get(), k.get(), v.get(), out.get(), lse.f());
      ASSERT_TRUE(f.ok()) << "rank " << r << ": " << f;
      absl::Status b = (*batch)->Backward(dout.get(), q.get(), k.get(), v.get(), out.get(), lse.f(),
                                          dq.get(), dk.get(), dv.get());
      ASSERT_TRUE(b.ok()) << "rank " << r << ": " << b;
      const int64_t cudnn_pairs = tally.pairs[static_cast<int>(AttentionEngine::kCudnn)];
      EXPECT_EQ(fake->forward_calls(), tally.cudnn_calls) << "rank " << r;
      EXPECT_EQ(fake->backward_calls(), tally.cudnn_calls) << "rank " << r;
      EXPECT_EQ(fake->forward_pairs(), cudnn_pairs) << "rank " << r;
      EXPECT_EQ(fake->backward_pairs(), cudnn_pairs) << "rank " << r;
      EXPECT_EQ(fake->error(), "") << "rank " << r;
      out.Download(t.out);
      lse.Download(t.lse);
      dq.Download(t.dq);
      dk.Download(t.dk);
      dv.Download(t.dv);
      t.Unslice(got);
    });
    EXPECT_EQ(kernels->error(), "");
    const ReferenceInputs ri = in.Reference(*DimsFromOptions(opts), DType::kBF16);
    testing::ExpectMatchesReference(layout, ri, in.dout.bytes.data(), got, /*backward=*/true,
                                    testing::kCudaKernelFloor);
    gpus.clear();
  }
  EXPECT_EQ(emu.live_allocations(), 0u);
  EXPECT_EQ(emu.live_streams(), 0);
  EXPECT_EQ(emu.live_events(), 0);
  EXPECT_THAT(emu.TakeFailures(), ::testing::IsEmpty());
}

// Streams per call (Batch::Forward / Backward's `stream`, hsapAttentionForwardOnStream): on
// each rank, forward on stream A, forward on stream B, backward on A, then a forward on the
// communicator's own stream. The inputs are written on A by a late "kernel" (it sleeps
// first), so a call that did not wait for its stream's earlier work reads garbage; after
// each call a "kernel" on the call's stream copies its results to the host, so a stream that
// did not wait for the call's work copies them before they exist. Calls 1 and 3 run on other
// streams than the call before them, which still holds the communicator's pool.
template <class Cfg>
void RunPerCallStreams(int R, bool fused, bool comm_streams) {
  testing::ScopedEnv fused_env("HSAP_FUSED_FORWARD", fused ? "1" : nullptr);
  EmulatedCudaRuntime::Options options;
  options.watchdog = absl::Seconds(60);
  EmulatedCudaRuntime emu(options);
  const CudaRuntimeApi& rt = emu.runtime();
  const absl::Duration timeout = absl::Seconds(60);
  ASSERT_EQ(rt.SetDevice(0), 0);
  const Layout layout = testing::RandomLayout(80, DocMix::kLongTail, 71, false);
  BatchOptions opts;
  opts.dtype = DType::kF32;
  opts.heads_q = kHeadsQ;
  opts.heads_kv = kHeadsKv;
  opts.head_dim = kDim;
  testing::DistCase c;
  c.dtype = DType::kF32;
  c.heads_q = kHeadsQ;
  c.heads_kv = kHeadsKv;
  c.head_dim = kDim;
  testing::RowInputs in(c, layout.num_tokens(), 71);
  // Call 0's outputs with call 2's gradients; call 1's and call 3's outputs.
  std::vector<testing::RowOutputs> got(3);
  for (testing::RowOutputs& g : got) {
    g.out = HostTensor(DType::kF32, layout.num_tokens(), kHeadsQ, kDim);
    g.dq = HostTensor(DType::kF32, layout.num_tokens(), kHeadsQ, kDim);
    g.dk = HostTensor(DType::kF32, layout.num_tokens(), kHeadsKv, kDim);
    g.dv = HostTensor(DType::kF32, layout.num_tokens(), kHeadsKv, kDim);
    g.lse.assign(layout.num_tokens() * kHeadsQ, 0.0f);
  }
  {
    auto transports = CreateLoopbackTransports(rt, R, timeout);
    ASSERT_TRUE(transports.ok()) << transports.status();
    std::vector<std::unique_ptr<Communicator>> comms;
    std::vector<std::shared_ptr<GpuComm>> gpus;
    std::vector<cudaStream> own(R, nullptr);
    for (int r = 0; r < R; ++r) {
      comms.push_back(std::make_unique<Communicator>(std::move((*transports)[r]), timeout, 1));
      absl::StatusOr<std::unique_ptr<Device>> d = CreateCudaDevice(rt, emu.driver());
      ASSERT_TRUE(d.ok()) << d.status();
      if (comm_streams) {
        ASSERT_EQ(rt.StreamCreateWithFlags(&own[r], kCudaStreamNonBlocking), 0);
      }
      auto gpu = GpuComm::Create(*std::move(d), own[r], timeout);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      gpus.push_back(*std::move(gpu));
    }
    auto kernels = std::make_shared<const RuntimeKernels<Cfg>>(emu);
    testing::OnEveryRank(R, [&](int r) {
      std::unique_ptr<RunnerFactory> runners = NewGpuRunners(gpus[r], kernels);
      auto batch = Batch::Create(*comms[r], layout, {}, opts, *runners);
      ASSERT_TRUE(batch.ok()) << "rank " << r << ": " << batch.status();
      Batch& b = **batch;
      std::vector<testing::ShardTensors> t;
      for (const testing::RowOutputs& g : got) {
        t.emplace_back(in, g, ShardOf(*b.schedule()), kHeadsQ);
      }
      // Device buffers of NaN until the late kernel writes the inputs.
      auto nan_like = [](const auto& v) {
        return std::vector<uint8_t>(v.size() * sizeof(v[0]), 0xff);
      };
      OnDevice q(rt, nan_like(t[0].q)), k(rt, nan_like(t[0].k)), v(rt, nan_like(t[0].v)),
          dout(rt, nan_like(t[0].dout)), dq(rt, nan_like(t[0].dq)), dk(rt, nan_like(t[0].dk)),
          dv(rt, nan_like(t[0].dv));
      std::vector<std::unique_ptr<OnDevice>> out, lse;
      for (int i = 0; i < 3; ++i) {
        out.push_back(std::make_unique<OnDevice>(rt, nan_like(t[i].out)));
        lse.push_back(std::make_unique<OnDevice>(rt, nan_like(t[i].lse)));
      }
      cudaStream a = nullptr, bs = nullptr;
      ASSERT_EQ(rt.StreamCreateWithFlags(&a, kCudaStreamNonBlocking), 0);
      ASSERT_EQ(rt.StreamCreateWithFlags(&bs, kCudaStreamNonBlocking), 0);
      auto on = [&](cudaStream s, std::function<void()> kernel) {
        ASSERT_EQ(emu.Launch(0, s, std::move(kernel)), 0);
      };
      auto put = [](const OnDevice& d, const auto& v) {
        std::memcpy(d.get(), v.data(), v.size() * sizeof(v[0]));
      };
      auto take = [](auto& v, const OnDevice& d) {
        std::memcpy(v.data(), d.get(), v.size() * sizeof(v[0]));
      };
      on(a, [&] {
        absl::SleepFor(absl::Milliseconds(30));
        put(q, t[0].q);
        put(k, t[0].k);
        put(v, t[0].v);
        put(dout, t[0].dout);
      });
      absl::Status s =
          b.Forward(q.get(), k.get(), v.get(), out[0]->get(), lse[0]->f(), absl::OkStatus(), a);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
      on(a, [&] { take(t[0].out, *out[0]), take(t[0].lse, *lse[0]); });
      s = b.Forward(q.get(), k.get(), v.get(), out[1]->get(), lse[1]->f(), absl::OkStatus(), bs);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
      on(bs, [&] { take(t[1].out, *out[1]), take(t[1].lse, *lse[1]); });
      s = b.Backward(dout.get(), q.get(), k.get(), v.get(), out[0]->get(), lse[0]->f(), dq.get(),
                     dk.get(), dv.get(), absl::OkStatus(), a);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
      on(a, [&] { take(t[0].dq, dq), take(t[0].dk, dk), take(t[0].dv, dv); });
      // The communicator's own stream after calls on callers' streams.
      s = b.Forward(q.get(), k.get(), v.get(), out[2]->get(), lse[2]->f());
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
      if (own[r] != nullptr) {
        ASSERT_EQ(rt.StreamSynchronize(own[r]), 0);
      }
      for (cudaStream st : {a, bs}) {
        ASSERT_EQ(rt.StreamSynchronize(st), 0);
        ASSERT_EQ(rt.StreamDestroy(st), 0);
      }
      out[2]->Download(t[2].out);
      lse[2]->Download(t[2].lse);
      for (int i = 0; i < 3; ++i) t[i].Unslice(got[i]);
    });
    EXPECT_EQ(kernels->error(), "");
    gpus.clear();
    for (cudaStream s : own) {
      if (s != nullptr) {
        EXPECT_EQ(rt.StreamDestroy(s), 0);
      }
    }
  }
  const ReferenceInputs ri = in.Reference(*DimsFromOptions(opts), DType::kF32);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(::testing::Message() << "call " << (i == 0 ? 0 : i == 1 ? 1 : 3));
    testing::ExpectMatchesReference(layout, ri, in.dout.bytes.data(), got[i],
                                    /*backward=*/i == 0, testing::kCudaKernelFloor);
  }
  EXPECT_EQ(emu.live_allocations(), 0u);
  EXPECT_EQ(emu.live_streams(), 0);
  EXPECT_EQ(emu.live_events(), 0);
  EXPECT_THAT(emu.TakeFailures(), ::testing::IsEmpty());
}

TEST(EmulatedLoopbackBatch, StreamsPerCallWithStages) {
  RunPerCallStreams<testing::SmallTileCfg<float, 2, true>>(3, /*fused=*/false,
                                                           /*comm_streams=*/false);
}

// The fused forward's windows and flags, on communicators with callers' streams of their own.
TEST(EmulatedLoopbackBatch, StreamsPerCallWithTheFusedForward) {
  RunPerCallStreams<testing::SmallTileCfg<float, 2, true, 2>>(2, /*fused=*/true,
                                                              /*comm_streams=*/true);
}

// A call's stream of another GPU is refused on its rank (GpuComm::CheckStream, the check of
// hsapAttentionForwardOnStream), and its peers fail the call too; the next call works.
TEST(EmulatedLoopbackBatch, AStreamOfAnotherGpuIsRefusedOnEveryRank) {
  EmulatedCudaRuntime::Options options;
  options.devices = 2;
  options.watchdog = absl::Seconds(60);
  EmulatedCudaRuntime emu(options);
  const CudaRuntimeApi& rt = emu.runtime();
  const absl::Duration timeout = absl::Seconds(60);
  constexpr int R = 2;
  ASSERT_EQ(rt.SetDevice(0), 0);
  const Layout layout = testing::RandomLayout(40, DocMix::kLongTail, 73, false);
  BatchOptions opts;
  opts.dtype = DType::kF32;
  opts.heads_q = kHeadsQ;
  opts.heads_kv = kHeadsKv;
  opts.head_dim = kDim;
  {
    auto transports = CreateLoopbackTransports(rt, R, timeout);
    ASSERT_TRUE(transports.ok()) << transports.status();
    std::vector<std::unique_ptr<Communicator>> comms;
    std::vector<std::shared_ptr<GpuComm>> gpus;
    for (int r = 0; r < R; ++r) {
      comms.push_back(std::make_unique<Communicator>(std::move((*transports)[r]), timeout, 1));
      absl::StatusOr<std::unique_ptr<Device>> d = CreateCudaDevice(rt, emu.driver());
      ASSERT_TRUE(d.ok()) << d.status();
      auto gpu = GpuComm::Create(*std::move(d), nullptr, timeout);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      gpus.push_back(*std::move(gpu));
    }
    auto kernels =
        std::make_shared<const RuntimeKernels<testing::SmallTileCfg<float, 2, true>>>(emu);
    testing::OnEveryRank(R, [&](int r) {
      ASSERT_EQ(rt.SetDevice(0), 0);
      std::unique_ptr<RunnerFactory> runners = NewGpuRunners(gpus[r], kernels);
      auto batch = Batch::Create(*comms[r], layout, {}, opts, *runners);
      ASSERT_TRUE(batch.ok()) << "rank " << r << ": " << batch.status();
      Batch& b = **batch;
      const size_t n = b.local_tokens();
      OnDevice q(rt, std::vector<float>(n * kHeadsQ * kDim, 0.5f)),
          k(rt, std::vector<float>(n * kHeadsKv * kDim, 0.25f)),
          v(rt, std::vector<float>(n * kHeadsKv * kDim, 1.0f)),
          out(rt, std::vector<float>(n * kHeadsQ * kDim)),
          lse(rt, std::vector<float>(n * kHeadsQ + 1));
      cudaStream stream = nullptr;
      ASSERT_EQ(rt.SetDevice(r == 0 ? 1 : 0), 0);  // rank 0's stream is one of GPU 1
      ASSERT_EQ(rt.StreamCreateWithFlags(&stream, kCudaStreamNonBlocking), 0);
      ASSERT_EQ(rt.SetDevice(0), 0);
      const absl::Status check = gpus[r]->CheckStream(stream, "cudaStream");
      EXPECT_EQ(check.ok(), r != 0) << check;
      if (r == 0) {
        EXPECT_EQ(check.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(check.message(),
                    ::testing::HasSubstr("cudaStream is not a stream of its device"));
      }
      absl::Status s = check.ok()
                           ? b.Forward(q.get(), k.get(), v.get(), out.get(), lse.f(), check, stream)
                           : b.Forward(nullptr, nullptr, nullptr, nullptr, nullptr, check);
      EXPECT_FALSE(s.ok()) << "rank " << r;
      if (r != 0) {
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
        EXPECT_THAT(s.message(), ::testing::HasSubstr("rank 0 rejected its arguments"));
      }
      // The batch still works: every rank on a stream of the right GPU.
      cudaStream good = nullptr;
      ASSERT_EQ(rt.StreamCreateWithFlags(&good, kCudaStreamNonBlocking), 0);
      s = b.Forward(q.get(), k.get(), v.get(), out.get(), lse.f(), absl::OkStatus(), good);
      EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
      EXPECT_EQ(rt.StreamSynchronize(good), 0);
      std::vector<float> o(n * kHeadsQ * kDim, 0.0f);
      out.Download(o);
      for (float x : o) ASSERT_FLOAT_EQ(x, 1.0f) << "rank " << r;  // the mean of V's 1.0
      EXPECT_EQ(rt.StreamDestroy(good), 0);
      EXPECT_EQ(rt.StreamDestroy(stream), 0);
    });
    gpus.clear();
  }
  EXPECT_EQ(emu.live_allocations(), 0u);
  EXPECT_EQ(emu.live_streams(), 0);
  EXPECT_EQ(emu.live_events(), 0);
  EXPECT_THAT(emu.TakeFailures(), ::testing::IsEmpty());
}

// A caller's stream (hsapCommConfig_t::cudaStream) must be a stream of the communicator's
// GPU: kernels launch only there. Refused at creation rather than at every call.
TEST(EmulatedGpuComm, ACallersStreamOfAnotherGpuIsRefused) {
  EmulatedCudaRuntime::Options options;
  options.devices = 2;
  EmulatedCudaRuntime emu(options);
  const CudaRuntimeApi& rt = emu.runtime();
  cudaStream on_1 = nullptr, on_0 = nullptr;
  ASSERT_EQ(rt.SetDevice(1), 0);
  ASSERT_EQ(rt.StreamCreateWithFlags(&on_1, kCudaStreamNonBlocking), 0);
  ASSERT_EQ(rt.SetDevice(0), 0);
  ASSERT_EQ(rt.StreamCreateWithFlags(&on_0, kCudaStreamNonBlocking), 0);
  absl::StatusOr<std::unique_ptr<Device>> d = CreateCudaDevice(rt, emu.driver());
  ASSERT_TRUE(d.ok());
  absl::StatusOr<std::shared_ptr<GpuComm>> wrong =
      GpuComm::Create(*std::move(d), on_1, absl::Seconds(10));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), ::testing::HasSubstr("not a stream of its device"));
  d = CreateCudaDevice(rt, emu.driver());
  ASSERT_TRUE(d.ok());
  absl::StatusOr<std::shared_ptr<GpuComm>> right =
      GpuComm::Create(*std::move(d), on_0, absl::Seconds(10));
  EXPECT_TRUE(right.ok()) << right.status();
  EXPECT_EQ((*right)->stream(), on_0);
  right->reset();
  EXPECT_EQ(rt.StreamDestroy(on_0), 0);
  EXPECT_EQ(rt.StreamDestroy(on_1), 0);
  EXPECT_EQ(emu.live_events(), 0);
}

}  // namespace
}  // namespace hsap::cuda
