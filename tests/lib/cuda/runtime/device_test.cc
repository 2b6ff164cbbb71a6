// CudaDevice (lib/cuda/runtime/device.h) on the emulated CUDA runtime
// (tests/support/emulated_cuda_runtime.h): copies between device, pinned and pageable memory,
// streams, events and flags on the device's own GPU whatever device the calling thread has
// current, host waits with their deadline, what the device says it is, and peer memory.
#include "lib/cuda/runtime/device.h"

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/emulated_cuda_runtime.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::EmulatedCudaRuntime;
using ::testing::HasSubstr;
using Memory = EmulatedCudaRuntime::Memory;

EmulatedCudaRuntime::Options Devices(int n) {
  EmulatedCudaRuntime::Options o;
  o.devices = n;
  o.watchdog = absl::Seconds(20);
  return o;
}

std::unique_ptr<Device> DeviceOn(const EmulatedCudaRuntime& emu, int ordinal) {
  const CudaRuntimeApi& rt = emu.runtime();
  int previous = 0;
  rt.GetDevice(&previous);
  rt.SetDevice(ordinal);
  absl::StatusOr<std::unique_ptr<Device>> d = CreateCudaDevice(rt, emu.driver());
  rt.SetDevice(previous);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

int Current(const CudaRuntimeApi& rt) {
  int d = -1;
  rt.GetDevice(&d);
  return d;
}

// Forward's and backward's traffic in small: host input to the device, a zeroed buffer, a
// stream that waits for another's event, the result back to pageable host memory.
TEST(CudaDevice, CopiesZeroesAndOrdersWork) {
  EmulatedCudaRuntime emu(Devices(1));
  std::unique_ptr<Device> dev = DeviceOn(emu, 0);
  ASSERT_NE(dev, nullptr);
  absl::StatusOr<void*> a = dev->Allocate(1000), b = dev->Allocate(1000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(emu.Query(*a).memory, Memory::kDevice);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*a) % 256, 0u);
  EXPECT_EQ(*dev->Allocate(0), nullptr);
  absl::StatusOr<cudaStream> s1 = dev->CreateStream(), s2 = dev->CreateStream();
  absl::StatusOr<cudaEvent> e = dev->CreateEvent();
  ASSERT_TRUE(s1.ok() && s2.ok() && e.ok());

  std::vector<char> in(1000), out(1000, 1);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<char>(i * 13);
  void* pinned = nullptr;
  ASSERT_EQ(emu.MallocHost(&pinned, 1000), 0);
  ASSERT_TRUE(dev->CopyAsync(*a, in.data(), 1000, *s1).ok());  // pageable -> device
  ASSERT_TRUE(dev->CopyAsync(pinned, *a, 1000, *s1).ok());     // device -> pinned
  ASSERT_TRUE(dev->ZeroAsync(static_cast<char*>(*a) + 500, 500, *s1).ok());
  ASSERT_TRUE(dev->RecordEvent(*e, *s1).ok());
  ASSERT_TRUE(dev->StreamWaitEvent(*s2, *e).ok());
  ASSERT_TRUE(dev->CopyAsync(*b, *a, 1000, *s2).ok());          // device -> device
  ASSERT_TRUE(dev->CopyAsync(out.data(), *b, 1000, *s2).ok());  // device -> pageable
  ASSERT_TRUE(dev->Synchronize(*s2, absl::Now() + absl::Seconds(10), "test").ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), 500), 0);
  EXPECT_EQ(out[500], 0);
  EXPECT_EQ(out[999], 0);
  ASSERT_TRUE(dev->Synchronize(*s1, absl::Now() + absl::Seconds(10), "test").ok());
  EXPECT_EQ(std::memcmp(pinned, in.data(), 1000), 0);
  EXPECT_FALSE(dev->ZeroAsync(out.data(), 8, *s1).ok()) << "memset of host memory";
  EXPECT_TRUE(dev->CopyAsync(*a, in.data(), 0, *s1).ok());

  dev->DestroyEvent(*e);
  dev->DestroyStream(*s1);
  dev->DestroyStream(*s2);
  dev->Free(*a);
  dev->Free(*b);
  EXPECT_EQ(emu.FreeHost(pinned), 0);
  EXPECT_EQ(emu.live_allocations(), 0u);
  EXPECT_EQ(emu.live_streams(), 0);
  EXPECT_EQ(emu.live_events(), 0) << "Synchronize leaves no event behind";
}

