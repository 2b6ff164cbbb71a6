// A CPU stand-in for a CUDA device, for testing the GPU executor without a GPU.
//
// EmulatedDevice: "device memory" is host memory (256-byte aligned, every allocation
// tracked); it counts allocations, so tests can check that forward and backward allocate
// nothing. Streams come in two kinds:
//   - synchronous (the default): every operation runs at once on the calling thread, so
//     events are complete as soon as they are recorded;
//   - asynchronous: each stream is a worker thread running its operations in order, events
//     mark a point of a stream, StreamWaitEvent makes a stream wait for one, Free waits for
//     every stream (as cudaFree does). With EmulatedDeviceTransport (a transport whose
//     stages run on a stream of their own, like NCCL's communication stream), a missing
//     event or host wait in the executor becomes a race that reads stale data.
//
// EmulatedKernels<Cfg>: the kernels of jit/device/hsap_attention.cuh for the configuration
// Cfg, run by the emulator of tests/jit/cuda_emulator.h (one std::thread per CUDA thread).
// Each launch gets an error word of its own; a kernel that reports a broken contract makes
// the launch fail with Internal.
//
// Include this header before anything that includes jit/device headers' host side (it
// must see the emulator first).
#ifndef HSAP_TESTS_SUPPORT_EMULATED_DEVICE_H_
#define HSAP_TESTS_SUPPORT_EMULATED_DEVICE_H_

// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_attention.cuh"
// clang-format on

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "lib/comm/transport.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::testing {

// An in-order queue of operations run by a thread of its own.
class EmuStream {
 public:
  EmuStream() : worker_([this] { Run(); }) {}
  ~EmuStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  // Enqueues `op`; returns its sequence number (1, 2, ...).
  uint64_t Enqueue(std::function<void()> op) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
    cv_.notify_all();
    return ++enqueued_;
  }
  uint64_t enqueued() const {
    std::lock_guard<std::mutex> lock(mu_);
    return enqueued_;
  }
  // Blocks until operation `seq` has run, or false at `deadline`.
  bool WaitFor(uint64_t seq, absl::Time deadline) const {
    std::unique_lock<std::mutex> lock(mu_);
    while (completed_ < seq) {
      if (absl::Now() > deadline) return false;
      cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
    return true;
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      std::function<void()> op = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      op();
      lock.lock();
      ++completed_;
      cv_.notify_all();
    }
  }

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: starts after the members above exist
};

