// The NCCL transport (lib/cuda/transport/nccl_transport.h) without NCCL or a GPU: a stand-in
// for NCCL's point-to-point calls over the emulated CUDA runtime
// (tests/support/emulated_cuda_runtime.h), one rank per emulated GPU. It checks buffers as
// NCCL's argument check does and runs each group as a kernel on the given stream, so the
// transport's staging of host buffers (the AllGather of batch creation), its events and its
// streams meet the driver's rules: device buffers in a ring, host AllGathers, and calls from
// threads whose current device is another GPU.
#include "lib/cuda/transport/nccl_transport.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/emulated_cuda_runtime.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::EmulatedCudaRuntime;

constexpr ncclResult kNcclInvalidArgument = 4;
constexpr ncclResult kNcclInvalidUsage = 5;
constexpr ncclResult kNcclUnhandledCudaError = 1;

// NCCL's send/receive for ranks of one process, rank r on emulated GPU devices[r]:
//  - buffers: "cudaPointerGetAttributes ... attr.devicePointer == NULL" -> "is not a valid
//    pointer", and device memory "allocated on device %d mismatchs with NCCL device %d"
//    (NCCL src/misc/argcheck.cc, CudaPtrCheck): ncclInvalidArgument;
//  - a group runs as one kernel on its stream, launched on the communicator's device (a
//    stream of another device fails the launch: ncclUnhandledCudaError); sends and receives
//    between two ranks match in posting order, as NCCL's do.
class FakeNccl {
 public:
  FakeNccl(EmulatedCudaRuntime& emu, std::vector<int> devices) : emu_(emu) {
    for (int r = 0; r < static_cast<int>(devices.size()); ++r) {
      comms_.push_back(
          std::make_unique<Comm>(Comm{r, static_cast<int>(devices.size()), devices[r]}));
    }
    active() = this;
    api_.path = "fake nccl";
    api_.version = 22809;
    api_.GetVersion = [](int* v) {
      *v = 22809;
      return kNcclSuccess;
    };
    api_.GetErrorString = [](ncclResult r) {
      return r == kNcclInvalidArgument ? "invalid argument" : "fake nccl error";
    };
    api_.CommDestroy = [](ncclComm) { return kNcclSuccess; };
    api_.CommAbort = [](ncclComm) { return kNcclSuccess; };
    api_.CommGetAsyncError = [](ncclComm, ncclResult* r) {
      *r = kNcclSuccess;
      return kNcclSuccess;
    };
    api_.CommCount = [](ncclComm c, int* n) {
      *n = Of(c)->size;
      return kNcclSuccess;
    };
    api_.CommUserRank = [](ncclComm c, int* r) {
      *r = Of(c)->rank;
      return kNcclSuccess;
    };
    api_.CommCuDevice = [](ncclComm c, int* d) {
      *d = Of(c)->device;
      return kNcclSuccess;
    };
    api_.GroupStart = [] {
      ++group().depth;
      return kNcclSuccess;
    };
    api_.GroupEnd = [] {
      Group& g = group();
      if (g.depth == 0) return kNcclInvalidUsage;
      if (--g.depth > 0) return kNcclSuccess;
      std::vector<Op> ops = std::move(g.ops);
      g.ops.clear();
      return active()->Submit(std::move(ops));
    };
    api_.Send = [](const void* buf, size_t count, int type, int peer, ncclComm c, cudaStream s) {
      return active()->Post(Op{true, const_cast<void*>(buf), count, type, peer, Of(c), s});
    };
    api_.Recv = [](void* buf, size_t count, int type, int peer, ncclComm c, cudaStream s) {
      return active()->Post(Op{false, buf, count, type, peer, Of(c), s});
    };
  }
  ~FakeNccl() { active() = nullptr; }

  const NcclApi& api() const { return api_; }
  ncclComm comm(int rank) const { return reinterpret_cast<ncclComm>(comms_[rank].get()); }
  // The last argument check that failed ("" when none).
  std::string refused() const {
    std::lock_guard<std::mutex> lock(mu_);
    return refused_;
  }

 private:
  struct Comm {
    int rank, size, device;
  };
  struct Op {
    bool send;
    void* buf;
    size_t bytes;
    int type;
    int peer;
    Comm* comm;
    cudaStream stream;
  };
  struct Group {
    int depth = 0;
    std::vector<Op> ops;
  };
  struct Message {
    const void* data;
    size_t bytes;
    bool taken = false;
  };
  static FakeNccl*& active() {
    static FakeNccl* a = nullptr;
    return a;
  }
  static Group& group() {
    thread_local Group g;
    return g;
  }
  static Comm* Of(ncclComm c) { return reinterpret_cast<Comm*>(c); }

