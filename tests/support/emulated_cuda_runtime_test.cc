// The emulated CUDA runtime (tests/support/emulated_cuda_runtime.h) enforces the rules it
// claims: copy kinds against the pointers' memory types, allocation bounds, devices of
// streams and events, stream order and the host synchronization of copies.
#include "tests/support/emulated_cuda_runtime.h"

#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsap::testing {
namespace {

using cuda::cudaEvent;
using cuda::cudaStream;
using cuda::kCudaMemcpyDefault;
using cuda::kCudaMemcpyDeviceToDevice;
using cuda::kCudaMemcpyDeviceToHost;
using cuda::kCudaMemcpyHostToDevice;
using cuda::kCudaMemcpyHostToHost;
using Memory = EmulatedCudaRuntime::Memory;

EmulatedCudaRuntime::Options Devices(int n) {
  EmulatedCudaRuntime::Options o;
  o.devices = n;
  o.watchdog = absl::Seconds(20);
  return o;
}

// A kernel that holds its stream until released.
struct Gate {
  absl::Notification open;
  std::function<void()> Kernel() {
    return [this] { open.WaitForNotificationWithTimeout(absl::Seconds(20)); };
  }
};

TEST(EmulatedCudaRuntime, DevicesAreCurrentPerThread) {
  EmulatedCudaRuntime emu(Devices(2));
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  int n = 0, d = -1;
  EXPECT_EQ(rt.GetDeviceCount(&n), 0);
  EXPECT_EQ(n, 2);
  EXPECT_EQ(rt.GetDevice(&d), 0);
  EXPECT_EQ(d, 0);
  EXPECT_EQ(rt.SetDevice(2), kCudaErrorInvalidDevice);
  EXPECT_EQ(rt.SetDevice(-1), kCudaErrorInvalidDevice);
  EXPECT_EQ(rt.SetDevice(1), 0);
  std::thread([&] {
    int other = -1;
    rt.GetDevice(&other);
    EXPECT_EQ(other, 0) << "a new thread starts on device 0";
  }).join();
  EXPECT_EQ(rt.GetDevice(&d), 0);
  EXPECT_EQ(d, 1);
  void* p = nullptr;
  ASSERT_EQ(rt.Malloc(&p, 100), 0);
  EXPECT_EQ(emu.Query(p).memory, Memory::kDevice);
  EXPECT_EQ(emu.Query(p).device, 1) << "allocations are made on the current device";
  EXPECT_EQ(rt.Free(p), 0);
}

TEST(EmulatedCudaRuntime, MemoryTypesAndFree) {
  EmulatedCudaRuntime::Options o = Devices(1);
  o.memory_bytes = 4096;
  EmulatedCudaRuntime emu(o);
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  void *dev = nullptr, *pinned = nullptr, *zero = &dev;
  std::vector<char> pageable(64);
  ASSERT_EQ(rt.Malloc(&dev, 1000), 0);
  ASSERT_EQ(emu.MallocHost(&pinned, 64), 0);
  EXPECT_EQ(emu.Query(dev).memory, Memory::kDevice);
  EXPECT_EQ(emu.Query(static_cast<char*>(dev) + 999).memory, Memory::kDevice);
  EXPECT_EQ(emu.Query(static_cast<char*>(dev) + 1000).memory, Memory::kPageable);
  EXPECT_EQ(emu.Query(pinned).memory, Memory::kPinnedHost);
  EXPECT_EQ(emu.Query(pageable.data()).memory, Memory::kPageable);
  EXPECT_EQ(rt.Malloc(&zero, 0), 0);
  EXPECT_EQ(zero, nullptr);
  void* big = nullptr;
  EXPECT_EQ(rt.Malloc(&big, 4096), kCudaErrorMemoryAllocation) << "past Options::memory_bytes";
  EXPECT_EQ(rt.Free(static_cast<char*>(dev) + 8), kCudaErrorInvalidValue) << "not a base";
  EXPECT_EQ(rt.Free(pinned), kCudaErrorInvalidValue) << "pinned memory goes to cudaFreeHost";
  EXPECT_EQ(rt.Free(pageable.data()), kCudaErrorInvalidValue);
  EXPECT_EQ(rt.Free(nullptr), 0);
  EXPECT_EQ(rt.Free(dev), 0);
  EXPECT_EQ(rt.Free(dev), kCudaErrorInvalidValue) << "freed twice";
  EXPECT_EQ(emu.FreeHost(pinned), 0);
  EXPECT_EQ(emu.live_allocations(), 0u);
}

// Every (source, destination, kind) combination: the kind must match the pointers' types;
// cudaMemcpyDefault infers it.
TEST(EmulatedCudaRuntime, CopyKindMustMatchThePointers) {
  EmulatedCudaRuntime emu(Devices(1));
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  void *dev_a = nullptr, *dev_b = nullptr, *pinned = nullptr;
  ASSERT_EQ(rt.Malloc(&dev_a, 64), 0);
  ASSERT_EQ(rt.Malloc(&dev_b, 64), 0);
  ASSERT_EQ(emu.MallocHost(&pinned, 64), 0);
  std::vector<char> pageable_a(64), pageable_b(64);
  cudaStream s = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&s, cuda::kCudaStreamNonBlocking), 0);
  struct Place {
    const char* name;
    void* p;
    bool device;
  };
  const std::vector<Place> places = {
      {"device", dev_a, true}, {"pinned", pinned, false}, {"pageable", pageable_a.data(), false}};
  const std::vector<Place> targets = {
      {"device", dev_b, true}, {"pinned", pinned, false}, {"pageable", pageable_b.data(), false}};
  for (const Place& from : places) {
    for (const Place& to : targets) {
      if (from.p == to.p) continue;
      for (int kind = kCudaMemcpyHostToHost; kind <= kCudaMemcpyDefault; ++kind) {
        const bool ok =
            kind == kCudaMemcpyDefault || kind == (from.device ? 2 : 0) + (to.device ? 1 : 0);
        SCOPED_TRACE(::testing::Message() << from.name << " -> " << to.name << ", kind " << kind);
        EXPECT_EQ(rt.MemcpyAsync(to.p, from.p, 64, kind, s), ok ? 0 : kCudaErrorInvalidValue);
        EXPECT_EQ(rt.Memcpy(to.p, from.p, 64, kind), ok ? 0 : kCudaErrorInvalidValue);
      }
    }
  }
  // What the loopback transport did with the host buffers of an AllGather (H200, 2026-12):
  EXPECT_EQ(rt.MemcpyAsync(pageable_b.data(), pageable_a.data(), 64, kCudaMemcpyDeviceToDevice, s),
            kCudaErrorInvalidValue);
  EXPECT_STREQ(rt.GetErrorString(kCudaErrorInvalidValue), "invalid argument");
  EXPECT_EQ(rt.MemcpyAsync(dev_b, dev_a, 64, 7, s), kCudaErrorInvalidMemcpyDirection);
  EXPECT_EQ(rt.MemcpyAsync(dev_b, dev_a, 0, kCudaMemcpyHostToHost, s), 0) << "nothing to copy";
  EXPECT_EQ(rt.StreamSynchronize(s), 0);
  EXPECT_EQ(rt.StreamDestroy(s), 0);
  EXPECT_EQ(emu.FreeHost(pinned), 0);
  EXPECT_EQ(rt.Free(dev_a), 0);
  EXPECT_EQ(rt.Free(dev_b), 0);
}

