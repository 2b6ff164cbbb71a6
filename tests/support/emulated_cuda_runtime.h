// A driver-strict CUDA runtime on the CPU, for testing the code that calls cudart and the
// driver through their function tables (lib/cuda/runtime/cuda_loader.h) without a GPU.
//
// EmulatedCudaRuntime fills a CudaRuntimeApi and a CudaDriverApi with functions backed by an
// emulator of the rules the real libraries enforce, so that code handed those tables (the
// loopback transport, CudaDevice, ...) fails here where it would fail on a GPU:
//
//   devices      a configurable count; the current device is per host thread (cudaSetDevice,
//                cudaGetDevice), device 0 until set.
//   memory       device allocations (cudaMalloc: tracked ranges with their device, filled with
//                garbage), pinned host allocations (MallocHost below), and pageable host memory
//                (any other address). "Device memory" is host memory underneath, so kernels
//                run on the CPU can use it; host code that dereferences a device pointer is
//                NOT caught.
//   copies       the kind must match the pointers' memory types, a range must lie inside its
//                allocation; synchronous with respect to the host as the API documents.
//   streams      belong to the device current at creation; each runs its operations in order
//                on a worker thread of its own, so a missing event or host wait is a race.
//   events       belong to the device current at creation; complete when their stream reaches
//                them; recording on a stream of another device fails.
//   driver       cuStreamWriteValue32 / cuStreamWaitValue32 (on device or pinned memory),
//                cuDeviceGet / GetName / TotalMem, contexts as the devices' primary ones,
//                cuTensorMapEncodeTiled (emulated_tensor_map.h: the driver's refusals).
//                Modules and kernel launches are not emulated (Unsupported): kernels run through
//                Launch() below, with the driver's stream rule.
//
// Each rule carries the sentence of NVIDIA's documentation it follows (CUDA Runtime API
// reference, its "API synchronization behavior" page, the CUDA C++ Programming Guide's
// "Stream and Event Behavior", the Driver API reference); the few rules the documentation
// does not state say so. Where the documentation calls a misuse "undefined behavior", the
// emulator fails the call: code that is right on the driver never depends on undefined
// behaviour.
//
// One emulator may exist at a time (the tables' functions are plain C function pointers and
// reach it through a process-wide pointer). A wait that exceeds the watchdog (Options) gives
// up: the API call returns kCudaErrorTimeout, a stream operation is recorded as a failure;
// failures left at destruction fail the running test.
#ifndef HSAP_TESTS_SUPPORT_EMULATED_CUDA_RUNTIME_H_
#define HSAP_TESTS_SUPPORT_EMULATED_CUDA_RUNTIME_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "tests/support/emulated_tensor_map.h"

namespace hsap::testing {

// cudaError_t values the emulator returns (cuda_runtime_api.h / driver_types.h).
inline constexpr cuda::cudaError kCudaErrorInvalidValue = 1;
inline constexpr cuda::cudaError kCudaErrorMemoryAllocation = 2;
inline constexpr cuda::cudaError kCudaErrorInitializationError = 3;
inline constexpr cuda::cudaError kCudaErrorInvalidMemcpyDirection = 21;
inline constexpr cuda::cudaError kCudaErrorNoDevice = 100;
inline constexpr cuda::cudaError kCudaErrorInvalidDevice = 101;
inline constexpr cuda::cudaError kCudaErrorInvalidResourceHandle = 400;
inline constexpr cuda::cudaError kCudaErrorNotSupported = 801;
inline constexpr cuda::cudaError kCudaErrorTimeout = 909;
// CUresult values (cuda.h): CUDA_ERROR_INVALID_VALUE, _INVALID_DEVICE, _INVALID_CONTEXT,
// _INVALID_HANDLE, _NOT_SUPPORTED, _TIMEOUT.
inline constexpr cuda::CUresult kCuErrorInvalidValue = 1;
inline constexpr cuda::CUresult kCuErrorInvalidDevice = 101;
inline constexpr cuda::CUresult kCuErrorInvalidContext = 201;
inline constexpr cuda::CUresult kCuErrorInvalidHandle = 400;
inline constexpr cuda::CUresult kCuErrorNotSupported = 801;
inline constexpr cuda::CUresult kCuErrorTimeout = 909;

struct EmulatedCudaRuntimeOptions {
  int devices = 1;
  int sm_count = 4;  // cudaDevAttrMultiProcessorCount
  int cc_major = 9, cc_minor = 0;
  // Device memory per device (host memory underneath): cudaMalloc beyond it fails with
  // cudaErrorMemoryAllocation.
  size_t memory_bytes = size_t{1} << 30;
  std::string name = "Emulated GPU";
  bool peer_access = true;         // cudaDeviceCanAccessPeer between distinct devices
  bool p2p_native_atomics = true;  // cudaDevP2PAttrNativeAtomicSupported
  // The longest any emulated wait blocks (a wait on the device that never ends, on a GPU).
  absl::Duration watchdog = absl::Seconds(30);
};

class EmulatedCudaRuntime {
 public:
  using Options = EmulatedCudaRuntimeOptions;

  enum class Memory { kPageable, kPinnedHost, kDevice };
  // What an address is: pageable host memory, or a byte of an allocation.
  struct Pointer {
    Memory memory = Memory::kPageable;
    int device = -1;  // kDevice: the allocation's device
    const char* base = nullptr;
    size_t bytes = 0;
  };

  explicit EmulatedCudaRuntime(Options options = Options());
  ~EmulatedCudaRuntime();
  EmulatedCudaRuntime(const EmulatedCudaRuntime&) = delete;
  EmulatedCudaRuntime& operator=(const EmulatedCudaRuntime&) = delete;

  // The tables to hand to the code under test (valid while the emulator lives).
  const cuda::CudaRuntimeApi& runtime() const { return runtime_; }
  const cuda::CudaDriverApi& driver() const { return driver_; }

  // cudart entry points the tables do not carry.
  cuda::cudaError MallocHost(void** p, size_t bytes);  // cudaMallocHost: pinned host memory
  cuda::cudaError FreeHost(void* p);                   // cudaFreeHost
  // cudaGetLastError / cudaPeekAtLastError of the calling thread.
  cuda::cudaError GetLastError();
  cuda::cudaError PeekAtLastError();

  // A kernel launch of a module loaded on `device` (-1: the calling thread's current
  // device, as a runtime launch) on stream `s`: `kernel` runs when the stream reaches it.
  // cudaErrorInvalidResourceHandle when `s` is not a stream of that device.
  cuda::cudaError Launch(int device, cuda::cudaStream s, std::function<void()> kernel);

