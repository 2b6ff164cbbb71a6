#include "lib/cuda/cudnn/libcudnn_runner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/cuda/cudnn/cudnn_descriptors.h"
#include "lib/cuda/cudnn/engine_choice.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::cuda {

SdpaGraphKey KeyOfCall(const SdpaShape& shape, const SdpaCall& call, bool backward, bool with_o) {
  SdpaGraphKey key;
  key.dtype = shape.dtype;
  key.head_dim = shape.head_dim;
  key.heads_q = shape.heads_q;
  key.heads_kv = shape.heads_kv;
  key.mask = call.mask.kind;
  key.batch = call.num_entries;
  key.max_q_len = call.max_q_len;
  key.max_k_len = call.max_k_len;
  key.backward = backward;
  key.with_o = !backward || with_o;
  return key;
}

SdpaGraphSpec SpecOfKey(const SdpaGraphKey& key, int64_t q_rows, int64_t k_rows, int version) {
  SdpaGraphSpec spec;
  spec.dtype = key.dtype;
  spec.head_dim = key.head_dim;
  spec.heads_q = key.heads_q;
  spec.heads_kv = key.heads_kv;
  spec.mask.kind = key.mask;
  const bool banded = key.mask == CudnnMaskKind::kWindowTopLeft ||
                      key.mask == CudnnMaskKind::kWindowBottomRight ||
                      key.mask == CudnnMaskKind::kLeftBandTopLeft;
  spec.mask.left_bound = banded ? 1 : 0;
  spec.batch = key.batch;
  spec.max_q_len = key.max_q_len;
  spec.max_k_len = key.max_k_len;
  spec.q_rows = q_rows;
  spec.k_rows = k_rows;
  spec.version = version;
  spec.softmax_sum_input = key.backward && !key.with_o;
  return spec;
}

absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> SharedLibCudnnPieceRunner() {
  HSAP_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
  int device = 0;
  HSAP_RETURN_IF_ERROR(rt->Check(rt->GetDevice(&device), "cudaGetDevice"));
  static std::mutex mu;
  static auto* runners = new std::map<int, std::weak_ptr<CudnnPieceRunner>>();
  std::lock_guard<std::mutex> lock(mu);
  if (std::shared_ptr<CudnnPieceRunner> r = (*runners)[device].lock()) return r;
  HSAP_ASSIGN_OR_RETURN(std::shared_ptr<CudnnPieceRunner> r, NewLibCudnnPieceRunner());
  (*runners)[device] = r;
  return r;
}

#if defined(HSAP_HAVE_CUDNN_HEADERS)

namespace {

using cudnn_internal::BuildOperationGraph;
using cudnn_internal::Desc;
using cudnn_internal::DeviceBuffer;
using cudnn_internal::ExecutePlan;
using cudnn_internal::LoadCudnn;
using cudnn_internal::LowerPlan;
using cudnn_internal::PickExecutionPlan;

// One built graph: its descriptors, execution plan and what a call needs from it.
struct Graph {
  const CudnnApi* api = nullptr;
  std::vector<Desc> descs;  // tensors, operations, graph, engine configs
  std::vector<Desc> plan;   // the execution plan, destroyed first
  CudnnGraphPlan data;
  size_t workspace_bytes = 0;
  ~Graph() {
    plan.clear();
    while (!descs.empty()) descs.pop_back();  // newest first
  }
};

// Workspace and scratch of one stream, grown to the largest call.
struct StreamBuffers {
  DeviceBuffer workspace, scratch;
};

class LibCudnnPieceRunner : public CudnnPieceRunner {
 public:
  LibCudnnPieceRunner(const CudnnApi* api, const CudaRuntimeApi* rt, cudnnHandle_t handle,
                      int version, size_t capacity)
      : api_(api), rt_(rt), handle_(handle), version_(version), graphs_(capacity) {}
  ~LibCudnnPieceRunner() override {
    std::lock_guard<std::mutex> lock(mu_);
    buffers_.clear();
    graphs_ = SdpaGraphCache<Graph>(1);
    if (handle_ != nullptr) api_->Destroy(handle_);
  }

