#include "bench/cudnn_attention.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/params.h"
#include "base/status_macros.h"

#if defined(HSAP_HAVE_CUDNN_HEADERS)
#include <cudnn_graph.h>
#endif

namespace hsap::bench {

// ---------------------------------------------------------------------------------------
// Host logic.

absl::StatusOr<CudnnRaggedGeometry> MakeRaggedGeometry(const CudnnAttentionShape& shape) {
  if (shape.dtype != DType::kBF16 && shape.dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN fused attention takes bf16 or fp16, not ",
                                                   std::string(DTypeName(shape.dtype))));
  }
  if (shape.heads_q <= 0 || shape.heads_kv <= 0 || shape.heads_q % shape.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: query heads (", shape.heads_q,
                                                   ") must be a positive multiple of kv heads (",
                                                   shape.heads_kv, ")"));
  }
  if (shape.head_dim <= 0 || shape.head_dim % 8 != 0 || shape.head_dim > 256) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: head dim ", shape.head_dim,
                                                   " is not a multiple of 8 in 8..256"));
  }
  CudnnRaggedGeometry g;
  const int64_t hq = shape.heads_q, hkv = shape.heads_kv, d = shape.head_dim;
  g.qo_offsets.push_back(0);
  g.kv_offsets.push_back(0);
  for (int64_t l : shape.doc_lengths) {
    if (l < 0) return absl::InvalidArgumentError("cuDNN attention: negative document length");
    g.total_tokens += l;
    if (l == 0) continue;  // nothing to attend; cuDNN gets only non-empty documents
    // Element offsets must fit the int32 ragged-offset tensors.
    if (l > std::numeric_limits<int32_t>::max() ||
        g.total_tokens * hq * d > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: ", g.total_tokens,
                                                     " tokens x ", hq, " heads x ", d,
                                                     " elements exceed the int32 ragged offsets"));
    }
    g.seq_lens.push_back(static_cast<int32_t>(l));
    g.qo_offsets.push_back(static_cast<int32_t>(g.total_tokens * hq * d));
    g.kv_offsets.push_back(static_cast<int32_t>(g.total_tokens * hkv * d));
    g.max_seq_len = std::max(g.max_seq_len, l);
  }
  g.batch = static_cast<int64_t>(g.seq_lens.size());
  if (g.batch == 0) return absl::InvalidArgumentError("cuDNN attention: the row has no token");
  const int64_t b = g.batch, s = g.max_seq_len;
  g.q_dims = {b, hq, s, d};
  g.q_strides = {s * hq * d, d, hq * d, 1};
  g.kt_dims = {b, hkv, d, s};
  g.kt_strides = {s * hkv * d, d, 1, hkv * d};
  g.v_dims = {b, hkv, s, d};
  g.v_strides = {s * hkv * d, d, hkv * d, 1};
  g.score_dims = {b, hq, s, s};
  g.score_strides = {hq * s * s, s * s, s, 1};
  g.stats_dims = {b, hq, s, 1};
  g.stats_strides = {hq * s, s, 1, 1};
  g.stats_elements = b * hq * s;
  return g;
}

double VisiblePairs(absl::Span<const int64_t> doc_lengths, bool causal) {
  double pairs = 0;
  for (int64_t l : doc_lengths) {
    const double x = static_cast<double>(std::max<int64_t>(l, 0));
    pairs += causal ? x * (x + 1) / 2 : x * x;
  }
  return pairs;
}

double ForwardFlops(absl::Span<const int64_t> doc_lengths, int heads_q, int head_dim, bool causal) {
  return 4.0 * head_dim * heads_q * VisiblePairs(doc_lengths, causal);
}

std::vector<std::string> CudnnLibrarySearchPath() {
  if (GetParam(Param::kCudaLibPath).has_value()) return cuda::CudaLibrarySearchPath();
  std::vector<std::string> dirs = cuda::CudaLibrarySearchPath();  // ends with "" (default)
  dirs.insert(dirs.end() - 1, "/usr/local/cuda-13.0/lib");
  return dirs;
}

// ---------------------------------------------------------------------------------------
// Device side.

#if defined(HSAP_HAVE_CUDNN_HEADERS)

namespace {

// Status propagation inside this file.
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

}  // namespace

// The functions of libcudnn.so.9 this file calls, typed by cudnn_graph.h.
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