  Pointer Query(const void* p) const;
  // The device of a live stream or event; -1 for an unknown handle.
  int DeviceOfStream(cuda::cudaStream s) const;
  int DeviceOfEvent(cuda::cudaEvent e) const;
  // Blocks until every stream ran what was enqueued so far (or the watchdog).
  void Drain();
  size_t live_allocations() const;  // device and pinned
  int live_streams() const;         // created and not destroyed (legacy streams excluded)
  int live_events() const;
  // Stream operations that gave up (a wait past the watchdog); taken, not left for the
  // destructor to report.
  std::vector<std::string> TakeFailures();

 private:
  struct Stream {
    int device = 0;
    bool blocking = false;  // synchronizes with the legacy default stream
    bool legacy = false;
    bool destroyed = false;
    std::deque<std::function<void()>> queue;  // guarded by mu_
    uint64_t enqueued = 0, completed = 0;     // guarded by mu_
    bool stop = false;
    std::thread worker;
  };
  struct Event {
    int device = 0;
    unsigned flags = 0;
    bool destroyed = false;
    Stream* stream = nullptr;  // the last record (null: never recorded)
    uint64_t seq = 0;
    std::shared_ptr<absl::Time> when;  // set when the stream reaches the record
  };
  struct Allocation {
    Memory memory = Memory::kDevice;
    int device = -1;
    size_t bytes = 0;
  };
  struct ThreadState {
    uint64_t generation = 0;
    int device = 0;
    cuda::cudaError last = 0;
  };

  static std::atomic<EmulatedCudaRuntime*>& ActiveSlot() {
    static std::atomic<EmulatedCudaRuntime*> active{nullptr};
    return active;
  }
  static std::atomic<uint64_t>& Generations() {
    static std::atomic<uint64_t> generations{0};
    return generations;
  }
  ThreadState& Thread() {
    thread_local ThreadState state;
    if (state.generation != generation_) state = ThreadState{generation_, 0, 0};
    return state;
  }
  // Runs `f` on the active emulator, keeping the thread's last error as cudart does.
  template <typename F>
  static cuda::cudaError Rt(F f) {
    EmulatedCudaRuntime* e = ActiveSlot().load();
    if (e == nullptr) return kCudaErrorInitializationError;
    const cuda::cudaError r = f(*e);
    if (r != 0 && r != cuda::kCudaErrorNotReady) e->Thread().last = r;
    return r;
  }
  template <typename F>
  static cuda::CUresult Drv(F f) {
    EmulatedCudaRuntime* e = ActiveSlot().load();
    if (e == nullptr) return 3;  // CUDA_ERROR_NOT_INITIALIZED
    return f(*e);
  }

  void FillTables();
  Stream* NewStreamLocked(int device, bool blocking, bool legacy);
  Stream* LegacyLocked(int device);
  // The stream a handle names (null and cudaStreamLegacy: the current device's legacy
  // default stream); null when the handle is not a live stream.
  Stream* ResolveLocked(cuda::cudaStream h);
  uint64_t EnqueueLocked(Stream* s, std::function<void()> op);
  void Work(Stream* s);
  // Waits (mu_ not held) until `s` completed operation `seq`; false past the watchdog.
  bool WaitFor(Stream* s, uint64_t seq, const std::string& what, bool record_failure);
  bool ValidDevice(int d) const { return d >= 0 && d < options_.devices; }
  Pointer QueryLocked(const void* p) const;

  cuda::cudaError Malloc(void** p, size_t bytes);
  cuda::cudaError Free(void* p);
  cuda::cudaError Copy(void* dst, const void* src, size_t bytes, int kind, cuda::cudaStream h,
                       bool synchronous_api);
  cuda::cudaError Memset(void* dst, int value, size_t bytes, cuda::cudaStream h);
  cuda::cudaError StreamCreate(cuda::cudaStream* s, unsigned flags);
  cuda::cudaError StreamDestroy(cuda::cudaStream h);
  cuda::cudaError StreamSynchronize(cuda::cudaStream h);
  cuda::cudaError StreamWaitEvent(cuda::cudaStream h, cuda::cudaEvent e, unsigned flags);
  cuda::cudaError EventCreate(cuda::cudaEvent* e, unsigned flags);
  cuda::cudaError EventDestroy(cuda::cudaEvent e);
  cuda::cudaError EventRecord(cuda::cudaEvent e, cuda::cudaStream h);
  cuda::cudaError EventQuery(cuda::cudaEvent e);
  cuda::cudaError EventSynchronize(cuda::cudaEvent e);
  cuda::cudaError EventElapsedTime(float* ms, cuda::cudaEvent a, cuda::cudaEvent b);
  cuda::cudaError DeviceSynchronize();
  cuda::cudaError DeviceGetAttribute(int* value, int attr, int device);
  cuda::cudaError DeviceGetPCIBusId(char* id, int len, int device);
  cuda::cudaError DeviceGetByPCIBusId(int* device, const char* id);
  cuda::cudaError DeviceCanAccessPeer(int* can, int device, int peer);
  cuda::cudaError DeviceGetP2PAttribute(int* value, int attr, int src, int dst);
  cuda::cudaError IpcGetMemHandle(cuda::CudaIpcMemHandle* h, void* p);
  cuda::CUresult StreamMemOp(cuda::cudaStream h, unsigned long long addr, unsigned value,
                             unsigned flags, bool write);
  Event* EventLocked(cuda::cudaEvent e) {
    auto it = events_.find(reinterpret_cast<Event*>(e));
    return it == events_.end() || it->first->destroyed ? nullptr : it->first;
  }

  static const char* ErrorName(cuda::cudaError e);

  const Options options_;
  const uint64_t generation_;
  cuda::CudaRuntimeApi runtime_;
  cuda::CudaDriverApi driver_;

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<std::unique_ptr<Stream>> streams_;     // every stream ever made, legacy included
  std::set<Stream*> live_streams_;                   // handles that name a stream now
  std::vector<Stream*> legacy_;                      // per device, created on first use
  std::map<Event*, std::unique_ptr<Event>> events_;  // destroyed ones stay (stale handles)
  std::map<uintptr_t, Allocation> allocations_;      // by base address
  std::vector<size_t> used_;                         // device bytes per device
  std::vector<std::string> failures_;
};

// ---- Implementation ----------------------------------------------------------------------

inline EmulatedCudaRuntime::EmulatedCudaRuntime(Options options)
    : options_(std::move(options)), generation_(++Generations()) {
  legacy_.assign(std::max(0, options_.devices), nullptr);
  used_.assign(std::max(0, options_.devices), 0);
  FillTables();
  EmulatedCudaRuntime* expected = nullptr;
  if (!ActiveSlot().compare_exchange_strong(expected, this)) {
    std::fprintf(stderr, "EmulatedCudaRuntime: only one emulator may exist at a time\n");
    std::abort();
  }
}

inline EmulatedCudaRuntime::~EmulatedCudaRuntime() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : streams_) s->stop = true;
    cv_.notify_all();
  }
  for (auto& s : streams_) s->worker.join();  // each finishes its queue first
  ActiveSlot().store(nullptr);
  for (auto& [base, a] : allocations_) std::free(reinterpret_cast<void*>(base));
  for (const std::string& f : failures_) ADD_FAILURE() << "emulated CUDA runtime: " << f;
}