class EmulatedDevice : public cuda::Device {
 public:
  explicit EmulatedDevice(bool async = false) : async_(async) {}
  ~EmulatedDevice() override {
    streams_.clear();  // joins the workers first
    for (void* p : live_) std::free(p);
  }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr) return absl::ResourceExhaustedError("emulated device out of memory");
    std::memset(p, 0xA5, bytes);  // garbage, as fresh device memory may hold
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(p);
    ++allocations_;
    return p;
  }
  void Free(void* p) override {
    if (p == nullptr) return;
    Drain();
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.erase(p) == 0) {
      ADD_FAILURE() << "Free of a pointer this device did not allocate";
      return;
    }
    std::free(p);
  }
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, cuda::cudaStream s) override {
    if (s == nullptr) return absl::InternalError("copy on a null stream");
    if (bytes > 0) Enqueue(s, [=] { std::memmove(dst, src, bytes); });
    return absl::OkStatus();
  }
  absl::Status ZeroAsync(void* dst, size_t bytes, cuda::cudaStream s) override {
    if (s == nullptr) return absl::InternalError("memset on a null stream");
    if (bytes > 0) Enqueue(s, [=] { std::memset(dst, 0, bytes); });
    return absl::OkStatus();
  }
  absl::StatusOr<cuda::cudaStream> CreateStream() override {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.push_back(async_ ? std::make_unique<EmuStream>() : nullptr);
    // Synchronous streams only need distinct non-null handles.
    return async_ ? reinterpret_cast<cuda::cudaStream>(streams_.back().get())
                  : reinterpret_cast<cuda::cudaStream>(uintptr_t{0x1000} + 16 * streams_.size());
  }
  void DestroyStream(cuda::cudaStream) override {}
  absl::StatusOr<cuda::cudaEvent> CreateEvent() override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::make_unique<Event>());
    ++events_alive_;
    return reinterpret_cast<cuda::cudaEvent>(events_.back().get());
  }
  void DestroyEvent(cuda::cudaEvent) override {
    std::lock_guard<std::mutex> lock(mu_);
    --events_alive_;
  }
  absl::Status RecordEvent(cuda::cudaEvent e, cuda::cudaStream s) override {
    if (async_) {
      auto* ev = reinterpret_cast<Event*>(e);
      ev->stream = reinterpret_cast<EmuStream*>(s);
      ev->seq = ev->stream->enqueued();
    }
    return absl::OkStatus();
  }
  absl::Status StreamWaitEvent(cuda::cudaStream waiter, cuda::cudaEvent e) override {
    if (!async_) return absl::OkStatus();
    const Event ev = *reinterpret_cast<Event*>(e);  // the record at the time of the call
    if (ev.stream == nullptr) return absl::OkStatus();
    Enqueue(waiter, [ev] { ev.stream->WaitFor(ev.seq, absl::InfiniteFuture()); });
    return absl::OkStatus();
  }
  absl::Status Synchronize(cuda::cudaStream s, absl::Time deadline,
                           absl::string_view what) override {
    if (!async_) return absl::OkStatus();
    auto* stream = reinterpret_cast<EmuStream*>(s);
    if (!stream->WaitFor(stream->enqueued(), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": emulated stream timed out"));
    }
    return absl::OkStatus();
  }

  absl::Status WriteValueAsync(uint32_t* flag, uint32_t value, cuda::cudaStream s) override {
    if (drop_flag_writes_) return absl::OkStatus();
    Enqueue(s, [=] { hsap_emu_store_release(flag, value); });
    return absl::OkStatus();
  }
  // Fault injection: flag writes are lost (a rank whose peers never see it publish).
  void set_drop_flag_writes(bool drop) { drop_flag_writes_ = drop; }
  // Waits up to a minute: a synchronous device returns DeadlineExceeded, an asynchronous
  // one fails the test (its stream carries on).
  absl::Status WaitValueAsync(const uint32_t* flag, uint32_t value, cuda::cudaStream s) override {
    auto reached = [flag, value] {
      const absl::Time deadline = absl::Now() + absl::Minutes(1);
      while (static_cast<int32_t>(hsap_emu_load_acquire(flag) - value) < 0) {
        if (absl::Now() > deadline) return false;
        std::this_thread::yield();
      }
      return true;
    };
    if (!async_) {
      if (!reached()) return absl::DeadlineExceededError("emulated stream wait on a flag");
      return absl::OkStatus();
    }
    Enqueue(s, [reached] {
      if (!reached()) ADD_FAILURE() << "emulated stream wait on a flag timed out";
    });
    return absl::OkStatus();
  }

  // Where the device says it is. Unset: Location() is Unimplemented, as for a device
  // without one (peer windows then reach only the ranks of this process).
  void set_location(const std::string& host, uint64_t process, const std::string& device) {
    cuda::DeviceLocation at;
    std::snprintf(at.host.data(), at.host.size(), "%s", host.c_str());
    at.process = process;
    std::snprintf(at.device.data(), at.device.size(), "%s", device.c_str());
    location_ = at;
  }
  absl::StatusOr<cuda::DeviceLocation> Location() override {
    if (!location_.has_value()) return absl::UnimplementedError("no location");
    return *location_;
  }
  // "IPC" between ranks that claim different processes: the handle carries the pointer
  // (they are all in this process, really); opening needs the owner on the same host.
  absl::StatusOr<cuda::IpcHandle> ExportMemory(void* p) override {
    if (!location_.has_value()) return absl::UnimplementedError("no location");
    cuda::IpcHandle h{};
    std::memcpy(h.data(), &p, sizeof(p));
    return h;
  }
  absl::StatusOr<void*> OpenPeerMemory(const cuda::IpcHandle& h,
                                       const cuda::DeviceLocation& owner) override {
    if (!location_.has_value() || std::strcmp(owner.host.data(), location_->host.data()) != 0) {
      return absl::FailedPreconditionError("emulated peer memory on another host");
    }
    void* p = nullptr;
    std::memcpy(&p, h.data(), sizeof(p));
    std::lock_guard<std::mutex> lock(mu_);
    ++opened_;
    return p;
  }
  void ClosePeerMemory(void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (p != nullptr) ++closed_;
  }
  int64_t peer_memory_opened() const {
    std::lock_guard<std::mutex> lock(mu_);
    return opened_;
  }
  int64_t peer_memory_closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }

  // Runs `op` on stream `s` (at once for a synchronous device).
  void Enqueue(cuda::cudaStream s, std::function<void()> op) {
    if (async_) {
      reinterpret_cast<EmuStream*>(s)->Enqueue(std::move(op));
    } else {
      op();
    }
  }
  bool async() const { return async_; }
  // Waits until every stream has run what was enqueued so far.
  void Drain() {
    std::vector<EmuStream*> streams;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& s : streams_) {
        if (s != nullptr) streams.push_back(s.get());
      }
    }
    for (EmuStream* s : streams) s->WaitFor(s->enqueued(), absl::InfiniteFuture());
  }

  int64_t allocations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return allocations_;
  }
  size_t live_allocations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }
  int64_t events_alive() const {
    std::lock_guard<std::mutex> lock(mu_);
    return events_alive_;
  }

 private:
  struct Event {
    EmuStream* stream = nullptr;
    uint64_t seq = 0;
  };
  const bool async_;
  std::optional<cuda::DeviceLocation> location_;
  bool drop_flag_writes_ = false;
  mutable std::mutex mu_;
  int64_t opened_ = 0, closed_ = 0;
  std::set<void*> live_;
  int64_t allocations_ = 0;
  std::vector<std::unique_ptr<EmuStream>> streams_;
  std::vector<std::unique_ptr<Event>> events_;
  int64_t events_alive_ = 0;
};

