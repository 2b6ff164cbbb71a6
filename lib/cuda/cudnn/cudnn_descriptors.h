// cuDNN's graph API for libhsap's cuDNN piece runner (libcudnn_runner.h) and the bench's
// whole-row baseline (bench/cudnn_attention.h): with cudnn_graph.h (HSAP_HAVE_CUDNN_HEADERS), the
// library loaded with the functions it uses resolved (CudnnApi), backend descriptors and device
// buffers owned by objects, a builder that creates, sets and finalizes descriptors checking every
// call, and a CudnnGraphPlan lowered to descriptors. Errors are Statuses naming the call and
// cuDNN's status string.
#ifndef HSAP_LIB_CUDA_CUDNN_CUDNN_DESCRIPTORS_H_
#define HSAP_LIB_CUDA_CUDNN_CUDNN_DESCRIPTORS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attention/dtype.h"
#include "lib/cuda/cudnn/cudnn_library.h"
#include "lib/cuda/cudnn/sdpa_graph.h"
// Before cudnn_graph.h: hsap::cuda::cudaStream names hsap's own CUstream_st in every unit.
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::cuda {

// Creates and finalizes every tensor and operation descriptor of `plan` (I/O type `dtype`)
// with libcudnn, which needs no GPU: cuDNN checks that each descriptor has its required
// attributes with the right attribute types. Shapes and data types across operations are
// checked only by the operation graph and its engines, which need a handle, hence a GPU, and
// are not built here. Unimplemented without
// libcudnn.so.9 or cudnn_graph.h; cuDNN's status (naming the descriptor) when one is refused.
absl::Status FinalizePlanDescriptors(const CudnnGraphPlan& plan, DType dtype);

}  // namespace hsap::cuda

#if defined(HSAP_HAVE_CUDNN_HEADERS)

#include <cudnn_graph.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "lib/cuda/runtime/cuda_loader.h"

// Status propagation in the cuDNN files.
#define HSAP_CUDNN_RETURN_IF_ERROR(expr)      \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (0)
#define HSAP_CUDNN_CONCAT_INNER(a, b) a##b
#define HSAP_CUDNN_CONCAT(a, b) HSAP_CUDNN_CONCAT_INNER(a, b)
#define HSAP_CUDNN_ASSIGN_OR_RETURN(lhs, expr) \
  HSAP_CUDNN_ASSIGN_OR_RETURN_IMPL(HSAP_CUDNN_CONCAT(_statusor_, __LINE__), lhs, expr)
#define HSAP_CUDNN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return tmp.status();                    \
  lhs = *std::move(tmp)

namespace hsap::cuda {

// The functions of libcudnn.so.9 the graph users call, typed by cudnn_graph.h.
class CudnnApi {
 public:
  std::string path;
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;  // may be null
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) BackendCreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) BackendDestroyDescriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) BackendSetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) BackendGetAttribute = nullptr;
  decltype(&cudnnBackendFinalize) BackendFinalize = nullptr;
  decltype(&cudnnBackendExecute) BackendExecute = nullptr;

  // "<what> failed: CUDNN_STATUS_NOT_SUPPORTED (3000): <last error>"; OK for success.
  absl::Status Check(cudnnStatus_t status, absl::string_view what) const {
    if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
    const char* text = GetErrorString != nullptr ? GetErrorString(status) : nullptr;
    std::string msg = absl::StrCat(what, " failed: ", text != nullptr ? text : "unknown status",
                                   " (", static_cast<int>(status), ")");
    if (GetLastErrorString != nullptr) {
      char last[1024] = {0};
      GetLastErrorString(last, sizeof(last));
      if (last[0] != '\0') absl::StrAppend(&msg, ": ", last);
    }
    if (status == CUDNN_STATUS_NOT_SUPPORTED ||
        (static_cast<int>(status) >= 3000 && static_cast<int>(status) < 4000)) {
      return absl::UnimplementedError(msg);
    }
    if (status == CUDNN_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
    return absl::InternalError(msg);
  }
};

namespace cudnn_internal {

// Loaded once per search path and never unloaded (as lib/cuda/runtime/cuda_loader.cc does).
absl::StatusOr<const CudnnApi*> LoadCudnn();

// One backend descriptor, destroyed with the object.
class Desc {
 public:
  Desc(const CudnnApi* api, cudnnBackendDescriptor_t d) : api_(api), d_(d) {}
  Desc(Desc&& o) noexcept : api_(o.api_), d_(std::exchange(o.d_, nullptr)) {}
  Desc& operator=(Desc&& o) noexcept {
    if (this != &o) {
      Reset();
      api_ = o.api_;
      d_ = std::exchange(o.d_, nullptr);
    }
    return *this;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  ~Desc() { Reset(); }
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  void Reset() {
    if (d_ != nullptr) api_->BackendDestroyDescriptor(d_);
    d_ = nullptr;
  }
  const CudnnApi* api_;
  cudnnBackendDescriptor_t d_;
};

// cudaMalloc'ed bytes, freed with the object.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : rt_(o.rt_), p_(std::exchange(o.p_, nullptr)), bytes_(o.bytes_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      rt_ = o.rt_;
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = o.bytes_;
    }
    return *this;
  }
  ~DeviceBuffer() { Reset(); }

  static absl::StatusOr<DeviceBuffer> Allocate(const CudaRuntimeApi* rt, size_t bytes,
                                               absl::string_view what);
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void Reset();
  const CudaRuntimeApi* rt_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

