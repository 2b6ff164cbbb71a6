// libcudnn's piece runner (lib/cuda/cudnn/libcudnn_runner.h) driven through a fake of
// libcudnn's function table and of the CUDA runtime's (host memory), so what needs no GPU is
// checked: each call's variant pack binds exactly the bound tensors of the call's graph
// (sdpa_graph.h) to the call's own pointers (Q/K/V/O/Stats/dO/dQ/dK/dV, the call's int32
// arrays, softmax_sum where there is no O, scratch for the rest) and the by-value scalars
// to their values (scale, lowest, the window's left bound), on the call's stream with a
// workspace of the plan's size; a graph is built once per key (cache), every descriptor is
// destroyed and the handle released with the runner; bad calls are refused. Whether cuDNN's
// engines take the graphs needs a GPU (CudaGpu.CudnnEngineMatchesTheReference).
#include "lib/cuda/cudnn/libcudnn_runner.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#if defined(HSAP_HAVE_CUDNN_HEADERS)

#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <vector>

#include "lib/cuda/cudnn/cudnn_descriptors.h"

namespace hsap::cuda {
namespace {

// What the fake saw.
struct FakeDesc {
  cudnnBackendDescriptorType_t type;
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  void* workspace = nullptr;
};
struct Execution {
  std::map<int64_t, void*> bound;
  void* workspace = nullptr;
  cudaStream_t stream = nullptr;
  float scale = 0, lowest = 0;
  int32_t left_bound = -1;
};
struct Seen {
  int live = 0, graphs = 0, handles = 0;
  cudaStream_t stream = nullptr;
  std::vector<Execution> executions;
};
Seen* seen = nullptr;
constexpr int64_t kWorkspace = 4096;

cudnnStatus_t Create(cudnnHandle_t* h) {
  ++seen->handles;
  *h = reinterpret_cast<cudnnHandle_t>(0x1000);
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t Destroy(cudnnHandle_t) {
  --seen->handles;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t SetStream(cudnnHandle_t, cudaStream_t s) {
  seen->stream = s;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t CreateDesc(cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t* d) {
  ++seen->live;
  if (type == CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR) ++seen->graphs;
  *d = reinterpret_cast<cudnnBackendDescriptor_t>(new FakeDesc{type, {}, {}, nullptr});
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t DestroyDesc(cudnnBackendDescriptor_t d) {
  --seen->live;
  delete reinterpret_cast<FakeDesc*>(d);
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t SetAttr(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                      cudnnBackendAttributeType_t, int64_t count, const void* value) {
  FakeDesc* f = reinterpret_cast<FakeDesc*>(d);
  if (f->type != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR) return CUDNN_STATUS_SUCCESS;
  if (name == CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS) {
    const int64_t* u = static_cast<const int64_t*>(value);
    f->uids.assign(u, u + count);
  } else if (name == CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS) {
    void* const* p = static_cast<void* const*>(value);
    f->ptrs.assign(p, p + count);
  } else if (name == CUDNN_ATTR_VARIANT_PACK_WORKSPACE) {
    f->workspace = *static_cast<void* const*>(value);
  }
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t GetAttr(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t name,
                      cudnnBackendAttributeType_t, int64_t requested, int64_t* count, void* out) {
  if (name == CUDNN_ATTR_ENGINEHEUR_RESULTS) {
    *count = 1;  // one engine configuration (the runner created `requested` of them)
  } else if (name == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE && requested == 1) {
    *static_cast<int64_t*>(out) = kWorkspace;
  }
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t Finalize(cudnnBackendDescriptor_t) { return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t Execute(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t pack) {
  const FakeDesc* f = reinterpret_cast<const FakeDesc*>(pack);
  Execution e;
  for (size_t i = 0; i < f->uids.size() && i < f->ptrs.size(); ++i)
    e.bound[f->uids[i]] = f->ptrs[i];
  e.workspace = f->workspace;
  e.stream = seen->stream;
  // By-value scalars are read during the call.
  if (e.bound.count(kUidScale)) e.scale = *static_cast<float*>(e.bound[kUidScale]);
  if (e.bound.count(kUidLowestPadding)) e.lowest = *static_cast<float*>(e.bound[kUidLowestPadding]);
  if (e.bound.count(kUidLeftBound)) e.left_bound = *static_cast<int32_t*>(e.bound[kUidLeftBound]);
  seen->executions.push_back(e);
  return CUDNN_STATUS_SUCCESS;
}
const char* ErrorString(cudnnStatus_t) { return "fake"; }
size_t Version() { return 91900; }

cudaError HostMalloc(void** p, size_t n) {
  *p = std::malloc(n);
  return 0;
}
cudaError HostFree(void* p) {
  std::free(p);
  return 0;
}
cudaError HostMemset(void* p, int v, size_t n, cudaStream) {
  std::memset(p, v, n);
  return 0;
}
cudaError Synchronize(cudaStream) { return 0; }
const char* RtError(cudaError) { return "fake"; }

class LibCudnnRunnerFakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seen = &seen_;
    api_.GetVersion = Version;
    api_.GetErrorString = ErrorString;
    api_.Create = Create;
    api_.Destroy = Destroy;
    api_.SetStream = SetStream;
    api_.BackendCreateDescriptor = CreateDesc;
    api_.BackendDestroyDescriptor = DestroyDesc;
    api_.BackendSetAttribute = SetAttr;
    api_.BackendGetAttribute = GetAttr;
    api_.BackendFinalize = Finalize;
    api_.BackendExecute = Execute;
    rt_.Malloc = HostMalloc;
    rt_.Free = HostFree;
    rt_.MemsetAsync = HostMemset;
    rt_.StreamSynchronize = Synchronize;
    rt_.GetErrorString = RtError;
  }
  void TearDown() override { seen = nullptr; }

  // A two-entry call with its arrays (host memory stands in for the device's).
  SdpaCall Call(CudnnMask mask) {
    SdpaCall c;
    c.mask = mask;
    c.num_entries = 2;
    c.max_q_len = 5;
    c.max_k_len = 7;
    c.seq_q = seq_q_;
    c.seq_kv = seq_kv_;
    c.q_offsets = q_off_;
    c.kv_offsets = kv_off_;
    c.q_rows = 12;
    c.k_rows = 14;
    return c;
  }

  Seen seen_;
  CudnnApi api_;
  CudaRuntimeApi rt_;
  const SdpaShape shape_{DType::kBF16, 64, 4, 2, 0.125f};
  int32_t seq_q_[2] = {5, 4}, seq_kv_[2] = {7, 6};
  int32_t q_off_[3] = {0, 6 * 256, 12 * 256}, kv_off_[3] = {0, 7 * 128, 14 * 128};
  // Distinct addresses for the tensors (never dereferenced by the fake).
  char q_, k_, v_, o_, dout_, dq_, dk_, dv_;
  float stats_[40], sum_[40];
};

TEST_F(LibCudnnRunnerFakeTest, ForwardBindsTheCallsTensorsAndScalars) {
  auto runner = NewLibCudnnPieceRunnerWith(&api_, &rt_, 91900);
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_EQ((*runner)->name(), "cuDNN 9.19.0");
  const SdpaCall call = Call({CudnnMaskKind::kWindowBottomRight, 3});
  const cudaStream stream = reinterpret_cast<cudaStream>(0x77);
  const SdpaForwardArgs args{&q_, &k_, &v_, &o_, stats_};
  ASSERT_TRUE((*runner)->Forward(shape_, call, args, stream).ok());
  ASSERT_EQ(seen_.executions.size(), 1u);
  const Execution& e = seen_.executions[0];
  absl::StatusOr<CudnnGraphPlan> plan =
      SdpaForwardPlan(SpecOfKey(KeyOfCall(shape_, call, false, true), 12, 14, 91900));
  ASSERT_TRUE(plan.ok());
  std::vector<int64_t> bound;
  for (const auto& [uid, p] : e.bound) bound.push_back(uid);
  EXPECT_EQ(bound, plan->BoundUids());
  EXPECT_EQ(e.bound.at(kUidQ), &q_);
  EXPECT_EQ(e.bound.at(kUidK), &k_);
  EXPECT_EQ(e.bound.at(kUidV), &v_);
  EXPECT_EQ(e.bound.at(kUidO), &o_);
  EXPECT_EQ(e.bound.at(kUidStats), stats_);
  EXPECT_EQ(e.bound.at(kUidSeqLenQ), seq_q_);
  EXPECT_EQ(e.bound.at(kUidSeqLenKv), seq_kv_);
  EXPECT_EQ(e.bound.at(kUidOffsetQo), q_off_);
  EXPECT_EQ(e.bound.at(kUidOffsetKv), kv_off_);
  EXPECT_EQ(e.scale, 0.125f);
  EXPECT_EQ(e.lowest, std::numeric_limits<float>::lowest());
  EXPECT_EQ(e.left_bound, 3);
  EXPECT_NE(e.workspace, nullptr);
  EXPECT_EQ(reinterpret_cast<cudaStream>(e.stream), stream);
  // The same key again (another window: a variant-pack value): no new graph.
  ASSERT_TRUE(
      (*runner)->Forward(shape_, Call({CudnnMaskKind::kWindowBottomRight, 9}), args, stream).ok());
  EXPECT_EQ(seen_.graphs, 1);
  ASSERT_EQ(seen_.executions.size(), 2u);
  EXPECT_EQ(seen_.executions[1].left_bound, 9);
  runner->reset();
  EXPECT_EQ(seen_.live, 0);  // every descriptor destroyed
  EXPECT_EQ(seen_.handles, 0);
}

TEST_F(LibCudnnRunnerFakeTest, BackwardBindsOOrSoftmaxSumAndScratch) {
  auto runner = NewLibCudnnPieceRunnerWith(&api_, &rt_, 91900);
  ASSERT_TRUE(runner.ok()) << runner.status();
  const SdpaCall call = Call({CudnnMaskKind::kCausalTopLeft, 0});
  SdpaBackwardArgs args{&q_, &k_, &v_, &o_, &dout_, stats_, nullptr, 0, nullptr, &dq_, &dk_, &dv_};
  ASSERT_TRUE((*runner)->Backward(shape_, call, args, nullptr).ok());
  args.o = nullptr;
  args.softmax_sum = sum_;
  ASSERT_TRUE((*runner)->Backward(shape_, call, args, nullptr).ok());
  ASSERT_EQ(seen_.executions.size(), 2u);
  EXPECT_EQ(seen_.graphs, 2);  // with O and without are two graphs
  const Execution& with_o = seen_.executions[0];
  const Execution& without = seen_.executions[1];
  EXPECT_EQ(with_o.bound.at(kUidO), &o_);
  EXPECT_EQ(without.bound.count(kUidO), 0u);
  EXPECT_EQ(without.bound.at(kUidSoftmaxSum), sum_);
  EXPECT_NE(with_o.bound.at(kUidSoftmaxSum), sum_);  // its own scratch
  for (const Execution* e : {&with_o, &without}) {
    EXPECT_EQ(e->bound.at(kUidDO), &dout_);
    EXPECT_EQ(e->bound.at(kUidDQ), &dq_);
    EXPECT_EQ(e->bound.at(kUidDK), &dk_);
    EXPECT_EQ(e->bound.at(kUidDV), &dv_);
    // GQA (4/2): per-query-head dK/dV scratch, and the dQ accumulator, all distinct.
    EXPECT_NE(e->bound.at(kUidDQAccum), e->bound.at(kUidDKFullHeads));
    EXPECT_NE(e->bound.at(kUidDKFullHeads), e->bound.at(kUidDVFullHeads));
    EXPECT_EQ(e->bound.count(kUidLeftBound), 0u);
  }
  // Neither O nor softmax_sum: refused before cuDNN is called.
  args.softmax_sum = nullptr;
  const absl::Status s = (*runner)->Backward(shape_, call, args, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(seen_.executions.size(), 2u);
}

TEST_F(LibCudnnRunnerFakeTest, AMaskTheVersionLacksIsRefused) {
  auto runner = NewLibCudnnPieceRunnerWith(&api_, &rt_, 90500);
  ASSERT_TRUE(runner.ok()) << runner.status();
  // Unimplemented with nothing enqueued (piece_runner.h): the executors run the call's pieces
  // on the JIT kernels. The refusal is remembered: a second call is answered alike.
  for (int i = 0; i < 2; ++i) {
    const absl::Status s = (*runner)->Forward(
        shape_, Call({CudnnMaskKind::kCausalBottomRight, 0}), {&q_, &k_, &v_, &o_, stats_}, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("builds no forward graph for a causal"));
  }
  EXPECT_TRUE(seen_.executions.empty());
}

}  // namespace
}  // namespace hsap::cuda

#else  // !HSAP_HAVE_CUDNN_HEADERS

TEST(LibCudnnRunnerFakeTest, NeedsCudnnHeaders) {
  GTEST_SKIP() << "built without cudnn_graph.h: the fake cuDNN is typed by it";
}

#endif  // HSAP_HAVE_CUDNN_HEADERS