inline void EmulatedCudaRuntime::FillTables() {
  using cuda::cudaError;
  using cuda::cudaEvent;
  using cuda::cudaStream;
  cuda::CudaRuntimeApi& r = runtime_;
  r.path = "emulated cudart";
  r.GetDeviceCount = [](int* n) {
    return Rt([&](EmulatedCudaRuntime& e) -> cudaError {
      if (n == nullptr) return kCudaErrorInvalidValue;
      *n = std::max(0, e.options_.devices);
      return *n == 0 ? kCudaErrorNoDevice : 0;
    });
  };
  // "Device memory allocations and kernel launches are made on the currently set device;
  // streams and events are created in association with the currently set device. If no
  // call to cudaSetDevice() is made, the current device is device 0." (CUDA C++
  // Programming Guide, Multi-Device System.) cudaSetDevice: cudaErrorInvalidDevice for an
  // ordinal outside [0, count).
  r.SetDevice = [](int d) {
    return Rt([&](EmulatedCudaRuntime& e) -> cudaError {
      if (!e.ValidDevice(d)) return kCudaErrorInvalidDevice;
      e.Thread().device = d;
      return 0;
    });
  };
  r.GetDevice = [](int* d) {
    return Rt([&](EmulatedCudaRuntime& e) -> cudaError {
      if (d == nullptr) return kCudaErrorInvalidValue;
      *d = e.Thread().device;
      return 0;
    });
  };
  r.GetErrorString = [](cudaError e) { return ErrorName(e); };
  r.Malloc = [](void** p, size_t n) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.Malloc(p, n); });
  };
  r.Free = [](void* p) { return Rt([&](EmulatedCudaRuntime& e) { return e.Free(p); }); };
  r.Memcpy = [](void* d, const void* s, size_t n, int kind) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.Copy(d, s, n, kind, nullptr, true); });
  };
  r.MemcpyAsync = [](void* d, const void* s, size_t n, int kind, cudaStream st) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.Copy(d, s, n, kind, st, false); });
  };
  r.MemsetAsync = [](void* d, int v, size_t n, cudaStream st) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.Memset(d, v, n, st); });
  };
  r.StreamCreateWithFlags = [](cudaStream* s, unsigned flags) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.StreamCreate(s, flags); });
  };
  r.StreamDestroy = [](cudaStream s) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.StreamDestroy(s); });
  };
  r.StreamSynchronize = [](cudaStream s) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.StreamSynchronize(s); });
  };
  r.StreamWaitEvent = [](cudaStream s, cudaEvent ev, unsigned flags) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.StreamWaitEvent(s, ev, flags); });
  };
  r.EventCreateWithFlags = [](cudaEvent* ev, unsigned flags) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.EventCreate(ev, flags); });
  };
  r.EventDestroy = [](cudaEvent ev) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.EventDestroy(ev); });
  };
  r.EventRecord = [](cudaEvent ev, cudaStream s) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.EventRecord(ev, s); });
  };
  r.EventQuery = [](cudaEvent ev) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.EventQuery(ev); });
  };
  r.EventSynchronize = [](cudaEvent ev) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.EventSynchronize(ev); });
  };
  r.EventElapsedTime = [](float* ms, cudaEvent a, cudaEvent b) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.EventElapsedTime(ms, a, b); });
  };
  r.DeviceSynchronize = [] {
    return Rt([&](EmulatedCudaRuntime& e) { return e.DeviceSynchronize(); });
  };
  r.DeviceGetAttribute = [](int* v, int attr, int d) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.DeviceGetAttribute(v, attr, d); });
  };
  r.DeviceGetPCIBusId = [](char* id, int len, int d) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.DeviceGetPCIBusId(id, len, d); });
  };
  r.DeviceGetByPCIBusId = [](int* d, const char* id) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.DeviceGetByPCIBusId(d, id); });
  };
  r.DeviceCanAccessPeer = [](int* can, int d, int peer) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.DeviceCanAccessPeer(can, d, peer); });
  };
  r.DeviceGetP2PAttribute = [](int* v, int attr, int src, int dst) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.DeviceGetP2PAttribute(v, attr, src, dst); });
  };
  r.IpcGetMemHandle = [](cuda::CudaIpcMemHandle* h, void* p) {
    return Rt([&](EmulatedCudaRuntime& e) { return e.IpcGetMemHandle(h, p); });
  };
  // "Opens an interprocess memory handle exported from another process": the emulator is
  // one process, so there is no other process whose handle could be opened.
  r.IpcOpenMemHandle = [](void** p, cuda::CudaIpcMemHandle, unsigned) {
    return Rt([&](EmulatedCudaRuntime&) -> cudaError {
      if (p != nullptr) *p = nullptr;
      return kCudaErrorInvalidResourceHandle;
    });
  };
  r.IpcCloseMemHandle = [](void*) {
    return Rt([&](EmulatedCudaRuntime&) { return kCudaErrorInvalidValue; });
  };

  cuda::CudaDriverApi& d = driver_;
  d.path = "emulated libcuda";
  d.Init = [](unsigned flags) {
    return Drv([&](EmulatedCudaRuntime&) { return flags == 0 ? 0 : kCuErrorInvalidValue; });
  };
  d.GetErrorString = [](cuda::CUresult r, const char** s) {
    return Drv([&](EmulatedCudaRuntime&) -> cuda::CUresult {
      if (s == nullptr) return kCuErrorInvalidValue;
      // The CUresult values the emulator returns share their numbers with cudaError_t.
      *s = r == 3 ? "initialization error" : ErrorName(r);
      return 0;
    });
  };
  // Contexts: each device's primary context, (CUcontext)(device + 1); the current context is
  // the calling thread's current device, as cudart's primary-context use has it.
  d.CtxGetCurrent = [](cuda::CUcontext* c) {
    return Drv([&](EmulatedCudaRuntime& e) -> cuda::CUresult {
      if (c == nullptr) return kCuErrorInvalidValue;
      *c = reinterpret_cast<cuda::CUcontext>(static_cast<uintptr_t>(e.Thread().device) + 1);
      return 0;
    });
  };
  d.CtxSetCurrent = [](cuda::CUcontext c) {
    return Drv([&](EmulatedCudaRuntime& e) -> cuda::CUresult {
      const int device = static_cast<int>(reinterpret_cast<uintptr_t>(c)) - 1;
      if (!e.ValidDevice(device)) return kCuErrorInvalidContext;
      e.Thread().device = device;
      return 0;
    });
  };
  d.ModuleLoadData = [](cuda::CUmodule*, const void*) {
    return Drv([](EmulatedCudaRuntime&) { return kCuErrorNotSupported; });
  };
  d.ModuleUnload = [](cuda::CUmodule) {
    return Drv([](EmulatedCudaRuntime&) { return kCuErrorNotSupported; });
  };
  d.ModuleGetFunction = [](cuda::CUfunction*, cuda::CUmodule, const char*) {
    return Drv([](EmulatedCudaRuntime&) { return kCuErrorNotSupported; });
  };
  d.FuncSetAttribute = [](cuda::CUfunction, int, int) {
    return Drv([](EmulatedCudaRuntime&) { return kCuErrorNotSupported; });
  };
  d.LaunchKernel = [](cuda::CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                      unsigned, cudaStream, void**, void**) {
    return Drv([](EmulatedCudaRuntime&) { return kCuErrorNotSupported; });
  };
  d.OccupancyMaxActiveBlocksPerMultiprocessor = [](int*, cuda::CUfunction, int, size_t) {
    return Drv([](EmulatedCudaRuntime&) { return kCuErrorNotSupported; });
  };
  d.StreamWriteValue32 = [](cudaStream s, unsigned long long addr, unsigned v, unsigned flags) {
    return Drv([&](EmulatedCudaRuntime& e) { return e.StreamMemOp(s, addr, v, flags, true); });
  };
  d.StreamWaitValue32 = [](cudaStream s, unsigned long long addr, unsigned v, unsigned flags) {
    return Drv([&](EmulatedCudaRuntime& e) { return e.StreamMemOp(s, addr, v, flags, false); });
  };
  // cuTensorMapEncodeTiled: the driver's documented requirements and the emulator's layout of
  // the 128 bytes (tests/support/emulated_tensor_map.h), which the emulated TMA decodes.
  d.TensorMapEncodeTiled = [](void* map, int dtype, unsigned rank, void* address,
                              const unsigned long long* dims, const unsigned long long* strides,
                              const unsigned* box, const unsigned* element_strides,
                              int interleave, int swizzle, int l2, int oob_fill) {
    return Drv([&](EmulatedCudaRuntime&) -> cuda::CUresult {
      static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
      return hsap_emu::EmuEncodeTiledTensorMap(
          map, dtype, rank, address, reinterpret_cast<const uint64_t*>(dims),
          reinterpret_cast<const uint64_t*>(strides), box, element_strides, interleave, swizzle,
          l2, oob_fill);
    });
  };
  d.DeviceGet = [](int* dev, int ordinal) {
    return Drv([&](EmulatedCudaRuntime& e) -> cuda::CUresult {
      if (dev == nullptr) return kCuErrorInvalidValue;
      if (!e.ValidDevice(ordinal)) return kCuErrorInvalidDevice;
      *dev = ordinal;
      return 0;
    });
  };
  d.DeviceGetName = [](char* name, int len, int dev) {
    return Drv([&](EmulatedCudaRuntime& e) -> cuda::CUresult {
      if (name == nullptr || len <= 0) return kCuErrorInvalidValue;
      if (!e.ValidDevice(dev)) return kCuErrorInvalidDevice;
      std::snprintf(name, static_cast<size_t>(len), "%s", e.options_.name.c_str());
      return 0;
    });
  };
  d.DeviceTotalMem = [](size_t* bytes, int dev) {
    return Drv([&](EmulatedCudaRuntime& e) -> cuda::CUresult {
      if (bytes == nullptr) return kCuErrorInvalidValue;
      if (!e.ValidDevice(dev)) return kCuErrorInvalidDevice;
      *bytes = e.options_.memory_bytes;
      return 0;
    });
  };
}