// A device of GPU 0 used from a thread whose current device is GPU 1 (a trainer thread bound
// to another GPU; the executors' ScopedDevice covers forward and backward, not every use):
// its memory, streams and events are GPU 0's, and the thread stays on GPU 1.
TEST(CudaDevice, WorksOnItsOwnGpuFromAThreadOnAnother) {
  EmulatedCudaRuntime emu(Devices(2));
  const CudaRuntimeApi& rt = emu.runtime();
  std::unique_ptr<Device> dev = DeviceOn(emu, 0);
  ASSERT_NE(dev, nullptr);
  // The communicator's stream, made when GPU 0 was current.
  absl::StatusOr<cudaStream> made_on_0 = dev->CreateStream();
  ASSERT_TRUE(made_on_0.ok());
  ASSERT_EQ(rt.SetDevice(1), 0);
  absl::Status synced = dev->Synchronize(*made_on_0, absl::Now() + absl::Seconds(10), "test");
  EXPECT_TRUE(synced.ok()) << synced;
  absl::StatusOr<cudaEvent> e0 = dev->CreateEvent();
  ASSERT_TRUE(e0.ok());
  absl::Status recorded = dev->RecordEvent(*e0, *made_on_0);
  EXPECT_TRUE(recorded.ok()) << recorded;
  dev->DestroyEvent(*e0);
  dev->DestroyStream(*made_on_0);
  absl::StatusOr<void*> p = dev->Allocate(64);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(emu.Query(*p).device, 0) << "allocated on the current device, not the device's";
  EXPECT_EQ(Current(rt), 1);
  absl::StatusOr<cudaStream> s = dev->CreateStream();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(emu.DeviceOfStream(*s), 0);
  absl::StatusOr<cudaEvent> e = dev->CreateEvent();
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(emu.DeviceOfEvent(*e), 0);
  EXPECT_TRUE(dev->RecordEvent(*e, *s).ok());
  EXPECT_TRUE(dev->ZeroAsync(*p, 64, *s).ok());
  absl::Status sync = dev->Synchronize(*s, absl::Now() + absl::Seconds(10), "test");
  EXPECT_TRUE(sync.ok()) << sync;
  std::vector<uint32_t> host(2, 7);
  EXPECT_TRUE(dev->WriteValueAsync(static_cast<uint32_t*>(*p), 5, *s).ok());
  EXPECT_TRUE(dev->WaitValueAsync(static_cast<uint32_t*>(*p), 5, *s).ok());
  EXPECT_TRUE(dev->CopyAsync(host.data(), *p, 8, *s).ok());
  EXPECT_TRUE(dev->Synchronize(*s, absl::Now() + absl::Seconds(10), "test").ok());
  EXPECT_EQ(host, (std::vector<uint32_t>{5, 0}));
  EXPECT_EQ(Current(rt), 1) << "the thread's current device changed";
  dev->DestroyEvent(*e);
  dev->DestroyStream(*s);
  dev->Free(*p);
  EXPECT_EQ(Current(rt), 1);

  // MakeCurrent / Restore (ScopedDevice).
  {
    ScopedDevice on(*dev);
    ASSERT_TRUE(on.status().ok());
    EXPECT_EQ(Current(rt), 0);
  }
  EXPECT_EQ(Current(rt), 1);
}

