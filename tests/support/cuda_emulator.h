// A small CUDA emulator for tests: compiles the device headers of jit/device as host C++
// (HSAP_DEVICE_EMULATION) and runs a kernel with one std::thread per CTA, whose CUDA threads
// are fibers of that thread (emulator_fibers.h: a barrier is a few context switches, not a
// round of futex wake-ups), so that the kernels' arithmetic, indexing, barriers, warp
// shuffles and flag protocols can be checked on a machine without a GPU. Spin waits
// (__nanosleep) let the CTA's other threads run; CTAs, launches and streams run concurrently.
//
// What is emulated: threadIdx/blockIdx/blockDim/gridDim, __syncthreads (a barrier of the
// CTA), named barriers (bar.sync / bar.arrive with an id and a thread count), __syncwarp and
// __shfl_xor_sync (a barrier of the warp and an exchange slot per lane), the tensor-core
// instructions mma.sync / ldmatrix / cp.async (emulated_ptx.h), the sm_90a warpgroup instructions
// wgmma / setmaxnreg (emulated_wgmma.h: a barrier per warpgroup), mbarrier and the TMA bulk tensor
// copies (emulated_tma.h), dynamic shared memory (one buffer per CTA, 1024-byte aligned), atomics
// (std::atomic_ref), the acquire/release flag helpers of hsap_sync.cuh (std::atomic_ref with the
// same orders). A thread that leaves the kernel drops out of its barriers, like an exited CUDA
// thread. Faults: a 16-byte vector (uint4) load or store at an address that is not 16-byte aligned
// stops the launch as the GPU's "misaligned address" error does: the faulting thread leaves,
// the others leave at their next barrier or spin, no further CTA starts, and Launch returns
// the error (the process carries on). Threads of a CTA that wait at barriers that cannot
// complete (some threads at __syncthreads, others at __syncwarp or exited early from a
// collective) stop the launch with "deadlock in CTA", where a GPU would hang.
// Residency (optional, per device: Residency below): a device keeps at most `limit` CTAs
// resident, whatever launch or stream they come from. A CTA takes a slot before it starts and
// frees it when it exits; the CTAs of a launch start in blockIdx order as slots free up, and
// launches from different threads (streams) compete for them. So CTAs that wait for CTAs of
// another launch, or of their own, that cannot become resident deadlock here as on a GPU;
// a watchdog catches that: when no CTA of the device exits or completes a __syncthreads for
// `watchdog` while some CTA waits for a slot, every launch on the device is stopped (as a
// fault) with "deadlock: N CTAs resident and waiting, M CTAs of <kernel> not resident;
// residency limit L", and later launches on it fail at once (a sticky error, so that a test
// fails fast).
// What is not: performance, the weak memory model of the GPU beyond what the C++ model
// gives, PTX-specific rounding (conversions use attention/dtype.h, which rounds the same).
#ifndef HSAP_TESTS_SUPPORT_CUDA_EMULATOR_H_
#define HSAP_TESTS_SUPPORT_CUDA_EMULATOR_H_

#define HSAP_DEVICE_EMULATION 1

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention/dtype.h"

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

struct EmuDim3 {
  unsigned int x = 1, y = 1, z = 1;
};
inline thread_local EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