namespace {

absl::StatusOr<std::unique_ptr<CudnnApi>> LoadCudnnImpl() {
  auto api = std::make_unique<CudnnApi>();
  std::vector<std::string> tried;
  void* handle = nullptr;
  for (const std::string& dir : CudnnLibrarySearchPath()) {
    const std::string candidate = dir.empty() ? "libcudnn.so.9" : dir + "/libcudnn.so.9";
    handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      api->path = candidate;
      break;
    }
    tried.push_back(candidate);
  }
  if (handle == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("libcudnn.so.9 not found: no cuDNN 9 (tried ", absl::StrJoin(tried, ", "),
                     "; set $HSAP_CUDA_LIB_PATH to the directory that holds it)"));
  }
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

// Loaded once per search path and never unloaded (as lib/cuda/runtime/cuda_loader.cc does).
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

  static absl::StatusOr<DeviceBuffer> Allocate(const cuda::CudaRuntimeApi* rt, size_t bytes,
                                               absl::string_view what) {
    DeviceBuffer b;
    b.rt_ = rt;
    b.bytes_ = bytes;
    if (bytes == 0) return b;
    HSAP_CUDNN_RETURN_IF_ERROR(rt->Check(rt->Malloc(&b.p_, bytes),
                                         absl::StrCat("cudaMalloc(", bytes, " bytes) for ", what)));
    return b;
  }
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (p_ != nullptr) rt_->Free(p_);
    p_ = nullptr;
  }
  const cuda::CudaRuntimeApi* rt_ = nullptr;
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
class Builder {
 public:
  Builder(const CudnnApi* api, std::vector<Desc>* keep) : api_(api), keep_(keep) {}

  absl::StatusOr<cudnnBackendDescriptor_t> Make(cudnnBackendDescriptorType_t type,
                                                absl::string_view what) {
    cudnnBackendDescriptor_t d = nullptr;
    HSAP_CUDNN_RETURN_IF_ERROR(
        api_->Check(api_->BackendCreateDescriptor(type, &d),
                    absl::StrCat("cudnnBackendCreateDescriptor(", what, ")")));
    keep_->emplace_back(api_, d);
    return d;
  }
  absl::Status Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr,
                   cudnnBackendAttributeType_t type, int64_t count, const void* value,
                   absl::string_view what) {
    return api_->Check(api_->BackendSetAttribute(d, attr, type, count, value),
                       absl::StrCat("cudnnBackendSetAttribute(", what, ", attribute ",
                                    static_cast<int>(attr), ")"));
  }
  absl::Status SetDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr,
                       cudnnBackendDescriptor_t value, absl::string_view what) {
    return Set(d, attr, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
  }
  absl::Status Finalize(cudnnBackendDescriptor_t d, absl::string_view what) {
    return api_->Check(api_->BackendFinalize(d), absl::StrCat("cudnnBackendFinalize(", what, ")"));
  }

  absl::StatusOr<cudnnBackendDescriptor_t> Tensor(const TensorSpec& t) {
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

  // y = op(x[, b[, t]]) with the given math precision; axis only for GEN_INDEX.
  absl::StatusOr<cudnnBackendDescriptor_t> Pointwise(
      const char* name, cudnnPointwiseMode_t mode, cudnnDataType_t math_prec,
      cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
      cudnnBackendDescriptor_t y, int64_t axis = -1) {
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

  // y = reduce(x) over the last axis (y's last dim is 1), fp32.
  absl::StatusOr<cudnnBackendDescriptor_t> Reduction(const char* name, cudnnReduceTensorOp_t mode,
                                                     cudnnBackendDescriptor_t x,
                                                     cudnnBackendDescriptor_t y) {
    const std::string what = absl::StrCat("reduction ", name);
    HSAP_CUDNN_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t red,
                                Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what));
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    HSAP_CUDNN_RETURN_IF_ERROR(Set(red, CUDNN_ATTR_REDUCTION_OPERATOR,
                                   CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what));
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

  // c = a @ b (fp32 accumulation), with optional GEMM M/N/K overrides (seq_len tensors).
  absl::StatusOr<cudnnBackendDescriptor_t> Matmul(const char* name, cudnnBackendDescriptor_t a,
                                                  cudnnBackendDescriptor_t b,
                                                  cudnnBackendDescriptor_t c,
                                                  cudnnBackendDescriptor_t m_override,
                                                  cudnnBackendDescriptor_t n_override,
                                                  cudnnBackendDescriptor_t k_override) {
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

 private:
  const CudnnApi* api_;
  std::vector<Desc>* keep_;
};

// Unique ids of the tensors the variant pack binds (virtual ones count from 100).
enum Uid : int64_t {
  kUidQ = 1,
  kUidK = 2,
  kUidV = 3,
  kUidO = 4,
  kUidStats = 5,
  kUidSeqLenQ = 6,
  kUidSeqLenKv = 7,
  kUidOffsetQo = 8,
  kUidOffsetKv = 9,
  kUidScale = 10,
  kUidLowestPadding = 11,
  kUidLowestCausal = 12,
  kUidFirstVirtual = 100,
};

// Bytes of `n` int32 values rounded up to 16.
size_t Aligned16(size_t n) { return (n * sizeof(int32_t) + 15) / 16 * 16; }

}  // namespace

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

  ~Impl() {
    plan.clear();
    // Engine configs and operations reference each other; destroy newest first.
    while (!descs.empty()) descs.pop_back();
    if (handle != nullptr) api->Destroy(handle);
  }

  absl::Status Build(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g);
  absl::Status PickPlan(cudnnBackendDescriptor_t graph, size_t* workspace_bytes);
};