TEST(EmulatedCudaRuntime, CopiesAndMemsetsStayInsideTheirAllocation) {
  EmulatedCudaRuntime emu(Devices(1));
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  void *a = nullptr, *b = nullptr;
  ASSERT_EQ(rt.Malloc(&a, 100), 0);
  ASSERT_EQ(rt.Malloc(&b, 100), 0);
  char* ca = static_cast<char*>(a);
  std::vector<char> host(200);
  EXPECT_EQ(rt.Memcpy(b, a, 100, kCudaMemcpyDefault), 0);
  EXPECT_EQ(rt.Memcpy(b, ca + 10, 90, kCudaMemcpyDefault), 0);
  EXPECT_EQ(rt.Memcpy(b, ca + 10, 91, kCudaMemcpyDefault), kCudaErrorInvalidValue);
  EXPECT_EQ(rt.Memcpy(b, a, 101, kCudaMemcpyDefault), kCudaErrorInvalidValue);
  EXPECT_EQ(rt.Memcpy(host.data(), a, 101, kCudaMemcpyDefault), kCudaErrorInvalidValue);
  EXPECT_EQ(rt.Memcpy(a, host.data(), 101, kCudaMemcpyHostToDevice), kCudaErrorInvalidValue);
  EXPECT_EQ(rt.Memcpy(nullptr, a, 4, kCudaMemcpyDefault), kCudaErrorInvalidValue);
  EXPECT_EQ(rt.MemsetAsync(ca + 50, 0, 50, nullptr), 0);
  EXPECT_EQ(rt.MemsetAsync(ca + 50, 0, 51, nullptr), kCudaErrorInvalidValue);
  EXPECT_EQ(rt.MemsetAsync(host.data(), 0, 4, nullptr), kCudaErrorInvalidValue)
      << "memset takes device memory";
  EXPECT_EQ(rt.DeviceSynchronize(), 0);
  EXPECT_EQ(rt.Free(a), 0);
  EXPECT_EQ(rt.Free(b), 0);
}