// Synchronize: a stream still busy at the deadline is DeadlineExceeded naming the wait.
TEST(CudaDevice, SynchronizeHasADeadline) {
  EmulatedCudaRuntime emu(Devices(1));
  std::unique_ptr<Device> dev = DeviceOn(emu, 0);
  ASSERT_NE(dev, nullptr);
  absl::StatusOr<cudaStream> s = dev->CreateStream();
  ASSERT_TRUE(s.ok());
  absl::Notification go;
  ASSERT_EQ(emu.Launch(0, *s, [&] { go.WaitForNotificationWithTimeout(absl::Seconds(20)); }), 0);
  absl::Status late = dev->Synchronize(*s, absl::Now() + absl::Milliseconds(20), "the kernels");
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(late.message(), HasSubstr("the kernels"));
  go.Notify();
  EXPECT_TRUE(dev->Synchronize(*s, absl::Now() + absl::Seconds(10), "the kernels").ok());
  dev->DestroyStream(*s);
  EXPECT_EQ(emu.live_events(), 0);
}

// Flags in device memory: a stream waits until another writes the value.
TEST(CudaDevice, StreamMemoryOperations) {
  EmulatedCudaRuntime emu(Devices(1));
  std::unique_ptr<Device> dev = DeviceOn(emu, 0);
  ASSERT_NE(dev, nullptr);
  absl::StatusOr<void*> m = dev->Allocate(4);
  absl::StatusOr<cudaStream> writer = dev->CreateStream(), waiter = dev->CreateStream();
  ASSERT_TRUE(m.ok() && writer.ok() && waiter.ok());
  auto* flag = static_cast<uint32_t*>(*m);
  ASSERT_TRUE(dev->ZeroAsync(flag, 4, *writer).ok());
  ASSERT_TRUE(dev->Synchronize(*writer, absl::Now() + absl::Seconds(10), "zero").ok());
  ASSERT_TRUE(dev->WaitValueAsync(flag, 2, *waiter).ok());
  ASSERT_TRUE(dev->WriteValueAsync(flag, 2, *writer).ok());
  EXPECT_TRUE(dev->Synchronize(*waiter, absl::Now() + absl::Seconds(10), "wait").ok());
  uint32_t on_host = 0;
  EXPECT_FALSE(dev->WriteValueAsync(&on_host, 1, *writer).ok()) << "a flag in pageable memory";
  dev->DestroyStream(*writer);
  dev->DestroyStream(*waiter);
  dev->Free(*m);
}

// What the device says it is and where; peer memory it cannot reach is FailedPrecondition.
TEST(CudaDevice, IdentityLocationAndPeers) {
  EmulatedCudaRuntime::Options o = Devices(2);
  o.name = "Emulated H200";
  o.memory_bytes = size_t{3} << 30;
  o.p2p_native_atomics = false;
  EmulatedCudaRuntime emu(o);
  std::unique_ptr<Device> dev = DeviceOn(emu, 0);
  std::unique_ptr<Device> other = DeviceOn(emu, 1);
  ASSERT_NE(dev, nullptr);
  ASSERT_NE(other, nullptr);
  absl::StatusOr<DeviceIdentity> id = dev->Identity();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->name, "Emulated H200");
  EXPECT_EQ(id->memory_bytes, size_t{3} << 30);
  absl::StatusOr<DeviceLocation> here = dev->Location(), there = other->Location();
  ASSERT_TRUE(here.ok() && there.ok());
  EXPECT_STREQ(here->device.data(), "0000:10:00.0");
  EXPECT_STREQ(there->device.data(), "0000:11:00.0");
  absl::StatusOr<void*> m = other->Allocate(256);
  ASSERT_TRUE(m.ok());
  absl::StatusOr<IpcHandle> h = other->ExportMemory(*m);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(other->ExportMemory(static_cast<char*>(*m) + 16).ok()) << "not an allocation's base";
  absl::StatusOr<void*> opened = dev->OpenPeerMemory(*h, *there);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(opened.status().message(), HasSubstr("no native atomics"));
  DeviceLocation nowhere = *there;
  std::snprintf(nowhere.device.data(), nowhere.device.size(), "0000:99:00.0");
  opened = dev->OpenPeerMemory(*h, nowhere);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(opened.status().message(), HasSubstr("not visible"));
  other->Free(*m);
}

}  // namespace
}  // namespace hsap::cuda