inline const char* EmulatedCudaRuntime::ErrorName(cuda::cudaError e) {
  switch (e) {
    case 0:
      return "no error";
    case kCudaErrorInvalidValue:
      return "invalid argument";
    case kCudaErrorMemoryAllocation:
      return "out of memory";
    case kCudaErrorInitializationError:
      return "initialization error (no emulated CUDA runtime)";
    case kCudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case kCudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case kCudaErrorInvalidDevice:
      return "invalid device ordinal";
    case 201:
      return "invalid device context";
    case kCudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cuda::kCudaErrorNotReady:
      return "device not ready";
    case kCudaErrorNotSupported:
      return "operation not supported";
    case kCudaErrorTimeout:
      return "the operation timed out (emulator watchdog)";
    default:
      return "unrecognized error code";
  }
}

// ---- Streams ------------------------------------------------------------------------------

inline EmulatedCudaRuntime::Stream* EmulatedCudaRuntime::NewStreamLocked(int device, bool blocking,
                                                                         bool legacy) {
  auto s = std::make_unique<Stream>();
  s->device = device;
  s->blocking = blocking;
  s->legacy = legacy;
  Stream* raw = s.get();
  s->worker = std::thread([this, raw] { Work(raw); });
  streams_.push_back(std::move(s));
  return raw;
}

inline EmulatedCudaRuntime::Stream* EmulatedCudaRuntime::LegacyLocked(int device) {
  if (legacy_[device] == nullptr) legacy_[device] = NewStreamLocked(device, true, true);
  return legacy_[device];
}

inline EmulatedCudaRuntime::Stream* EmulatedCudaRuntime::ResolveLocked(cuda::cudaStream h) {
  // 0 and cudaStreamLegacy ((cudaStream_t)0x1): "Each device has its own default stream"
  // (Programming Guide, Stream and Event Behavior): the current device's.
  if (h == nullptr || h == reinterpret_cast<cuda::cudaStream>(uintptr_t{1})) {
    return LegacyLocked(Thread().device);
  }
  auto* s = reinterpret_cast<Stream*>(h);
  return live_streams_.count(s) != 0 ? s : nullptr;  // cudaStreamPerThread is not emulated
}

inline uint64_t EmulatedCudaRuntime::EnqueueLocked(Stream* s, std::function<void()> op) {
  // The legacy default stream "synchronizes with all other blocking streams in the same
  // device" (Runtime API, Stream synchronization behavior): work on it waits for what the
  // blocking streams hold, work on a blocking stream waits for what it holds. Streams created
  // with cudaStreamNonBlocking take no part.
  std::vector<std::pair<Stream*, uint64_t>> after;
  if (s->legacy) {
    for (auto& t : streams_) {
      if (t.get() != s && t->blocking && t->device == s->device && t->enqueued > t->completed) {
        after.emplace_back(t.get(), t->enqueued);
      }
    }
  } else if (s->blocking) {
    Stream* l = legacy_[s->device];
    if (l != nullptr && l->enqueued > l->completed) after.emplace_back(l, l->enqueued);
  }
  if (!after.empty()) {
    op = [this, after, inner = std::move(op)] {
      for (const auto& [t, seq] : after) {
        WaitFor(t, seq, "implicit synchronization with the legacy default stream", true);
      }
      inner();
    };
  }
  s->queue.push_back(std::move(op));
  cv_.notify_all();
  return ++s->enqueued;
}