TEST(EmulatedCudaRuntime, StreamsAndEventsBelongToTheirDevice) {
  EmulatedCudaRuntime emu(Devices(2));
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  cudaStream s0 = nullptr, s1 = nullptr;
  cudaEvent e0 = nullptr, e1 = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&s0, cuda::kCudaStreamNonBlocking), 0);
  ASSERT_EQ(rt.EventCreateWithFlags(&e0, cuda::kCudaEventDisableTiming), 0);
  ASSERT_EQ(rt.SetDevice(1), 0);
  ASSERT_EQ(rt.StreamCreateWithFlags(&s1, cuda::kCudaStreamNonBlocking), 0);
  ASSERT_EQ(rt.EventCreateWithFlags(&e1, cuda::kCudaEventDisableTiming), 0);
  EXPECT_EQ(emu.DeviceOfStream(s0), 0);
  EXPECT_EQ(emu.DeviceOfStream(s1), 1);
  EXPECT_EQ(emu.DeviceOfEvent(e0), 0);
  EXPECT_EQ(emu.DeviceOfEvent(e1), 1);

  // Recording: the event's device must be the stream's, whatever the current device.
  EXPECT_EQ(rt.EventRecord(e0, s1), kCudaErrorInvalidResourceHandle);
  EXPECT_EQ(rt.EventRecord(e1, s0), kCudaErrorInvalidResourceHandle);
  EXPECT_EQ(rt.EventRecord(e0, s0), 0) << "device 1 is current; the record is device 0's";
  EXPECT_EQ(rt.EventRecord(e1, s1), 0);
  EXPECT_EQ(rt.EventRecord(e0, nullptr), kCudaErrorInvalidResourceHandle)
      << "the null stream is the current device's (1)";
  // Waiting across devices is allowed, and so are queries and copies on another device.
  EXPECT_EQ(rt.StreamWaitEvent(s0, e1, 0), 0);
  EXPECT_EQ(rt.StreamWaitEvent(s1, e0, 0), 0);
  EXPECT_EQ(rt.StreamWaitEvent(s1, e0, 1), kCudaErrorInvalidValue);
  EXPECT_EQ(rt.EventSynchronize(e0), 0);
  EXPECT_EQ(rt.EventQuery(e0), 0);
  void* d0 = nullptr;
  ASSERT_EQ(rt.SetDevice(0), 0);
  ASSERT_EQ(rt.Malloc(&d0, 16), 0);
  ASSERT_EQ(rt.SetDevice(1), 0);
  std::vector<char> host(16, 7);
  EXPECT_EQ(rt.MemcpyAsync(d0, host.data(), 16, kCudaMemcpyHostToDevice, s0), 0);
  // Kernels: only on a stream of the launching device.
  EXPECT_EQ(emu.Launch(-1, s0, [] {}), kCudaErrorInvalidResourceHandle);
  EXPECT_EQ(emu.Launch(0, s0, [] {}), 0);
  EXPECT_EQ(emu.Launch(-1, s1, [] {}), 0);
  // Timing: both events on one device, both timed, both recorded and complete.
  cudaEvent t0 = nullptr, t1 = nullptr, t_other = nullptr, untimed = nullptr;
  ASSERT_EQ(rt.EventCreateWithFlags(&t0, 0), 0);
  ASSERT_EQ(rt.EventCreateWithFlags(&t1, 0), 0);
  ASSERT_EQ(rt.EventCreateWithFlags(&untimed, cuda::kCudaEventDisableTiming), 0);
  float ms = -1;
  EXPECT_EQ(rt.EventElapsedTime(&ms, t0, t1), kCudaErrorInvalidResourceHandle) << "not recorded";
  ASSERT_EQ(rt.EventRecord(t0, s1), 0);
  ASSERT_EQ(rt.EventRecord(t1, s1), 0);
  ASSERT_EQ(rt.EventRecord(untimed, s1), 0);
  ASSERT_EQ(rt.EventSynchronize(t1), 0);
  EXPECT_EQ(rt.EventElapsedTime(&ms, t0, t1), 0);
  EXPECT_GE(ms, 0.0f);
  EXPECT_EQ(rt.EventElapsedTime(&ms, t0, untimed), kCudaErrorInvalidResourceHandle);
  ASSERT_EQ(rt.SetDevice(0), 0);
  ASSERT_EQ(rt.EventCreateWithFlags(&t_other, 0), 0);
  ASSERT_EQ(rt.EventRecord(t_other, s0), 0);
  ASSERT_EQ(rt.EventSynchronize(t_other), 0);
  EXPECT_EQ(rt.EventElapsedTime(&ms, t0, t_other), kCudaErrorInvalidResourceHandle)
      << "events of two devices";

  // Stale handles.
  EXPECT_EQ(rt.StreamDestroy(s1), 0);
  EXPECT_EQ(rt.StreamDestroy(s1), kCudaErrorInvalidResourceHandle);
  EXPECT_EQ(rt.MemcpyAsync(d0, host.data(), 16, kCudaMemcpyDefault, s1),
            kCudaErrorInvalidResourceHandle);
  EXPECT_EQ(rt.EventDestroy(e1), 0);
  EXPECT_EQ(rt.EventQuery(e1), kCudaErrorInvalidResourceHandle);
  for (cudaEvent e : {e0, t0, t1, t_other, untimed}) EXPECT_EQ(rt.EventDestroy(e), 0);
  EXPECT_EQ(rt.StreamDestroy(s0), 0);
  EXPECT_EQ(rt.Free(d0), 0);
  EXPECT_EQ(emu.live_streams(), 0);
  EXPECT_EQ(emu.live_events(), 0);
}

