#include "lib/cuda/cudnn/cudnn_descriptors.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "lib/cuda/cudnn/cudnn_library.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::cuda {

#if defined(HSAP_HAVE_CUDNN_HEADERS)

namespace cudnn_internal {
namespace {

absl::StatusOr<std::unique_ptr<CudnnApi>> LoadCudnnImpl() {
  // The library itself is opened by libhsap's loader (lib/cuda/cudnn/cudnn_library.h); the
  // graph API's functions are resolved on its handle here.
  HSAP_ASSIGN_OR_RETURN(const CudnnLibrary* lib, OpenCudnnLibrary());
  auto api = std::make_unique<CudnnApi>();
  api->path = lib->path;
  void* handle = lib->handle;
  auto bind = [&](const char* symbol, auto* out, bool optional = false) -> absl::Status {
    void* p = dlsym(handle, symbol);
    if (p == nullptr && !optional) {
      return absl::UnimplementedError(
          absl::StrCat(api->path, " lacks ", symbol, ": not a cuDNN 9 library"));
    }
    *out = reinterpret_cast<std::remove_pointer_t<decltype(out)>>(p);
    return absl::OkStatus();
  };
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnGetVersion", &api->GetVersion));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnGetErrorString", &api->GetErrorString));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnGetLastErrorString", &api->GetLastErrorString, true));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnCreate", &api->Create));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnDestroy", &api->Destroy));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnSetStream", &api->SetStream));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendCreateDescriptor", &api->BackendCreateDescriptor));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendDestroyDescriptor", &api->BackendDestroyDescriptor));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendSetAttribute", &api->BackendSetAttribute));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendGetAttribute", &api->BackendGetAttribute));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendFinalize", &api->BackendFinalize));
  HSAP_CUDNN_RETURN_IF_ERROR(bind("cudnnBackendExecute", &api->BackendExecute));
  const size_t version = api->GetVersion();
  if (version < 90000) {
    return absl::UnimplementedError(
        absl::StrCat(api->path, " is cuDNN ", version, "; the ragged graph needs cuDNN 9"));
  }
  return api;
}

cudnnDataType_t CudnnDataType(CudnnDataKind kind, cudnnDataType_t io) {
  switch (kind) {
    case CudnnDataKind::kIo:
      return io;
    case CudnnDataKind::kFloat:
      return CUDNN_DATA_FLOAT;
    case CudnnDataKind::kInt32:
      return CUDNN_DATA_INT32;
    case CudnnDataKind::kBool:
      return CUDNN_DATA_BOOLEAN;
  }
  return CUDNN_DATA_FLOAT;
}

cudnnPointwiseMode_t CudnnPointwise(CudnnPointwiseMode mode) {
  switch (mode) {
    case CudnnPointwiseMode::kMul:
      return CUDNN_POINTWISE_MUL;
    case CudnnPointwiseMode::kSub:
      return CUDNN_POINTWISE_SUB;
    case CudnnPointwiseMode::kExp:
      return CUDNN_POINTWISE_EXP;
    case CudnnPointwiseMode::kIdentity:
      return CUDNN_POINTWISE_IDENTITY;
    case CudnnPointwiseMode::kGenIndex:
      return CUDNN_POINTWISE_GEN_INDEX;
    case CudnnPointwiseMode::kCmpLt:
      return CUDNN_POINTWISE_CMP_LT;
    case CudnnPointwiseMode::kCmpGe:
      return CUDNN_POINTWISE_CMP_GE;
    case CudnnPointwiseMode::kLogicalAnd:
      return CUDNN_POINTWISE_LOGICAL_AND;
    case CudnnPointwiseMode::kBinarySelect:
      return CUDNN_POINTWISE_BINARY_SELECT;
    case CudnnPointwiseMode::kAdd:
      return CUDNN_POINTWISE_ADD;
    case CudnnPointwiseMode::kDiv:
      return CUDNN_POINTWISE_DIV;
    case CudnnPointwiseMode::kLog:
      return CUDNN_POINTWISE_LOG;
    case CudnnPointwiseMode::kCmpGt:
      return CUDNN_POINTWISE_CMP_GT;
  }
  return CUDNN_POINTWISE_IDENTITY;
}

}  // namespace

