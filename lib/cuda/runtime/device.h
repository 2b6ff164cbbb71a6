// What the GPU executor needs from a device: memory, streams, events and the JIT kernels.
//
// Two small interfaces keep the executor (lib/cuda/exec/gpu_executor.h) independent of how a
// device is reached: CudaDevice implements Device with the CUDA runtime (dlopen, see
// cuda_loader.h) and jit_device_kernels.h implements DeviceKernels with the NVRTC-compiled
// kernels launched through the driver API. The tests implement both on the CPU (host
// memory, and the kernels of jit/device run by the emulator of tests/jit/cuda_emulator.h),
// so the executor's schedule handling is checked against the fp64 reference on machines
// without a GPU.
//
// Streams and events are the CUDA runtime's handles (cuda_loader.h); an implementation
// that runs every operation at once may use any non-null value. Every operation is
// asynchronous with respect to the host unless it says otherwise.
#ifndef HSAP_LIB_CUDA_RUNTIME_DEVICE_H_
#define HSAP_LIB_CUDA_RUNTIME_DEVICE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "jit/device/hsap_params.cuh"
#include "lib/comm/transport.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::cuda {

// Where a device is: two ranks may open each other's memory when they are on one host
// (CUDA IPC between processes) or in one process on one device.
struct DeviceLocation {
  std::array<char, 64> host{};    // host name, NUL-terminated
  uint64_t process = 0;           // process id
  std::array<char, 32> device{};  // PCI bus id ("0000:3b:00.0"), NUL-terminated
};
// What a device is: the driver's name ("NVIDIA H100 80GB HBM3") and its memory.
struct DeviceIdentity {
  std::string name;
  uint64_t memory_bytes = 0;
};
// An exported allocation (cudaIpcMemHandle_t).
using IpcHandle = std::array<char, 64>;

class Device {
 public:
  virtual ~Device() = default;

  // Device memory of `bytes` bytes (at least 256-byte aligned); bytes == 0 gives null.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  // Frees memory of Allocate (null is ignored). Blocks until the device no longer uses it.
  virtual void Free(void* p) = 0;

  // Copies between any two pointers the device can address (cudaMemcpyDefault).
  virtual absl::Status CopyAsync(void* dst, const void* src, size_t bytes, cudaStream s) = 0;
  virtual absl::Status ZeroAsync(void* dst, size_t bytes, cudaStream s) = 0;

  virtual absl::StatusOr<cudaStream> CreateStream() = 0;
  virtual void DestroyStream(cudaStream s) = 0;
  virtual absl::StatusOr<cudaEvent> CreateEvent() = 0;
  virtual void DestroyEvent(cudaEvent e) = 0;
  // The event completes when the work enqueued on `s` so far has.
  virtual absl::Status RecordEvent(cudaEvent e, cudaStream s) = 0;
  // Work enqueued on `waiter` after this call starts only after `e` completed.
  virtual absl::Status StreamWaitEvent(cudaStream waiter, cudaEvent e) = 0;
  // Blocks the host until the work enqueued on `s` has completed, or DeadlineExceeded
  // naming `what` at `deadline`.
  virtual absl::Status Synchronize(cudaStream s, absl::Time deadline, absl::string_view what) = 0;

  // Stream memory operations on 32-bit flags in device memory, for signalling between the
  // ranks' streams without the host. WriteValueAsync: *flag = value once the work enqueued
  // on `s` before it has completed, with that work's writes visible to peers first.
  // WaitValueAsync: work enqueued on `s` after it starts once (int32_t)(*flag - value) >= 0
  // (a counter that may wrap). Unimplemented where the device cannot (the fused forward is
  // then not offered).
  virtual absl::Status WriteValueAsync(uint32_t* flag, uint32_t value, cudaStream s) {
    return absl::UnimplementedError("this device has no stream memory operations");
  }
  virtual absl::Status WaitValueAsync(const uint32_t* flag, uint32_t value, cudaStream s) {
    return absl::UnimplementedError("this device has no stream memory operations");
  }