inline void EmulatedCudaRuntime::Work(Stream* s) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return s->stop || !s->queue.empty(); });
    if (s->queue.empty()) return;  // stopping, nothing left
    std::function<void()> op = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
    op();
    lock.lock();
    ++s->completed;
    cv_.notify_all();
  }
}

inline bool EmulatedCudaRuntime::WaitFor(Stream* s, uint64_t seq, const std::string& what,
                                         bool record_failure) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline =
      std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(options_.watchdog);
  if (cv_.wait_until(lock, deadline, [&] { return s->completed >= seq; })) return true;
  if (record_failure) {
    failures_.push_back(absl::StrCat(what, ": waited ", absl::FormatDuration(options_.watchdog),
                                     " for a stream of device ", s->device));
  }
  return false;
}

inline cuda::cudaError EmulatedCudaRuntime::StreamCreate(cuda::cudaStream* out, unsigned flags) {
  if (out == nullptr || (flags & ~cuda::kCudaStreamNonBlocking) != 0) return kCudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(mu_);
  // "streams and events are created in association with the currently set device".
  Stream* s = NewStreamLocked(Thread().device, (flags & cuda::kCudaStreamNonBlocking) == 0, false);
  live_streams_.insert(s);
  *out = reinterpret_cast<cuda::cudaStream>(s);
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::StreamDestroy(cuda::cudaStream h) {
  std::lock_guard<std::mutex> lock(mu_);
  if (h == nullptr) return kCudaErrorInvalidResourceHandle;
  Stream* s = ResolveLocked(h);
  if (s == nullptr || s->legacy) return kCudaErrorInvalidResourceHandle;
  // "In case the device is still doing work in the stream stream when cudaStreamDestroy() is
  // called, the function will return immediately and the resources associated with stream
  // will be released automatically once the device has completed all work in stream."
  s->destroyed = true;
  live_streams_.erase(s);
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::StreamSynchronize(cuda::cudaStream h) {
  Stream* s;
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = ResolveLocked(h);
    if (s == nullptr) return kCudaErrorInvalidResourceHandle;
    seq = s->enqueued;
  }
  return WaitFor(s, seq, "cudaStreamSynchronize", false) ? 0 : kCudaErrorTimeout;
}

inline cuda::cudaError EmulatedCudaRuntime::StreamWaitEvent(cuda::cudaStream h, cuda::cudaEvent e,
                                                            unsigned flags) {
  if (flags != 0) return kCudaErrorInvalidValue;  // cudaEventWaitExternal: graph capture only
  std::lock_guard<std::mutex> lock(mu_);
  Stream* s = ResolveLocked(h);
  Event* ev = EventLocked(e);
  if (s == nullptr || ev == nullptr) return kCudaErrorInvalidResourceHandle;
  // "event may be from a different device than stream." (cudaStreamWaitEvent) Uses "the most
  // recently captured state at the time of the API call"; an event never recorded is "an
  // empty set of work" (cudaEventRecord).
  if (ev->stream == nullptr) return 0;
  Stream* on = ev->stream;
  const uint64_t seq = ev->seq;
  EnqueueLocked(s, [this, on, seq] { WaitFor(on, seq, "cudaStreamWaitEvent", true); });
  return 0;
}

// ---- Events -------------------------------------------------------------------------------

inline cuda::cudaError EmulatedCudaRuntime::EventCreate(cuda::cudaEvent* out, unsigned flags) {
  // cudaEventDefault 0, BlockingSync 1, DisableTiming 2, Interprocess 4 ("must be specified
  // along with cudaEventDisableTiming").
  constexpr unsigned kInterprocess = 4;
  if (out == nullptr || (flags & ~7u) != 0) return kCudaErrorInvalidValue;
  if ((flags & kInterprocess) != 0 && (flags & cuda::kCudaEventDisableTiming) == 0) {
    return kCudaErrorInvalidValue;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto ev = std::make_unique<Event>();
  ev->device = Thread().device;  // "created in association with the currently set device"
  ev->flags = flags;
  Event* raw = ev.get();
  events_.emplace(raw, std::move(ev));
  *out = reinterpret_cast<cuda::cudaEvent>(raw);
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::EventDestroy(cuda::cudaEvent e) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* ev = EventLocked(e);
  if (ev == nullptr) return kCudaErrorInvalidResourceHandle;
  // "In case event has been recorded but has not yet been completed when cudaEventDestroy()
  // is called, the function will return immediately": waits already enqueued keep their
  // copy of the record.
  ev->destroyed = true;
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::EventRecord(cuda::cudaEvent e, cuda::cudaStream h) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* ev = EventLocked(e);
  Stream* s = ResolveLocked(h);
  if (ev == nullptr || s == nullptr) return kCudaErrorInvalidResourceHandle;
  // "event and stream must be on the same device." (cudaEventRecord) "cudaEventRecord() will
  // fail if the input event and input stream are associated to different devices."
  // (Programming Guide, Stream and Event Behavior) The driver: "h_event and h_stream must be
  // from the same context otherwise CUDA_ERROR_INVALID_HANDLE is returned." (cuEventRecord)
  if (ev->device != s->device) return kCudaErrorInvalidResourceHandle;
  // "Captures in event the contents of stream at the time of this call ... can be called
  // multiple times on the same event and will overwrite the previously captured state."
  auto when = std::make_shared<absl::Time>(absl::InfinitePast());
  ev->seq = EnqueueLocked(s, [when] { *when = absl::Now(); });
  ev->stream = s;
  ev->when = when;
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::EventQuery(cuda::cudaEvent e) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* ev = EventLocked(e);
  if (ev == nullptr) return kCudaErrorInvalidResourceHandle;
  // "cudaEventSynchronize() and cudaEventQuery() will succeed even if the input event is
  // associated to a device that is different from the current device." "Before the first
  // call to cudaEventRecord(), an event represents an empty set of work, so for example
  // cudaEventQuery() would return cudaSuccess."
  if (ev->stream == nullptr || ev->stream->completed >= ev->seq) return 0;
  return cuda::kCudaErrorNotReady;
}

inline cuda::cudaError EmulatedCudaRuntime::EventSynchronize(cuda::cudaEvent e) {
  Stream* s;
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Event* ev = EventLocked(e);
    if (ev == nullptr) return kCudaErrorInvalidResourceHandle;
    if (ev->stream == nullptr) return 0;
    s = ev->stream;
    seq = ev->seq;
  }
  return WaitFor(s, seq, "cudaEventSynchronize", false) ? 0 : kCudaErrorTimeout;
}

inline cuda::cudaError EmulatedCudaRuntime::EventElapsedTime(float* ms, cuda::cudaEvent a,
                                                             cuda::cudaEvent b) {
  if (ms == nullptr) return kCudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(mu_);
  Event* start = EventLocked(a);
  Event* end = EventLocked(b);
  if (start == nullptr || end == nullptr) return kCudaErrorInvalidResourceHandle;
  // "If cuEventRecord() has not been called on either event then CUDA_ERROR_INVALID_HANDLE
  // is returned ... If either event was created with the CU_EVENT_DISABLE_TIMING flag, then
  // this function will return CUDA_ERROR_INVALID_HANDLE." (cuEventElapsedTime)
  // "cudaEventElapsedTime() will fail if the two input events are associated to different
  // devices." (Programming Guide)
  if (start->stream == nullptr || end->stream == nullptr || start->device != end->device ||
      ((start->flags | end->flags) & cuda::kCudaEventDisableTiming) != 0) {
    return kCudaErrorInvalidResourceHandle;
  }
  // "... but one or both of them has not yet been completed ... CUDA_ERROR_NOT_READY".
  if (start->stream->completed < start->seq || end->stream->completed < end->seq) {
    return cuda::kCudaErrorNotReady;
  }
  *ms = static_cast<float>(absl::ToDoubleMilliseconds(*end->when - *start->when));
  return 0;
}

// ---- Memory -------------------------------------------------------------------------------

inline EmulatedCudaRuntime::Pointer EmulatedCudaRuntime::QueryLocked(const void* p) const {
  const auto at = reinterpret_cast<uintptr_t>(p);
  auto it = allocations_.upper_bound(at);
  if (it == allocations_.begin()) return Pointer{};
  --it;
  if (at >= it->first + it->second.bytes) return Pointer{};
  return Pointer{it->second.memory, it->second.device, reinterpret_cast<const char*>(it->first),
                 it->second.bytes};
}

inline EmulatedCudaRuntime::Pointer EmulatedCudaRuntime::Query(const void* p) const {
  std::lock_guard<std::mutex> lock(mu_);
  return QueryLocked(p);
}

inline cuda::cudaError EmulatedCudaRuntime::Malloc(void** p, size_t bytes) {
  if (p == nullptr) return kCudaErrorInvalidValue;
  *p = nullptr;
  if (bytes == 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  const int device = Thread().device;  // "made on the currently set device"
  const size_t rounded = (bytes + 255) / 256 * 256;
  // "cudaMalloc returns cudaErrorMemoryAllocation in case of failure."
  if (used_[device] + rounded > options_.memory_bytes) return kCudaErrorMemoryAllocation;
  void* m = std::aligned_alloc(256, rounded);
  if (m == nullptr) return kCudaErrorMemoryAllocation;
  std::memset(m, 0xA5, rounded);  // "The memory is not cleared."
  used_[device] += rounded;
  allocations_[reinterpret_cast<uintptr_t>(m)] = Allocation{Memory::kDevice, device, bytes};
  *p = m;
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::Free(void* p) {
  // "If devPtr is 0, no operation is performed."
  if (p == nullptr) return 0;
  std::vector<std::pair<Stream*, uint64_t>> tails;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(p));
    // "Frees the memory space pointed to by devPtr, which must have been returned by a
    // previous call to cudaMalloc() ... Otherwise, or if cudaFree(devPtr) has already been
    // called before, an error is returned." (cudaErrorInvalidValue since CUDA 10.1)
    if (it == allocations_.end() || it->second.memory != Memory::kDevice) {
      return kCudaErrorInvalidValue;
    }
    // cudaFree synchronizes the device that owns the memory, so it is not released under
    // work still using it (device.h relies on that). The emulator waits for that device's
    // streams only: work of other GPUs may wait for this thread (a peer that has not posted
    // yet), and waiting for it would deadlock where a GPU does not.
    for (auto& s : streams_) {
      if (s->device == it->second.device) tails.emplace_back(s.get(), s->enqueued);
    }
  }
  for (const auto& [s, seq] : tails) WaitFor(s, seq, "cudaFree", true);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocations_.end()) return kCudaErrorInvalidValue;  // freed meanwhile
  used_[it->second.device] -= (it->second.bytes + 255) / 256 * 256;
  allocations_.erase(it);
  std::free(p);
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::MallocHost(void** p, size_t bytes) {
  return Rt([&](EmulatedCudaRuntime& e) -> cuda::cudaError {
    if (p == nullptr) return kCudaErrorInvalidValue;
    *p = nullptr;
    if (bytes == 0) return 0;
    const size_t rounded = (bytes + 255) / 256 * 256;
    void* m = std::aligned_alloc(256, rounded);
    if (m == nullptr) return kCudaErrorMemoryAllocation;
    std::memset(m, 0xA5, rounded);
    std::lock_guard<std::mutex> lock(e.mu_);
    e.allocations_[reinterpret_cast<uintptr_t>(m)] = Allocation{Memory::kPinnedHost, -1, bytes};
    *p = m;
    return 0;
  });
}

inline cuda::cudaError EmulatedCudaRuntime::FreeHost(void* p) {
  return Rt([&](EmulatedCudaRuntime& e) -> cuda::cudaError {
    if (p == nullptr) return 0;
    {
      std::lock_guard<std::mutex> lock(e.mu_);
      auto it = e.allocations_.find(reinterpret_cast<uintptr_t>(p));
      if (it == e.allocations_.end() || it->second.memory != Memory::kPinnedHost) {
        return kCudaErrorInvalidValue;
      }
    }
    e.Drain();
    std::lock_guard<std::mutex> lock(e.mu_);
    e.allocations_.erase(reinterpret_cast<uintptr_t>(p));
    std::free(p);
    return 0;
  });
}

// cudaMemcpy (synchronous_api, on the current device's legacy default stream) and
// cudaMemcpyAsync.
inline cuda::cudaError EmulatedCudaRuntime::Copy(void* dst, const void* src, size_t bytes, int kind,
                                                 cuda::cudaStream h, bool synchronous_api) {
  if (kind < cuda::kCudaMemcpyHostToHost || kind > cuda::kCudaMemcpyDefault) {
    return kCudaErrorInvalidMemcpyDirection;
  }
  if (bytes == 0) return 0;
  if (dst == nullptr || src == nullptr) return kCudaErrorInvalidValue;
  Stream* s;
  uint64_t seq = 0;
  bool wait = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // "A memory copy will succeed even if it is issued to a stream that is not associated to
    // the current device." (Programming Guide, Stream and Event Behavior): any live stream.
    s = ResolveLocked(h);
    if (s == nullptr) return kCudaErrorInvalidResourceHandle;
    const Pointer from = QueryLocked(src), to = QueryLocked(dst);
    // A range that starts in an allocation must end in it. (Not stated by the documentation:
    // past the end a GPU faults or corrupts a neighbour; the emulator refuses the copy with
    // cudaErrorInvalidValue.)
    const auto past_end = [bytes](const Pointer& p, const void* at) {
      return p.base != nullptr && static_cast<const char*>(at) + bytes > p.base + p.bytes;
    };
    if (past_end(from, src) || past_end(to, dst)) return kCudaErrorInvalidValue;
    const bool src_device = from.memory == Memory::kDevice;
    const bool dst_device = to.memory == Memory::kDevice;
    // "kind specifies the direction of the copy ... Calling cudaMemcpyAsync() with dst and src
    // pointers that do not match the direction of the copy results in an undefined behavior."
    // (cudaMemcpy, cudaMemcpyAsync) The emulator fails such a copy with cudaErrorInvalidValue,
    // which is what the driver answered on an H200 for cudaMemcpyDeviceToDevice between
    // pageable host buffers. "Passing cudaMemcpyDefault is recommended, in which case the type
    // of transfer is inferred from the pointer values."
    const bool matches = kind == cuda::kCudaMemcpyDefault ||
                         (kind == cuda::kCudaMemcpyHostToHost && !src_device && !dst_device) ||
                         (kind == cuda::kCudaMemcpyHostToDevice && !src_device && dst_device) ||
                         (kind == cuda::kCudaMemcpyDeviceToHost && src_device && !dst_device) ||
                         (kind == cuda::kCudaMemcpyDeviceToDevice && src_device && dst_device);
    if (!matches) return kCudaErrorInvalidValue;

    // When the host may go on (Runtime API, "API synchronization behavior"):
    //  - "For transfers from pageable host memory to device memory, a stream sync is performed
    //    before the copy is initiated. The function will return once the pageable buffer has
    //    been copied to the staging memory for DMA transfer to device memory, but the DMA to
    //    final destination may not have completed." (cudaMemcpy) "If pageable memory must
    //    first be staged to pinned memory, the driver may synchronize with the stream and
    //    stage the copy into pinned memory." (Async): the source is read now, the destination
    //    written when the stream gets there.
    //  - "For transfers from device memory to pageable host memory, the function will return
    //    only once the copy has completed." (Async) "For transfers from device to either
    //    pageable or pinned host memory, the function returns only once the copy has
    //    completed." (cudaMemcpy)
    //  - "For transfers from any host memory to any host memory, the function is fully
    //    synchronous with respect to the host."
    //  - "For transfers from pinned host memory to device memory, the function is synchronous
    //    with respect to the host." (cudaMemcpy) "For all other transfers, the function should
    //    be fully asynchronous." (Async)
    const bool staged = !src_device && from.memory == Memory::kPageable && dst_device;
    wait = (!src_device && !dst_device) ||
           (src_device && !dst_device && (synchronous_api || to.memory == Memory::kPageable)) ||
           (synchronous_api && !staged);
    if (staged && synchronous_api && s->enqueued > s->completed) {
      // "a stream sync is performed before the copy is initiated": wait, then stage.
      const uint64_t tail = s->enqueued;
      lock.unlock();
      const bool synced = WaitFor(s, tail, "cudaMemcpy", false);
      lock.lock();
      if (!synced) return kCudaErrorTimeout;
    }
    if (staged) {
      auto staging = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                         static_cast<const char*>(src) + bytes);
      seq =
          EnqueueLocked(s, [dst, staging] { std::memcpy(dst, staging->data(), staging->size()); });
    } else {
      seq = EnqueueLocked(s, [dst, src, bytes] { std::memmove(dst, src, bytes); });
    }
  }
  if (wait && !WaitFor(s, seq, "cudaMemcpy", false)) return kCudaErrorTimeout;
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::Memset(void* dst, int value, size_t bytes,
                                                   cuda::cudaStream h) {
  if (bytes == 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  Stream* s = ResolveLocked(h);
  if (s == nullptr) return kCudaErrorInvalidResourceHandle;
  // "Fills the first count bytes of the memory area pointed to by devPtr" -- device memory,
  // inside its allocation.
  const Pointer to = QueryLocked(dst);
  if (to.memory != Memory::kDevice || static_cast<const char*>(dst) + bytes > to.base + to.bytes) {
    return kCudaErrorInvalidValue;
  }
  EnqueueLocked(s, [dst, value, bytes] { std::memset(dst, value, bytes); });
  return 0;
}

// ---- Devices ------------------------------------------------------------------------------

inline cuda::cudaError EmulatedCudaRuntime::DeviceSynchronize() {
  std::vector<std::pair<Stream*, uint64_t>> tails;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int device = Thread().device;
    for (auto& s : streams_) {
      if (s->device == device) tails.emplace_back(s.get(), s->enqueued);
    }
  }
  for (const auto& [s, seq] : tails) {
    if (!WaitFor(s, seq, "cudaDeviceSynchronize", false)) return kCudaErrorTimeout;
  }
  return 0;
}