// A transport whose stages run on a stream of an asynchronous EmulatedDevice, like NCCL
// groups on a communication stream: Start() enqueues the stage (the inner transport's
// Start and Wait, in the stream's order), Pending::Wait() waits on the host for it.
class EmulatedDeviceTransport : public Transport {
 public:
  // share_memory: claim that the ranks can read each other's memory (they can: it is the
  // host's), so that batches use the fused forward (peer_window.h).
  EmulatedDeviceTransport(std::unique_ptr<Transport> inner, EmulatedDevice& device,
                          bool share_memory = false)
      : inner_(std::move(inner)),
        device_(device),
        stream_(*device.CreateStream()),
        share_memory_(share_memory) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp> sends,
                                                 absl::Span<const RecvOp> recvs,
                                                 std::string stage) override {
    auto state = std::make_shared<State>();
    std::vector<SendOp> s(sends.begin(), sends.end());
    std::vector<RecvOp> r(recvs.begin(), recvs.end());
    Transport* inner = inner_.get();
    device_.Enqueue(stream_, [state, s, r, stage, inner] {
      absl::StatusOr<std::unique_ptr<Pending>> p = inner->Start(s, r, stage);
      state->status = p.ok() ? (*p)->Wait() : p.status();
      state->done.Notify();
    });
    return std::unique_ptr<Pending>(new StagePending(state));
  }
  void Abort(absl::string_view reason) override { inner_->Abort(reason); }
  bool aborted() const override { return inner_->aborted(); }
  TrafficCounters counters() const override { return inner_->counters(); }
  void ResetCounters() override { inner_->ResetCounters(); }
  void* transfer_stream() const override { return stream_; }
  bool offers_peer_windows() const override { return share_memory_; }

 private:
  struct State {
    absl::Notification done;
    absl::Status status;
  };
  class StagePending : public Pending {
   public:
    explicit StagePending(std::shared_ptr<State> s) : state_(std::move(s)) {}
    ~StagePending() override { state_->done.WaitForNotification(); }
    absl::Status Wait() override {
      state_->done.WaitForNotification();
      return state_->status;
    }

   private:
    std::shared_ptr<State> state_;
  };
  std::unique_ptr<Transport> inner_;
  EmulatedDevice& device_;
  cuda::cudaStream stream_;
  bool share_memory_;
};