  std::string name() const override { return "cuDNN " + CudnnVersionString(version_); }

  absl::Status Forward(const SdpaShape& shape, const SdpaCall& call, const SdpaForwardArgs& args,
                       cudaStream stream) override {
    if (args.q == nullptr || args.k == nullptr || args.v == nullptr || args.o == nullptr ||
        args.stats == nullptr) {
      return absl::InvalidArgumentError("cuDNN piece runner forward: a null tensor");
    }
    void* const io[9] = {const_cast<void*>(args.q),
                         const_cast<void*>(args.k),
                         const_cast<void*>(args.v),
                         args.o,
                         nullptr,
                         args.stats,
                         nullptr,
                         nullptr,
                         nullptr};
    return Run(shape, call, KeyOfCall(shape, call, false, true), io, nullptr, stream);
  }

  absl::Status Backward(const SdpaShape& shape, const SdpaCall& call, const SdpaBackwardArgs& args,
                        cudaStream stream) override {
    if (args.q == nullptr || args.k == nullptr || args.v == nullptr || args.dout == nullptr ||
        args.stats == nullptr || args.dq == nullptr || args.dk == nullptr || args.dv == nullptr ||
        (args.o == nullptr && args.softmax_sum == nullptr)) {
      return absl::InvalidArgumentError(
          "cuDNN piece runner backward: a null tensor (O or softmax_sum is needed)");
    }
    void* const io[9] = {const_cast<void*>(args.q),
                         const_cast<void*>(args.k),
                         const_cast<void*>(args.v),
                         const_cast<void*>(args.o),
                         const_cast<void*>(args.dout),
                         const_cast<float*>(args.stats),
                         args.dq,
                         args.dk,
                         args.dv};
    return Run(shape, call, KeyOfCall(shape, call, true, args.o != nullptr), io,
               const_cast<float*>(args.softmax_sum), stream);
  }

 private:
  absl::StatusOr<Graph*> GraphFor(const SdpaGraphKey& key, const SdpaCall& call) {
    if (Graph* g = graphs_.Find(key)) return g;
    const SdpaGraphSpec spec = SpecOfKey(key, std::max(call.q_rows, call.max_q_len),
                                         std::max(call.k_rows, call.max_k_len), version_);
    auto g = std::make_unique<Graph>();
    g->api = api_;
    HSAP_ASSIGN_OR_RETURN(g->data, key.backward ? SdpaBackwardPlan(spec) : SdpaForwardPlan(spec));
    HSAP_RETURN_IF_ERROR(ValidateGraphPlan(g->data));
    HSAP_ASSIGN_OR_RETURN(const std::vector<cudnnBackendDescriptor_t> ops,
                          LowerPlan(api_, g->data, key.dtype, &g->descs));
    HSAP_ASSIGN_OR_RETURN(auto graph, BuildOperationGraph(api_, handle_, ops, &g->descs));
    HSAP_ASSIGN_OR_RETURN(Desc plan,
                          PickExecutionPlan(api_, handle_, graph, &g->descs, &g->workspace_bytes));
    g->plan.push_back(std::move(plan));
    return graphs_.Insert(key, std::move(g));
  }

  // GraphFor, with a graph cuDNN will not build answered as Unimplemented (piece_runner.h:
  // nothing was enqueued, so the caller may run the call's pieces elsewhere), remembered so
  // that later calls of the shape are answered at once and alike.
  absl::StatusOr<Graph*> GraphOrRefusal(const SdpaGraphKey& key, const SdpaCall& call) {
    if (auto it = refused_.find(key); it != refused_.end()) return it->second;
    absl::StatusOr<Graph*> g = GraphFor(key, call);
    if (g.ok()) return g;
    const absl::Status refusal = absl::UnimplementedError(absl::StrCat(
        name(), " builds no ", key.backward ? "backward" : "forward", " graph for a ",
        call.mask.ToString(), " call (d ", key.head_dim, ", ", key.heads_q, "/", key.heads_kv,
        " heads, ", key.batch, " entries, S_q ", key.max_q_len, ", S_kv ", key.max_k_len,
        "): ", g.status().message()));
    refused_.emplace(key, refusal);
    return refusal;
  }