inline void EmulatedCudaRuntime::Drain() {
  std::vector<std::pair<Stream*, uint64_t>> tails;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : streams_) tails.emplace_back(s.get(), s->enqueued);
  }
  for (const auto& [s, seq] : tails) WaitFor(s, seq, "draining the streams", true);
}

inline cuda::cudaError EmulatedCudaRuntime::DeviceGetAttribute(int* value, int attr, int device) {
  if (value == nullptr) return kCudaErrorInvalidValue;
  if (!ValidDevice(device)) return kCudaErrorInvalidDevice;
  switch (attr) {
    case cuda::kCudaDevAttrMultiProcessorCount:
      *value = options_.sm_count;
      return 0;
    case cuda::kCudaDevAttrComputeCapabilityMajor:
      *value = options_.cc_major;
      return 0;
    case cuda::kCudaDevAttrComputeCapabilityMinor:
      *value = options_.cc_minor;
      return 0;
    default:
      return kCudaErrorInvalidValue;
  }
}

inline cuda::cudaError EmulatedCudaRuntime::DeviceGetPCIBusId(char* id, int len, int device) {
  if (id == nullptr || len <= 0) return kCudaErrorInvalidValue;
  if (!ValidDevice(device)) return kCudaErrorInvalidDevice;
  // "[domain]:[bus]:[device].[function]", 13 characters and the NUL.
  if (len < 13) return kCudaErrorInvalidValue;
  std::snprintf(id, static_cast<size_t>(len), "0000:%02x:00.0", 0x10 + device);
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::DeviceGetByPCIBusId(int* device, const char* id) {
  if (device == nullptr || id == nullptr) return kCudaErrorInvalidValue;
  for (int d = 0; d < options_.devices; ++d) {
    char mine[32];
    std::snprintf(mine, sizeof(mine), "0000:%02x:00.0", 0x10 + d);
    if (std::strcmp(mine, id) == 0) {
      *device = d;
      return 0;
    }
  }
  return kCudaErrorInvalidDevice;
}

inline cuda::cudaError EmulatedCudaRuntime::DeviceCanAccessPeer(int* can, int device, int peer) {
  if (can == nullptr) return kCudaErrorInvalidValue;
  if (!ValidDevice(device) || !ValidDevice(peer)) return kCudaErrorInvalidDevice;
  *can = device != peer && options_.peer_access ? 1 : 0;
  return 0;
}

inline cuda::cudaError EmulatedCudaRuntime::DeviceGetP2PAttribute(int* value, int attr, int src,
                                                                  int dst) {
  if (value == nullptr) return kCudaErrorInvalidValue;
  // "Returns cudaErrorInvalidDevice if srcDevice or dstDevice are not valid or if they
  // represent the same device." (cudaDeviceGetP2PAttribute)
  if (!ValidDevice(src) || !ValidDevice(dst) || src == dst) return kCudaErrorInvalidDevice;
  switch (attr) {
    case 1:  // cudaDevP2PAttrPerformanceRank
      *value = 0;
      return 0;
    case 2:  // cudaDevP2PAttrAccessSupported
      *value = options_.peer_access ? 1 : 0;
      return 0;
    case cuda::kCudaDevP2PAttrNativeAtomicSupported:
      *value = options_.peer_access && options_.p2p_native_atomics ? 1 : 0;
      return 0;
    case 4:  // cudaDevP2PAttrCudaArrayAccessSupported
      *value = 0;
      return 0;
    default:
      return kCudaErrorInvalidValue;
  }
}

inline cuda::cudaError EmulatedCudaRuntime::IpcGetMemHandle(cuda::CudaIpcMemHandle* h, void* p) {
  if (h == nullptr) return kCudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(mu_);
  // "Takes a pointer to the base of an existing device memory allocation created with
  // cudaMalloc and exports it for use in another process."
  auto it = allocations_.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocations_.end() || it->second.memory != Memory::kDevice) {
    return kCudaErrorInvalidValue;
  }
  std::memset(h->reserved, 0, sizeof(h->reserved));
  std::memcpy(h->reserved, &p, sizeof(p));
  return 0;
}