namespace hsap_emu {

// A launch's fault: the first one is kept, and its flag stops every thread of the launch.
struct LaunchState {
  std::atomic<bool> faulted{false};
  std::mutex mu;
  std::string fault;
};
inline thread_local LaunchState* tl_launch = nullptr;

// Thrown to take a thread out of a stopped launch (caught by Launch).
struct LaunchStopped {};

// Stops `launch` with `what` as its error, unless it already failed.
inline void StopLaunch(LaunchState* launch, const std::string& what) {
  std::lock_guard<std::mutex> lock(launch->mu);
  if (!launch->faulted.load()) {
    launch->fault = what;
    launch->faulted.store(true);
  }
}

// Records a fault of the calling thread's launch and stops the thread.
[[noreturn]] inline void Fault(const std::string& what) {
  LaunchState* launch = tl_launch;
  if (launch != nullptr) {
    std::lock_guard<std::mutex> lock(launch->mu);
    if (!launch->faulted.load()) {
      launch->fault = absl::StrCat(what, " (thread ", threadIdx.x, " of CTA (", blockIdx.x, ", ",
                                   blockIdx.y, "))");
      launch->faulted.store(true);
    }
  }
  throw LaunchStopped{};
}

// Leaves the kernel when another thread of the launch has faulted (called where a thread
// would otherwise wait for the faulted one: barriers and spins).
inline void StopIfFaulted() {
  if (tl_launch != nullptr && tl_launch->faulted.load(std::memory_order_relaxed)) {
    throw LaunchStopped{};
  }
}

// A 16-byte access must be 16-byte aligned. The empty asm hides the address from the
// optimiser, which may otherwise assume an aligned uint4* and fold the test away.
inline void CheckVectorAccess(const void* p, const char* access) {
  auto address = reinterpret_cast<std::uintptr_t>(p);
  asm("" : "+r"(address));
  if ((address & 15u) != 0) {
    Fault(absl::StrCat("misaligned address: 16-byte ", access, " at 0x", absl::Hex(address)));
  }
}

}  // namespace hsap_emu

// CUDA's 16-byte vector. Copies are the loads and stores device code makes of it, so they
// check both addresses, as the GPU's vector instructions do.
struct alignas(16) uint4 {
  unsigned int x, y, z, w;

  uint4() = default;
  uint4(const uint4& other) {
    hsap_emu::CheckVectorAccess(&other, "load");
    x = other.x, y = other.y, z = other.z, w = other.w;
  }
  uint4& operator=(const uint4& other) {
    hsap_emu::CheckVectorAccess(&other, "load");
    hsap_emu::CheckVectorAccess(this, "store");
    x = other.x, y = other.y, z = other.z, w = other.w;
    return *this;
  }
};

// The tensor-core instructions of jit/device/hsap_mma.cuh (mma, ldmatrix, cp.async), and the
// sm_90a warpgroup instructions of jit/device/hsap_wgmma.cuh (wgmma, setmaxnreg).
#include "tests/support/emulated_ptx.h"
#include "tests/support/emulated_wgmma.h"
// mbarrier and the TMA bulk tensor copies of jit/device/hsap_tma.cuh.
#include "tests/support/emulated_tma.h"
#include "tests/support/emulator_fibers.h"

namespace hsap_emu {

// A device's resident CTA slots, shared by every launch that names it (see the top of this
// file). Thread-safe; outlives the launches that use it.
class Residency {
 public:
  explicit Residency(int limit, std::chrono::milliseconds watchdog = std::chrono::seconds(5))
      : limit_(std::max(1, limit)), watchdog_(watchdog) {}
  Residency(const Residency&) = delete;
  Residency& operator=(const Residency&) = delete;

  int limit() const { return limit_; }
  // Something ran to a visible point (a CTA exited or completed a barrier).
  void Progress() { progress_.fetch_add(1, std::memory_order_relaxed); }
  // The most CTAs that were resident at once so far.
  int peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }

  // A launch on the device: registered while it runs, so that a deadlock stops it too.
  struct Entry {
    LaunchState* launch;
    std::string name;
    size_t not_started;  // its CTAs still waiting for a slot
  };
  Entry* Register(LaunchState* launch, std::string name, size_t ctas) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.push_back({launch, std::move(name), ctas});
    return &entries_.back();
  }
  void Unregister(Entry* e) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.remove_if([e](const Entry& x) { return &x == e; });
  }

  // Blocks until a slot is free and takes it for the next CTA of `e` (true), or false when
  // `e`'s launch was stopped meanwhile, by a fault or by the watchdog, which then stops every
  // launch of the device.
  bool Acquire(Entry* e) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!deadlock_.empty()) {  // sticky, like a GPU's unrecoverable error
      StopLaunch(e->launch, absl::StrCat("the device deadlocked before: ", deadlock_));
      return false;
    }
    for (;;) {
      if (e->launch->faulted.load()) return false;
      if (in_use_ < limit_) break;
      const uint64_t seen = progress_.load(std::memory_order_relaxed);
      const auto now = std::chrono::steady_clock::now();
      if (seen != last_progress_) {
        last_progress_ = seen;
        last_change_ = now;
      } else if (now - last_change_ > watchdog_) {
        StopAll();
        return false;
      }
      cv_.wait_for(lock, std::chrono::milliseconds(10));
    }
    ++in_use_;
    peak_ = std::max(peak_, in_use_);
    --e->not_started;
    // A CTA starting is progress too (it may be what the others wait for).
    last_change_ = std::chrono::steady_clock::now();
    return true;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      --in_use_;
    }
    Progress();
    cv_.notify_all();
  }

 private:
  // Under mu_: nothing moved for the watchdog's time while CTAs wait for slots.
  void StopAll() {
    std::string waiting;
    for (const Entry& x : entries_) {
      if (x.not_started == 0) continue;
      absl::StrAppend(&waiting, waiting.empty() ? "" : ", ", x.not_started,
                      x.not_started == 1 ? " CTA of " : " CTAs of ", x.name);
    }
    const std::string what = absl::StrCat(
        "deadlock: ", in_use_, in_use_ == 1 ? " CTA" : " CTAs", " resident and waiting, ",
        waiting, " not resident; residency limit ", limit_, " (no CTA exited or passed a barrier ",
        "for ", std::chrono::duration_cast<std::chrono::milliseconds>(watchdog_).count(), " ms)");
    for (const Entry& x : entries_) StopLaunch(x.launch, what);
    deadlock_ = what;
    cv_.notify_all();
  }

  const int limit_;
  const std::chrono::steady_clock::duration watchdog_;
  std::atomic<uint64_t> progress_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int in_use_ = 0, peak_ = 0;
  uint64_t last_progress_ = 0;
  std::chrono::steady_clock::time_point last_change_ = std::chrono::steady_clock::now();
  std::list<Entry> entries_;
  std::string deadlock_;  // the deadlock found, if any: later launches fail at once
};

// The barrier of a CTA's or a warp's emulated threads (fibers of one scheduler, so no lock),
// with std::barrier's arrive_and_wait and arrive_and_drop. A waiter blocks its fiber; the
// arrival that completes the phase wakes the waiters.
class Barrier {
 public:
  // residency: the device whose progress a completed phase is (the watchdog's), or null.
  explicit Barrier(int count, Residency* residency = nullptr)
      : expected_(count), pending_(count), residency_(residency) {}
  Barrier(const Barrier&) = delete;
  Barrier& operator=(const Barrier&) = delete;

  // Returns when the phase completed, or when the scheduler found the CTA deadlocked (its
  // launch is then stopped: the caller's StopIfFaulted takes it out).
  void arrive_and_wait() {
    if (--pending_ == 0) {
      Complete();
      return;
    }
    waiters_.push_back(tl_fibers->current());
    tl_fibers->Block();
  }
  // Arrives at this phase and leaves every later one (an exited thread).
  void arrive_and_drop() {
    --expected_;
    if (--pending_ == 0) Complete();
  }

 private:
  void Complete() {
    pending_ = expected_;
    if (residency_ != nullptr) residency_->Progress();
    for (int fiber : waiters_) tl_fibers->Wake(fiber);
    waiters_.clear();
  }

  int expected_;  // arrivals each later phase waits for
  int pending_;   // arrivals this phase still waits for
  std::vector<int> waiters_;
  Residency* const residency_;
};

