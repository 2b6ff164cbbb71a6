#include "lib/cuda/exec/gpu_reference.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "jit/cache.h"

namespace hsap::cuda {
namespace {

using jit::RefArith;
using jit::RefKernel;

static_assert(sizeof(long long) == sizeof(int64_t), "the interval arrays are copied as they are");

// Sorts `v` by lo and merges intervals that overlap or touch.
void SortAndMerge(std::vector<std::pair<int64_t, int64_t>>& v) {
  std::sort(v.begin(), v.end());
  size_t out = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (out > 0 && v[i].first <= v[out - 1].second) {
      v[out - 1].second = std::max(v[out - 1].second, v[i].second);
    } else {
      v[out++] = v[i];
    }
  }
  v.resize(out);
}

// Device memory freed on destruction (after the device is done with it: Device::Free waits).
class DeviceArena {
 public:
  explicit DeviceArena(Device& device) : device_(device) {}
  ~DeviceArena() {
    for (void* p : owned_) device_.Free(p);
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  template <typename T>
  absl::StatusOr<T*> Allocate(size_t count) {
    HSAP_ASSIGN_OR_RETURN(void* p, device_.Allocate(count * sizeof(T)));
    if (p != nullptr) owned_.push_back(p);
    return static_cast<T*>(p);
  }
  // A device copy of `bytes` bytes at `src` (host or device memory).
  absl::StatusOr<void*> Upload(const void* src, size_t bytes, cudaStream s) {
    HSAP_ASSIGN_OR_RETURN(char* p, Allocate<char>(bytes));
    if (bytes > 0) HSAP_RETURN_IF_ERROR(device_.CopyAsync(p, src, bytes, s));
    return static_cast<void*>(p);
  }
  template <typename T>
  absl::StatusOr<const T*> Upload(const std::vector<T>& v, cudaStream s) {
    HSAP_ASSIGN_OR_RETURN(void* p, Upload(v.data(), v.size() * sizeof(T), s));
    return static_cast<const T*>(p);
  }

 private:
  Device& device_;
  std::vector<void*> owned_;
};

// The stream of one run, destroyed at the end.
class ScopedStream {
 public:
  explicit ScopedStream(Device& device) : device_(device) {}
  ~ScopedStream() {
    if (stream_ != nullptr) device_.DestroyStream(stream_);
  }
  absl::Status Create() {
    HSAP_ASSIGN_OR_RETURN(stream_, device_.CreateStream());
    return absl::OkStatus();
  }
  cudaStream get() const { return stream_; }

 private:
  Device& device_;
  cudaStream stream_ = nullptr;
};

absl::StatusOr<hsap_dev::RefIntervals> UploadIntervals(DeviceArena& arena,
                                                       const RefRowIntervals& iv, cudaStream s) {
  hsap_dev::RefIntervals out{};
  HSAP_ASSIGN_OR_RETURN(const int64_t* rows, arena.Upload(iv.row_offsets, s));
  HSAP_ASSIGN_OR_RETURN(const int64_t* tiles, arena.Upload(iv.tile_offsets, s));
  HSAP_ASSIGN_OR_RETURN(const int64_t* lo, arena.Upload(iv.lo, s));
  HSAP_ASSIGN_OR_RETURN(const int64_t* hi, arena.Upload(iv.hi, s));
  out.row_offsets = reinterpret_cast<const long long*>(rows);
  out.tile_offsets = reinterpret_cast<const long long*>(tiles);
  out.lo = reinterpret_cast<const long long*>(lo);
  out.hi = reinterpret_cast<const long long*>(hi);
  return out;
}

absl::Status CheckArguments(const ReferenceKernels& kernels, const Layout& layout,
                            const ReferenceInputs& in, const void* dout,
                            const GpuReferenceOptions& options) {
  const AttentionDims& dims = in.dims;
  if (kernels.dtype() != in.dtype || kernels.head_dim() != dims.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU reference: kernels for ", std::string(DTypeName(kernels.dtype())),
                     ", head dim ", kernels.head_dim(), " given inputs in ",
                     std::string(DTypeName(in.dtype)), ", head dim ", dims.head_dim));
  }
  if (dims.heads_q < 1 || dims.heads_kv < 1 || dims.heads_q > 65535 ||
      (dims.kv_head_of_q.empty() && dims.heads_q % dims.heads_kv != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU reference: heads_q ", dims.heads_q, ", heads_kv ", dims.heads_kv));
  }
  for (int h = 0; h < dims.heads_q; ++h) {
    if (dims.KvHead(h) < 0 || dims.KvHead(h) >= dims.heads_kv) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU reference: query head ", h, " maps to kv head ", dims.KvHead(h)));
    }
  }
  if (layout.num_tokens() > 0 && (in.q == nullptr || in.k == nullptr || in.v == nullptr)) {
    return absl::InvalidArgumentError("GPU reference: q, k and v are required");
  }
  if (options.backward && layout.num_tokens() > 0 && dout == nullptr) {
    return absl::InvalidArgumentError("GPU reference: the backward needs dout");
  }
  return absl::OkStatus();
}