// Streams run asynchronously and in order; an event completes when its stream reaches it;
// a stream waiting on an event holds its later work.
TEST(EmulatedCudaRuntime, StreamsRunInOrderAndWaitForEvents) {
  EmulatedCudaRuntime emu(Devices(1));
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  cudaStream a = nullptr, b = nullptr;
  cudaEvent on_a = nullptr, on_b = nullptr, never = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&a, cuda::kCudaStreamNonBlocking), 0);
  ASSERT_EQ(rt.StreamCreateWithFlags(&b, cuda::kCudaStreamNonBlocking), 0);
  ASSERT_EQ(rt.EventCreateWithFlags(&on_a, cuda::kCudaEventDisableTiming), 0);
  ASSERT_EQ(rt.EventCreateWithFlags(&on_b, cuda::kCudaEventDisableTiming), 0);
  ASSERT_EQ(rt.EventCreateWithFlags(&never, cuda::kCudaEventDisableTiming), 0);
  EXPECT_EQ(rt.EventQuery(never), 0) << "an event never recorded is complete";
  void* d = nullptr;
  ASSERT_EQ(rt.Malloc(&d, 4), 0);
  int* dev = static_cast<int*>(d);

  Gate gate;
  std::vector<int> order;
  ASSERT_EQ(emu.Launch(-1, a, gate.Kernel()), 0);
  ASSERT_EQ(emu.Launch(-1, a, [&] { order.push_back(1); }), 0);
  ASSERT_EQ(rt.EventRecord(on_a, a), 0);
  ASSERT_EQ(rt.StreamWaitEvent(b, on_a, 0), 0);
  ASSERT_EQ(emu.Launch(-1, b, [&] { order.push_back(2); }), 0);
  ASSERT_EQ(rt.EventRecord(on_b, b), 0);
  ASSERT_EQ(rt.EventRecord(on_a, a), 0) << "a new record does not change b's wait";
  EXPECT_EQ(rt.EventQuery(on_a), cuda::kCudaErrorNotReady);
  EXPECT_EQ(rt.EventQuery(on_b), cuda::kCudaErrorNotReady) << "b waits for a";
  gate.open.Notify();
  EXPECT_EQ(rt.EventSynchronize(on_b), 0);
  EXPECT_EQ(rt.StreamSynchronize(a), 0);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));

  // Device to pageable host: the call returns once the copy is done.
  ASSERT_EQ(emu.Launch(-1, a, [dev] { *dev = 42; }), 0);
  int host = 0;
  ASSERT_EQ(rt.MemcpyAsync(&host, d, 4, kCudaMemcpyDefault, a), 0);
  EXPECT_EQ(host, 42);

  // Pageable host to device: the source is staged at the call; pinned memory is read when the
  // stream gets there.
  Gate held;
  ASSERT_EQ(emu.Launch(-1, a, held.Kernel()), 0);
  int pageable = 5;
  ASSERT_EQ(rt.MemcpyAsync(d, &pageable, 4, kCudaMemcpyHostToDevice, a), 0);
  pageable = 6;
  held.open.Notify();
  ASSERT_EQ(rt.Memcpy(&host, d, 4, kCudaMemcpyDeviceToHost), 0) << "the legacy stream";
  ASSERT_EQ(rt.StreamSynchronize(a), 0);
  ASSERT_EQ(rt.MemcpyAsync(&host, d, 4, kCudaMemcpyDeviceToHost, a), 0);
  EXPECT_EQ(host, 5);
  void* pinned = nullptr;
  ASSERT_EQ(emu.MallocHost(&pinned, 4), 0);
  *static_cast<int*>(pinned) = 7;
  Gate held2;
  ASSERT_EQ(emu.Launch(-1, a, held2.Kernel()), 0);
  ASSERT_EQ(rt.MemcpyAsync(d, pinned, 4, kCudaMemcpyHostToDevice, a), 0);
  *static_cast<int*>(pinned) = 8;  // a race on a GPU too: the copy has not run
  held2.open.Notify();
  ASSERT_EQ(rt.MemcpyAsync(&host, d, 4, kCudaMemcpyDeviceToHost, a), 0);
  EXPECT_EQ(host, 8);

  for (cudaEvent e : {on_a, on_b, never}) EXPECT_EQ(rt.EventDestroy(e), 0);
  EXPECT_EQ(rt.StreamDestroy(a), 0);
  EXPECT_EQ(rt.StreamDestroy(b), 0);
  EXPECT_EQ(emu.FreeHost(pinned), 0);
  EXPECT_EQ(rt.Free(d), 0);
}