absl::StatusOr<const CudnnApi*> LoadCudnn() {
  static std::mutex mu;
  static auto* cache = new std::map<std::string, absl::StatusOr<const CudnnApi*>>();
  const std::string key = absl::StrJoin(CudnnLibrarySearchPath(), ":");
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache->find(key); it != cache->end()) return it->second;
  absl::StatusOr<std::unique_ptr<CudnnApi>> api = LoadCudnnImpl();
  absl::StatusOr<const CudnnApi*> result =
      api.ok() ? absl::StatusOr<const CudnnApi*>(api->release()) : api.status();
  cache->emplace(key, result);
  return result;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(const CudaRuntimeApi* rt, size_t bytes,
                                                    absl::string_view what) {
  DeviceBuffer b;
  b.rt_ = rt;
  b.bytes_ = bytes;
  if (bytes == 0) return b;
  HSAP_CUDNN_RETURN_IF_ERROR(rt->Check(rt->Malloc(&b.p_, bytes),
                                       absl::StrCat("cudaMalloc(", bytes, " bytes) for ", what)));
  return b;
}

void DeviceBuffer::Reset() {
  if (p_ != nullptr) rt_->Free(p_);
  p_ = nullptr;
}

absl::StatusOr<cudnnBackendDescriptor_t> DescriptorBuilder::Make(cudnnBackendDescriptorType_t type,
                                                                 absl::string_view what) {
  cudnnBackendDescriptor_t d = nullptr;
  HSAP_CUDNN_RETURN_IF_ERROR(api_->Check(api_->BackendCreateDescriptor(type, &d),
                                         absl::StrCat("cudnnBackendCreateDescriptor(", what, ")")));
  keep_->emplace_back(api_, d);
  return d;
}

absl::Status DescriptorBuilder::Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr,
                                    cudnnBackendAttributeType_t type, int64_t count,
                                    const void* value, absl::string_view what) {
  return api_->Check(
      api_->BackendSetAttribute(d, attr, type, count, value),
      absl::StrCat("cudnnBackendSetAttribute(", what, ", attribute ", static_cast<int>(attr), ")"));
}

absl::Status DescriptorBuilder::SetDesc(cudnnBackendDescriptor_t d,
                                        cudnnBackendAttributeName_t attr,
                                        cudnnBackendDescriptor_t value, absl::string_view what) {
  return Set(d, attr, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
}

absl::Status DescriptorBuilder::Finalize(cudnnBackendDescriptor_t d, absl::string_view what) {
  return api_->Check(api_->BackendFinalize(d), absl::StrCat("cudnnBackendFinalize(", what, ")"));
}

absl::StatusOr<cudnnBackendDescriptor_t> DescriptorBuilder::Tensor(const TensorSpec& t) {
  const std::string what = absl::StrCat("tensor ", t.name);
  HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t d,
                              Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, what));
  const int64_t alignment = 16;
  const bool is_virtual = t.is_virtual, by_value = t.by_value;
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &t.dtype, what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, t.dims.data(), what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, t.strides.data(), what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t.uid, what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, what));
  if (by_value) {
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, what));
  }
  if (t.ragged_offset != nullptr) {
    HSAP_CUDNN_RETURN_IF_ERROR(
        SetDesc(d, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, t.ragged_offset, what));
  }
  HSAP_CUDNN_RETURN_IF_ERROR(Finalize(d, what));
  return d;
}

absl::StatusOr<cudnnBackendDescriptor_t> DescriptorBuilder::Pointwise(
    const char* name, cudnnPointwiseMode_t mode, cudnnDataType_t math_prec,
    cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
    cudnnBackendDescriptor_t y, int64_t axis) {
  const std::string what = absl::StrCat("pointwise ", name);
  HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t pw,
                              Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math_prec, what));
  if (axis >= 0) {
    HSAP_CUDNN_RETURN_IF_ERROR(
        Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what));
  }
  HSAP_CUDNN_RETURN_IF_ERROR(Finalize(pw, what));
  const std::string op_what = absl::StrCat("operation ", what);
  HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                              Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, op_what));
  if (b != nullptr) {
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, op_what));
  }
  if (t != nullptr) {
    HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, op_what));
  }
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(Finalize(op, op_what));
  return op;
}

absl::StatusOr<cudnnBackendDescriptor_t> DescriptorBuilder::Reduction(const char* name,
                                                                      cudnnReduceTensorOp_t mode,
                                                                      cudnnBackendDescriptor_t x,
                                                                      cudnnBackendDescriptor_t y) {
  const std::string what = absl::StrCat("reduction ", name);
  HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t red,
                              Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what));
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(red, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what));
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what));
  HSAP_CUDNN_RETURN_IF_ERROR(Finalize(red, what));
  const std::string op_what = absl::StrCat("operation ", what);
  HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                              Make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, red, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(Finalize(op, op_what));
  return op;
}