// A named barrier (bar.sync a, b / bar.arrive a, b; PTX ISA "Parallel Synchronization and
// Communication Instructions: bar, barrier"): a phase completes when b threads have arrived
// (the emulator counts threads; the ISA counts warps of 32, which is the same for the whole
// warps that .aligned requires); bar.sync's thread waits for that, bar.arrive's does not;
// the waiters go on and the barrier is ready for the next phase at once. Unlike
// __syncthreads', an exited thread never arrives: a phase short of arrivals waits for ever,
// so a waiter there ends as a deadlock of the CTA. Faults: ids outside 1..15 (0 is
// __syncthreads', which the emulator keeps apart), b not a non-zero multiple of 32 or above
// the CTA's threads (a phase that can never complete), arrivals of one phase with different
// b (the ISA gives no meaning to them).
class NamedBarrier {
 public:
  void Arrive(int id, int threads, bool wait, Residency* residency) {
    if (threads_ != 0 && threads != threads_) {
      Fault(absl::StrCat("named barrier ", id, ": ", wait ? "bar.sync" : "bar.arrive", " with ",
                         threads, " threads in a phase that ", threads_,
                         "-thread arrivals began (one phase, one thread count)"));
    }
    threads_ = threads;
    if (++arrived_ == threads_) {
      arrived_ = 0;
      threads_ = 0;
      if (residency != nullptr) residency->Progress();
      for (int fiber : waiters_) tl_fibers->Wake(fiber);
      waiters_.clear();
      return;
    }
    if (!wait) return;
    waiters_.push_back(tl_fibers->current());
    tl_fibers->Block();
  }

 private:
  int threads_ = 0;  // this phase's thread count (0: no arrival yet)
  int arrived_ = 0;
  std::vector<int> waiters_;
};

// The CTA's shared window: on the GPU its base is aligned far beyond any pattern of the
// shared-memory address (the TMA / wgmma swizzles repeat every 1024 bytes at most), so that
// a kernel may align a generic pointer into it; the emulator's buffer is aligned to 1024.
inline constexpr std::size_t kSharedWindowAlignment = 1024;
template <typename T>
struct SharedWindowAllocator {
  using value_type = T;
  SharedWindowAllocator() = default;
  template <typename U>
  SharedWindowAllocator(const SharedWindowAllocator<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(
        ::operator new(n * sizeof(T), std::align_val_t{kSharedWindowAlignment}));
  }
  void deallocate(T* p, std::size_t) {
    ::operator delete(p, std::align_val_t{kSharedWindowAlignment});
  }
  friend bool operator==(const SharedWindowAllocator&, const SharedWindowAllocator&) {
    return true;
  }
};

// A completed __syncthreads counts as progress of the CTA's device (when it has a residency).
struct Cta {
  explicit Cta(int threads, size_t smem_floats, Residency* residency = nullptr)
      : residency(residency),
        bar(threads, residency),
        smem(smem_floats, 0.0f),
        shfl(threads, 0.0f),
        ptx(threads / 32) {
    for (int w = 0; w < threads / 32; ++w) warp_bars.push_back(std::make_unique<Barrier>(32));
    for (int g = 0; g < threads; g += 128) {  // the last may be partial: wgmma faults there
      warpgroup_bars.push_back(std::make_unique<Barrier>(std::min(128, threads - g)));
    }
  }
  Residency* const residency;  // null: none
  Barrier bar;
  NamedBarrier named_bars[16];  // bar.sync / bar.arrive a, b (0 unused: __syncthreads' is bar)
  std::vector<std::unique_ptr<Barrier>> warp_bars;
  std::vector<std::unique_ptr<Barrier>> warpgroup_bars;  // threads 128g .. 128g + 127
  std::vector<float, SharedWindowAllocator<float>> smem;
  std::vector<float> shfl;
  std::vector<PtxWarpExchange> ptx;  // per warp
  WgmmaCtaState wgmma;
  TmaCtaState tma;  // mbarriers and TMA copies in flight
};

inline thread_local Cta* tl_cta = nullptr;