// The legacy default stream (cudaMemcpy, the null stream) waits for blocking streams only.
TEST(EmulatedCudaRuntime, LegacyStreamSynchronizesWithBlockingStreamsOnly) {
  EmulatedCudaRuntime emu(Devices(1));
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  cudaStream blocking = nullptr, nonblocking = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&blocking, 0), 0);
  ASSERT_EQ(rt.StreamCreateWithFlags(&nonblocking, cuda::kCudaStreamNonBlocking), 0);
  EXPECT_EQ(rt.StreamCreateWithFlags(&nonblocking, 8), kCudaErrorInvalidValue);
  void* d = nullptr;
  ASSERT_EQ(rt.Malloc(&d, 4), 0);
  int* dev = static_cast<int*>(d);
  ASSERT_EQ(emu.Launch(-1, blocking, [dev] { *dev = 1; }), 0);
  int host = 0;
  ASSERT_EQ(rt.Memcpy(&host, d, 4, kCudaMemcpyDefault), 0);
  EXPECT_EQ(host, 1) << "cudaMemcpy waited for the blocking stream";
  Gate gate;
  ASSERT_EQ(emu.Launch(-1, nonblocking, gate.Kernel()), 0);
  ASSERT_EQ(emu.Launch(-1, nonblocking, [dev] { *dev = 2; }), 0);
  ASSERT_EQ(rt.Memcpy(&host, d, 4, kCudaMemcpyDefault), 0) << "does not wait: no deadlock";
  EXPECT_EQ(host, 1);
  gate.open.Notify();
  EXPECT_EQ(rt.DeviceSynchronize(), 0);
  ASSERT_EQ(rt.Memcpy(&host, d, 4, kCudaMemcpyDefault), 0);
  EXPECT_EQ(host, 2);
  EXPECT_EQ(rt.StreamDestroy(blocking), 0);
  EXPECT_EQ(rt.StreamDestroy(nonblocking), 0);
  EXPECT_EQ(rt.Free(d), 0);
}