  // The stream's buffers with at least `workspace` and `scratch` bytes.
  absl::StatusOr<StreamBuffers*> BuffersFor(cudaStream stream, size_t workspace, size_t scratch) {
    StreamBuffers& b = buffers_[stream];
    if (b.workspace.bytes() < workspace || b.scratch.bytes() < scratch) {
      // The old buffers may still be read by this stream's earlier calls.
      HSAP_RETURN_IF_ERROR(rt_->Check(rt_->StreamSynchronize(stream),
                                      "cudaStreamSynchronize (growing cuDNN buffers)"));
    }
    if (b.workspace.bytes() < workspace) {
      b.workspace = DeviceBuffer();
      HSAP_ASSIGN_OR_RETURN(b.workspace,
                            DeviceBuffer::Allocate(rt_, workspace, "the cuDNN workspace"));
    }
    if (b.scratch.bytes() < scratch) {
      b.scratch = DeviceBuffer();
      HSAP_ASSIGN_OR_RETURN(b.scratch,
                            DeviceBuffer::Allocate(rt_, scratch, "the cuDNN scratch tensors"));
    }
    return &b;
  }

  absl::Status Run(const SdpaShape& shape, const SdpaCall& call, const SdpaGraphKey& key,
                   void* const io[9], float* softmax_sum, cudaStream stream) {
    if (call.num_entries <= 0) return absl::OkStatus();
    if (call.seq_q == nullptr || call.seq_kv == nullptr || call.q_offsets == nullptr ||
        call.kv_offsets == nullptr) {
      return absl::InvalidArgumentError("cuDNN piece runner: a call without its device arrays");
    }
    std::lock_guard<std::mutex> lock(mu_);
    HSAP_ASSIGN_OR_RETURN(Graph * g, GraphOrRefusal(key, call));
    // Scratch of this call's buffers (the graph's sizes are those of its first call's).
    const SdpaGraphSpec spec = SpecOfKey(key, std::max(call.q_rows, call.max_q_len),
                                         std::max(call.k_rows, call.max_k_len), version_);
    HSAP_ASSIGN_OR_RETURN(const CudnnGraphPlan sized,
                          key.backward ? SdpaBackwardPlan(spec) : SdpaForwardPlan(spec));
    size_t scratch_bytes = 0;
    const std::map<int64_t, size_t> offsets = ScratchLayout(sized, &scratch_bytes);
    HSAP_ASSIGN_OR_RETURN(StreamBuffers * buf,
                          BuffersFor(stream, g->workspace_bytes, scratch_bytes));
    float scale = shape.scale, lowest = std::numeric_limits<float>::lowest(), one = 1.0f;
    int32_t left_bound = static_cast<int32_t>(call.mask.left_bound);
    const std::vector<int64_t> uids = g->data.BoundUids();
    std::vector<void*> ptrs;
    for (int64_t uid : uids) {
      void* p = nullptr;
      switch (uid) {
        case kUidQ:
        case kUidK:
        case kUidV:
        case kUidO:
        case kUidDO:
        case kUidStats:
        case kUidDQ:
        case kUidDK:
        case kUidDV: {
          static constexpr int64_t kOrder[9] = {kUidQ,     kUidK,  kUidV,  kUidO, kUidDO,
                                                kUidStats, kUidDQ, kUidDK, kUidDV};
          p = io[std::find(kOrder, kOrder + 9, uid) - kOrder];
          break;
        }
        case kUidSeqLenQ:
          p = const_cast<int32_t*>(call.seq_q);
          break;
        case kUidSeqLenKv:
          p = const_cast<int32_t*>(call.seq_kv);
          break;
        case kUidOffsetQo:
          p = const_cast<int32_t*>(call.q_offsets);
          break;
        case kUidOffsetKv:
          p = const_cast<int32_t*>(call.kv_offsets);
          break;
        case kUidScale:
          p = &scale;
          break;
        case kUidOne:
          p = &one;
          break;
        case kUidLeftBound:
          p = &left_bound;
          break;
        case kUidLowestPadding:
        case kUidLowestCausal:
        case kUidLowestPadding2:
          p = &lowest;
          break;
        case kUidSoftmaxSum:
          if (!key.with_o) {
            p = softmax_sum;
            break;
          }
          [[fallthrough]];  // scratch
        default:
          if (auto it = offsets.find(uid); it != offsets.end()) {
            p = static_cast<uint8_t*>(buf->scratch.get()) + it->second;
          }
      }
      if (p == nullptr) {
        return absl::InternalError(
            absl::StrCat("cuDNN piece runner: tensor uid ", uid, " has no address"));
      }
      ptrs.push_back(p);
    }
    if (key.backward && version_ < 90600) {  // cuDNN < 9.6 expects a zeroed dQ accumulator
      const CudnnTensorNode* accum = sized.Find(kUidDQAccum);
      HSAP_RETURN_IF_ERROR(rt_->Check(
          rt_->MemsetAsync(static_cast<uint8_t*>(buf->scratch.get()) + offsets.at(kUidDQAccum), 0,
                           accum->scratch_bytes, stream),
          "cudaMemsetAsync (cuDNN dQ accumulator)"));
    }
    return ExecutePlan(
        api_, handle_, g->plan.front().get(), uids, ptrs, buf->workspace.get(), stream,
        absl::StrCat("cuDNN ", key.backward ? "backward" : "forward", " of a ",
                     call.mask.ToString(), " call of ", call.num_entries, " entries"));
  }