// The GPU kernels: one NVRTC module, launched with the driver API.
class JitReferenceKernels : public ReferenceKernels {
 public:
  ~JitReferenceKernels() override {
    if (module_ != nullptr) driver_->ModuleUnload(module_);
  }

  static absl::StatusOr<std::unique_ptr<ReferenceKernels>> Load(DType dtype, int head_dim) {
    HSAP_RETURN_IF_ERROR(jit::ValidateRefHeadDim(head_dim));
    HSAP_RETURN_IF_ERROR(CheckCudaDevice());
    HSAP_ASSIGN_OR_RETURN(std::string arch, CurrentCudaArch());
    HSAP_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
    // cudaFree(nullptr) initialises the device's primary context and makes it current.
    HSAP_RETURN_IF_ERROR(rt->Check(rt->Free(nullptr), "cudaFree(nullptr) (context set-up)"));
    HSAP_ASSIGN_OR_RETURN(
        jit::CudaBinary binary,
        jit::CompileReferenceKernels(dtype, head_dim, arch, &jit::CompileCache::Global()));
    HSAP_ASSIGN_OR_RETURN(const CudaDriverApi* driver, LoadCudaDriver());
    auto k = std::unique_ptr<JitReferenceKernels>(new JitReferenceKernels(dtype, head_dim));
    k->driver_ = driver;
    const CudaDriverApi& d = *driver;
    HSAP_RETURN_IF_ERROR(d.Check(d.CtxGetCurrent(&k->context_), "cuCtxGetCurrent"));
    if (k->context_ == nullptr) {
      return absl::InternalError("no current CUDA context to load the reference kernels into");
    }
    HSAP_RETURN_IF_ERROR(
        d.Check(d.ModuleLoadData(&k->module_, binary.image.c_str()),
                absl::StrCat("cuModuleLoadData(reference kernels, ", binary.target, ")")));
    for (RefArith arith : {RefArith::kExact, RefArith::kRounded}) {
      for (RefKernel kernel : jit::kAllRefKernels) {
        const std::string expression = jit::RefKernelExpression(kernel, arith, dtype, head_dim);
        HSAP_ASSIGN_OR_RETURN(std::string name, binary.LoweredName(expression));
        CUfunction& f = k->Slot(kernel, arith);
        HSAP_RETURN_IF_ERROR(d.Check(d.ModuleGetFunction(&f, k->module_, name.c_str()),
                                     absl::StrCat("cuModuleGetFunction(", name, ")")));
        const RefLaunch launch = RefLaunchOf(kernel, arith, head_dim, 1, 1, 1);
        if (launch.smem_bytes > 48 * 1024) {
          HSAP_RETURN_IF_ERROR(d.Check(
              d.FuncSetAttribute(f, kCuFuncAttributeMaxDynamicSharedSize, launch.smem_bytes),
              absl::StrCat("cuFuncSetAttribute(", expression, ", ", launch.smem_bytes,
                           " B shared memory)")));
        }
      }
    }
    return std::unique_ptr<ReferenceKernels>(std::move(k));
  }