// The hooks of emulated_ptx.h.
inline PtxWarpExchange& ThisWarpExchange() { return tl_cta->ptx[threadIdx.x / 32]; }
inline int ThisLane() { return static_cast<int>(threadIdx.x % 32); }
inline bool InSharedMemory(const void* p, std::size_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(tl_cta->smem.data());
  const auto end = begin + tl_cta->smem.size() * sizeof(float);
  const auto q = reinterpret_cast<std::uintptr_t>(p);
  return begin <= q && q + bytes <= end;
}

// The hooks of emulated_tma.h.
inline TmaCtaState& ThisCtaTma() { return tl_cta->tma; }
inline std::uintptr_t SharedWindowBase() {
  return reinterpret_cast<std::uintptr_t>(tl_cta->smem.data());
}
inline void YieldThread() {
  StopIfFaulted();
  tl_fibers->Yield();
}

// The hooks of emulated_wgmma.h.
inline WgmmaCtaState& ThisCtaWgmma() { return tl_cta->wgmma; }
inline int ThisThreadIndex() { return static_cast<int>(threadIdx.x); }
inline int CtaThreads() { return static_cast<int>(blockDim.x); }
inline unsigned char* SharedWindow() {
  return reinterpret_cast<unsigned char*>(tl_cta->smem.data());
}
inline std::size_t SharedWindowBytes() { return tl_cta->smem.size() * sizeof(float); }
inline void SyncWarpgroup() {
  tl_cta->warpgroup_bars[threadIdx.x / 128]->arrive_and_wait();
  StopIfFaulted();
}

// bar.sync (wait) or bar.arrive of the calling thread at named barrier `id` of `threads`.
inline void NamedBarrierArrive(int id, int threads, bool wait) {
  const char* op = wait ? "bar.sync" : "bar.arrive";
  if (id < 1 || id > 15) {
    Fault(absl::StrCat(op, " on barrier ", id, ": named barriers are 1..15 (0 is __syncthreads')"));
  }
  if (threads <= 0 || threads % 32 != 0 || threads > static_cast<int>(blockDim.x)) {
    Fault(absl::StrCat(op, " on barrier ", id, " with ", threads,
                       " threads: the count must be a non-zero multiple of 32 and at most the "
                       "CTA's ",
                       blockDim.x, " threads"));
  }
  tl_cta->named_bars[id].Arrive(id, threads, wait, tl_cta->residency);
  StopIfFaulted();
}

inline void SyncWarp() {
  tl_cta->warp_bars[threadIdx.x / 32]->arrive_and_wait();
  StopIfFaulted();
}

inline float ShflXor(float v, int offset) {
  float* slots = tl_cta->shfl.data() + (threadIdx.x / 32) * 32;
  const int lane = threadIdx.x % 32;
  slots[lane] = v;
  SyncWarp();
  const float r = slots[lane ^ offset];
  SyncWarp();
  return r;
}

// Runs `threads` emulated threads of the calling thread's CTA (tl_cta, tl_launch, blockIdx
// set) as fibers: each its own threadIdx, cp.async queue and count of warp collectives. A
// thread that leaves the kernel drops out of its barriers. Threads of the CTA that wait at
// barriers which cannot complete (a GPU would hang) stop the launch with an error.
inline void RunCtaThreads(Cta& cta, int threads, const std::function<void()>& kernel) {
  struct Saved {
    std::uint64_t collectives = 0;
    ptx::CpAsyncQueue cp_async;
  };
  std::vector<Saved> saved(static_cast<size_t>(threads));
  FiberScheduler fibers(
      threads,
      [&](int t) {
        try {
          kernel();
        } catch (const LaunchStopped&) {
          // Left the kernel: faulted, or stopped by another thread's fault.
        }
        cta.warp_bars[static_cast<size_t>(t / 32)]->arrive_and_drop();
        cta.warpgroup_bars[static_cast<size_t>(t / 128)]->arrive_and_drop();
        cta.bar.arrive_and_drop();
      },
      [&](int t) {
        threadIdx = {static_cast<unsigned int>(t), 0, 0};
        std::swap(ptx::tl_collectives, saved[static_cast<size_t>(t)].collectives);
        std::swap(ptx::tl_cp_async, saved[static_cast<size_t>(t)].cp_async);
      });
  fibers.Run([&] {
    StopLaunch(tl_launch,
               absl::StrCat("deadlock in CTA (", blockIdx.x, ", ", blockIdx.y,
                            "): its threads wait at barriers that cannot complete (__syncthreads, "
                            "named barriers, __syncwarp or warp-collective instructions reached "
                            "by only some of the threads that take part)"));
  });
}