// A kernel configuration as jit/codegen_cuda emits it, with small tiles so that short rows
// still span several tiles, chunks and segments; head dim 32; kSteps > 0: with the fused
// forward of kSteps steps per launch.
template <typename StorageT, int kG, bool kBand, int kSteps = 0>
struct SmallTileCfg {
  using T = StorageT;
  static constexpr int kHeadDim = 32;
  static constexpr int kGqa = kG;
  static constexpr int kBlockM = 32, kBlockN = 16, kThreads = 64;
  static constexpr int kBwdBlockM = 16, kBwdBlockN = 16, kBwdThreads = 32;
  static constexpr bool kHasBand = kBand;
  static constexpr int kNumPeers = kSteps > 0 ? kSteps - 1 : 0;
  static constexpr int kMaxSteps = kSteps;
  static constexpr int kFwdSmemBytes = 4 * ((32 + 2 * 16) * 33 + 32 * 17);
  static constexpr int kBwdSmemBytes = 4 * ((2 * 16 + 2 * 16) * 33 + 2 * 16 * 17);
};

template <class Cfg>
class EmulatedKernels : public cuda::DeviceKernels {
 public:
  // Launches run on `device`'s streams (at once when null or synchronous).
  explicit EmulatedKernels(EmulatedDevice* device = nullptr) : device_(device) {}

