#include "bench/cudnn_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "lib/cuda/cudnn/cudnn_descriptors.h"

namespace hsap::bench {

#if defined(HSAP_HAVE_CUDNN_HEADERS)

using cuda::CudnnApi;
using cuda::ScratchLayout;
using cuda::cudnn_internal::Aligned16;
using cuda::cudnn_internal::BuildOperationGraph;
using cuda::cudnn_internal::Desc;
using cuda::cudnn_internal::DescriptorBuilder;
using cuda::cudnn_internal::DeviceBuffer;
using cuda::cudnn_internal::ExecutePlan;
using cuda::cudnn_internal::LoadCudnn;
using cuda::cudnn_internal::LowerPlan;
using cuda::cudnn_internal::PickExecutionPlan;

struct CudnnAttention::Impl {
  const CudnnApi* api = nullptr;
  const cuda::CudaRuntimeApi* rt = nullptr;
  cudnnHandle_t handle = nullptr;
  std::vector<Desc> descs;  // tensors, operations, graph, engine configs
  std::vector<Desc> plan;   // the execution plan (at most one), destroyed first
  DeviceBuffer index;       // seq_lens, qo offsets, kv offsets
  DeviceBuffer workspace;
  void* seq_lens_dev = nullptr;
  void* qo_offsets_dev = nullptr;
  void* kv_offsets_dev = nullptr;
  // Host values of the by-value scalars (their addresses go into every variant pack).
  float scale = 1.0f;
  float lowest = std::numeric_limits<float>::lowest();
  float one = 1.0f;
  // The graph as data, its scratch tensors (uid -> device address) in one allocation.
  CudnnGraphPlan graph_plan;
  DeviceBuffer scratch;
  std::map<int64_t, void*> scratch_dev;
  bool zero_dq_accum = false;  // cuDNN < 9.6 expects the caller to zero the dQ accumulator

  ~Impl() {
    plan.clear();
    // Engine configs and operations reference each other; destroy newest first.
    while (!descs.empty()) descs.pop_back();
    if (handle != nullptr) api->Destroy(handle);
  }

  // The graph of `pass` (ForwardGraphPlan / BackwardGraphPlan) lowered and finalized.
  absl::Status Build(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g, int version,
                     CudnnPass pass);
  // The address bound to `uid` for this call (`io`: q, k, v, o, dout, stats, dq, dk, dv).
  void* Address(int64_t uid, void* const io[9]) const;
  // Finalizes the graph of `ops`, picks the plan, allocates the workspace, uploads the index
  // tensors and sets the scale.
  absl::Status FinishBuild(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g,
                           const std::vector<cudnnBackendDescriptor_t>& ops);
  // Binds `uids` to `ptrs` in a variant pack and executes the plan on `stream`.
  absl::Status Execute(absl::Span<const int64_t> uids, absl::Span<void* const> ptrs,
                       cuda::cudaStream stream, absl::string_view what);
};

absl::Status CudnnAttention::Impl::Build(const CudnnAttentionShape& shape,
                                         const CudnnRaggedGeometry& g, int version,
                                         CudnnPass pass) {
  HSAP_CUDNN_ASSIGN_OR_RETURN(graph_plan, pass == CudnnPass::kForward
                                              ? ForwardGraphPlan(shape, version)
                                              : BackwardGraphPlan(shape, version));
  HSAP_CUDNN_RETURN_IF_ERROR(ValidateGraphPlan(graph_plan));
  HSAP_CUDNN_ASSIGN_OR_RETURN(const std::vector<cudnnBackendDescriptor_t> ops,
                              LowerPlan(api, graph_plan, shape.dtype, &descs));
  HSAP_CUDNN_RETURN_IF_ERROR(FinishBuild(shape, g, ops));

  // Scratch tensors (the backward's softmax_sum, dQ accumulator, GQA full heads): one
  // allocation.
  size_t scratch_bytes = 0;
  const std::map<int64_t, size_t> offsets = ScratchLayout(graph_plan, &scratch_bytes);
  if (scratch_bytes > 0) {
    HSAP_CUDNN_ASSIGN_OR_RETURN(scratch,
                                DeviceBuffer::Allocate(rt, scratch_bytes, "cuDNN scratch tensors"));
  }
  for (const auto& [uid, offset] : offsets) {
    scratch_dev[uid] = static_cast<uint8_t*>(scratch.get()) + offset;
  }
  zero_dq_accum = pass == CudnnPass::kBackward && version < 90600;
  return absl::OkStatus();
}

void* CudnnAttention::Impl::Address(int64_t uid, void* const io[9]) const {
  switch (uid) {
    case kUidQ:
      return io[0];
    case kUidK:
      return io[1];
    case kUidV:
      return io[2];
    case kUidO:
      return io[3];
    case kUidDO:
      return io[4];
    case kUidStats:
      return io[5];
    case kUidDQ:
      return io[6];
    case kUidDK:
      return io[7];
    case kUidDV:
      return io[8];
    case kUidSeqLenQ:
    case kUidSeqLenKv:
      return seq_lens_dev;
    case kUidOffsetQo:
      return qo_offsets_dev;
    case kUidOffsetKv:
      return kv_offsets_dev;
    case kUidScale:
      return const_cast<float*>(&scale);
    case kUidOne:
      return const_cast<float*>(&one);
    case kUidLowestPadding:
    case kUidLowestCausal:
    case kUidLowestPadding2:
      return const_cast<float*>(&lowest);
    default:
      if (auto it = scratch_dev.find(uid); it != scratch_dev.end()) return it->second;
  }
  return nullptr;
}

absl::Status CudnnAttention::Impl::FinishBuild(const CudnnAttentionShape& shape,
                                               const CudnnRaggedGeometry& g,
                                               const std::vector<cudnnBackendDescriptor_t>& ops) {
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto graph, BuildOperationGraph(api, handle, ops, &descs));
  size_t workspace_bytes = 0;
  HSAP_CUDNN_ASSIGN_OR_RETURN(Desc picked,
                              PickExecutionPlan(api, handle, graph, &descs, &workspace_bytes));
  plan.push_back(std::move(picked));
  HSAP_CUDNN_ASSIGN_OR_RETURN(workspace,
                              DeviceBuffer::Allocate(rt, workspace_bytes, "the cuDNN workspace"));