absl::StatusOr<cudnnBackendDescriptor_t> DescriptorBuilder::Matmul(
    const char* name, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
    cudnnBackendDescriptor_t c, cudnnBackendDescriptor_t m_override,
    cudnnBackendDescriptor_t n_override, cudnnBackendDescriptor_t k_override) {
  const std::string what = absl::StrCat("matmul ", name);
  HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t mm,
                              Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, what));
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  HSAP_CUDNN_RETURN_IF_ERROR(
      Set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what));
  HSAP_CUDNN_RETURN_IF_ERROR(Finalize(mm, what));
  const std::string op_what = absl::StrCat("operation ", what);
  HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                              Make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, op_what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, op_what));
  if (m_override != nullptr) {
    HSAP_CUDNN_RETURN_IF_ERROR(
        SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override, op_what));
  }
  if (n_override != nullptr) {
    HSAP_CUDNN_RETURN_IF_ERROR(
        SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override, op_what));
  }
  if (k_override != nullptr) {
    HSAP_CUDNN_RETURN_IF_ERROR(
        SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override, op_what));
  }
  HSAP_CUDNN_RETURN_IF_ERROR(Finalize(op, op_what));
  return op;
}

absl::StatusOr<cudnnBackendDescriptor_t> DescriptorBuilder::Reshape(const char* name,
                                                                    cudnnBackendDescriptor_t x,
                                                                    cudnnBackendDescriptor_t y) {
  const std::string what = absl::StrCat("operation reshape ", name);
  HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                              Make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, what));
  HSAP_CUDNN_RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, what));
  HSAP_CUDNN_RETURN_IF_ERROR(Finalize(op, what));
  return op;
}

size_t Aligned16(size_t n) { return (n * sizeof(int32_t) + 15) / 16 * 16; }

absl::StatusOr<std::vector<cudnnBackendDescriptor_t>> LowerPlan(const CudnnApi* api,
                                                                const CudnnGraphPlan& plan,
                                                                DType dtype,
                                                                std::vector<Desc>* keep) {
  DescriptorBuilder b(api, keep);
  const cudnnDataType_t io = dtype == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  // Tensors: those without a ragged offset first (the others name their offset tensor).
  std::map<int64_t, cudnnBackendDescriptor_t> made;
  for (bool ragged : {false, true}) {
    for (const CudnnTensorNode& t : plan.tensors) {
      if ((t.ragged_offset_uid != 0) != ragged) continue;
      HSAP_CUDNN_ASSIGN_OR_RETURN(
          made[t.uid],
          b.Tensor({t.name.c_str(), t.uid, CudnnDataType(t.dtype, io), t.dims, t.strides,
                    t.is_virtual, t.by_value, ragged ? made.at(t.ragged_offset_uid) : nullptr}));
    }
  }
  auto tensor = [&](int64_t uid) -> cudnnBackendDescriptor_t {
    return uid == 0 ? nullptr : made.at(uid);
  };
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const CudnnOpNode& node : plan.ops) {
    auto input = [&](size_t i) {
      return i < node.inputs.size() ? tensor(node.inputs[i]) : nullptr;
    };
    const char* name = node.name.c_str();
    absl::StatusOr<cudnnBackendDescriptor_t> op;
    switch (node.kind) {
      case CudnnOpKind::kMatmul:
        op = b.Matmul(name, input(0), input(1), tensor(node.output), tensor(node.m_override),
                      tensor(node.n_override), tensor(node.k_override));
        break;
      case CudnnOpKind::kPointwise:
        op = b.Pointwise(name, CudnnPointwise(node.mode), CudnnDataType(node.math, io), input(0),
                         input(1), input(2), tensor(node.output), node.axis);
        break;
      case CudnnOpKind::kReduction:
        op = b.Reduction(name,
                         node.reduce == CudnnReduceMode::kMax ? CUDNN_REDUCE_TENSOR_MAX
                                                              : CUDNN_REDUCE_TENSOR_ADD,
                         input(0), tensor(node.output));
        break;
      case CudnnOpKind::kReshape:
        op = b.Reshape(name, input(0), tensor(node.output));
        break;
    }
    if (!op.ok()) return op.status();
    ops.push_back(*op);
  }
  return ops;
}

absl::StatusOr<cudnnBackendDescriptor_t> BuildOperationGraph(
    const CudnnApi* api, cudnnHandle_t handle, const std::vector<cudnnBackendDescriptor_t>& ops,
    std::vector<Desc>* keep) {
  DescriptorBuilder b(api, keep);
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto graph,
                              b.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                   &handle, "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
                                   ops.data(), "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Finalize(graph, "operation graph"));
  return graph;
}

