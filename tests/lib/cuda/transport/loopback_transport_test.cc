// The loopback transport (lib/cuda/transport/loopback_transport.h) on the emulated CUDA
// runtime (tests/support/emulated_cuda_runtime.h), which refuses what the driver refuses:
// host buffers (the AllGather of batch creation), device, pinned and mixed buffers, the
// ranks' own or the caller's streams, callers whose current device is another GPU, the order
// of the sender's work before a send, and what the transports leave behind.
#include "lib/cuda/transport/loopback_transport.h"

#include <cstring>
#include <functional>
#include <memory>
#include <string>
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

EmulatedCudaRuntime::Options Devices(int n) {
  EmulatedCudaRuntime::Options o;
  o.devices = n;
  o.watchdog = absl::Seconds(20);
  return o;
}

std::vector<char> Pattern(size_t bytes, int seed) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>((i * 7 + seed * 31) & 0x7f);
  return v;
}

// Device memory of the emulated runtime (on the current device).
struct DeviceBytes {
  DeviceBytes(const CudaRuntimeApi& rt, size_t n) : rt(rt), bytes(n) {
    EXPECT_EQ(rt.Malloc(&p, n), 0);
  }
  ~DeviceBytes() { rt.Free(p); }
  // cudaMemcpy from pageable memory "will return once the pageable buffer has been copied to
  // the staging memory ... but the DMA to final destination may not have completed": the
  // legacy stream's synchronization, before the ranks' non-blocking streams use the data.
  void Upload(const std::vector<char>& v) {
    ASSERT_EQ(rt.Memcpy(p, v.data(), v.size(), kCudaMemcpyHostToDevice), 0);
    ASSERT_EQ(rt.StreamSynchronize(nullptr), 0);
  }
  std::vector<char> Download() const {
    std::vector<char> v(bytes);
    EXPECT_EQ(rt.Memcpy(v.data(), p, bytes, kCudaMemcpyDeviceToHost), 0);
    return v;
  }
  const CudaRuntimeApi& rt;
  size_t bytes;
  void* p = nullptr;
};

// Runs body(rank) on a thread per rank.
void OnEveryRank(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
}