absl::Status CudnnAttention::Impl::Build(const CudnnAttentionShape& shape,
                                         const CudnnRaggedGeometry& g) {
  Builder b(api, &descs);
  const cudnnDataType_t io = shape.dtype == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  const int64_t batch = g.batch;
  const Dims4 one = {1, 1, 1, 1};
  int64_t next_virtual = kUidFirstVirtual;
  auto virt = [&](const char* name, cudnnDataType_t dtype, const Dims4& dims,
                  const Dims4& strides) {
    return b.Tensor({name, next_virtual++, dtype, dims, strides, /*is_virtual=*/true});
  };

  // Index tensors (device int32): seq lens [B,1,1,1], ragged offsets [B+1,1,1,1].
  const Dims4 seq_dims = {batch, 1, 1, 1}, off_dims = {batch + 1, 1, 1, 1};
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto seq_q, b.Tensor({"seq_len_q", kUidSeqLenQ, CUDNN_DATA_INT32, seq_dims, one}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto seq_kv, b.Tensor({"seq_len_kv", kUidSeqLenKv, CUDNN_DATA_INT32, seq_dims, one}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto off_qo, b.Tensor({"ragged_offset_qo", kUidOffsetQo, CUDNN_DATA_INT32, off_dims, one}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto off_kv, b.Tensor({"ragged_offset_kv", kUidOffsetKv, CUDNN_DATA_INT32, off_dims, one}));

  // Inputs and outputs in our packed layout.
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto q, b.Tensor({"Q", kUidQ, io, g.q_dims, g.q_strides, false, false, off_qo}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto kt, b.Tensor({"K^T", kUidK, io, g.kt_dims, g.kt_strides, false, false, off_kv}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto v, b.Tensor({"V", kUidV, io, g.v_dims, g.v_strides, false, false, off_kv}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto o, b.Tensor({"O", kUidO, io, g.q_dims, g.q_strides, false, false, off_qo}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto stats, b.Tensor({"Stats", kUidStats, CUDNN_DATA_FLOAT, g.stats_dims, g.stats_strides}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto scale_t, b.Tensor({"attn_scale", kUidScale, CUDNN_DATA_FLOAT,
                                                      one, one, false, /*by_value=*/true}));

  std::vector<cudnnBackendDescriptor_t> ops;
  const Dims4& sd = g.score_dims;
  const Dims4& ss = g.score_strides;

  // S = Q K^T over each document's seq_len x seq_len block.
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_raw, virt("S", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto bmm1,
                              b.Matmul("bmm1 (Q K^T)", q, kt, s_raw, seq_q, seq_kv, nullptr));
  ops.push_back(bmm1);
  // S *= 1/sqrt(D).
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_scaled, virt("S_scaled", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto mul, b.Pointwise("attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s_raw, scale_t,
                            nullptr, s_scaled));
  ops.push_back(mul);

  // Padding mask: keep (row < seq_len_q) && (col < seq_len_kv), else the lowest float.
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_p, virt("pad_row_index", CUDNN_DATA_INT32, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_p, virt("pad_col_index", CUDNN_DATA_INT32, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_ok, virt("row_lt_seq_q", CUDNN_DATA_INT32, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_ok, virt("col_lt_seq_kv", CUDNN_DATA_INT32, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto keep_p, virt("pad_keep", CUDNN_DATA_BOOLEAN, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto lowest_p, b.Tensor({"lowest (padding)", kUidLowestPadding, CUDNN_DATA_FLOAT, one, one,
                               false, /*by_value=*/true}));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_padded, virt("S_padded", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      auto op, b.Pointwise("pad_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s_scaled,
                           nullptr, nullptr, row_p, /*axis=*/2));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("pad_col_index", CUDNN_POINTWISE_GEN_INDEX,
                                              CUDNN_DATA_INT32, s_scaled, nullptr, nullptr, col_p,
                                              /*axis=*/3));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("row_lt_seq_q", CUDNN_POINTWISE_CMP_LT,
                                              CUDNN_DATA_INT32, row_p, seq_q, nullptr, row_ok));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("col_lt_seq_kv", CUDNN_POINTWISE_CMP_LT,
                                              CUDNN_DATA_INT32, col_p, seq_kv, nullptr, col_ok));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("pad_and", CUDNN_POINTWISE_LOGICAL_AND,
                                              CUDNN_DATA_BOOLEAN, row_ok, col_ok, nullptr, keep_p));
  ops.push_back(op);
  // BINARY_SELECT: y = t ? x : b.
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      op, b.Pointwise("pad_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s_scaled,
                      lowest_p, keep_p, s_padded));
  ops.push_back(op);
  cudnnBackendDescriptor_t s_masked = s_padded;

  // Causal mask inside each document: keep row >= col (q and kv lengths are equal, so top-left
  // and bottom-right alignments coincide).
  if (shape.causal) {
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_c, virt("causal_row_index", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_c, virt("causal_col_index", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto keep_c, virt("causal_keep", CUDNN_DATA_BOOLEAN, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        auto lowest_c, b.Tensor({"lowest (causal)", kUidLowestCausal, CUDNN_DATA_FLOAT, one, one,
                                 false, /*by_value=*/true}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_causal, virt("S_causal", CUDNN_DATA_FLOAT, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("causal_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s_padded,
                        nullptr, nullptr, row_c, /*axis=*/2));
    ops.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("causal_col_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s_padded,
                        nullptr, nullptr, col_c, /*axis=*/3));
    ops.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("row_ge_col", CUDNN_POINTWISE_CMP_GE,
                                                CUDNN_DATA_BOOLEAN, row_c, col_c, nullptr, keep_c));
    ops.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("causal_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s_padded,
                        lowest_c, keep_c, s_causal));
    ops.push_back(op);
    s_masked = s_causal;
  }

  // Softmax with its log-sum-exp: M = max, E = exp(S - M), Z = sum E, Stats = M + log Z,
  // P = E / Z (in the I/O type: what the second matmul takes).
  const Dims4& rd = g.stats_dims;
  const Dims4& rs = g.stats_strides;
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_max, virt("row_max", CUDNN_DATA_FLOAT, rd, rs));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_sub, virt("S_minus_max", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_exp, virt("exp", CUDNN_DATA_FLOAT, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_sum, virt("row_sum", CUDNN_DATA_FLOAT, rd, rs));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_log, virt("log_row_sum", CUDNN_DATA_FLOAT, rd, rs));
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto p, virt("P", io, sd, ss));
  HSAP_CUDNN_ASSIGN_OR_RETURN(op,
                              b.Reduction("row_max", CUDNN_REDUCE_TENSOR_MAX, s_masked, row_max));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("sub_max", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT,
                                              s_masked, row_max, nullptr, s_sub));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, s_sub,
                                              nullptr, nullptr, s_exp));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Reduction("row_sum", CUDNN_REDUCE_TENSOR_ADD, s_exp, row_sum));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("log", CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, row_sum,
                                              nullptr, nullptr, row_log));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("stats", CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT,
                                              row_max, row_log, nullptr, stats));
  ops.push_back(op);
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("div_sum", CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT,
                                              s_exp, row_sum, nullptr, p));
  ops.push_back(op);

  // O = P V over each document.
  HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Matmul("bmm2 (P V)", p, v, o, seq_q, nullptr, seq_kv));
  ops.push_back(op);

  // The operation graph.
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto graph,
                              b.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                   &handle, "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
                                   ops.data(), "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Finalize(graph, "operation graph"));
  size_t workspace_bytes = 0;
  HSAP_CUDNN_RETURN_IF_ERROR(PickPlan(graph, &workspace_bytes));
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
  uint8_t* base = static_cast<uint8_t*>(index.get());
  seq_lens_dev = base;
  qo_offsets_dev = base + seq_bytes;
  kv_offsets_dev = base + seq_bytes + off_bytes;
  scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  return absl::OkStatus();
}

