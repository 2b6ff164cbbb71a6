#include "lib/cuda/runtime/device.h"

#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"

namespace hsap::cuda {
namespace {

class CudaDevice : public Device {
 public:
  CudaDevice(const CudaRuntimeApi* rt, const CudaDriverApi* driver, int ordinal)
      : rt_(rt), driver_(driver), ordinal_(ordinal) {}

  absl::StatusOr<int> MakeCurrent() override {
    int previous = 0;
    HSAP_RETURN_IF_ERROR(rt_->Check(rt_->GetDevice(&previous), "cudaGetDevice"));
    if (previous == ordinal_) return previous;
    HSAP_RETURN_IF_ERROR(
        rt_->Check(rt_->SetDevice(ordinal_), absl::StrCat("cudaSetDevice(", ordinal_, ")")));
    return previous;
  }
  void Restore(int previous) override {
    if (previous != ordinal_) rt_->SetDevice(previous);
  }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    CudaDeviceScope on(*rt_, ordinal_);  // cudaMalloc allocates on the current device
    HSAP_RETURN_IF_ERROR(on.status());
    void* p = nullptr;
    HSAP_RETURN_IF_ERROR(
        rt_->Check(rt_->Malloc(&p, bytes), absl::StrCat("cudaMalloc(", bytes, " B)")));
    return p;
  }
  void Free(void* p) override {
    if (p != nullptr) rt_->Free(p);  // cudaFree synchronizes the device
  }
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, cudaStream s) override {
    if (bytes == 0) return absl::OkStatus();
    return rt_->Check(rt_->MemcpyAsync(dst, src, bytes, kCudaMemcpyDefault, s),
                      absl::StrCat("cudaMemcpyAsync(", bytes, " B)"));
  }
  absl::Status ZeroAsync(void* dst, size_t bytes, cudaStream s) override {
    if (bytes == 0) return absl::OkStatus();
    CudaDeviceScope on(*rt_, ordinal_);
    HSAP_RETURN_IF_ERROR(on.status());
    return rt_->Check(rt_->MemsetAsync(dst, 0, bytes, s),
                      absl::StrCat("cudaMemsetAsync(", bytes, " B)"));
  }
  absl::Status WriteValueAsync(uint32_t* flag, uint32_t value, cudaStream s) override {
    const CudaDriverApi* d = driver_;
    return d->Check(d->StreamWriteValue32(s, reinterpret_cast<uintptr_t>(flag), value,
                                          kCuStreamWriteValueDefault),
                    "cuStreamWriteValue32");
  }
  absl::Status WaitValueAsync(const uint32_t* flag, uint32_t value, cudaStream s) override {
    const CudaDriverApi* d = driver_;
    return d->Check(
        d->StreamWaitValue32(s, reinterpret_cast<uintptr_t>(flag), value, kCuStreamWaitValueGeq),
        "cuStreamWaitValue32 (GEQ)");
  }
  absl::StatusOr<DeviceIdentity> Identity() override {
    const CudaDriverApi* d = driver_;
    int device = 0;
    HSAP_RETURN_IF_ERROR(
        d->Check(d->DeviceGet(&device, ordinal_), absl::StrCat("cuDeviceGet(", ordinal_, ")")));
    char name[256] = {};
    HSAP_RETURN_IF_ERROR(
        d->Check(d->DeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName"));
    size_t bytes = 0;
    HSAP_RETURN_IF_ERROR(d->Check(d->DeviceTotalMem(&bytes, device), "cuDeviceTotalMem"));
    return DeviceIdentity{name, bytes};
  }
  absl::StatusOr<DeviceLocation> Location() override {
    DeviceLocation at;
    gethostname(at.host.data(), at.host.size() - 1);
    at.process = static_cast<uint64_t>(getpid());
    HSAP_RETURN_IF_ERROR(rt_->Check(
        rt_->DeviceGetPCIBusId(at.device.data(), static_cast<int>(at.device.size()) - 1, ordinal_),
        "cudaDeviceGetPCIBusId"));
    return at;
  }
  absl::StatusOr<IpcHandle> ExportMemory(void* p) override {
    CudaIpcMemHandle h;
    HSAP_RETURN_IF_ERROR(rt_->Check(rt_->IpcGetMemHandle(&h, p), "cudaIpcGetMemHandle"));
    IpcHandle out;
    std::memcpy(out.data(), h.reserved, out.size());
    return out;
  }
  absl::StatusOr<void*> OpenPeerMemory(const IpcHandle& handle,
                                       const DeviceLocation& owner) override {
    int peer = -1, can = 0;
    if (absl::Status s =
            rt_->Check(rt_->DeviceGetByPCIBusId(&peer, owner.device.data()),
                       absl::StrCat("cudaDeviceGetByPCIBusId(", owner.device.data(), ")"));
        !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("GPU ", owner.device.data(), " is not visible here: ", s.message()));
    }
    if (peer != ordinal_) {
      HSAP_RETURN_IF_ERROR(
          rt_->Check(rt_->DeviceCanAccessPeer(&can, ordinal_, peer), "cudaDeviceCanAccessPeer"));
      if (can == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "GPU ", ordinal_, " has no peer access to GPU ", peer, " (", owner.device.data(), ")"));
      }
      // The fused kernel's copy CTAs count their copies with atomics in the owner's window.
      int atomics = 0;
      HSAP_RETURN_IF_ERROR(
          rt_->Check(rt_->DeviceGetP2PAttribute(&atomics, kCudaDevP2PAttrNativeAtomicSupported,
                                                ordinal_, peer),
                     "cudaDeviceGetP2PAttribute(native atomics)"));
      if (atomics == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the link from GPU ", ordinal_, " to GPU ", peer, " has no native atomics"));
      }
    }
    CudaIpcMemHandle h;
    std::memcpy(h.reserved, handle.data(), handle.size());
    // cudaIpcOpenMemHandle maps "into the current device address space".
    CudaDeviceScope on(*rt_, ordinal_);
    HSAP_RETURN_IF_ERROR(on.status());
    void* p = nullptr;
    if (absl::Status s = rt_->Check(rt_->IpcOpenMemHandle(&p, h, kCudaIpcMemLazyEnablePeerAccess),
                                    "cudaIpcOpenMemHandle");
        !s.ok()) {
      return absl::FailedPreconditionError(s.message());
    }
    return p;
  }
  void ClosePeerMemory(void* p) override {
    if (p != nullptr) rt_->IpcCloseMemHandle(p);
  }
  absl::StatusOr<cudaStream> CreateStream() override {
    CudaDeviceScope on(*rt_, ordinal_);  // a stream is the device's current at creation
    HSAP_RETURN_IF_ERROR(on.status());
    cudaStream s = nullptr;
    HSAP_RETURN_IF_ERROR(rt_->Check(rt_->StreamCreateWithFlags(&s, kCudaStreamNonBlocking),
                                    "cudaStreamCreateWithFlags"));
    return s;
  }
  void DestroyStream(cudaStream s) override {
    if (s != nullptr) rt_->StreamDestroy(s);
  }
  absl::StatusOr<cudaEvent> CreateEvent() override {
    // An event is the device's current at creation, and records only on that device's
    // streams.
    CudaDeviceScope on(*rt_, ordinal_);
    HSAP_RETURN_IF_ERROR(on.status());
    cudaEvent e = nullptr;
    HSAP_RETURN_IF_ERROR(rt_->Check(rt_->EventCreateWithFlags(&e, kCudaEventDisableTiming),
                                    "cudaEventCreateWithFlags"));
    return e;
  }
  void DestroyEvent(cudaEvent e) override {
    if (e != nullptr) rt_->EventDestroy(e);
  }
  absl::Status RecordEvent(cudaEvent e, cudaStream s) override {
    return rt_->Check(rt_->EventRecord(e, s), "cudaEventRecord");
  }
  absl::Status StreamWaitEvent(cudaStream waiter, cudaEvent e) override {
    return rt_->Check(rt_->StreamWaitEvent(waiter, e, 0), "cudaStreamWaitEvent");
  }
  absl::Status Synchronize(cudaStream s, absl::Time deadline, absl::string_view what) override {
    // Poll an event rather than cudaStreamSynchronize, which has no timeout.
    HSAP_ASSIGN_OR_RETURN(cudaEvent e, CreateEvent());
    absl::Status result = RecordEvent(e, s);
    while (result.ok()) {
      const cudaError q = rt_->EventQuery(e);
      if (q == kCudaSuccess) break;
      if (q != kCudaErrorNotReady) {
        result = rt_->Check(q, absl::StrCat("cudaEventQuery (", what, ")"));
        break;
      }
      if (absl::Now() > deadline) {
        result = absl::DeadlineExceededError(
            absl::StrCat(what, ": the GPU work did not finish before the communicator's timeout"));
        break;
      }
      std::this_thread::yield();
    }
    DestroyEvent(e);
    return result;
  }

 private:
  const CudaRuntimeApi* rt_;
  const CudaDriverApi* driver_;
  int ordinal_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice() {
  HSAP_RETURN_IF_ERROR(CheckCudaDevice());
  HSAP_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
  HSAP_ASSIGN_OR_RETURN(const CudaDriverApi* driver, LoadCudaDriver());
  return CreateCudaDevice(*rt, *driver);
}

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaRuntimeApi& rt,
                                                         const CudaDriverApi& driver) {
  int ordinal = 0;
  HSAP_RETURN_IF_ERROR(rt.Check(rt.GetDevice(&ordinal), "cudaGetDevice"));
  return std::unique_ptr<Device>(new CudaDevice(&rt, &driver, ordinal));
}