  // Seq lens and ragged offsets on the device.
  const size_t seq_bytes = Aligned16(g.seq_lens.size());
  const size_t off_bytes = Aligned16(g.qo_offsets.size());
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      index, DeviceBuffer::Allocate(rt, seq_bytes + 2 * off_bytes, "seq lens and ragged offsets"));
  std::vector<uint8_t> host(index.bytes(), 0);
  std::memcpy(host.data(), g.seq_lens.data(), g.seq_lens.size() * sizeof(int32_t));
  std::memcpy(host.data() + seq_bytes, g.qo_offsets.data(), g.qo_offsets.size() * sizeof(int32_t));
  std::memcpy(host.data() + seq_bytes + off_bytes, g.kv_offsets.data(),
              g.kv_offsets.size() * sizeof(int32_t));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->Memcpy(index.get(), host.data(), host.size(), cuda::kCudaMemcpyDefault),
                "cudaMemcpy (seq lens and ragged offsets)"));
  // A copy from pageable memory may return before its DMA lands; the graph's stream is
  // non-blocking.
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->DeviceSynchronize(), "cudaDeviceSynchronize (seq lens and ragged offsets)"));
  uint8_t* base = static_cast<uint8_t*>(index.get());
  seq_lens_dev = base;
  qo_offsets_dev = base + seq_bytes;
  kv_offsets_dev = base + seq_bytes + off_bytes;
  scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  return absl::OkStatus();
}

absl::Status CudnnAttention::Impl::Execute(absl::Span<const int64_t> uids,
                                           absl::Span<void* const> ptrs, cuda::cudaStream stream,
                                           absl::string_view what) {
  return ExecutePlan(api, handle, plan.front().get(), uids, ptrs, workspace.get(), stream, what);
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    const CudnnAttentionShape& shape, CudnnPass pass) {
  HSAP_CUDNN_ASSIGN_OR_RETURN(CudnnRaggedGeometry geometry, MakeRaggedGeometry(shape));
  HSAP_CUDNN_ASSIGN_OR_RETURN(const CudnnApi* api, LoadCudnn());
  if (absl::Status s = cuda::CheckCudaDevice(); !s.ok()) {
    return absl::UnimplementedError(absl::StrCat("cuDNN attention: ", s.message()));
  }
  HSAP_CUDNN_ASSIGN_OR_RETURN(const cuda::CudaRuntimeApi* rt, cuda::LoadCudaRuntime());
  int device = 0, major = 0, minor = 0;
  HSAP_CUDNN_RETURN_IF_ERROR(rt->Check(rt->GetDevice(&device), "cudaGetDevice"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->DeviceGetAttribute(&major, cuda::kCudaDevAttrComputeCapabilityMajor, device),
                "cudaDeviceGetAttribute(compute capability)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->DeviceGetAttribute(&minor, cuda::kCudaDevAttrComputeCapabilityMinor, device),
                "cudaDeviceGetAttribute(compute capability)"));
  if (major < 8) {
    return absl::UnimplementedError(absl::StrCat("cuDNN fused attention needs sm80 or newer; GPU ",
                                                 device, " is sm", major, minor));
  }

  std::unique_ptr<CudnnAttention> self(new CudnnAttention());
  self->geometry_ = std::move(geometry);
  self->version_ = static_cast<int>(api->GetVersion());
  self->library_path_ = api->path;
  self->causal_ = shape.causal;
  self->pass_ = pass;
  self->impl_ = std::make_unique<Impl>();
  Impl& impl = *self->impl_;
  impl.api = api;
  impl.rt = rt;
  HSAP_CUDNN_RETURN_IF_ERROR(api->Check(api->Create(&impl.handle), "cudnnCreate"));
  HSAP_CUDNN_RETURN_IF_ERROR(impl.Build(shape, self->geometry_, self->version_, pass));
  self->workspace_bytes_ = impl.workspace.bytes();
  self->scratch_bytes_ = impl.scratch.bytes();
  return self;
}

CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Forward(const void* q, const void* k, const void* v, void* o,
                                     float* stats, cuda::cudaStream stream) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || stats == nullptr) {
    return absl::InvalidArgumentError("cuDNN attention forward: a null tensor");
  }
  if (pass_ != CudnnPass::kForward) {
    return absl::FailedPreconditionError("cuDNN attention: Forward on a backward instance");
  }
  void* const io[9] = {const_cast<void*>(q),
                       const_cast<void*>(k),
                       const_cast<void*>(v),
                       o,
                       nullptr,
                       stats,
                       nullptr,
                       nullptr,
                       nullptr};
  return Run(io, stream, "fused attention forward");
}

absl::Status CudnnAttention::Run(void* const io[9], cuda::cudaStream stream,
                                 absl::string_view what) {
  Impl& impl = *impl_;
  const std::vector<int64_t> uids = impl.graph_plan.BoundUids();
  std::vector<void*> ptrs;
  for (int64_t uid : uids) {
    void* p = impl.Address(uid, io);
    if (p == nullptr) {
      return absl::InternalError(
          absl::StrCat("cuDNN attention: tensor uid ", uid, " has no address"));
    }
    ptrs.push_back(p);
  }
  if (impl.zero_dq_accum) {
    const CudnnTensorNode* accum = impl.graph_plan.Find(kUidDQAccum);
    HSAP_CUDNN_RETURN_IF_ERROR(impl.rt->Check(
        impl.rt->MemsetAsync(impl.scratch_dev.at(kUidDQAccum), 0, accum->scratch_bytes, stream),
        "cudaMemsetAsync (cuDNN dQ accumulator)"));
  }
  return impl.Execute(uids, ptrs, stream, what);
}

absl::Status CudnnAttention::Backward(const void* q, const void* k, const void* v, const void* o,
                                      const void* dout, const float* stats, void* dq, void* dk,
                                      void* dv, cuda::cudaStream stream) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || dout == nullptr ||
      stats == nullptr || dq == nullptr || dk == nullptr || dv == nullptr) {
    return absl::InvalidArgumentError("cuDNN attention backward: a null tensor");
  }
  if (pass_ != CudnnPass::kBackward) {
    return absl::FailedPreconditionError("cuDNN attention: Backward on a forward instance");
  }
  void* const io[9] = {const_cast<void*>(q),
                       const_cast<void*>(k),
                       const_cast<void*>(v),
                       const_cast<void*>(o),
                       const_cast<void*>(dout),
                       const_cast<float*>(stats),
                       dq,
                       dk,
                       dv};
  return Run(io, stream, "fused attention backward");
}

#else  // !HSAP_HAVE_CUDNN_HEADERS

struct CudnnAttention::Impl {};

absl::Status CudnnAttention::Run(void* const*, cuda::cudaStream, absl::string_view) {
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    const CudnnAttentionShape& shape, CudnnPass) {
  absl::StatusOr<CudnnRaggedGeometry> geometry = MakeRaggedGeometry(shape);
  if (!geometry.ok()) return geometry.status();
  return absl::UnimplementedError(
      "cuDNN attention: built without cudnn_graph.h (configure with the cuDNN 9 headers in the "
      "CUDA include directory or $CUDNN_HOME/include)");
}

CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Forward(const void*, const void*, const void*, void*, float*,
                                     cuda::cudaStream) {
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

absl::Status CudnnAttention::Backward(const void*, const void*, const void*, const void*,
                                      const void*, const float*, void*, void*, void*,
                                      cuda::cudaStream) {
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

#endif  // HSAP_HAVE_CUDNN_HEADERS

}  // namespace hsap::bench