  // Peer memory (peer windows, peer_window.h). Location: this device's. ExportMemory: a
  // handle to an allocation of Allocate that a device in another process of this host can
  // open. OpenPeerMemory: maps such a handle of the device at `owner`; FailedPrecondition
  // when this device cannot reach that one (no peer access). ClosePeerMemory unmaps it.
  // Unimplemented where the device has no such thing.
  virtual absl::StatusOr<DeviceLocation> Location() {
    return absl::UnimplementedError("this device has no location");
  }
  // Name and memory (the planner's device description); Unimplemented where unknown.
  virtual absl::StatusOr<DeviceIdentity> Identity() {
    return absl::UnimplementedError("this device does not say what it is");
  }
  virtual absl::StatusOr<IpcHandle> ExportMemory(void* p) {
    return absl::UnimplementedError("this device cannot export memory");
  }
  virtual absl::StatusOr<void*> OpenPeerMemory(const IpcHandle& handle,
                                               const DeviceLocation& owner) {
    return absl::UnimplementedError("this device cannot open peer memory");
  }
  virtual void ClosePeerMemory(void* p) {}

  // Makes this device the calling thread's current one and returns the device that was
  // current before (to hand back to Restore), so that a call from a thread set to another
  // GPU still works on this one and leaves the thread as it found it.
  virtual absl::StatusOr<int> MakeCurrent() { return 0; }
  virtual void Restore(int previous) {}
};