absl::StatusOr<Desc> PickExecutionPlan(const CudnnApi* api, cudnnHandle_t handle,
                                       cudnnBackendDescriptor_t graph, std::vector<Desc>* keep,
                                       size_t* workspace_bytes) {
  DescriptorBuilder b(api, keep);
  std::vector<std::string> rejected;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "A" : "fallback";
    const std::string what = absl::StrCat("engine heuristics (mode ", mode_name, ")");
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto heur, b.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, what));
    HSAP_CUDNN_RETURN_IF_ERROR(b.SetDesc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        b.Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, what));
    if (absl::Status s = b.Finalize(heur, what); !s.ok()) {
      rejected.push_back(std::string(s.message()));
      continue;
    }
    int64_t count = 0;
    HSAP_CUDNN_RETURN_IF_ERROR(
        api->Check(api->BackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                            CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
                   absl::StrCat("cudnnBackendGetAttribute(", what, ", result count)")));
    if (count <= 0) {
      rejected.push_back(absl::StrCat(what, ": no engine configuration"));
      continue;
    }
    std::vector<cudnnBackendDescriptor_t> cfgs;
    for (int64_t i = 0; i < count; ++i) {
      HSAP_CUDNN_ASSIGN_OR_RETURN(auto cfg,
                                  b.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
      cfgs.push_back(cfg);
    }
    int64_t returned = 0;
    HSAP_CUDNN_RETURN_IF_ERROR(api->Check(
        api->BackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                 count, &returned, cfgs.data()),
        absl::StrCat("cudnnBackendGetAttribute(", what, ", results)")));
    for (int64_t i = 0; i < std::min(returned, count); ++i) {
      cudnnBackendDescriptor_t d = nullptr;
      HSAP_CUDNN_RETURN_IF_ERROR(
          api->Check(api->BackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &d),
                     "cudnnBackendCreateDescriptor(execution plan)"));
      Desc candidate(api, d);
      absl::Status s = b.Set(d, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle,
                             "execution plan");
      if (s.ok())
        s = b.SetDesc(d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[i], "execution plan");
      if (s.ok()) s = b.Finalize(d, absl::StrCat("execution plan of engine config ", i));
      if (!s.ok()) {
        rejected.push_back(std::string(s.message()));
        continue;  // `candidate` destroys the descriptor
      }
      int64_t ws = 0;
      HSAP_CUDNN_RETURN_IF_ERROR(
          api->Check(api->BackendGetAttribute(d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                              CUDNN_TYPE_INT64, 1, nullptr, &ws),
                     "cudnnBackendGetAttribute(execution plan, workspace size)"));
      *workspace_bytes = static_cast<size_t>(std::max<int64_t>(ws, 0));
      return candidate;
    }
  }
  // Keep the message readable: the first few reasons.
  if (rejected.size() > 4) rejected.resize(4);
  return absl::NotFoundError(absl::StrCat("no cuDNN engine supports the fused attention graph: ",
                                          absl::StrJoin(rejected, "; ")));
}

absl::Status ExecutePlan(const CudnnApi* api, cudnnHandle_t handle, cudnnBackendDescriptor_t plan,
                         absl::Span<const int64_t> uids, absl::Span<void* const> ptrs,
                         void* workspace, cudaStream stream, absl::string_view what) {
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->SetStream(handle, reinterpret_cast<cudaStream_t>(stream)), "cudnnSetStream"));
  cudnnBackendDescriptor_t d = nullptr;
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &d),
                 "cudnnBackendCreateDescriptor(variant pack)"));
  Desc pack(api, d);
  void* workspace_ptr = workspace;
  const int64_t n = static_cast<int64_t>(uids.size());
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                          n, uids.data()),
                 "cudnnBackendSetAttribute(variant pack, unique ids)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                          CUDNN_TYPE_VOID_PTR, n, ptrs.data()),
                 "cudnnBackendSetAttribute(variant pack, data pointers)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR,
                                          1, &workspace_ptr),
                 "cudnnBackendSetAttribute(variant pack, workspace)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendFinalize(d), "cudnnBackendFinalize(variant pack)"));
  return api->Check(api->BackendExecute(handle, plan, d),
                    absl::StrCat("cudnnBackendExecute(", what, ")"));
}

}  // namespace cudnn_internal

absl::Status FinalizePlanDescriptors(const CudnnGraphPlan& plan, DType dtype) {
  HSAP_RETURN_IF_ERROR(ValidateGraphPlan(plan));
  HSAP_ASSIGN_OR_RETURN(const CudnnApi* api, cudnn_internal::LoadCudnn());
  std::vector<cudnn_internal::Desc> keep;
  absl::Status status = cudnn_internal::LowerPlan(api, plan, dtype, &keep).status();
  while (!keep.empty()) keep.pop_back();  // newest first, as ~Impl does
  return status;
}

#else  // !HSAP_HAVE_CUDNN_HEADERS

absl::Status FinalizePlanDescriptors(const CudnnGraphPlan& plan, DType) {
  HSAP_RETURN_IF_ERROR(ValidateGraphPlan(plan));
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

#endif  // HSAP_HAVE_CUDNN_HEADERS

}  // namespace hsap::cuda