struct TensorSpec {
  const char* name;
  int64_t uid;
  cudnnDataType_t dtype;
  Dims4 dims;
  Dims4 strides;
  bool is_virtual = false;
  bool by_value = false;
  cudnnBackendDescriptor_t ragged_offset = nullptr;
};

// Builds backend descriptors, each checked, each kept alive in `keep` until the owner goes.
class DescriptorBuilder {
 public:
  DescriptorBuilder(const CudnnApi* api, std::vector<Desc>* keep) : api_(api), keep_(keep) {}

  absl::StatusOr<cudnnBackendDescriptor_t> Make(cudnnBackendDescriptorType_t type,
                                                absl::string_view what);
  absl::Status Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr,
                   cudnnBackendAttributeType_t type, int64_t count, const void* value,
                   absl::string_view what);
  absl::Status SetDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr,
                       cudnnBackendDescriptor_t value, absl::string_view what);
  absl::Status Finalize(cudnnBackendDescriptor_t d, absl::string_view what);

  absl::StatusOr<cudnnBackendDescriptor_t> Tensor(const TensorSpec& t);

  // y = op(x[, b[, t]]) with the given math precision; axis only for GEN_INDEX.
  absl::StatusOr<cudnnBackendDescriptor_t> Pointwise(const char* name, cudnnPointwiseMode_t mode,
                                                     cudnnDataType_t math_prec,
                                                     cudnnBackendDescriptor_t x,
                                                     cudnnBackendDescriptor_t b,
                                                     cudnnBackendDescriptor_t t,
                                                     cudnnBackendDescriptor_t y, int64_t axis = -1);

  // y = reduce(x) over the last axis (y's last dim is 1), fp32.
  absl::StatusOr<cudnnBackendDescriptor_t> Reduction(const char* name, cudnnReduceTensorOp_t mode,
                                                     cudnnBackendDescriptor_t x,
                                                     cudnnBackendDescriptor_t y);

  // c = a @ b (fp32 accumulation), with optional GEMM M/N/K overrides (seq_len tensors).
  absl::StatusOr<cudnnBackendDescriptor_t> Matmul(const char* name, cudnnBackendDescriptor_t a,
                                                  cudnnBackendDescriptor_t b,
                                                  cudnnBackendDescriptor_t c,
                                                  cudnnBackendDescriptor_t m_override,
                                                  cudnnBackendDescriptor_t n_override,
                                                  cudnnBackendDescriptor_t k_override);

  // y = x seen through y's dims and strides (a transpose, or a cast of a virtual tensor).
  absl::StatusOr<cudnnBackendDescriptor_t> Reshape(const char* name, cudnnBackendDescriptor_t x,
                                                   cudnnBackendDescriptor_t y);

 private:
  const CudnnApi* api_;
  std::vector<Desc>* keep_;
};

// Bytes of `n` int32 values rounded up to 16.
size_t Aligned16(size_t n);

// Creates and finalizes the tensor and operation descriptors of `plan` (kept in `keep`); the
// operations in plan order.
absl::StatusOr<std::vector<cudnnBackendDescriptor_t>> LowerPlan(const CudnnApi* api,
                                                                const CudnnGraphPlan& plan,
                                                                DType dtype,
                                                                std::vector<Desc>* keep);

// The operation graph of `ops` on `handle`, finalized (kept in `keep`).
absl::StatusOr<cudnnBackendDescriptor_t> BuildOperationGraph(
    const CudnnApi* api, cudnnHandle_t handle, const std::vector<cudnnBackendDescriptor_t>& ops,
    std::vector<Desc>* keep);

// The first engine configuration of `graph` whose execution plan finalizes (heuristics mode A,
// then fallback), its workspace size in `workspace_bytes`. NotFound with cuDNN's first reasons
// when none does.
absl::StatusOr<Desc> PickExecutionPlan(const CudnnApi* api, cudnnHandle_t handle,
                                       cudnnBackendDescriptor_t graph, std::vector<Desc>* keep,
                                       size_t* workspace_bytes);

// Binds `uids` to `ptrs` (and the workspace) in a variant pack and executes `plan` on
// `stream`; `what` names the call in errors.
absl::Status ExecutePlan(const CudnnApi* api, cudnnHandle_t handle, cudnnBackendDescriptor_t plan,
                         absl::Span<const int64_t> uids, absl::Span<void* const> ptrs,
                         void* workspace, cudaStream stream, absl::string_view what);

}  // namespace cudnn_internal
}  // namespace hsap::cuda

#endif  // HSAP_HAVE_CUDNN_HEADERS

#endif  // HSAP_LIB_CUDA_CUDNN_CUDNN_DESCRIPTORS_H_