  absl::Status Forward(const hsap_dev::FwdParams& p, cuda::cudaStream s) const override {
    return Attention("forward", p, p.num_blocks, p.heads_q, Cfg::kThreads, Cfg::kFwdSmemBytes, s,
                     [](const hsap_dev::FwdParams& q) { hsap_dev::attn_fwd_kernel<Cfg>(q); });
  }
  absl::Status Backward(const hsap_dev::BwdParams& p, cuda::cudaStream s) const override {
    return Attention("backward", p, p.num_blocks, p.heads_q, Cfg::kBwdThreads, Cfg::kBwdSmemBytes,
                     s, [](const hsap_dev::BwdParams& q) { hsap_dev::attn_bwd_kernel<Cfg>(q); });
  }
  absl::Status Delta(const hsap_dev::DeltaParams& p, cuda::cudaStream s) const override {
    return Helper(s, [p] { hsap_dev::attn_delta_kernel<Cfg>(p); });
  }
  absl::Status Init(const hsap_dev::InitParams& p, cuda::cudaStream s) const override {
    return Helper(s, [p] { hsap_dev::init_partial_kernel<Cfg>(p); });
  }
  absl::Status Convert(const hsap_dev::ConvertParams& p, cuda::cudaStream s) const override {
    return Helper(s, [p] { hsap_dev::convert_out_kernel<Cfg>(p); });
  }
  absl::Status Accumulate(const hsap_dev::AccumulateParams& p, cuda::cudaStream s) const override {
    return Helper(s, [p] { hsap_dev::accumulate_kernel<Cfg>(p); });
  }
  absl::Status CopyChunks(const hsap_dev::ChunksParams& p, cuda::cudaStream s) const override {
    return Helper(s, [p] { hsap_dev::copy_chunks_kernel<Cfg>(p); });
  }
  absl::Status AddChunks(const hsap_dev::ChunksParams& p, cuda::cudaStream s) const override {
    return Helper(s, [p] { hsap_dev::add_chunks_kernel<Cfg>(p); });
  }
  // The fused forward (Cfg::kMaxSteps > 0): one copy CTA and up to two compute CTAs, all
  // running at once as on a GPU.
  int max_fused_steps() const override { return Cfg::kMaxSteps; }
  int fused_copy_ctas() const override { return 1; }
  absl::Status FusedForward(const cuda::FusedForwardLaunch& launch,
                            cuda::cudaStream s) const override {
    if constexpr (Cfg::kMaxSteps == 0) {
      return absl::UnimplementedError("configuration without the fused forward");
    } else {
      const int steps = static_cast<int>(launch.steps.size());
      if (steps > Cfg::kMaxSteps) return absl::InternalError("too many fused steps");
      if (steps == 0) return absl::OkStatus();
      hsap_dev::FusedFwdParamsT<Cfg::kMaxSteps> p{};
      p.head = launch.head;
      p.head.num_steps = steps;
      p.head.num_copy_ctas = 1;
      long long work = 1;
      for (int i = 0; i < steps; ++i) {
        p.steps[i] = launch.steps[i];
        work = std::max<long long>(work, 1LL * launch.steps[i].num_blocks * launch.head.heads_q);
      }
      const unsigned grid = 1 + static_cast<unsigned>(std::min<long long>(work, 2));
      Run(s, [this, p, grid]() mutable {
        unsigned int error = 0;
        unsigned int* caller_flag = p.head.error_flag;
        p.head.error_flag = &error;
        hsap_emu::Launch(grid, 1, Cfg::kThreads, Cfg::kFwdSmemBytes, /*all_concurrent=*/true,
                         [&] { hsap_dev::fused_fwd_kernel<Cfg>(p); });
        // The caller's word sees the bits too (the executor reads it back).
        if (error != 0 && caller_flag != nullptr) {
          std::atomic_ref<unsigned int>(*caller_flag).fetch_or(error);
        }
        if (error != 0) {
          std::lock_guard<std::mutex> lock(mu_);
          if (error_.empty()) error_ = absl::StrCat("fused forward reported error bits ", error);
        }
      });
      return absl::OkStatus();
    }
  }
  int64_t launches() const { return launches_.load(); }
  // The first contract violation a kernel reported ("" when none).
  std::string error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  void Run(cuda::cudaStream s, std::function<void()> op) const {
    launches_.fetch_add(1);
    if (device_ != nullptr) {
      device_->Enqueue(s, std::move(op));
    } else {
      op();
    }
  }
  // Attention kernels: grid (num_blocks, heads_q), with an error word of the launch's own.
  template <typename Params, typename Fn>
  absl::Status Attention(const char* what, Params p, int grid_x, int grid_y, int threads, int smem,
                         cuda::cudaStream s, Fn kernel) const {
    if (grid_x == 0 || grid_y == 0) return absl::OkStatus();
    Run(s, [this, what, p, grid_x, grid_y, threads, smem, kernel]() mutable {
      unsigned int error = 0;
      p.error_flag = &error;
      hsap_emu::Launch(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y), threads,
                       static_cast<size_t>(smem), /*all_concurrent=*/false, [&] { kernel(p); });
      if (error != 0) {
        std::lock_guard<std::mutex> lock(mu_);
        if (error_.empty()) error_ = absl::StrCat(what, " kernel reported error bits ", error);
      }
    });
    return absl::OkStatus();
  }
  // Row-wise helpers: two CTAs of 256 threads (their loops are grid-stride).
  template <typename Fn>
  absl::Status Helper(cuda::cudaStream s, Fn kernel) const {
    Run(s, [kernel] { hsap_emu::Launch(2, 1, 256, 0, /*all_concurrent=*/false, kernel); });
    return absl::OkStatus();
  }

  EmulatedDevice* device_;
  mutable std::atomic<int64_t> launches_{0};
  mutable std::mutex mu_;
  mutable std::string error_;
};

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_EMULATED_DEVICE_H_