// ---- Driver stream memory operations ------------------------------------------------------

inline cuda::CUresult EmulatedCudaRuntime::StreamMemOp(cuda::cudaStream h, unsigned long long addr,
                                                       unsigned value, unsigned flags, bool write) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream* s = ResolveLocked(h);
  if (s == nullptr) return kCuErrorInvalidHandle;
  auto* word = reinterpret_cast<uint32_t*>(static_cast<uintptr_t>(addr));
  // "addr - The device address to write to." "If the memory was registered via
  // cuMemHostRegister(), the device pointer should be obtained with
  // cuMemHostGetDevicePointer()." (cuStreamWriteValue32): device memory or pinned host
  // memory, never pageable memory; the word inside its allocation and 4-byte aligned (the
  // emulator's reading of a 32-bit operation; the documentation does not say).
  const Pointer at = QueryLocked(word);
  if (at.memory == Memory::kPageable || addr % 4 != 0 ||
      reinterpret_cast<const char*>(word) + 4 > at.base + at.bytes) {
    return kCuErrorInvalidValue;
  }
  if (write) {
    // CU_STREAM_WRITE_VALUE_DEFAULT (0) or _NO_MEMORY_BARRIER (1).
    if ((flags & ~1u) != 0) return kCuErrorInvalidValue;
    EnqueueLocked(s, [word, value] { std::atomic_ref<uint32_t>(*word).store(value); });
    return 0;
  }
  // CU_STREAM_WAIT_VALUE_GEQ 0, _EQ 1, _AND 2, _NOR 3, optionally | _FLUSH (1 << 30).
  const unsigned op = flags & ~(1u << 30);
  if (op > 3) return kCuErrorInvalidValue;
  EnqueueLocked(s, [this, word, value, op] {
    const auto reached = [&] {
      const uint32_t v = std::atomic_ref<uint32_t>(*word).load();
      switch (op) {
        case 0:
          return static_cast<int32_t>(v - value) >= 0;
        case 1:
          return v == value;
        case 2:
          return (v & value) != 0;
        default:
          return ~(v | value) != 0;
      }
    };
    const absl::Time deadline = absl::Now() + options_.watchdog;
    std::unique_lock<std::mutex> lock(mu_);
    // Other streams' writes notify; kernels' atomics do not, hence the short period.
    while (!reached()) {
      if (absl::Now() > deadline) {
        failures_.push_back(absl::StrCat("cuStreamWaitValue32 never saw its value ", value,
                                         " (the word holds ",
                                         std::atomic_ref<uint32_t>(*word).load(), ")"));
        return;
      }
      cv_.wait_for(lock, std::chrono::milliseconds(1));
    }
  });
  return 0;
}

