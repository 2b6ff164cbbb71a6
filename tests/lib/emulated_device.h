// A CPU stand-in for a CUDA device, for testing the GPU executor without a GPU.
//
// EmulatedDevice: "device memory" is host memory (256-byte aligned, every allocation
// tracked), and every stream operation runs at once on the calling thread, so events are
// complete as soon as they are recorded. It counts allocations, so tests can check that
// forward and backward allocate nothing.
//
// EmulatedKernels<Cfg>: the kernels of jit/device/hsap_attention.cuh for the configuration
// Cfg, run by the emulator of tests/jit/cuda_emulator.h (one std::thread per CUDA thread).
// Each launch gets an error word of its own; a kernel that reports a broken contract makes
// the launch fail with Internal.
//
// Include this header before anything that includes jit/device headers' host side (it
// must see the emulator first).
#ifndef HSAP_TESTS_LIB_EMULATED_DEVICE_H_
#define HSAP_TESTS_LIB_EMULATED_DEVICE_H_

// clang-format off
#include "tests/jit/cuda_emulator.h"
#include "jit/device/hsap_attention.cuh"
// clang-format on

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "lib/cuda/device.h"

namespace hsap::testing {

class EmulatedDevice : public cuda::Device {
 public:
  ~EmulatedDevice() override {
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
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.erase(p) == 0) {
      ADD_FAILURE() << "Free of a pointer this device did not allocate";
      return;
    }
    std::free(p);
  }
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, cuda::cudaStream s) override {
    if (s == nullptr) return absl::InternalError("copy on a null stream");
    if (bytes > 0) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status ZeroAsync(void* dst, size_t bytes, cuda::cudaStream s) override {
    if (s == nullptr) return absl::InternalError("memset on a null stream");
    if (bytes > 0) std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }
  absl::StatusOr<cuda::cudaStream> CreateStream() override {
    return reinterpret_cast<cuda::cudaStream>(next_handle_.fetch_add(16));
  }
  void DestroyStream(cuda::cudaStream) override {}
  absl::StatusOr<cuda::cudaEvent> CreateEvent() override {
    events_created_.fetch_add(1);
    return reinterpret_cast<cuda::cudaEvent>(next_handle_.fetch_add(16));
  }
  void DestroyEvent(cuda::cudaEvent) override { events_destroyed_.fetch_add(1); }
  absl::Status RecordEvent(cuda::cudaEvent, cuda::cudaStream) override { return absl::OkStatus(); }
  absl::Status StreamWaitEvent(cuda::cudaStream, cuda::cudaEvent) override {
    return absl::OkStatus();
  }
  absl::Status Synchronize(cuda::cudaStream, absl::Time, absl::string_view) override {
    return absl::OkStatus();
  }

  int64_t allocations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return allocations_;
  }
  size_t live_allocations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }
  int64_t events_alive() const { return events_created_.load() - events_destroyed_.load(); }

 private:
  mutable std::mutex mu_;
  std::set<void*> live_;
  int64_t allocations_ = 0;
  std::atomic<uintptr_t> next_handle_{0x1000};
  std::atomic<int64_t> events_created_{0}, events_destroyed_{0};
};

template <class Cfg>
class EmulatedKernels : public cuda::DeviceKernels {
 public:
  absl::Status Forward(const hsap_dev::FwdParams& p, cuda::cudaStream) const override {
    return Run("forward", p, p.num_blocks, p.heads_q, Cfg::kThreads, Cfg::kFwdSmemBytes,
               [](const hsap_dev::FwdParams& q) { hsap_dev::attn_fwd_kernel<Cfg>(q); });
  }
  absl::Status Backward(const hsap_dev::BwdParams& p, cuda::cudaStream) const override {
    return Run("backward", p, p.num_blocks, p.heads_q, Cfg::kBwdThreads, Cfg::kBwdSmemBytes,
               [](const hsap_dev::BwdParams& q) { hsap_dev::attn_bwd_kernel<Cfg>(q); });
  }
  absl::Status Delta(const hsap_dev::DeltaParams& p, cuda::cudaStream) const override {
    return Helper([&] { hsap_dev::attn_delta_kernel<Cfg>(p); });
  }
  absl::Status Init(const hsap_dev::InitParams& p, cuda::cudaStream) const override {
    return Helper([&] { hsap_dev::init_partial_kernel<Cfg>(p); });
  }
  absl::Status Convert(const hsap_dev::ConvertParams& p, cuda::cudaStream) const override {
    return Helper([&] { hsap_dev::convert_out_kernel<Cfg>(p); });
  }
  absl::Status Accumulate(const hsap_dev::AccumulateParams& p, cuda::cudaStream) const override {
    return Helper([&] { hsap_dev::accumulate_kernel<Cfg>(p); });
  }
  int64_t launches() const { return launches_.load(); }

 private:
  // Attention kernels: grid (num_blocks, heads_q), with an error word of the launch's own.
  template <typename Params, typename Fn>
  absl::Status Run(const char* what, Params p, int grid_x, int grid_y, int threads, int smem,
                   Fn kernel) const {
    if (grid_x == 0 || grid_y == 0) return absl::OkStatus();
    launches_.fetch_add(1);
    unsigned int error = 0;
    p.error_flag = &error;
    hsap_emu::Launch(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y), threads,
                     static_cast<size_t>(smem), /*all_concurrent=*/false, [&] { kernel(p); });
    if (error != 0) {
      return absl::InternalError(absl::StrCat(what, " kernel reported error bits ", error));
    }
    return absl::OkStatus();
  }
  // Row-wise helpers: two CTAs of 256 threads (their loops are grid-stride).
  template <typename Fn>
  absl::Status Helper(Fn kernel) const {
    launches_.fetch_add(1);
    hsap_emu::Launch(2, 1, 256, 0, /*all_concurrent=*/false, kernel);
    return absl::OkStatus();
  }

  mutable std::atomic<int64_t> launches_{0};
};

}  // namespace hsap::testing

#endif  // HSAP_TESTS_LIB_EMULATED_DEVICE_H_