TEST(EmulatedCudaRuntime, LastErrorIsPerThread) {
  EmulatedCudaRuntime emu(Devices(1));
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  EXPECT_EQ(emu.GetLastError(), 0);
  EXPECT_EQ(rt.SetDevice(5), kCudaErrorInvalidDevice);
  std::thread([&] { EXPECT_EQ(emu.PeekAtLastError(), 0); }).join();
  EXPECT_EQ(emu.PeekAtLastError(), kCudaErrorInvalidDevice);
  EXPECT_EQ(emu.GetLastError(), kCudaErrorInvalidDevice);
  EXPECT_EQ(emu.GetLastError(), 0);
  EXPECT_STREQ(rt.GetErrorString(kCudaErrorInvalidDevice), "invalid device ordinal");
  EXPECT_STREQ(rt.GetErrorString(kCudaErrorInvalidResourceHandle), "invalid resource handle");
  absl::Status s = rt.Check(kCudaErrorInvalidValue, "cudaMemcpyAsync (loopback)");
  EXPECT_THAT(s.message(), ::testing::HasSubstr("invalid argument (cudaError 1)"));
}

TEST(EmulatedCudaRuntime, StreamMemoryOperations) {
  EmulatedCudaRuntime emu(Devices(1));
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  const cuda::CudaDriverApi& drv = emu.driver();
  cudaStream writer = nullptr, waiter = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&writer, cuda::kCudaStreamNonBlocking), 0);
  ASSERT_EQ(rt.StreamCreateWithFlags(&waiter, cuda::kCudaStreamNonBlocking), 0);
  void* d = nullptr;
  ASSERT_EQ(rt.Malloc(&d, 8), 0);
  ASSERT_EQ(rt.MemsetAsync(d, 0, 8, writer), 0);
  ASSERT_EQ(rt.StreamSynchronize(writer), 0);
  const auto flag = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(d));
  uint32_t pageable = 0;
  EXPECT_EQ(drv.StreamWriteValue32(writer, reinterpret_cast<uintptr_t>(&pageable), 1, 0),
            kCuErrorInvalidValue)
      << "pageable memory";
  EXPECT_EQ(drv.StreamWriteValue32(writer, flag + 2, 1, 0), kCuErrorInvalidValue) << "unaligned";
  EXPECT_EQ(drv.StreamWriteValue32(writer, flag + 8, 1, 0), kCuErrorInvalidValue) << "past end";
  cudaEvent done = nullptr;
  ASSERT_EQ(rt.EventCreateWithFlags(&done, cuda::kCudaEventDisableTiming), 0);
  ASSERT_EQ(drv.StreamWaitValue32(waiter, flag, 2, cuda::kCuStreamWaitValueGeq), 0);
  ASSERT_EQ(rt.EventRecord(done, waiter), 0);
  Gate gate;
  ASSERT_EQ(emu.Launch(-1, writer, gate.Kernel()), 0);
  ASSERT_EQ(drv.StreamWriteValue32(writer, flag, 1, cuda::kCuStreamWriteValueDefault), 0);
  ASSERT_EQ(drv.StreamWriteValue32(writer, flag, 3, cuda::kCuStreamWriteValueDefault), 0);
  EXPECT_EQ(rt.EventQuery(done), cuda::kCudaErrorNotReady);
  gate.open.Notify();
  EXPECT_EQ(rt.EventSynchronize(done), 0) << "3 >= 2 released the waiter";
  // Contexts follow the current device; modules are not emulated.
  cuda::CUcontext ctx = nullptr;
  EXPECT_EQ(drv.CtxGetCurrent(&ctx), 0);
  EXPECT_EQ(drv.CtxSetCurrent(ctx), 0);
  EXPECT_EQ(drv.ModuleLoadData(nullptr, nullptr), kCuErrorNotSupported);
  int dev = -1;
  char name[64];
  size_t bytes = 0;
  EXPECT_EQ(drv.DeviceGet(&dev, 0), 0);
  EXPECT_EQ(drv.DeviceGet(&dev, 1), kCuErrorInvalidDevice);
  EXPECT_EQ(drv.DeviceGetName(name, sizeof(name), 0), 0);
  EXPECT_STREQ(name, "Emulated GPU");
  EXPECT_EQ(drv.DeviceTotalMem(&bytes, 0), 0);
  EXPECT_EQ(bytes, size_t{1} << 30);
  EXPECT_EQ(rt.EventDestroy(done), 0);
  EXPECT_EQ(rt.StreamDestroy(writer), 0);
  EXPECT_EQ(rt.StreamDestroy(waiter), 0);
  EXPECT_EQ(rt.Free(d), 0);
}