// ---- Test helpers -------------------------------------------------------------------------

inline cuda::cudaError EmulatedCudaRuntime::Launch(int device, cuda::cudaStream h,
                                                   std::function<void()> kernel) {
  return Rt([&](EmulatedCudaRuntime& e) -> cuda::cudaError {
    std::lock_guard<std::mutex> lock(e.mu_);
    const int on = device < 0 ? e.Thread().device : device;
    Stream* s = e.ResolveLocked(h);
    if (s == nullptr) return kCudaErrorInvalidResourceHandle;
    // "A kernel launch will fail if it is issued to a stream that is not associated to the
    // current device" (Programming Guide, Stream and Event Behavior); a driver launch takes
    // the function's context, which must be the stream's.
    if (s->device != on) return kCudaErrorInvalidResourceHandle;
    e.EnqueueLocked(s, std::move(kernel));
    return 0;
  });
}

inline cuda::cudaError EmulatedCudaRuntime::GetLastError() {
  const cuda::cudaError e = Thread().last;
  Thread().last = 0;
  return e;
}

inline cuda::cudaError EmulatedCudaRuntime::PeekAtLastError() { return Thread().last; }

inline int EmulatedCudaRuntime::DeviceOfStream(cuda::cudaStream h) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto* s = reinterpret_cast<Stream*>(h);
  return live_streams_.count(s) != 0 ? s->device : -1;
}

inline int EmulatedCudaRuntime::DeviceOfEvent(cuda::cudaEvent e) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = events_.find(reinterpret_cast<Event*>(e));
  return it == events_.end() || it->first->destroyed ? -1 : it->first->device;
}

inline size_t EmulatedCudaRuntime::live_allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocations_.size();
}

inline int EmulatedCudaRuntime::live_streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(live_streams_.size());
}

inline int EmulatedCudaRuntime::live_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& [e, owned] : events_) n += e->destroyed ? 0 : 1;
  return n;
}

inline std::vector<std::string> EmulatedCudaRuntime::TakeFailures() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(failures_, {});
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_EMULATED_CUDA_RUNTIME_H_
