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

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

// $HSAP_ATTENTION_ENGINE=cudnn where cuDNN cannot run the batch (here: fp32; and this version
// has no cuDNN piece runner): creation fails on every rank, saying why, and nothing is left.
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
