// The CUDA communicator entry points and the dlopen paths. On a machine without a GPU these
// check the clear hsapUnsupported reports; the GPU tests at the end skip there.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "lib/cuda/cudnn/libcudnn_runner.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "lib/cuda/transport/loopback_transport.h"
#include "lib/cuda/transport/nccl_transport.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/random_layouts.h"
#include "tests/support/scoped_env.h"
#include "tests/support/sweep.h"

namespace hsap::cuda {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

std::string LastError() { return hsapGetLastError(); }

std::string EmptyDir() {
  const auto dir = std::filesystem::temp_directory_path() / "hsap_cuda_empty_libdir";
  std::filesystem::create_directories(dir);
  return dir.string();
}

// Why the GPU tests cannot run here, or "" when a CUDA device and NCCL are usable.
std::string NoGpuReason() {
  absl::Status s = CheckNcclDevice();
  return s.ok() ? "" : std::string(s.message());
}

#define SKIP_WITHOUT_GPU()                               \
  do {                                                   \
    if (std::string why = NoGpuReason(); !why.empty()) { \
      GTEST_SKIP() << "no CUDA device: " << why;         \
    }                                                    \
  } while (0)

TEST(CudaLoader, MissingLibrariesAreNamed) {
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", EmptyDir().c_str());
  absl::StatusOr<const CudaDriverApi*> driver = LoadCudaDriver();
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(driver.status().message(), HasSubstr("libcuda.so.1 not found: no NVIDIA driver"));
  EXPECT_THAT(driver.status().message(), HasSubstr(EmptyDir()));
  absl::StatusOr<const NcclApi*> nccl = LoadNccl();
  EXPECT_THAT(nccl.status().message(), HasSubstr("libnccl.so.2 not found"));
  absl::StatusOr<const CudaRuntimeApi*> rt = LoadCudaRuntime();
  EXPECT_THAT(rt.status().message(), HasSubstr("libcudart"));
  EXPECT_THAT(CheckCudaDevice().message(), HasSubstr("libcuda.so.1 not found"));
}

TEST(CudaLoader, SearchPathHonoursOverrideAndDefaults) {
  {
    testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", "/a:/b::");
    EXPECT_EQ(CudaLibrarySearchPath(), (std::vector<std::string>{"/a", "/b"}));
  }
  {
    testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", "");
    EXPECT_EQ(CudaLibrarySearchPath().size(), 1u);  // only a directory that does not exist
  }
  if (std::getenv("HSAP_CUDA_LIB_PATH") != nullptr) {
    GTEST_SKIP() << "$HSAP_CUDA_LIB_PATH is set for this run; the default path is not used";
  }
  const std::vector<std::string> dirs = CudaLibrarySearchPath();
  ASSERT_FALSE(dirs.empty());
  EXPECT_EQ(dirs.back(), "");  // the default loader path last
}

TEST(CudaLoader, DefaultSearchReportsWhatThisMachineLacks) {
  absl::Status s = CheckNcclDevice();
  if (s.ok()) GTEST_SKIP() << "this machine has a CUDA device and NCCL";
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(
      std::string(s.message()),
      AnyOf(HasSubstr("libcuda.so.1 not found: no NVIDIA driver"), HasSubstr("no CUDA device"),
            HasSubstr("libnccl.so.2 not found"), HasSubstr("libcudart not found")));
}

// Tokens are made for either backend: with NCCL they carry an ncclUniqueId too, without
// it they still name a host communicator.
TEST(CudaApi, UniqueIdWithOrWithoutNccl) {
  hsapUniqueId_t id, other;
  std::memset(&id, 0, sizeof(id));
  EXPECT_EQ(sizeof(id), 128u);
  ASSERT_EQ(hsapGetUniqueId(&id), hsapSuccess) << LastError();
  ASSERT_EQ(hsapGetUniqueId(&other), hsapSuccess) << LastError();
  bool nonzero = false;
  for (char c : id.internal) nonzero = nonzero || c != 0;
  EXPECT_TRUE(nonzero);
  EXPECT_NE(std::memcmp(&id, &other, sizeof(id)), 0);
  EXPECT_EQ(hsapGetUniqueId(nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("uniqueId"));
}

TEST(CudaApi, UniqueIdWithoutNccl) {
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", EmptyDir().c_str());
  hsapUniqueId_t id;
  ASSERT_EQ(hsapGetUniqueId(&id), hsapSuccess) << LastError();
  hsapComm_t comm = nullptr;
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.backend = hsapBackendCuda;
  EXPECT_EQ(hsapCommInitRank(&comm, 1, id, 0, &config), hsapUnsupported);
  EXPECT_THAT(LastError(), HasSubstr("libcuda.so.1 not found"));
  EXPECT_EQ(comm, nullptr);
  // The default backend without CUDA: host.
  config.backend = hsapBackendDefault;
  config.timeoutMs = 10000;
  ASSERT_EQ(hsapCommInitRank(&comm, 1, id, 0, &config), hsapSuccess) << LastError();
  int is_cuda = -1;
  EXPECT_EQ(hsapCommIsCuda(comm, &is_cuda), hsapSuccess);
  EXPECT_EQ(is_cuda, 0);
  EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess);
}

TEST(CudaApi, InitRankChecksArgumentsFirst) {
  hsapUniqueId_t id{};
  hsapComm_t comm = nullptr;
  EXPECT_EQ(hsapCommInitRank(nullptr, 1, id, 0, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapCommInitRank(&comm, 0, id, 0, nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("nranks = 0"));
  EXPECT_EQ(hsapCommInitRank(&comm, 2, id, 2, nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("rank = 2"));
  hsapCommConfig_t bad = HSAP_COMM_CONFIG_INITIALIZER;
  bad.magic = 0;
  EXPECT_EQ(hsapCommInitRank(&comm, 1, id, 0, &bad), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("HSAP_COMM_CONFIG_INITIALIZER"));
  EXPECT_EQ(comm, nullptr);
  EXPECT_EQ(hsapCommInitFromNccl(&comm, nullptr, nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("ncclComm"));
}

TEST(CudaApi, InitRankWithoutDriverIsUnsupported) {
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", EmptyDir().c_str());
  hsapUniqueId_t id{};
  hsapComm_t comm = nullptr;
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  EXPECT_EQ(config.cudaStream, nullptr);
  EXPECT_EQ(hsapCommInitRank(&comm, 1, id, 0, &config), hsapUnsupported);
  EXPECT_THAT(LastError(), HasSubstr("libcuda.so.1 not found: no NVIDIA driver"));
  EXPECT_EQ(comm, nullptr);
  int fake = 0;
  EXPECT_EQ(hsapCommInitFromNccl(&comm, &fake, &config), hsapUnsupported);
  EXPECT_THAT(LastError(), HasSubstr("libcuda.so.1 not found"));
}

TEST(CudaApi, InitRankOnThisMachine) {
  if (NoGpuReason().empty()) GTEST_SKIP() << "this machine has a CUDA device";
  hsapUniqueId_t id{};
  hsapComm_t comm = nullptr;
  EXPECT_EQ(hsapCommInitRank(&comm, 1, id, 0, nullptr), hsapUnsupported);
  EXPECT_EQ(LastError().find("hsapCommInitRank"), 0u) << LastError();
  EXPECT_EQ(comm, nullptr);
}

TEST(CudaApi, HostCommunicatorsStayHost) {
  hsapComm_t comms[2] = {nullptr, nullptr};
  // A caller built against version 1 of the config (without cudaStream) still works.
  hsapCommConfig_t old = HSAP_COMM_CONFIG_INITIALIZER;
  old.size = offsetof(hsapCommConfig_t, numThreads) + sizeof(int);
  ASSERT_EQ(hsapCommInitAll(comms, 2, &old), hsapSuccess) << LastError();
  int is_cuda = -1;
  ASSERT_EQ(hsapCommIsCuda(comms[0], &is_cuda), hsapSuccess);
  EXPECT_EQ(is_cuda, 0);
  hsapComm_t sub = comms[0];
  EXPECT_EQ(hsapCommSplit(comms[0], 0, 0, &sub, nullptr), hsapUnsupported);
  EXPECT_THAT(LastError(), HasSubstr("needs a CUDA communicator"));
  EXPECT_EQ(sub, nullptr);
  EXPECT_EQ(hsapCommIsCuda(nullptr, &is_cuda), hsapInvalidArgument);
  for (hsapComm_t c : comms) hsapCommDestroy(c);
}

// ---- GPU tests ------------------------------------------------------------------------

// Device buffer with upload/download through the loaded runtime.
struct GpuBuffer {
  const CudaRuntimeApi* rt = nullptr;
  void* p = nullptr;
  size_t bytes = 0;
  GpuBuffer(const CudaRuntimeApi* r, size_t n) : rt(r), bytes(n) {
    EXPECT_TRUE(rt->Check(rt->Malloc(&p, n), "cudaMalloc").ok());
  }
  ~GpuBuffer() { rt->Free(p); }
  // cudaMemcpy from pageable memory may return before its DMA is done, and the transports'
  // streams are non-blocking: wait for the legacy stream before they read the data.
  void Upload(const std::vector<uint8_t>& h) {
    EXPECT_TRUE(rt->Check(rt->Memcpy(p, h.data(), bytes, kCudaMemcpyDefault), "upload").ok());
    EXPECT_TRUE(rt->Check(rt->StreamSynchronize(nullptr), "upload (sync)").ok());
  }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> h(bytes);
    EXPECT_TRUE(rt->Check(rt->Memcpy(h.data(), p, bytes, kCudaMemcpyDefault), "download").ok());
    return h;
  }
};

std::vector<uint8_t> Pattern(size_t n, int seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * 131 + seed * 17) & 0xff);
  return v;
}

TEST(CudaGpu, SingleRankCommunicatorSendsToItself) {
  SKIP_WITHOUT_GPU();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  ASSERT_TRUE(rt->Check(rt->SetDevice(0), "cudaSetDevice").ok());
  hsapUniqueId_t id;
  ASSERT_EQ(hsapGetUniqueId(&id), hsapSuccess) << LastError();
  hsapComm_t comm = nullptr;
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.timeoutMs = 60000;
  ASSERT_EQ(hsapCommInitRank(&comm, 1, id, 0, &config), hsapSuccess) << LastError();
  int is_cuda = 0;
  ASSERT_EQ(hsapCommIsCuda(comm, &is_cuda), hsapSuccess);
  EXPECT_EQ(is_cuda, 1);
  // Batches with and without a plan run on it.
  hsapLayout_t layout = nullptr;
  const int64_t cu[] = {0, 16};
  ASSERT_EQ(hsapLayoutCreate(&layout, cu, 1, nullptr, nullptr), hsapSuccess);
  hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
  bc.numHeadsQ = bc.numHeadsKV = 1;
  bc.headDim = 64;
  hsapBatch_t batch = nullptr;
  EXPECT_EQ(hsapBatchCreate(&batch, comm, layout, nullptr, &bc), hsapSuccess) << LastError();
  size_t pool = 0;
  EXPECT_EQ(hsapCommGetPoolBytes(comm, &pool), hsapSuccess);
  EXPECT_GT(pool, 0u);
  hsapBatchDestroy(batch);
  hsapPlan_t plan = nullptr;
  const int sizes[] = {1}, ranks[] = {0}, counts[] = {1}, heads[] = {0};
  ASSERT_EQ(
      hsapPlanCreate(&plan, 1, 1, 1, 1, sizes, ranks, nullptr, nullptr, counts, heads, nullptr),
      hsapSuccess)
      << LastError();
  EXPECT_EQ(hsapBatchCreateWithPlan(&batch, comm, layout, plan, &bc), hsapSuccess) << LastError();
  hsapBatchDestroy(batch);
  hsapPlanDestroy(plan);
  hsapLayoutDestroy(layout);
  hsapCommDestroy(comm);
}

// One thread per GPU, a ring exchange of two messages per stage through NcclTransport.
TEST(CudaGpu, NcclTransportRingOnEveryGpu) {
  SKIP_WITHOUT_GPU();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  int devices = 0;
  ASSERT_TRUE(rt->Check(rt->GetDeviceCount(&devices), "cudaGetDeviceCount").ok());
  if (devices < 2) GTEST_SKIP() << "no CUDA device: needs 2 GPUs, found " << devices;
  const int R = std::min(devices, 8);
  hsapUniqueId_t id;
  ASSERT_EQ(hsapGetUniqueId(&id), hsapSuccess) << LastError();
  std::vector<std::string> failures(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      rt->SetDevice(r);
      hsapComm_t comm = nullptr;
      hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
      config.timeoutMs = 60000;
      if (hsapCommInitRank(&comm, R, id, r, &config) != hsapSuccess) {
        failures[r] = LastError();
        return;
      }
      // Through the internal transport: send K and V (distinct sizes) to r+1.
      hsapComm_st* handle = comm;
      Transport& t = handle->comm->transport();
      const size_t kb = 4096 + 64 * r, vb = 1000;
      const int next = (r + 1) % R, prev = (r + R - 1) % R;
      GpuBuffer k(rt, kb), v(rt, vb), rk(rt, 4096 + 64 * prev), rv(rt, vb);
      k.Upload(Pattern(kb, r));
      v.Upload(Pattern(vb, 100 + r));
      std::vector<SendOp> sends = {{next, v.p, vb, 2}, {next, k.p, kb, 1}};
      std::vector<RecvOp> recvs = {{prev, rk.p, rk.bytes, 1}, {prev, rv.p, vb, 2}};
      absl::Status s = t.Exchange(sends, recvs, "ring");
      if (!s.ok()) {
        failures[r] = std::string(s.message());
      } else if (rk.Download() != Pattern(rk.bytes, prev) ||
                 rv.Download() != Pattern(vb, 100 + prev)) {
        failures[r] = "wrong data";
      }
      hsapCommDestroy(comm);
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

TEST(CudaLoopback, ArgumentsAndMissingDevice) {
  EXPECT_EQ(CreateLoopbackTransports(0, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateLoopbackTransports(2, absl::Seconds(1), {nullptr}).status().code(),
            absl::StatusCode::kInvalidArgument);
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", EmptyDir().c_str());
  absl::Status s = CreateLoopbackTransports(2, absl::Seconds(1)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("libcuda.so.1 not found"));
}

// Four ranks on one GPU: a ring exchange, a size mismatch and a missing peer.
TEST(CudaGpu, LoopbackRanksOnOneGpu) {
  SKIP_WITHOUT_GPU();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  ASSERT_TRUE(rt->Check(rt->SetDevice(0), "cudaSetDevice").ok());
  const int R = 4;
  auto world = CreateLoopbackTransports(R, absl::Seconds(30));
  ASSERT_TRUE(world.ok()) << world.status();
  std::vector<std::string> failures(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      rt->SetDevice(0);
      Transport& t = *(*world)[r];
      const int next = (r + 1) % R, prev = (r + R - 1) % R;
      const size_t kb = 1024 + 16 * r;
      GpuBuffer k(rt, kb), rk(rt, 1024 + 16 * prev);
      k.Upload(Pattern(kb, r));
      std::vector<SendOp> sends = {{next, k.p, kb, 7}};
      std::vector<RecvOp> recvs = {{prev, rk.p, rk.bytes, 7}};
      if (absl::Status s = t.Exchange(sends, recvs, "ring"); !s.ok()) {
        failures[r] = std::string(s.message());
      } else if (rk.Download() != Pattern(rk.bytes, prev)) {
        failures[r] = "wrong data";
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  EXPECT_EQ((*world)[0]->counters().bytes_sent, 1024u);

  // Sizes disagree: both sides fail.
  GpuBuffer a(rt, 64), b(rt, 32);
  std::vector<SendOp> s0 = {{1, a.p, 64, 9}};
  std::vector<RecvOp> r1 = {{0, b.p, 32, 9}};
  auto p0 = (*world)[0]->Start(s0, {}, "mismatch");
  ASSERT_TRUE(p0.ok());
  EXPECT_THAT((*world)[1]->Exchange({}, r1, "mismatch").message(), HasSubstr("64 bytes"));
  EXPECT_EQ((*p0)->Wait().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CudaGpu, LoopbackTimeoutNamesThePeer) {
  SKIP_WITHOUT_GPU();
  auto world = CreateLoopbackTransports(2, absl::Milliseconds(200));
  ASSERT_TRUE(world.ok()) << world.status();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  GpuBuffer b(rt, 16);
  std::vector<RecvOp> r = {{1, b.p, 16, 3}};
  absl::Status s = (*world)[0]->Exchange({}, r, "lonely");
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("waits for rank 1"));
}

// ---- Batches on CUDA communicators, through the C API --------------------------------

TEST(CudaApi, PoolBytesOfHostCommunicatorsIsZero) {
  hsapComm_t comms[2] = {nullptr, nullptr};
  ASSERT_EQ(hsapCommInitAll(comms, 2, nullptr), hsapSuccess) << LastError();
  size_t bytes = 123;
  EXPECT_EQ(hsapCommGetPoolBytes(comms[0], &bytes), hsapSuccess);
  EXPECT_EQ(bytes, 0u);
  EXPECT_EQ(hsapCommGetPoolBytes(comms[0], nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("bytes"));
  EXPECT_EQ(hsapCommGetPoolBytes(nullptr, &bytes), hsapInvalidArgument);
  for (hsapComm_t c : comms) hsapCommDestroy(c);
}

TEST(CudaApi, LoopbackArgumentsAndMissingDevice) {
  hsapComm_t comms[2] = {nullptr, nullptr};
  EXPECT_EQ(hsapCommInitLoopback(nullptr, 2, nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("comms"));
  EXPECT_EQ(hsapCommInitLoopback(comms, 0, nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("nranks = 0"));
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", EmptyDir().c_str());
  EXPECT_EQ(hsapCommInitLoopback(comms, 2, nullptr), hsapUnsupported);
  EXPECT_THAT(LastError(), HasSubstr("libcuda.so.1 not found"));
  EXPECT_EQ(comms[0], nullptr);
  EXPECT_EQ(comms[1], nullptr);
}

// Tensors in the current GPU's memory (one cudaMalloc per tensor, freed at the end).
class DevicePlacement : public testing::TensorPlacement {
 public:
  explicit DevicePlacement(const CudaRuntimeApi* rt) : rt_(rt) {}
  ~DevicePlacement() override {
    for (void* p : placed_) rt_->Free(p);
  }
  void* Place(void* host, size_t bytes) override {
    void* p = nullptr;
    EXPECT_TRUE(rt_->Check(rt_->Malloc(&p, bytes), "cudaMalloc").ok());
    EXPECT_TRUE(rt_->Check(rt_->Memcpy(p, host, bytes, kCudaMemcpyDefault), "upload").ok());
    // The DMA of a pageable upload may still run; the communicators' streams do not wait.
    EXPECT_TRUE(rt_->Check(rt_->StreamSynchronize(nullptr), "upload (sync)").ok());
    std::lock_guard<std::mutex> lock(mu_);
    placed_.push_back(p);
    return p;
  }
  void Fetch(const void* placed, void* host, size_t bytes) override {
    EXPECT_TRUE(rt_->Check(rt_->Memcpy(host, placed, bytes, kCudaMemcpyDefault), "download").ok());
  }

 private:
  const CudaRuntimeApi* rt_;
  std::mutex mu_;
  std::vector<void*> placed_;
};

struct GpuCase {
  int ranks;
  DType dtype;
  int heads_q, heads_kv, head_dim;
  hsap::testing::DocMix mix;
  int64_t tokens;
};

// `g.ranks` loopback ranks on GPU 0, a random layout of `g.mix` (all mask kinds), forward and
// backward against the fp64 reference under the kernels' tolerance rule.
void CheckLoopbackCase(const CudaRuntimeApi* rt, const GpuCase& g, uint64_t seed) {
  DevicePlacement placement(rt);
  hsap::testing::DistCase c;
  c.ranks = g.ranks;
  c.dtype = g.dtype;
  c.heads_q = g.heads_q;
  c.heads_kv = g.heads_kv;
  c.head_dim = g.head_dim;
  c.init_comms = hsapCommInitLoopback;
  c.placement = &placement;
  c.enter_rank = [rt](int) { rt->SetDevice(0); };
  const Layout layout = hsap::testing::RandomLayout(g.tokens, g.mix, seed, false);
  hsap::testing::CheckAgainstReference(layout, c, seed, hsap::testing::kCudaKernelFloor);
}

// Loopback ranks on GPU 0: forward and backward against the fp64 reference, forward through
// the peer windows (the default for loopback ranks) or through transfer stages
// ($HSAP_FUSED_FORWARD=0). A sweep (tests/support/sweep.h): its subset, the first and the
// last case, is what bench/device_check.sh runs under compute-sanitizer.
TEST(CudaGpu, LoopbackBatchesMatchTheReference) {
  SKIP_WITHOUT_GPU();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  using hsap::testing::DocMix;
  struct LoopbackCase {
    GpuCase g;
    bool fused;
    uint64_t seed;
  };
  const std::vector<LoopbackCase> cases = {
      {{2, DType::kBF16, 8, 2, 128, DocMix::kSingle, 1500}, false, 502},
      {{1, DType::kF32, 2, 1, 64, DocMix::kUniform, 700}, true, 501},
      {{3, DType::kF16, 4, 4, 64, DocMix::kLongTail, 1300}, true, 503},
      {{4, DType::kBF16, 8, 1, 128, DocMix::kLongTail, 2000}, false, 504},
      {{8, DType::kF32, 4, 2, 96, DocMix::kOneHuge, 1600}, true, 505},
  };
  testing::ScopedEnv fused_env("HSAP_FUSED_FORWARD", nullptr);
  for (const LoopbackCase& lc : hsap::testing::Sweep(cases, 2)) {
    const GpuCase& g = lc.g;
    fused_env.Set(lc.fused ? "1" : "0");
    SCOPED_TRACE(::testing::Message()
                 << g.ranks << " loopback ranks, " << DTypeName(g.dtype) << ", d " << g.head_dim
                 << ", " << g.heads_q << "/" << g.heads_kv << " heads, forward "
                 << (lc.fused ? "fused" : "staged"));
    CheckLoopbackCase(rt, g, lc.seed);
  }
}

// The engine choice of a CUDA batch ($HSAP_ATTENTION_ENGINE): reported per engine with the
// reasons. Where libcudnn's piece runner can be made on this GPU, `auto` and `cudnn` put
// pieces on cuDNN; where it cannot, every piece is on the JIT kernels and `cudnn` is refused
// at creation, saying why.
TEST(CudaGpu, LoopbackBatchReportsItsEngines) {
  SKIP_WITHOUT_GPU();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  ASSERT_TRUE(rt->Check(rt->SetDevice(0), "cudaSetDevice").ok());
  const absl::StatusOr<std::shared_ptr<cuda::CudnnPieceRunner>> runner =
      cuda::NewLibCudnnPieceRunner();
  hsapComm_t comm = nullptr;
  ASSERT_EQ(hsapCommInitLoopback(&comm, 1, nullptr), hsapSuccess) << LastError();
  const Layout layout =
      hsap::testing::RandomLayout(300, hsap::testing::DocMix::kLongTail, 31, false);
  hsapLayout_t c_layout = hsap::testing::ToCLayout(layout);
  hsapBatchConfig_t config = HSAP_BATCH_CONFIG_INITIALIZER;
  config.dtype = hsapBFloat16;
  config.numHeadsQ = 4;
  config.numHeadsKV = 2;
  config.headDim = 128;
  testing::ScopedEnv engine("HSAP_ATTENTION_ENGINE", nullptr);
  for (const char* mode : {"auto", "jit"}) {
    engine.Set(mode);
    const bool jit = std::string(mode) == "jit";
    hsapBatch_t batch = nullptr;
    ASSERT_EQ(hsapBatchCreate(&batch, comm, c_layout, nullptr, &config), hsapSuccess)
        << LastError();
    hsapEngines_t e{};
    ASSERT_EQ(hsapBatchGetEngines(batch, &e), hsapSuccess) << LastError();
    EXPECT_EQ(e.mode, jit ? hsapEngineJit : hsapEngineAuto);
    EXPECT_EQ(e.cudnnPairs + e.jitPairs, layout.VisiblePairs());
    size_t size = 0;
    ASSERT_EQ(hsapBatchGetEngineReport(batch, nullptr, &size), hsapSuccess);
    std::string report(size, '\0');
    ASSERT_EQ(hsapBatchGetEngineReport(batch, report.data(), &size), hsapSuccess);
    if (jit || !runner.ok()) {
      EXPECT_EQ(e.cudnnPieces, 0) << report;
      EXPECT_GT(e.jitPieces, 0);
      EXPECT_THAT(report, HasSubstr(jit ? "HSAP_ATTENTION_ENGINE=jit" : "jit "));
    } else {
      EXPECT_GT(e.cudnnPieces, 0) << report;
      EXPECT_GT(e.cudnnCalls, 0);
      EXPECT_THAT(report, HasSubstr("cudnn "));
    }
    EXPECT_EQ(hsapBatchDestroy(batch), hsapSuccess);
  }
  engine.Set("cudnn");
  hsapBatch_t batch = nullptr;
  if (runner.ok()) {
    EXPECT_EQ(hsapBatchCreate(&batch, comm, c_layout, nullptr, &config), hsapSuccess)
        << LastError();
    if (batch != nullptr) {
      EXPECT_EQ(hsapBatchDestroy(batch), hsapSuccess);
    }
  } else {
    EXPECT_NE(hsapBatchCreate(&batch, comm, c_layout, nullptr, &config), hsapSuccess);
    EXPECT_THAT(LastError(), HasSubstr("HSAP_ATTENTION_ENGINE=cudnn"));
  }
  hsapLayoutDestroy(c_layout);
  EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess) << LastError();
}

// The cuDNN engine through libcudnn's piece runner ($HSAP_ATTENTION_ENGINE=cudnn): loopback
// ring batches on GPU 0, random layouts of every mask kind (causal with offsets, full,
// prefix, sliding windows: pieces of every cuDNN mask), bf16 and fp16, MHA and GQA, forward
// and backward against the fp64 reference under the kernels' tolerance rule. Skipped where
// the runner cannot be made (no libcudnn, cudnn_graph.h absent at build time, an old GPU).
TEST(CudaGpu, CudnnEngineMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  ASSERT_TRUE(rt->Check(rt->SetDevice(0), "cudaSetDevice").ok());
  if (absl::StatusOr<std::shared_ptr<cuda::CudnnPieceRunner>> r = cuda::NewLibCudnnPieceRunner();
      !r.ok()) {
    GTEST_SKIP() << r.status();
  }
  using hsap::testing::DocMix;
  struct CudnnCase {
    GpuCase g;
    uint64_t seed;
  };
  const std::vector<CudnnCase> cases = {
      {{1, DType::kBF16, 8, 2, 128, DocMix::kLongTail, 1500}, 601},
      {{2, DType::kBF16, 4, 4, 64, DocMix::kUniform, 1200}, 602},
      {{3, DType::kF16, 8, 1, 128, DocMix::kOneHuge, 1400}, 603},
  };
  testing::ScopedEnv engine("HSAP_ATTENTION_ENGINE", "cudnn");
  for (const CudnnCase& cc : cases) {
    const GpuCase& g = cc.g;
    SCOPED_TRACE(::testing::Message()
                 << g.ranks << " loopback ranks, " << DTypeName(g.dtype) << ", d " << g.head_dim
                 << ", " << g.heads_q << "/" << g.heads_kv << " heads, cuDNN engine");
    CheckLoopbackCase(rt, g, cc.seed);
  }
}

// hsapAttentionForwardOnStream / BackwardOnStream on a GPU: the calls on two streams of the
// caller's and on CUDA's default stream (NULL) compute what the plain calls compute; each
// returns once enqueued, and the results are read after its stream. (The ordering itself is
// tested on the emulated runtime, tests/lib/cuda/exec/gpu_batch_emulated_test.cc.)
TEST(CudaGpu, LoopbackCallsOnCallersStreams) {
  SKIP_WITHOUT_GPU();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  ASSERT_TRUE(rt->Check(rt->SetDevice(0), "cudaSetDevice").ok());
  hsapComm_t comm = nullptr;
  ASSERT_EQ(hsapCommInitLoopback(&comm, 1, nullptr), hsapSuccess) << LastError();
  const Layout layout =
      hsap::testing::RandomLayout(300, hsap::testing::DocMix::kLongTail, 37, false);
  hsapLayout_t c_layout = hsap::testing::ToCLayout(layout);
  hsapBatchConfig_t config = HSAP_BATCH_CONFIG_INITIALIZER;
  config.dtype = hsapFloat32;
  config.numHeadsQ = 4;
  config.numHeadsKV = 2;
  config.headDim = 64;
  hsapBatch_t batch = nullptr;
  ASSERT_EQ(hsapBatchCreate(&batch, comm, c_layout, nullptr, &config), hsapSuccess) << LastError();
  const int64_t n = layout.num_tokens();
  const size_t qn = n * 4 * 64, kn = n * 2 * 64;
  std::vector<float> hq(qn), hk(kn), hv(kn), hd(qn);
  for (size_t i = 0; i < qn; ++i) hq[i] = hd[i] = static_cast<float>((i * 37) % 101) / 101.0f;
  for (size_t i = 0; i < kn; ++i) hk[i] = hv[i] = static_cast<float>((i * 53) % 97) / 97.0f;
  DevicePlacement placement(rt);
  auto place = [&](std::vector<float>& h) { return placement.Place(h.data(), h.size() * 4); };
  std::vector<float> zeros_q(qn, 0.0f), zeros_k(kn, 0.0f), zeros_l(4 * n + 1, 0.0f);
  void* q = place(hq);
  void* k = place(hk);
  void* v = place(hv);
  void* dout = place(hd);
  auto t = [&](void* p, int heads) { return hsapTensor_t{p, hsapFloat32, n, heads, 64}; };
  hsapTensor_t tq = t(q, 4), tk = t(k, 2), tv = t(v, 2), td = t(dout, 4);
  cudaStream streams[2] = {nullptr, nullptr};
  for (cudaStream& s : streams) {
    ASSERT_TRUE(rt->Check(rt->StreamCreateWithFlags(&s, kCudaStreamNonBlocking), "stream").ok());
  }
  // Call 0: the plain calls; 1, 2: the caller's streams; 3: CUDA's default stream.
  std::vector<std::vector<float>> outs(4, std::vector<float>(qn)), dqs(4, std::vector<float>(qn));
  for (int call = 0; call < 4; ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    void* out = place(zeros_q);
    void* lse = place(zeros_l);
    void* dq = place(zeros_q);
    void* dk = place(zeros_k);
    void* dv = place(zeros_k);
    hsapTensor_t to = t(out, 4), tdq = t(dq, 4), tdk = t(dk, 2), tdv = t(dv, 2);
    float* l = static_cast<float*>(lse);
    void* stream = call == 1 || call == 2 ? streams[call - 1] : nullptr;
    if (call == 0) {
      ASSERT_EQ(hsapAttentionForward(batch, &tq, &tk, &tv, &to, l), hsapSuccess) << LastError();
      ASSERT_EQ(hsapAttentionBackward(batch, &td, &tq, &tk, &tv, &to, l, &tdq, &tdk, &tdv),
                hsapSuccess)
          << LastError();
    } else {
      ASSERT_EQ(hsapAttentionForwardOnStream(batch, &tq, &tk, &tv, &to, l, stream), hsapSuccess)
          << LastError();
      ASSERT_EQ(hsapAttentionBackwardOnStream(batch, &td, &tq, &tk, &tv, &to, l, &tdq, &tdk, &tdv,
                                              stream),
                hsapSuccess)
          << LastError();
    }
    ASSERT_TRUE(rt->Check(rt->StreamSynchronize(static_cast<cudaStream>(stream)), "sync").ok());
    placement.Fetch(out, outs[call].data(), qn * 4);
    placement.Fetch(dq, dqs[call].data(), qn * 4);
  }
  for (int call = 1; call < 4; ++call) {
    EXPECT_EQ(outs[call], outs[0]) << "call " << call;  // forward has no atomics
    for (size_t i = 0; i < qn; ++i) {
      ASSERT_NEAR(dqs[call][i], dqs[0][i], 1e-5f * (1.0f + std::abs(dqs[0][i])))
          << "call " << call << " dq[" << i << "]";
    }
  }
  for (cudaStream s : streams) rt->StreamDestroy(s);
  EXPECT_EQ(hsapBatchDestroy(batch), hsapSuccess);
  hsapLayoutDestroy(c_layout);
  EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess) << LastError();
}

// One NCCL rank per GPU (2..8 GPUs): the same check over NCCL.
TEST(CudaGpu, NcclBatchesOnEveryGpuMatchTheReference) {
  SKIP_WITHOUT_GPU();
  const CudaRuntimeApi* rt = *LoadCudaRuntime();
  int devices = 0;
  ASSERT_TRUE(rt->Check(rt->GetDeviceCount(&devices), "cudaGetDeviceCount").ok());
  if (devices < 2) GTEST_SKIP() << "no CUDA device: needs 2 GPUs, found " << devices;
  DevicePlacement placement(rt);
  hsap::testing::DistCase c;
  c.ranks = std::min(devices, 8);
  c.dtype = DType::kBF16;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.placement = &placement;
  c.enter_rank = [rt](int r) { rt->SetDevice(r); };
  c.init_comms = [rt](hsapComm_t* comms, int n, const hsapCommConfig_t* config) {
    hsapUniqueId_t id;
    if (hsapResult_t e = hsapGetUniqueId(&id); e != hsapSuccess) return e;
    std::vector<hsapResult_t> results(n, hsapSuccess);
    hsap::testing::OnEveryRank(n, [&](int r) {
      rt->SetDevice(r);
      results[r] = hsapCommInitRank(&comms[r], n, id, r, config);
    });
    for (hsapResult_t e : results) {
      if (e != hsapSuccess) return e;
    }
    return hsapSuccess;
  };
  const Layout layout =
      hsap::testing::RandomLayout(2500, hsap::testing::DocMix::kLongTail, 77, false);
  hsap::testing::CheckAgainstReference(layout, c, 77, hsap::testing::kCudaKernelFloor);
}

}  // namespace
}  // namespace hsap::cuda