absl::StatusOr<std::string> CurrentCudaArch() {
  HSAP_RETURN_IF_ERROR(CheckCudaDevice());
  HSAP_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
  const CudaRuntimeApi& api = *rt;
  int device = 0, major = 0, minor = 0;
  HSAP_RETURN_IF_ERROR(api.Check(api.GetDevice(&device), "cudaGetDevice"));
  HSAP_RETURN_IF_ERROR(
      api.Check(api.DeviceGetAttribute(&major, kCudaDevAttrComputeCapabilityMajor, device),
                "cudaDeviceGetAttribute(compute capability major)"));
  HSAP_RETURN_IF_ERROR(
      api.Check(api.DeviceGetAttribute(&minor, kCudaDevAttrComputeCapabilityMinor, device),
                "cudaDeviceGetAttribute(compute capability minor)"));
  return absl::StrCat("sm_", major, minor);
}

absl::StatusOr<std::string> CurrentCudaDeviceName() {
  HSAP_RETURN_IF_ERROR(CheckCudaDevice());
  HSAP_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
  HSAP_ASSIGN_OR_RETURN(const CudaDriverApi* driver, LoadCudaDriver());
  int ordinal = 0, device = 0;
  HSAP_RETURN_IF_ERROR(rt->Check(rt->GetDevice(&ordinal), "cudaGetDevice"));
  HSAP_RETURN_IF_ERROR(driver->Check(driver->DeviceGet(&device, ordinal),
                                     absl::StrCat("cuDeviceGet(", ordinal, ")")));
  char name[256] = {};
  HSAP_RETURN_IF_ERROR(
      driver->Check(driver->DeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName"));
  return std::string(name);
}

cudaStream TransferStream(const Transport& t) {
  const auto* device = dynamic_cast<const DeviceTransport*>(&t);
  return device != nullptr ? device->transfer_stream() : nullptr;
}

bool OffersPeerWindows(const Transport& t) {
  const auto* device = dynamic_cast<const DeviceTransport*>(&t);
  return device != nullptr && device->offers_peer_windows();
}

}  // namespace hsap::cuda