  DType dtype() const override { return dtype_; }
  int head_dim() const override { return head_dim_; }
  absl::Status Forward(RefArith arith, const hsap_dev::RefFwdParams& p,
                       cudaStream s) const override {
    return Launch(RefKernel::kForward, arith, &p, p.tokens, p.heads_q, p.heads_kv, s);
  }
  absl::Status RowDot(RefArith arith, const hsap_dev::RefRowDotParams& p,
                      cudaStream s) const override {
    return Launch(RefKernel::kRowDot, arith, &p, p.tokens, p.heads_q, 1, s);
  }
  absl::Status Dq(RefArith arith, const hsap_dev::RefBwdParams& p, cudaStream s) const override {
    return Launch(RefKernel::kDq, arith, &p, p.tokens, p.heads_q, p.heads_kv, s);
  }
  absl::Status DkDv(RefArith arith, const hsap_dev::RefBwdParams& p, cudaStream s) const override {
    return Launch(RefKernel::kDkDv, arith, &p, p.tokens, p.heads_q, p.heads_kv, s);
  }

 private:
  JitReferenceKernels(DType dtype, int head_dim) : dtype_(dtype), head_dim_(head_dim) {}

  CUfunction& Slot(RefKernel kernel, RefArith arith) {
    return functions_[static_cast<int>(kernel) * 2 + (arith == RefArith::kExact ? 0 : 1)];
  }
  CUfunction Function(RefKernel kernel, RefArith arith) const {
    return functions_[static_cast<int>(kernel) * 2 + (arith == RefArith::kExact ? 0 : 1)];
  }

  absl::Status Launch(RefKernel kernel, RefArith arith, const void* params, long long tokens,
                      int heads_q, int heads_kv, cudaStream s) const {
    const RefLaunch launch = RefLaunchOf(kernel, arith, head_dim_, tokens, heads_q, heads_kv);
    if (launch.empty()) return absl::OkStatus();
    void* args[] = {const_cast<void*>(params)};
    HSAP_RETURN_IF_ERROR(driver_->Check(driver_->CtxSetCurrent(context_), "cuCtxSetCurrent"));
    return driver_->Check(
        driver_->LaunchKernel(Function(kernel, arith), launch.grid_x, launch.grid_y, 1,
                              static_cast<unsigned>(launch.threads), 1, 1,
                              static_cast<unsigned>(launch.smem_bytes), s, args, nullptr),
        absl::StrCat("cuLaunchKernel(reference ", jit::RefKernelName(kernel),
                     arith == RefArith::kExact ? " exact" : " rounded", ", grid ", launch.grid_x,
                     "x", launch.grid_y, ", ", launch.smem_bytes, " B shared)"));
  }

  DType dtype_;
  int head_dim_;
  const CudaDriverApi* driver_ = nullptr;
  CUcontext context_ = nullptr;
  CUmodule module_ = nullptr;
  CUfunction functions_[8] = {};
};

}  // namespace