  ncclResult Refuse(std::string why) {
    std::lock_guard<std::mutex> lock(mu_);
    refused_ = std::move(why);
    return kNcclInvalidArgument;
  }
  ncclResult Post(Op op) {
    if (op.type != kNcclUint8) return Refuse("only ncclUint8 is faked");
    if (op.peer < 0 || op.peer >= op.comm->size) return Refuse("peer out of range");
    const EmulatedCudaRuntime::Pointer at = emu_.Query(op.buf);
    if (at.memory == EmulatedCudaRuntime::Memory::kPageable) {
      return Refuse(absl::StrCat(op.send ? "ncclSend" : "ncclRecv", " : buffer ",
                                 absl::Hex(reinterpret_cast<uintptr_t>(op.buf)),
                                 " is not a valid pointer"));
    }
    if (at.memory == EmulatedCudaRuntime::Memory::kDevice && at.device != op.comm->device) {
      return Refuse(absl::StrCat(op.send ? "ncclSend" : "ncclRecv",
                                 " : buffer allocated on device ", at.device,
                                 " mismatchs with NCCL device ", op.comm->device));
    }
    if (group().depth > 0) {
      group().ops.push_back(op);
      return kNcclSuccess;
    }
    return Submit({op});
  }
  // One kernel per (communicator, stream) of the group.
  ncclResult Submit(std::vector<Op> ops) {
    std::map<std::pair<Comm*, cudaStream>, std::vector<Op>> kernels;
    for (const Op& op : ops) kernels[{op.comm, op.stream}].push_back(op);
    for (auto& [key, list] : kernels) {
      const int device = key.first->device;
      if (emu_.Launch(device, key.second, [this, list] { Run(list); }) != 0) {
        return kNcclUnhandledCudaError;
      }
    }
    return kNcclSuccess;
  }
  void Run(const std::vector<Op>& ops) {
    std::unique_lock<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<Message>> sent;
    for (const Op& op : ops) {
      if (!op.send) continue;
      auto m = std::make_shared<Message>(Message{op.buf, op.bytes});
      mailbox_[{op.comm->rank, op.peer}].push_back(m);
      sent.push_back(m);
    }
    cv_.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (const Op& op : ops) {
      if (op.send) continue;
      auto& box = mailbox_[{op.peer, op.comm->rank}];
      if (!cv_.wait_until(lock, deadline, [&] { return !box.empty(); })) {
        ADD_FAILURE() << "fake NCCL: rank " << op.comm->rank << " never got rank " << op.peer
                      << "'s message";
        return;
      }
      std::shared_ptr<Message> m = box.front();
      box.pop_front();
      EXPECT_EQ(m->bytes, op.bytes) << "fake NCCL: sizes disagree";
      std::memcpy(op.buf, m->data, std::min(m->bytes, op.bytes));
      m->taken = true;
      cv_.notify_all();
    }
    for (const auto& m : sent) {
      if (!cv_.wait_until(lock, deadline, [&] { return m->taken; })) {
        ADD_FAILURE() << "fake NCCL: a message was never received";
        return;
      }
    }
  }

  EmulatedCudaRuntime& emu_;
  NcclApi api_;
  std::vector<std::unique_ptr<Comm>> comms_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Message>>> mailbox_;
  std::string refused_;
};

std::vector<char> Pattern(size_t bytes, int seed) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>((i * 5 + seed * 29) & 0x7f);
  return v;
}

void OnEveryRank(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
}

// R ranks, rank r on GPU r; each creates its transport with its GPU current (as
// hsapCommInitRank requires), then runs body on a thread of its own.
struct World {
  explicit World(int R) : emu(Options(R)), nccl(emu, Devices(R)), transports(R) {
    OnEveryRank(R, [&](int r) {
      ASSERT_EQ(emu.runtime().SetDevice(r), 0);
      auto t = NcclTransport::Create(nccl.api(), emu.runtime(), nccl.comm(r), false, nullptr,
                                     absl::Seconds(10));
      ASSERT_TRUE(t.ok()) << t.status();
      transports[r] = *std::move(t);
    });
  }
  static EmulatedCudaRuntime::Options Options(int R) {
    EmulatedCudaRuntime::Options o;
    o.devices = R;
    o.watchdog = absl::Seconds(20);
    return o;
  }
  static std::vector<int> Devices(int R) {
    std::vector<int> d(R);
    for (int r = 0; r < R; ++r) d[r] = r;
    return d;
  }
  EmulatedCudaRuntime emu;
  FakeNccl nccl;
  std::vector<std::unique_ptr<NcclTransport>> transports;
};