// Runs kernel() on a grid of grid_x * grid_y CTAs of `threads` threads each, on a device
// that keeps `residency`'s CTAs resident (nullptr: no limit) under the name `name`. With
// `all_concurrent` every CTA may run at once (kernels whose CTAs wait on one another);
// otherwise at most kBatch CTAs of the launch run at once (independent CTAs; batching bounds
// the number of threads while overlapping the barrier round trips of several CTAs). With a
// residency, CTAs also wait for a slot of the device, in blockIdx order (x, then y).
// Internal with the fault's description when a thread faulted or the watchdog found a
// deadlock.
[[nodiscard]] inline absl::Status Launch(Residency* residency, const std::string& name,
                                         unsigned int grid_x, unsigned int grid_y, int threads,
                                         size_t smem_bytes, bool all_concurrent,
                                         const std::function<void()>& kernel) {
  LaunchState launch;
  struct Item {
    unsigned int bx, by;
  };
  std::vector<Item> items;
  for (unsigned int y = 0; y < grid_y; ++y) {
    for (unsigned int x = 0; x < grid_x; ++x) items.push_back({x, y});
  }
  // One CTA, on a thread of its own; `on_exit` runs once, when its last thread left the kernel.
  auto start_cta = [&](Cta* cta, Item item, std::vector<std::thread>& pool,
                       std::function<void()> on_exit) {
    pool.emplace_back([=, &kernel, &launch] {
      blockIdx = {item.bx, item.by, 0};
      blockDim = {static_cast<unsigned int>(threads), 1, 1};
      gridDim = {grid_x, grid_y, 1};
      tl_cta = cta;
      tl_launch = &launch;
      RunCtaThreads(*cta, threads, kernel);
      tl_launch = nullptr;
      tl_cta = nullptr;
      if (on_exit) on_exit();
    });
  };
  constexpr size_t kBatch = 8;
  if (residency == nullptr) {
    auto run_ctas = [&](size_t first, size_t count) {
      std::vector<std::unique_ptr<Cta>> ctas;
      std::vector<std::thread> pool;
      for (size_t i = first; i < first + count; ++i) {
        ctas.push_back(std::make_unique<Cta>(threads, smem_bytes / sizeof(float)));
        start_cta(ctas.back().get(), items[i], pool, nullptr);
      }
      for (std::thread& th : pool) th.join();
    };
    if (all_concurrent) {
      run_ctas(0, items.size());
    } else {
      for (size_t i = 0; i < items.size() && !launch.faulted.load(); i += kBatch) {
        run_ctas(i, std::min(kBatch, items.size() - i));
      }
    }
  } else {
    // CTAs start one by one as slots free up; finished ones are joined as the launch goes.
    struct Running {
      std::unique_ptr<Cta> cta;
      std::vector<std::thread> pool;  // the CTA's thread
      std::atomic<bool> exited{false};
    };
    std::list<Running> running;
    std::mutex mu;
    std::condition_variable cv;
    size_t live = 0;  // this launch's CTAs that have not exited
    auto reap = [&](bool all) {
      for (auto it = running.begin(); it != running.end();) {
        if (all || it->exited.load()) {
          for (std::thread& th : it->pool) th.join();
          it = running.erase(it);
        } else {
          ++it;
        }
      }
    };
    Residency::Entry* entry = residency->Register(&launch, name, items.size());
    for (const Item& item : items) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return all_concurrent || live < kBatch || launch.faulted.load(); });
      }
      reap(false);
      if (!residency->Acquire(entry)) break;  // stopped (fault or deadlock)
      {
        std::lock_guard<std::mutex> lock(mu);
        ++live;
      }
      Running& r = running.emplace_back();
      r.cta = std::make_unique<Cta>(threads, smem_bytes / sizeof(float), residency);
      start_cta(r.cta.get(), item, r.pool, [&] {
        residency->Release();
        {
          std::lock_guard<std::mutex> lock(mu);
          --live;
        }
        r.exited.store(true);
        cv.notify_all();
      });
    }
    reap(true);
    residency->Unregister(entry);
  }
  if (launch.faulted.load()) {
    return absl::InternalError(absl::StrCat("emulated kernel launch failed: ", launch.fault));
  }
  return absl::OkStatus();
}