RefRowIntervals BuildRefIntervals(const Layout& layout, bool by_key, int tile) {
  const int64_t n = layout.num_tokens();
  // Every slice's interval of each of its rows (slices never share a visible pair, so a row's
  // intervals are disjoint; those of one document's slices may touch and are merged).
  auto for_each_interval = [&](auto&& emit) {
    for (const MaskSlice& s : layout.slices()) {
      if (!by_key) {
        for (int64_t q = s.q_begin; q < s.q_end; ++q) {
          const int64_t rel = q - s.q_begin;  // k - k_begin in [rel + diag_lo, rel + diag_hi]
          const int64_t lo = std::max(s.k_begin, s.k_begin + rel + s.diag_lo);
          const int64_t hi = std::min(s.k_end, s.k_begin + rel + s.diag_hi + 1);
          if (lo < hi) emit(q, lo, hi);
        }
      } else {
        for (int64_t k = s.k_begin; k < s.k_end; ++k) {
          const int64_t rel = k - s.k_begin;  // q - q_begin in [rel - diag_hi, rel - diag_lo]
          const int64_t lo = std::max(s.q_begin, s.q_begin + rel - s.diag_hi);
          const int64_t hi = std::min(s.q_end, s.q_begin + rel - s.diag_lo + 1);
          if (lo < hi) emit(k, lo, hi);
        }
      }
    }
  };
  std::vector<int64_t> count(n + 1, 0);
  for_each_interval([&](int64_t row, int64_t, int64_t) { ++count[row + 1]; });
  for (int64_t r = 0; r < n; ++r) count[r + 1] += count[r];
  std::vector<std::pair<int64_t, int64_t>> raw(count[n]);
  {
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for_each_interval([&](int64_t row, int64_t lo, int64_t hi) { raw[fill[row]++] = {lo, hi}; });
  }
  RefRowIntervals out;
  out.tile = std::max(tile, 1);
  out.row_offsets.reserve(n + 1);
  out.row_offsets.push_back(0);
  std::vector<std::pair<int64_t, int64_t>> row;
  for (int64_t r = 0; r < n; ++r) {
    row.assign(raw.begin() + count[r], raw.begin() + count[r + 1]);
    SortAndMerge(row);
    for (const auto& [lo, hi] : row) {
      out.lo.push_back(lo);
      out.hi.push_back(hi);
    }
    out.row_offsets.push_back(static_cast<int64_t>(out.lo.size()));
  }
  const int64_t tiles = (n + out.tile - 1) / out.tile;
  out.tile_offsets.reserve(tiles + 1);
  out.tile_offsets.push_back(static_cast<int64_t>(out.lo.size()));
  for (int64_t t = 0; t < tiles; ++t) {
    row.clear();
    const int64_t first = out.row_offsets[t * out.tile];
    const int64_t last = out.row_offsets[std::min(n, (t + 1) * out.tile)];
    for (int64_t i = first; i < last; ++i) row.emplace_back(out.lo[i], out.hi[i]);
    SortAndMerge(row);
    for (const auto& [lo, hi] : row) {
      out.lo.push_back(lo);
      out.hi.push_back(hi);
    }
    out.tile_offsets.push_back(static_cast<int64_t>(out.lo.size()));
  }
  return out;
}

RefLaunch RefLaunchOf(RefKernel kernel, RefArith arith, int head_dim, long long tokens, int heads_q,
                      int heads_kv) {
  const int vb = arith == RefArith::kExact ? 8 : 4;
  const int tile = hsap_dev::ref_tile(head_dim);
  const long long tiles = (tokens + tile - 1) / tile;
  RefLaunch l;
  switch (kernel) {
    case RefKernel::kForward:
      l.grid_x = static_cast<unsigned>(tiles);
      l.grid_y = static_cast<unsigned>(heads_q);
      l.smem_bytes = hsap_dev::ref_fwd_smem_bytes(head_dim, vb);
      break;
    case RefKernel::kDq:
      l.grid_x = static_cast<unsigned>(tiles);
      l.grid_y = static_cast<unsigned>(heads_q);
      l.smem_bytes = hsap_dev::ref_dq_smem_bytes(head_dim, vb);
      break;
    case RefKernel::kDkDv:
      l.grid_x = static_cast<unsigned>(tiles);
      l.grid_y = static_cast<unsigned>(heads_kv);
      l.smem_bytes = hsap_dev::ref_dkdv_smem_bytes(head_dim, vb);
      break;
    case RefKernel::kRowDot: {
      const long long items = tokens * heads_q;
      const long long ctas = (items + hsap_dev::kRefThreads - 1) / hsap_dev::kRefThreads;
      l.grid_x = static_cast<unsigned>(std::min<long long>(ctas, 1 << 16));  // grid-stride
      l.grid_y = 1;
      l.smem_bytes = 0;
      break;
    }
  }
  return l;
}