  const CudnnApi* api_;
  const CudaRuntimeApi* rt_;
  cudnnHandle_t handle_;
  const int version_;
  std::mutex mu_;
  SdpaGraphCache<Graph> graphs_;
  absl::flat_hash_map<SdpaGraphKey, absl::Status> refused_;  // GraphOrRefusal
  std::map<cudaStream, StreamBuffers> buffers_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> NewLibCudnnPieceRunner(size_t cache_capacity) {
  HSAP_ASSIGN_OR_RETURN(const CudnnApi* api, LoadCudnn());
  if (absl::Status s = CheckCudaDevice(); !s.ok()) {
    return absl::UnimplementedError(absl::StrCat("cuDNN piece runner: ", s.message()));
  }
  HSAP_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
  int device = 0, major = 0;
  HSAP_RETURN_IF_ERROR(rt->Check(rt->GetDevice(&device), "cudaGetDevice"));
  HSAP_RETURN_IF_ERROR(
      rt->Check(rt->DeviceGetAttribute(&major, kCudaDevAttrComputeCapabilityMajor, device),
                "cudaDeviceGetAttribute(compute capability)"));
  if (major < 8) {
    return absl::UnimplementedError(
        absl::StrCat("cuDNN fused attention needs sm80 or newer; GPU ", device, " is sm", major));
  }
  return NewLibCudnnPieceRunnerWith(api, rt, static_cast<int>(api->GetVersion()), cache_capacity);
}

absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> NewLibCudnnPieceRunnerWith(
    const CudnnApi* api, const CudaRuntimeApi* rt, int version, size_t cache_capacity) {
  cudnnHandle_t handle = nullptr;
  HSAP_RETURN_IF_ERROR(api->Check(api->Create(&handle), "cudnnCreate"));
  return std::shared_ptr<CudnnPieceRunner>(
      std::make_shared<LibCudnnPieceRunner>(api, rt, handle, version, cache_capacity));
}

#else  // !HSAP_HAVE_CUDNN_HEADERS

absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> NewLibCudnnPieceRunner(size_t) {
  return absl::UnimplementedError(
      "cuDNN piece runner: hsap was built without cudnn_graph.h (configure with the cuDNN 9 "
      "headers in the CUDA include directory or $CUDNN_HOME/include)");
}

absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> NewLibCudnnPieceRunnerWith(const CudnnApi*,
                                                                             const CudaRuntimeApi*,
                                                                             int, size_t) {
  return absl::UnimplementedError("cuDNN piece runner: hsap was built without cudnn_graph.h");
}

#endif  // HSAP_HAVE_CUDNN_HEADERS

}  // namespace hsap::cuda