// What Batch::AgreeOnCreate (lib/exec/batch.cc) does on every rank: an AllGather of a record
// in pageable host memory. On an H200 every multi-rank loopback batch failed here with
// "cudaMemcpyAsync (loopback) failed: invalid argument" (a device-to-device copy of host
// buffers).
TEST(LoopbackTransport, HostBufferAllGatherAsBatchCreationDoes) {
  EmulatedCudaRuntime emu(Devices(1));
  const int R = 4;
  auto world = CreateLoopbackTransports(emu.runtime(), R, absl::Seconds(10));
  ASSERT_TRUE(world.ok()) << world.status();
  struct Record {
    uint64_t ok, rank, layout[6];
  };
  std::vector<std::string> failures(R);
  OnEveryRank(R, [&](int r) {
    Record mine{1, static_cast<uint64_t>(r), {}};
    for (int i = 0; i < 6; ++i) mine.layout[i] = 1000 * r + i;
    std::vector<Record> all(R);
    for (int round = 0; round < 3; ++round) {
      absl::Status s = (*world)[r]->AllGather(&mine, all.data(), sizeof(Record),
                                              "batch creation (agreement on the inputs)");
      if (!s.ok()) {
        failures[r] = std::string(s.message());
        return;
      }
      for (int q = 0; q < R; ++q) {
        if (all[q].rank != static_cast<uint64_t>(q) || all[q].layout[5] != 1000u * q + 5) {
          failures[r] = absl::StrCat("round ", round, ": wrong record from rank ", q);
          return;
        }
      }
    }
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  EXPECT_EQ((*world)[0]->counters().messages_received, 3u * (R - 1));
}

// Device buffers in a ring, then pinned, pageable and device buffers mixed in one stage; a
// size mismatch fails both sides; a missing peer is named.
TEST(LoopbackTransport, DevicePinnedAndPageableBuffers) {
  EmulatedCudaRuntime emu(Devices(1));
  const CudaRuntimeApi& rt = emu.runtime();
  const int R = 3;
  auto world = CreateLoopbackTransports(rt, R, absl::Seconds(10));
  ASSERT_TRUE(world.ok()) << world.status();
  std::vector<std::string> failures(R);
  OnEveryRank(R, [&](int r) {
    Transport& t = *(*world)[r];
    const int next = (r + 1) % R, prev = (r + R - 1) % R;
    const size_t kb = 1024 + 16 * r;
    DeviceBytes k(rt, kb), rk(rt, 1024 + 16 * prev);
    k.Upload(Pattern(kb, r));
    void* pinned = nullptr;
    ASSERT_EQ(emu.MallocHost(&pinned, 256), 0);
    std::memcpy(pinned, Pattern(256, 10 + r).data(), 256);
    std::vector<char> pageable_in = Pattern(128, 20 + r), pageable_out(256);
    DeviceBytes from_pageable(rt, 128);
    std::vector<SendOp> sends = {
        {next, k.p, kb, 7}, {next, pinned, 256, 8}, {next, pageable_in.data(), 128, 9}};
    std::vector<RecvOp> recvs = {{prev, rk.p, rk.bytes, 7},
                                 {prev, pageable_out.data(), 256, 8},
                                 {prev, from_pageable.p, 128, 9}};
    if (absl::Status s = t.Exchange(sends, recvs, "ring"); !s.ok()) {
      failures[r] = std::string(s.message());
    } else if (rk.Download() != Pattern(rk.bytes, prev)) {
      failures[r] = "wrong device data";
    } else if (pageable_out != Pattern(256, 10 + prev)) {
      failures[r] = "wrong pinned-to-pageable data";
    } else if (from_pageable.Download() != Pattern(128, 20 + prev)) {
      failures[r] = "wrong pageable-to-device data";
    }
    EXPECT_EQ(emu.FreeHost(pinned), 0);
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  EXPECT_EQ((*world)[0]->counters().bytes_sent, 1024u + 256 + 128);

  DeviceBytes a(rt, 64), b(rt, 32);
  std::vector<SendOp> s0 = {{1, a.p, 64, 9}};
  std::vector<RecvOp> r1 = {{0, b.p, 32, 9}};
  auto p0 = (*world)[0]->Start(s0, {}, "mismatch");
  ASSERT_TRUE(p0.ok()) << p0.status();
  EXPECT_THAT((*world)[1]->Exchange({}, r1, "mismatch").message(), HasSubstr("64 bytes"));
  EXPECT_EQ((*p0)->Wait().code(), absl::StatusCode::kFailedPrecondition);

  auto lonely = CreateLoopbackTransports(rt, 2, absl::Milliseconds(100));
  ASSERT_TRUE(lonely.ok());
  std::vector<RecvOp> r = {{1, b.p, 16, 3}};
  absl::Status s = (*lonely)[0]->Exchange({}, r, "lonely");
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("waits for rank 1"));
}

// A send carries what the sender's stream produced before Start(), however late the stream
// gets there (the emulated streams are asynchronous: without the event the copy would read
// the buffer first).
TEST(LoopbackTransport, SendWaitsForTheSendersEarlierWork) {
  EmulatedCudaRuntime emu(Devices(1));
  const CudaRuntimeApi& rt = emu.runtime();
  cudaStream streams[2] = {nullptr, nullptr};
  for (cudaStream& s : streams) ASSERT_EQ(rt.StreamCreateWithFlags(&s, kCudaStreamNonBlocking), 0);
  {
    auto world = CreateLoopbackTransports(rt, 2, absl::Seconds(10), {streams[0], streams[1]});
    ASSERT_TRUE(world.ok()) << world.status();
    DeviceBytes src(rt, 512), dst(rt, 512);
    src.Upload(std::vector<char>(512, 0));
    absl::Notification go;
    const std::vector<char> produced = Pattern(512, 3);
    // A "kernel" on rank 0's stream that writes the data once released.
    ASSERT_EQ(emu.Launch(-1, streams[0],
                         [&] {
                           go.WaitForNotificationWithTimeout(absl::Seconds(20));
                           std::memcpy(src.p, produced.data(), produced.size());
                         }),
              0);
    std::vector<SendOp> sends = {{1, src.p, 512, 1}};
    std::vector<RecvOp> recvs = {{0, dst.p, 512, 1}};
    auto sent = (*world)[0]->Start(sends, {}, "produced");
    ASSERT_TRUE(sent.ok()) << sent.status();
    auto received = (*world)[1]->Start({}, recvs, "produced");
    ASSERT_TRUE(received.ok()) << received.status();
    go.Notify();
    EXPECT_TRUE((*received)->Wait().ok());
    EXPECT_TRUE((*sent)->Wait().ok());
    EXPECT_EQ(dst.Download(), produced);
  }
  // The transports did not own the caller's streams.
  EXPECT_EQ(emu.live_streams(), 2);
  for (cudaStream s : streams) EXPECT_EQ(rt.StreamDestroy(s), 0);
}

// Ranks driven from threads whose current device is another GPU (a trainer's thread bound
// to GPU 1 creating a batch on a loopback communicator of GPU 0): the transport works on its
// own device and leaves the thread's current device as it found it.
TEST(LoopbackTransport, CallersWhoseCurrentDeviceIsAnotherGpu) {
  EmulatedCudaRuntime emu(Devices(2));
  const CudaRuntimeApi& rt = emu.runtime();
  auto world = CreateLoopbackTransports(rt, 2, absl::Seconds(10));  // on device 0
  ASSERT_TRUE(world.ok()) << world.status();
  std::vector<std::string> failures(2);
  OnEveryRank(2, [&](int r) {
    DeviceBytes src(rt, 256), dst(rt, 256);  // on device 0, current for a new thread
    src.Upload(Pattern(256, r));
    ASSERT_EQ(rt.SetDevice(1), 0);
    std::vector<SendOp> sends = {{1 - r, src.p, 256, 5}};
    std::vector<RecvOp> recvs = {{1 - r, dst.p, 256, 5}};
    uint64_t mine = 10 + r, all[2] = {0, 0};
    if (absl::Status s = (*world)[r]->Exchange(sends, recvs, "swap"); !s.ok()) {
      failures[r] = std::string(s.message());
    } else if (absl::Status g = (*world)[r]->AllGather(&mine, all, sizeof(mine), "gather");
               !g.ok()) {
      failures[r] = std::string(g.message());
    } else if (all[0] != 10 || all[1] != 11) {
      failures[r] = "wrong gather";
    }
    int device = -1;
    rt.GetDevice(&device);
    EXPECT_EQ(device, 1) << "rank " << r << ": the current device changed";
    ASSERT_EQ(rt.SetDevice(0), 0);
    if (failures[r].empty() && dst.Download() != Pattern(256, 1 - r)) failures[r] = "wrong data";
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// The transports leave no stream or event behind.
TEST(LoopbackTransport, ReleasesItsStreamsAndEvents) {
  EmulatedCudaRuntime emu(Devices(1));
  {
    auto world = CreateLoopbackTransports(emu.runtime(), 3, absl::Seconds(10));
    ASSERT_TRUE(world.ok()) << world.status();
    EXPECT_EQ(emu.live_streams(), 3);
    OnEveryRank(3, [&](int r) {
      uint64_t mine = r, all[3];
      EXPECT_TRUE((*world)[r]->AllGather(&mine, all, sizeof(mine), "gather").ok());
    });
  }
  EXPECT_EQ(emu.live_streams(), 0);
  EXPECT_EQ(emu.live_events(), 0);
}

// The caller's streams must be streams of the ranks' device (the current one).
TEST(LoopbackTransport, CallersStreamsOfAnotherGpuAreRefused) {
  EmulatedCudaRuntime emu(Devices(2));
  const CudaRuntimeApi& rt = emu.runtime();
  cudaStream on_0 = nullptr, on_1 = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&on_0, kCudaStreamNonBlocking), 0);
  ASSERT_EQ(rt.SetDevice(1), 0);
  ASSERT_EQ(rt.StreamCreateWithFlags(&on_1, kCudaStreamNonBlocking), 0);
  ASSERT_EQ(rt.SetDevice(0), 0);
  auto world = CreateLoopbackTransports(rt, 2, absl::Seconds(10), {on_0, on_1});
  EXPECT_EQ(world.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(world.status().message(), HasSubstr("streams[1] is not a stream of GPU 0"));
  EXPECT_TRUE(CreateLoopbackTransports(rt, 2, absl::Seconds(10), {on_0, on_0}).ok());
  EXPECT_EQ(rt.StreamDestroy(on_0), 0);
  EXPECT_EQ(rt.StreamDestroy(on_1), 0);
  EXPECT_EQ(emu.live_events(), 0);
}

TEST(LoopbackTransport, Arguments) {
  EmulatedCudaRuntime emu(Devices(1));
  EXPECT_EQ(CreateLoopbackTransports(emu.runtime(), 0, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateLoopbackTransports(emu.runtime(), 2, absl::Seconds(1), {nullptr}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateLoopbackTransports(emu.runtime(), 2, absl::ZeroDuration()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsap::cuda