// MakeCurrent for a scope.
class ScopedDevice {
 public:
  explicit ScopedDevice(Device& device) : device_(device) {
    absl::StatusOr<int> previous = device.MakeCurrent();
    status_ = previous.status();
    if (previous.ok()) previous_ = *previous;
  }
  ~ScopedDevice() {
    if (status_.ok()) device_.Restore(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  Device& device_;
  absl::Status status_;
  int previous_ = 0;
};

// One launch of the fused forward (fused_fwd_kernel of jit/device/hsap_attention.cuh): the
// launcher sets head.num_steps and head.num_copy_ctas.
struct FusedForwardLaunch {
  hsap_dev::FusedFwdHead head{};
  std::vector<hsap_dev::FusedStep> steps;  // at most DeviceKernels::max_fused_steps()
  // Fused kernels of this many ranks run on the device at once (loopback ranks sharing one
  // GPU): each launch takes at most 1/share of the CTAs the device keeps resident, so that
  // no rank's kernel, whose CTAs spin on peers' flags, crowds out the others' (the kernel
  // itself finishes whichever of its CTAs are resident).
  int share = 1;
};

// The kernels of one configuration (dtype, head dim, GQA ratio, mask kinds), with the
// Params of jit/device/hsap_params.cuh. Each launch picks its grid from the Params (see
// there) and is enqueued on `s`.
class DeviceKernels {
 public:
  virtual ~DeviceKernels() = default;
  virtual absl::Status Forward(const hsap_dev::FwdParams& p, cudaStream s) const = 0;
  virtual absl::Status Backward(const hsap_dev::BwdParams& p, cudaStream s) const = 0;
  virtual absl::Status Delta(const hsap_dev::DeltaParams& p, cudaStream s) const = 0;
  virtual absl::Status Init(const hsap_dev::InitParams& p, cudaStream s) const = 0;
  virtual absl::Status Convert(const hsap_dev::ConvertParams& p, cudaStream s) const = 0;
  virtual absl::Status Accumulate(const hsap_dev::AccumulateParams& p, cudaStream s) const = 0;
  virtual absl::Status CopyChunks(const hsap_dev::ChunksParams& p, cudaStream s) const = 0;
  virtual absl::Status AddChunks(const hsap_dev::ChunksParams& p, cudaStream s) const = 0;
  // The helpers of the cuDNN engine (hsap_params.cuh, EntryRows); Unimplemented in kernel
  // sets without them.
  virtual absl::Status MergeEntries(const hsap_dev::EntryMergeParams& p, cudaStream s) const {
    return absl::UnimplementedError("these kernels cannot merge cuDNN's partial results");
  }
  virtual absl::Status GatherStats(const hsap_dev::StatsGatherParams& p, cudaStream s) const {
    return absl::UnimplementedError("these kernels cannot gather cuDNN's Stats");
  }
  virtual absl::Status AddEntries(const hsap_dev::EntryAddParams& p, cudaStream s) const {
    return absl::UnimplementedError("these kernels cannot add cuDNN's gradients");
  }

  // Query rows per work-list block the forward was built for (the sm_90a forward's 128-row
  // CTA tile), or 0 for no preference. Any block size is correct for every kernel (each walks
  // a block in chunks of its own tile); a block smaller than the tile idles part of the CTA.
  virtual int64_t forward_block_rows() const { return 0; }

  // The fused forward, in configurations generated with a topology role: at most
  // max_fused_steps() steps per launch (0: this configuration has no fused kernel), each
  // launch with fused_copy_ctas() copy CTAs (the same on every rank of a configuration:
  // owners count their readers' copies by it).
  virtual int max_fused_steps() const { return 0; }
  virtual int fused_copy_ctas() const { return 1; }
  // CTAs of the fused kernel the device keeps resident at once (0: no limit).
  virtual int fused_resident_ctas() const { return 0; }
  virtual absl::Status FusedForward(const FusedForwardLaunch& launch, cudaStream s) const {
    return absl::UnimplementedError("these kernels have no fused forward");
  }
};

// The current CUDA device through the CUDA runtime (remembered: MakeCurrent selects it
// again, and the device makes it current itself, restoring the caller's, for what belongs to
// a device: allocations, streams, events, memsets, opened peer memory -- so it works from a
// thread whose current device is another GPU). Unimplemented without one.
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice();
// The same through the CUDA runtime `rt` and driver `driver` (the ones CreateCudaDevice
// loads, or a test's emulated ones), which must outlive the device.
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaRuntimeApi& rt,
                                                         const CudaDriverApi& driver);

// "sm_90" for the current CUDA device (its compute capability).
absl::StatusOr<std::string> CurrentCudaArch();
// The current CUDA device's name as its driver gives it ("NVIDIA H200").
absl::StatusOr<std::string> CurrentCudaDeviceName();

// A transport that moves device memory: NCCL ranks, loopback ranks sharing one GPU.
class DeviceTransport : public Transport {
 public:
  // The CUDA stream it moves data on (NCCL's communication stream, a loopback rank's
  // stream). The GPU executors make it wait for their compute stream before each stage.
  virtual cudaStream transfer_stream() const = 0;
  // Whether batches on this transport may move forward's K/V through peer windows
  // (peer_window.h): loopback ranks share one process and GPU; NCCL ranks on one host may
  // open each other's windows with CUDA IPC. The exchange of the windows at batch creation
  // decides, for all ranks alike, whether they actually can.
  virtual bool offers_peer_windows() const = 0;
};

// t's transfer stream when it is a DeviceTransport, else null (a host transport).
cudaStream TransferStream(const Transport& t);

// Whether `t` is a DeviceTransport that offers peer windows.
bool OffersPeerWindows(const Transport& t);

// Owns a device allocation; frees it through its Device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* p) : device_(device), p_(p) {}
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : device_(o.device_), p_(o.p_) { o.p_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      device_ = o.device_;
      p_ = o.p_;
      o.p_ = nullptr;
    }
    return *this;
  }
  void* get() const { return p_; }
  void Reset() {
    if (p_ != nullptr) device_->Free(p_);
    p_ = nullptr;
  }

 private:
  Device* device_ = nullptr;
  void* p_ = nullptr;
};

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_RUNTIME_DEVICE_H_