absl::StatusOr<std::unique_ptr<ReferenceKernels>> LoadJitReferenceKernels(DType dtype,
                                                                          int head_dim) {
  return JitReferenceKernels::Load(dtype, head_dim);
}

absl::StatusOr<GpuReferenceResult> RunGpuReference(Device& device, const ReferenceKernels& kernels,
                                                   const Layout& layout, const ReferenceInputs& in,
                                                   const void* dout,
                                                   const GpuReferenceOptions& options) {
  HSAP_RETURN_IF_ERROR(CheckArguments(kernels, layout, in, dout, options));
  const absl::Time start = absl::Now();
  const AttentionDims& dims = in.dims;
  const int64_t tokens = layout.num_tokens();
  const int hq = dims.heads_q, hkv = dims.heads_kv, d = dims.head_dim;
  const size_t q_elems = static_cast<size_t>(tokens) * hq * d;
  const size_t kv_elems = static_cast<size_t>(tokens) * hkv * d;
  const size_t row_values = static_cast<size_t>(hq) * tokens;
  const size_t esize = DTypeSize(in.dtype);

  ScopedDevice scoped(device);
  HSAP_RETURN_IF_ERROR(scoped.status());
  ScopedStream stream(device);
  HSAP_RETURN_IF_ERROR(stream.Create());
  const cudaStream s = stream.get();
  DeviceArena arena(device);

  const int tile = hsap_dev::ref_tile(d);
  const RefRowIntervals keys_of_query = BuildRefIntervals(layout, /*by_key=*/false, tile);
  RefRowIntervals queries_of_key;
  if (options.backward) queries_of_key = BuildRefIntervals(layout, /*by_key=*/true, tile);
  std::vector<int> kv_head_of_q(hq), q_head_offsets(hkv + 1, 0), q_heads;
  for (int h = 0; h < hq; ++h) {
    kv_head_of_q[h] = dims.KvHead(h);
    ++q_head_offsets[kv_head_of_q[h] + 1];
  }
  for (int g = 0; g < hkv; ++g) q_head_offsets[g + 1] += q_head_offsets[g];
  for (int g = 0; g < hkv; ++g) {
    for (int h = 0; h < hq; ++h) {
      if (kv_head_of_q[h] == g) q_heads.push_back(h);
    }
  }

  HSAP_ASSIGN_OR_RETURN(const hsap_dev::RefIntervals q_iv,
                        UploadIntervals(arena, keys_of_query, s));
  hsap_dev::RefIntervals k_iv{};
  if (options.backward) {
    HSAP_ASSIGN_OR_RETURN(k_iv, UploadIntervals(arena, queries_of_key, s));
  }
  HSAP_ASSIGN_OR_RETURN(const int* kv_head_of_q_dev, arena.Upload(kv_head_of_q, s));
  HSAP_ASSIGN_OR_RETURN(const int* q_head_offsets_dev, arena.Upload(q_head_offsets, s));
  HSAP_ASSIGN_OR_RETURN(const int* q_heads_dev, arena.Upload(q_heads, s));
  HSAP_ASSIGN_OR_RETURN(const void* q, arena.Upload(in.q, q_elems * esize, s));
  HSAP_ASSIGN_OR_RETURN(const void* k, arena.Upload(in.k, kv_elems * esize, s));
  HSAP_ASSIGN_OR_RETURN(const void* v, arena.Upload(in.v, kv_elems * esize, s));
  const void* dout_dev = nullptr;
  if (options.backward) {
    HSAP_ASSIGN_OR_RETURN(dout_dev, arena.Upload(dout, q_elems * esize, s));
  }
  HSAP_ASSIGN_OR_RETURN(double* out, arena.Allocate<double>(q_elems));
  HSAP_ASSIGN_OR_RETURN(double* lse, arena.Allocate<double>(row_values));
  HSAP_ASSIGN_OR_RETURN(double* row_max, arena.Allocate<double>(row_values));
  HSAP_ASSIGN_OR_RETURN(double* row_sum, arena.Allocate<double>(row_values));
  double *delta = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  if (options.backward) {
    HSAP_ASSIGN_OR_RETURN(delta, arena.Allocate<double>(row_values));
    HSAP_ASSIGN_OR_RETURN(dq, arena.Allocate<double>(q_elems));
    HSAP_ASSIGN_OR_RETURN(dk, arena.Allocate<double>(kv_elems));
    HSAP_ASSIGN_OR_RETURN(dv, arena.Allocate<double>(kv_elems));
  }

  GpuReferenceResult result;
  auto download = [&](std::vector<double>& into, const double* from, size_t count) {
    into.assign(count, 0.0);
    return count == 0 ? absl::OkStatus()
                      : device.CopyAsync(into.data(), from, count * sizeof(double), s);
  };
  std::vector<RefArith> ariths = {RefArith::kExact};
  if (options.rounded) ariths.push_back(RefArith::kRounded);
  for (RefArith arith : ariths) {
    const bool exact = arith == RefArith::kExact;
    ReferenceForwardResult& fwd = exact ? result.forward : result.naive_forward;
    ReferenceGradients& grad = exact ? result.backward : result.naive_backward;

    hsap_dev::RefFwdParams f{};
    f.q = q;
    f.k = k;
    f.v = v;
    f.out = out;
    f.lse = lse;
    f.row_max = row_max;
    f.row_sum = row_sum;
    f.keys_of_query = q_iv;
    f.kv_head_of_q = kv_head_of_q_dev;
    f.tokens = tokens;
    f.heads_q = hq;
    f.heads_kv = hkv;
    f.scale = dims.scale;
    HSAP_RETURN_IF_ERROR(kernels.Forward(arith, f, s));
    HSAP_RETURN_IF_ERROR(download(fwd.out, out, q_elems));
    HSAP_RETURN_IF_ERROR(download(fwd.lse, lse, row_values));
    if (!options.backward) continue;

    hsap_dev::RefRowDotParams r{};
    r.dout = dout_dev;
    r.out = out;
    r.delta = delta;
    r.tokens = tokens;
    r.heads_q = hq;
    HSAP_RETURN_IF_ERROR(kernels.RowDot(arith, r, s));

    hsap_dev::RefBwdParams b{};
    b.q = q;
    b.k = k;
    b.v = v;
    b.dout = dout_dev;
    b.lse = lse;
    b.row_max = row_max;
    b.row_sum = row_sum;
    b.delta = delta;
    b.dq = dq;
    b.dk = dk;
    b.dv = dv;
    b.keys_of_query = q_iv;
    b.queries_of_key = k_iv;
    b.kv_head_of_q = kv_head_of_q_dev;
    b.q_head_offsets = q_head_offsets_dev;
    b.q_heads = q_heads_dev;
    b.tokens = tokens;
    b.heads_q = hq;
    b.heads_kv = hkv;
    b.scale = dims.scale;
    HSAP_RETURN_IF_ERROR(kernels.Dq(arith, b, s));
    HSAP_RETURN_IF_ERROR(kernels.DkDv(arith, b, s));
    HSAP_RETURN_IF_ERROR(download(grad.dq, dq, q_elems));
    HSAP_RETURN_IF_ERROR(download(grad.dk, dk, kv_elems));
    HSAP_RETURN_IF_ERROR(download(grad.dv, dv, kv_elems));
  }
  HSAP_RETURN_IF_ERROR(
      device.Synchronize(s, absl::Now() + absl::Minutes(30), "the GPU reference attention"));
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

absl::StatusOr<GpuReferenceResult> GpuReference(const Layout& layout, const ReferenceInputs& in,
                                                const void* dout,
                                                const GpuReferenceOptions& options) {
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateCudaDevice());
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<ReferenceKernels> kernels,
                        LoadJitReferenceKernels(in.dtype, in.dims.head_dim));
  return RunGpuReference(*device, *kernels, layout, in, dout, options);
}

}  // namespace hsap::cuda