// On a device without a residency limit.
[[nodiscard]] inline absl::Status Launch(unsigned int grid_x, unsigned int grid_y, int threads,
                                         size_t smem_bytes, bool all_concurrent,
                                         const std::function<void()>& kernel) {
  return Launch(nullptr, "kernel", grid_x, grid_y, threads, smem_bytes, all_concurrent, kernel);
}

}  // namespace hsap_emu

inline void __syncthreads() {
  hsap_emu::tl_cta->bar.arrive_and_wait();
  hsap_emu::StopIfFaulted();
}
inline void __syncwarp(unsigned int = 0xffffffffu) { hsap_emu::SyncWarp(); }
inline void hsap_emu_named_barrier(int id, int threads, bool wait) {
  hsap_emu::NamedBarrierArrive(id, threads, wait);
}
inline float __shfl_xor_sync(unsigned int, float v, int offset) {
  return hsap_emu::ShflXor(v, offset);
}
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned int x) { return std::bit_cast<float>(x); }
inline unsigned int __float_as_uint(float x) { return std::bit_cast<unsigned int>(x); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
  return std::atomic_ref<unsigned int>(*p).fetch_add(v);
}
inline unsigned int atomicOr(unsigned int* p, unsigned int v) {
  return std::atomic_ref<unsigned int>(*p).fetch_or(v);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// A spin wait's pause: the CTA's other threads run (fibers), or, outside an emulated kernel,
// other OS threads do.
inline void __nanosleep(unsigned int) {
  hsap_emu::StopIfFaulted();
  if (hsap_emu::tl_fibers != nullptr) {
    hsap_emu::tl_fibers->Yield();
  } else {
    std::this_thread::yield();
  }
}

inline float hsap_emu_f16_to_float(unsigned short bits) {
  return hsap::F16ToFloat(hsap::F16{bits});
}
inline unsigned short hsap_emu_float_to_f16(float f) { return hsap::FloatToF16(f).bits; }
inline float* hsap_emu_dynamic_smem() { return hsap_emu::tl_cta->smem.data(); }
inline unsigned int hsap_emu_load_acquire(const unsigned int* p) {
  return std::atomic_ref<unsigned int>(*const_cast<unsigned int*>(p))
      .load(std::memory_order_acquire);
}
inline void hsap_emu_store_release(unsigned int* p, unsigned int v) {
  std::atomic_ref<unsigned int>(*p).store(v, std::memory_order_release);
}
inline unsigned long long hsap_emu_globaltimer_ns() {
  return static_cast<unsigned long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::steady_clock::now().time_since_epoch())
                                             .count());
}
inline unsigned int hsap_emu_fetch_add_release(unsigned int* p, unsigned int v) {
  return std::atomic_ref<unsigned int>(*p).fetch_add(v, std::memory_order_acq_rel);
}

#endif  // HSAP_TESTS_SUPPORT_CUDA_EMULATOR_H_