// A wait that never ends on a GPU gives up at the watchdog and is reported.
TEST(EmulatedCudaRuntime, WatchdogEndsWaitsThatNeverEnd) {
  EmulatedCudaRuntime::Options o = Devices(1);
  o.watchdog = absl::Milliseconds(100);
  EmulatedCudaRuntime emu(o);
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  cudaStream s = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&s, cuda::kCudaStreamNonBlocking), 0);
  void* d = nullptr;
  ASSERT_EQ(rt.Malloc(&d, 4), 0);
  ASSERT_EQ(rt.MemsetAsync(d, 0, 4, s), 0);
  ASSERT_EQ(emu.driver().StreamWaitValue32(s, reinterpret_cast<uintptr_t>(d), 1, 0), 0);
  cuda::cudaError e = kCudaErrorTimeout;
  for (int i = 0; i < 100 && e == kCudaErrorTimeout; ++i) e = rt.StreamSynchronize(s);
  EXPECT_EQ(e, 0);
  EXPECT_THAT(emu.TakeFailures(), ::testing::ElementsAre(::testing::HasSubstr("never saw")));
  EXPECT_EQ(rt.StreamDestroy(s), 0);
  EXPECT_EQ(rt.Free(d), 0);
}

TEST(EmulatedCudaRuntime, DeviceQueries) {
  EmulatedCudaRuntime::Options o = Devices(2);
  o.p2p_native_atomics = false;
  EmulatedCudaRuntime emu(o);
  const cuda::CudaRuntimeApi& rt = emu.runtime();
  int v = 0, dev = -1;
  EXPECT_EQ(rt.DeviceGetAttribute(&v, cuda::kCudaDevAttrComputeCapabilityMajor, 1), 0);
  EXPECT_EQ(v, 9);
  EXPECT_EQ(rt.DeviceGetAttribute(&v, cuda::kCudaDevAttrMultiProcessorCount, 2),
            kCudaErrorInvalidDevice);
  char id[32];
  EXPECT_EQ(rt.DeviceGetPCIBusId(id, sizeof(id), 1), 0);
  EXPECT_EQ(rt.DeviceGetByPCIBusId(&dev, id), 0);
  EXPECT_EQ(dev, 1);
  EXPECT_EQ(rt.DeviceGetByPCIBusId(&dev, "0000:99:00.0"), kCudaErrorInvalidDevice);
  EXPECT_EQ(rt.DeviceCanAccessPeer(&v, 0, 1), 0);
  EXPECT_EQ(v, 1);
  EXPECT_EQ(rt.DeviceCanAccessPeer(&v, 0, 0), 0);
  EXPECT_EQ(v, 0);
  EXPECT_EQ(rt.DeviceGetP2PAttribute(&v, cuda::kCudaDevP2PAttrNativeAtomicSupported, 0, 1), 0);
  EXPECT_EQ(v, 0);
  EXPECT_EQ(rt.DeviceGetP2PAttribute(&v, cuda::kCudaDevP2PAttrNativeAtomicSupported, 0, 0),
            kCudaErrorInvalidDevice);
  void* d = nullptr;
  ASSERT_EQ(rt.Malloc(&d, 64), 0);
  cuda::CudaIpcMemHandle h;
  EXPECT_EQ(rt.IpcGetMemHandle(&h, d), 0);
  EXPECT_EQ(rt.IpcGetMemHandle(&h, static_cast<char*>(d) + 4), kCudaErrorInvalidValue);
  void* opened = nullptr;
  EXPECT_NE(rt.IpcOpenMemHandle(&opened, h, cuda::kCudaIpcMemLazyEnablePeerAccess), 0)
      << "one process: nothing to open";
  EXPECT_EQ(rt.Free(d), 0);
}

}  // namespace
}  // namespace hsap::testing