TEST(NcclTransport, DeviceBuffersInARing) {
  const int R = 3;
  World w(R);
  const CudaRuntimeApi& rt = w.emu.runtime();
  std::vector<std::string> failures(R);
  OnEveryRank(R, [&](int r) {
    ASSERT_EQ(rt.SetDevice(r), 0);
    void *send = nullptr, *recv = nullptr;
    ASSERT_EQ(rt.Malloc(&send, 300), 0);
    ASSERT_EQ(rt.Malloc(&recv, 300), 0);
    ASSERT_EQ(rt.Memcpy(send, Pattern(300, r).data(), 300, kCudaMemcpyHostToDevice), 0);
    ASSERT_EQ(rt.StreamSynchronize(nullptr), 0);
    const int next = (r + 1) % R, prev = (r + R - 1) % R;
    std::vector<SendOp> sends = {{next, send, 300, 4}};
    std::vector<RecvOp> recvs = {{prev, recv, 300, 4}};
    std::vector<char> got(300);
    if (absl::Status s = w.transports[r]->Exchange(sends, recvs, "ring"); !s.ok()) {
      failures[r] = std::string(s.message());
    } else if (rt.Memcpy(got.data(), recv, 300, kCudaMemcpyDeviceToHost) != 0 ||
               got != Pattern(300, prev)) {
      failures[r] = "wrong data";
    }
    rt.Free(send);
    rt.Free(recv);
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  EXPECT_EQ(w.nccl.refused(), "");
}

// Batch creation's AllGathers of host records go through the transport's device staging.
TEST(NcclTransport, HostAllGatherThroughStaging) {
  const int R = 3;
  World w(R);
  std::vector<std::string> failures(R);
  OnEveryRank(R, [&](int r) {
    ASSERT_EQ(w.emu.runtime().SetDevice(r), 0);
    for (size_t bytes : {8, 72, 1000}) {
      std::vector<char> mine = Pattern(bytes, r), all(bytes * R);
      if (absl::Status s = w.transports[r]->AllGather(mine.data(), all.data(), bytes, "gather");
          !s.ok()) {
        failures[r] = std::string(s.message());
        return;
      }
      for (int q = 0; q < R; ++q) {
        if (!std::equal(all.begin() + q * bytes, all.begin() + (q + 1) * bytes,
                        Pattern(bytes, q).begin())) {
          failures[r] = absl::StrCat("wrong record of rank ", q, " (", bytes, " B)");
        }
      }
    }
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  EXPECT_EQ(w.nccl.refused(), "");
}

// A rank driven from a thread whose current device is another GPU (the transport was made
// with its own GPU current): staging memory, events and the stream stay on the
// communicator's GPU, and the thread's device is left as it was.
TEST(NcclTransport, CallersWhoseCurrentDeviceIsAnotherGpu) {
  const int R = 2;
  World w(R);
  const CudaRuntimeApi& rt = w.emu.runtime();
  std::vector<std::string> failures(R);
  OnEveryRank(R, [&](int r) {
    ASSERT_EQ(rt.SetDevice(1 - r), 0);
    uint64_t mine = 100 + r, all[2] = {0, 0};
    if (absl::Status s = w.transports[r]->AllGather(&mine, all, sizeof(mine), "gather"); !s.ok()) {
      failures[r] = std::string(s.message());
    } else if (all[0] != 100 || all[1] != 101) {
      failures[r] = "wrong records";
    }
    int device = -1;
    rt.GetDevice(&device);
    EXPECT_EQ(device, 1 - r) << "rank " << r << ": the current device changed";
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  EXPECT_EQ(w.nccl.refused(), "");
}

// A transport made from a thread whose current device is another GPU (hsapCommSplit and
// hsapCommInitFromNccl may be called from any thread) works on the communicator's GPU.
TEST(NcclTransport, CreatedFromAThreadOnAnotherGpu) {
  const int R = 2;
  World w(R);
  const CudaRuntimeApi& rt = w.emu.runtime();
  std::vector<std::unique_ptr<NcclTransport>> split(R);
  std::vector<std::string> failures(R);
  OnEveryRank(R, [&](int r) {
    ASSERT_EQ(rt.SetDevice(1 - r), 0);
    auto t =
        NcclTransport::Create(w.nccl.api(), rt, w.nccl.comm(r), false, nullptr, absl::Seconds(10));
    ASSERT_TRUE(t.ok()) << t.status();
    split[r] = *std::move(t);
    EXPECT_EQ(split[r]->device(), r);
    EXPECT_EQ(w.emu.DeviceOfStream(split[r]->stream()), r) << "rank " << r;
    uint64_t mine = 7 + r, all[2] = {0, 0};
    if (absl::Status s = split[r]->AllGather(&mine, all, sizeof(mine), "gather"); !s.ok()) {
      failures[r] = std::string(s.message());
    } else if (all[0] != 7 || all[1] != 8) {
      failures[r] = "wrong records";
    }
    int device = -1;
    rt.GetDevice(&device);
    EXPECT_EQ(device, 1 - r) << "rank " << r << ": the current device changed";
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

TEST(NcclTransport, HostBuffersOutsideTheAllGatherAreRefusedByNccl) {
  World w(2);
  std::vector<char> host(16);
  std::vector<SendOp> sends = {{1, host.data(), 16, 3}};
  absl::StatusOr<std::unique_ptr<Transport::Pending>> p =
      w.transports[0]->Start(sends, {}, "host send");
  EXPECT_FALSE(p.ok());
  EXPECT_THAT(w.nccl.refused(), ::testing::HasSubstr("is not a valid pointer"));
}

}  // namespace
}  // namespace hsap::cuda