absl::Status CudnnAttention::Impl::PickPlan(cudnnBackendDescriptor_t graph,
                                            size_t* workspace_bytes) {
  Builder b(api, &descs);
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
      plan.push_back(std::move(candidate));
      return absl::OkStatus();
    }
  }
  // Keep the message readable: the first few reasons.
  if (rejected.size() > 4) rejected.resize(4);
  return absl::NotFoundError(absl::StrCat("no cuDNN engine supports the fused attention graph: ",
                                          absl::StrJoin(rejected, "; ")));
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    const CudnnAttentionShape& shape) {
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
  self->impl_ = std::make_unique<Impl>();
  Impl& impl = *self->impl_;
  impl.api = api;
  impl.rt = rt;
  HSAP_CUDNN_RETURN_IF_ERROR(api->Check(api->Create(&impl.handle), "cudnnCreate"));
  HSAP_CUDNN_RETURN_IF_ERROR(impl.Build(shape, self->geometry_));
  self->workspace_bytes_ = impl.workspace.bytes();
  return self;
}

CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Forward(const void* q, const void* k, const void* v, void* o,
                                     float* stats, cuda::cudaStream stream) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || stats == nullptr) {
    return absl::InvalidArgumentError("cuDNN attention forward: a null tensor");
  }
  Impl& impl = *impl_;
  const CudnnApi* api = impl.api;
  HSAP_CUDNN_RETURN_IF_ERROR(api->Check(
      api->SetStream(impl.handle, reinterpret_cast<cudaStream_t>(stream)), "cudnnSetStream"));
  const int64_t uids[] = {
      kUidQ,        kUidK,        kUidV,        kUidO,     kUidStats,         kUidSeqLenQ,
      kUidSeqLenKv, kUidOffsetQo, kUidOffsetKv, kUidScale, kUidLowestPadding, kUidLowestCausal};
  void* ptrs[] = {const_cast<void*>(q),
                  const_cast<void*>(k),
                  const_cast<void*>(v),
                  o,
                  stats,
                  impl.seq_lens_dev,
                  impl.seq_lens_dev,
                  impl.qo_offsets_dev,
                  impl.kv_offsets_dev,
                  &impl.scale,
                  &impl.lowest,
                  &impl.lowest};
  // The causal select's scalar is not in a non-causal graph.
  const int64_t n = causal_ ? 12 : 11;
  cudnnBackendDescriptor_t d = nullptr;
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &d),
                 "cudnnBackendCreateDescriptor(variant pack)"));
  Desc pack(api, d);
  void* workspace = impl.workspace.get();
  HSAP_CUDNN_RETURN_IF_ERROR(api->Check(
      api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids),
      "cudnnBackendSetAttribute(variant pack, unique ids)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                          CUDNN_TYPE_VOID_PTR, n, ptrs),
                 "cudnnBackendSetAttribute(variant pack, data pointers)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR,
                                          1, &workspace),
                 "cudnnBackendSetAttribute(variant pack, workspace)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendFinalize(d), "cudnnBackendFinalize(variant pack)"));
  return api->Check(api->BackendExecute(impl.handle, impl.plan.front().get(), d),
                    "cudnnBackendExecute(fused attention forward)");
}

#else  // !HSAP_HAVE_CUDNN_HEADERS

class CudnnApi {};
struct CudnnAttention::Impl {};

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    const CudnnAttentionShape& shape) {
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

#endif  // HSAP_HAVE_CUDNN_HEADERS

// ---------------------------------------------------------------------------------------
// The bench's timed run.

absl::StatusOr<CudnnForwardRun> RunCudnnForward(const CudnnAttentionShape& shape,
                                                const void* q_host, const void* k_host,
                                                const void* v_host, int warmup, int iters,
                                                void* out_host) {
  if (iters < 1) return absl::InvalidArgumentError("cuDNN attention: iters must be at least 1");
  absl::StatusOr<std::unique_ptr<CudnnAttention>> runner = CudnnAttention::Create(shape);
  if (!runner.ok()) return runner.status();
  absl::StatusOr<const cuda::CudaRuntimeApi*> rt_or = cuda::LoadCudaRuntime();
  if (!rt_or.ok()) return rt_or.status();
  const cuda::CudaRuntimeApi* rt = *rt_or;
  CudnnAttention& attn = **runner;
  const int64_t T = attn.geometry().total_tokens;
  const size_t es = DTypeSize(shape.dtype);
  const size_t q_bytes = static_cast<size_t>(T) * shape.heads_q * shape.head_dim * es;
  const size_t kv_bytes = static_cast<size_t>(T) * shape.heads_kv * shape.head_dim * es;

  // Device memory, streams and events, released on every path.
  struct Resources {
    const cuda::CudaRuntimeApi* rt = nullptr;
    std::vector<void*> buffers;
    cuda::cudaStream stream = nullptr;
    cuda::cudaEvent start = nullptr, stop = nullptr;
    ~Resources() {
      if (stream != nullptr) rt->StreamSynchronize(stream);
      if (start != nullptr) rt->EventDestroy(start);
      if (stop != nullptr) rt->EventDestroy(stop);
      if (stream != nullptr) rt->StreamDestroy(stream);
      for (void* p : buffers) rt->Free(p);
    }
    absl::StatusOr<void*> Alloc(size_t bytes, absl::string_view what) {
      void* p = nullptr;
      HSAP_RETURN_IF_ERROR(rt->Check(rt->Malloc(&p, std::max<size_t>(bytes, 16)),
                                     absl::StrCat("cudaMalloc(", bytes, " bytes) for ", what)));
      buffers.push_back(p);
      return p;
    }
  } res;
  res.rt = rt;
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *stats = nullptr;
  {
    absl::StatusOr<void*> p = res.Alloc(q_bytes, "Q");
    if (!p.ok()) return p.status();
    q = *p;
    if (p = res.Alloc(kv_bytes, "K"); !p.ok()) return p.status();
    k = *p;
    if (p = res.Alloc(kv_bytes, "V"); !p.ok()) return p.status();
    v = *p;
    if (p = res.Alloc(q_bytes, "O"); !p.ok()) return p.status();
    o = *p;
    if (p = res.Alloc(attn.StatsBytes(), "the softmax stats"); !p.ok()) return p.status();
    stats = *p;
  }
  auto check = [&](cuda::cudaError e, absl::string_view what) { return rt->Check(e, what); };
  for (auto [dst, src, bytes] : {std::tuple<void*, const void*, size_t>{q, q_host, q_bytes},
                                 {k, k_host, kv_bytes},
                                 {v, v_host, kv_bytes}}) {
    HSAP_RETURN_IF_ERROR(
        check(rt->Memcpy(dst, src, bytes, cuda::kCudaMemcpyDefault), "cudaMemcpy (cuDNN inputs)"));
  }
  HSAP_RETURN_IF_ERROR(check(rt->StreamCreateWithFlags(&res.stream, cuda::kCudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags"));
  HSAP_RETURN_IF_ERROR(check(rt->EventCreateWithFlags(&res.start, 0), "cudaEventCreate"));
  HSAP_RETURN_IF_ERROR(check(rt->EventCreateWithFlags(&res.stop, 0), "cudaEventCreate"));
  for (int i = 0; i < warmup; ++i) {
    HSAP_RETURN_IF_ERROR(attn.Forward(q, k, v, o, static_cast<float*>(stats), res.stream));
  }
  HSAP_RETURN_IF_ERROR(check(rt->EventRecord(res.start, res.stream), "cudaEventRecord"));
  for (int i = 0; i < iters; ++i) {
    HSAP_RETURN_IF_ERROR(attn.Forward(q, k, v, o, static_cast<float*>(stats), res.stream));
  }
  HSAP_RETURN_IF_ERROR(check(rt->EventRecord(res.stop, res.stream), "cudaEventRecord"));
  HSAP_RETURN_IF_ERROR(
      check(rt->EventSynchronize(res.stop), "cudaEventSynchronize (cuDNN attention forward)"));
  float ms = 0;
  HSAP_RETURN_IF_ERROR(
      check(rt->EventElapsedTime(&ms, res.start, res.stop), "cudaEventElapsedTime"));
  if (out_host != nullptr) {
    HSAP_RETURN_IF_ERROR(check(rt->Memcpy(out_host, o, q_bytes, cuda::kCudaMemcpyDefault),
                               "cudaMemcpy (cuDNN output)"));
  }
  CudnnForwardRun run;
  run.forward_ms = static_cast<double>(ms) / iters;
  run.version = attn.version();
  run.workspace_bytes = attn.WorkspaceBytes();
  return run;
}

}  // namespace hsap::bench
