#include "lib/cuda/runtime/cuda_loader.h"

#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/params.h"
#include "base/status_macros.h"

namespace hsap::cuda {
namespace {

// dlopen of the first of `names` found in the search path, or Unimplemented naming the
// places tried.
absl::StatusOr<void*> OpenFirst(const std::vector<std::string>& names, absl::string_view what,
                                std::string* path) {
  std::vector<std::string> tried;
  for (const std::string& dir : CudaLibrarySearchPath()) {
    for (const std::string& name : names) {
      const std::string candidate = dir.empty() ? name : absl::StrCat(dir, "/", name);
      void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) {
        *path = candidate;
        return handle;
      }
      tried.push_back(candidate);
    }
  }
  return absl::UnimplementedError(
      absl::StrCat(names.front(), " not found: ", what, " (tried ", absl::StrJoin(tried, ", "),
                   "; set $HSAP_CUDA_LIB_PATH to the directory that holds it)"));
}

template <typename F>
absl::Status Bind(void* handle, const char* symbol, const std::string& path, F* out,
                  bool optional = false) {
  void* p = dlsym(handle, symbol);
  if (p == nullptr && !optional) {
    return absl::UnimplementedError(
        absl::StrCat(path, " lacks ", symbol, ": the library is too old or not the real one"));
  }
  *out = reinterpret_cast<F>(p);
  return absl::OkStatus();
}

#define HSAP_BIND(handle, api, field, symbol) \
  if (absl::Status s = Bind(handle, symbol, api->path, &api->field); !s.ok()) return s

// One loaded instance per (library kind, search path), kept for the process' lifetime.
template <typename Api>
absl::StatusOr<const Api*> LoadOnce(absl::StatusOr<std::unique_ptr<Api>> (*load)()) {
  static std::mutex mu;
  static auto* cache = new std::map<std::string, absl::StatusOr<const Api*>>();
  const std::string key = absl::StrJoin(CudaLibrarySearchPath(), ":");
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  absl::StatusOr<std::unique_ptr<Api>> api = load();
  absl::StatusOr<const Api*> result =
      api.ok() ? absl::StatusOr<const Api*>(api->release()) : api.status();
  cache->emplace(key, result);
  return result;
}

absl::StatusOr<std::unique_ptr<CudaRuntimeApi>> LoadRuntimeImpl() {
  auto api = std::make_unique<CudaRuntimeApi>();
  HSAP_ASSIGN_OR_RETURN(void* h, OpenFirst({"libcudart.so.13", "libcudart.so.12", "libcudart.so"},
                                           "libcudart not found: no CUDA runtime", &api->path));
  void* handle = h;
  HSAP_BIND(handle, api, GetDeviceCount, "cudaGetDeviceCount");
  HSAP_BIND(handle, api, SetDevice, "cudaSetDevice");
  HSAP_BIND(handle, api, GetDevice, "cudaGetDevice");
  HSAP_BIND(handle, api, GetErrorString, "cudaGetErrorString");
  HSAP_BIND(handle, api, Malloc, "cudaMalloc");
  HSAP_BIND(handle, api, Free, "cudaFree");
  HSAP_BIND(handle, api, Memcpy, "cudaMemcpy");
  HSAP_BIND(handle, api, MemcpyAsync, "cudaMemcpyAsync");
  HSAP_BIND(handle, api, MemsetAsync, "cudaMemsetAsync");
  HSAP_BIND(handle, api, StreamCreateWithFlags, "cudaStreamCreateWithFlags");
  HSAP_BIND(handle, api, StreamDestroy, "cudaStreamDestroy");
  HSAP_BIND(handle, api, StreamSynchronize, "cudaStreamSynchronize");
  HSAP_BIND(handle, api, StreamWaitEvent, "cudaStreamWaitEvent");
  HSAP_BIND(handle, api, EventCreateWithFlags, "cudaEventCreateWithFlags");
  HSAP_BIND(handle, api, EventDestroy, "cudaEventDestroy");
  HSAP_BIND(handle, api, EventRecord, "cudaEventRecord");
  HSAP_BIND(handle, api, EventQuery, "cudaEventQuery");
  HSAP_BIND(handle, api, EventSynchronize, "cudaEventSynchronize");
  HSAP_BIND(handle, api, EventElapsedTime, "cudaEventElapsedTime");
  HSAP_BIND(handle, api, DeviceSynchronize, "cudaDeviceSynchronize");
  HSAP_BIND(handle, api, DeviceGetAttribute, "cudaDeviceGetAttribute");
  HSAP_BIND(handle, api, DeviceGetPCIBusId, "cudaDeviceGetPCIBusId");
  HSAP_BIND(handle, api, DeviceGetByPCIBusId, "cudaDeviceGetByPCIBusId");
  HSAP_BIND(handle, api, DeviceCanAccessPeer, "cudaDeviceCanAccessPeer");
  HSAP_BIND(handle, api, DeviceGetP2PAttribute, "cudaDeviceGetP2PAttribute");
  HSAP_BIND(handle, api, IpcGetMemHandle, "cudaIpcGetMemHandle");
  HSAP_BIND(handle, api, IpcOpenMemHandle, "cudaIpcOpenMemHandle");
  HSAP_BIND(handle, api, IpcCloseMemHandle, "cudaIpcCloseMemHandle");
  return api;
}

absl::StatusOr<std::unique_ptr<CudaDriverApi>> LoadDriverImpl() {
  auto api = std::make_unique<CudaDriverApi>();
  HSAP_ASSIGN_OR_RETURN(void* h, OpenFirst({"libcuda.so.1"}, "no NVIDIA driver", &api->path));
  void* handle = h;
  HSAP_BIND(handle, api, Init, "cuInit");
  HSAP_BIND(handle, api, GetErrorString, "cuGetErrorString");
  HSAP_BIND(handle, api, CtxGetCurrent, "cuCtxGetCurrent");
  HSAP_BIND(handle, api, CtxSetCurrent, "cuCtxSetCurrent");
  HSAP_BIND(handle, api, ModuleLoadData, "cuModuleLoadData");
  HSAP_BIND(handle, api, ModuleUnload, "cuModuleUnload");
  HSAP_BIND(handle, api, ModuleGetFunction, "cuModuleGetFunction");
  HSAP_BIND(handle, api, FuncSetAttribute, "cuFuncSetAttribute");
  HSAP_BIND(handle, api, LaunchKernel, "cuLaunchKernel");
  HSAP_BIND(handle, api, OccupancyMaxActiveBlocksPerMultiprocessor,
            "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  HSAP_BIND(handle, api, StreamWriteValue32, "cuStreamWriteValue32_v2");
  HSAP_BIND(handle, api, StreamWaitValue32, "cuStreamWaitValue32_v2");
  HSAP_BIND(handle, api, DeviceGet, "cuDeviceGet");
  HSAP_BIND(handle, api, DeviceGetName, "cuDeviceGetName");
  HSAP_BIND(handle, api, DeviceTotalMem, "cuDeviceTotalMem_v2");
  // Optional: only the sm_90a kernels need it, and EncodeTiledTensorMap says so when absent.
  if (absl::Status s = Bind(handle, "cuTensorMapEncodeTiled", api->path,
                            &api->TensorMapEncodeTiled, /*optional=*/true);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = api->Check(api->Init(0), "cuInit(0)"); !s.ok()) {
    // A driver without a usable device (or a stub library) is "no CUDA device".
    return absl::UnimplementedError(absl::StrCat("no CUDA device: ", s.message()));
  }
  return api;
}

absl::StatusOr<std::unique_ptr<NcclApi>> LoadNcclImpl() {
  auto api = std::make_unique<NcclApi>();
  HSAP_ASSIGN_OR_RETURN(void* h, OpenFirst({"libnccl.so.2"}, "no NCCL", &api->path));
  void* handle = h;
  HSAP_BIND(handle, api, GetVersion, "ncclGetVersion");
  HSAP_BIND(handle, api, GetErrorString, "ncclGetErrorString");
  HSAP_RETURN_IF_ERROR(Bind(handle, "ncclGetLastError", api->path, &api->GetLastError, true));
  HSAP_BIND(handle, api, GetUniqueId, "ncclGetUniqueId");
  HSAP_BIND(handle, api, CommInitRank, "ncclCommInitRank");
  HSAP_BIND(handle, api, CommDestroy, "ncclCommDestroy");
  HSAP_BIND(handle, api, CommAbort, "ncclCommAbort");
  HSAP_BIND(handle, api, CommGetAsyncError, "ncclCommGetAsyncError");
  HSAP_BIND(handle, api, CommCount, "ncclCommCount");
  HSAP_BIND(handle, api, CommUserRank, "ncclCommUserRank");
  HSAP_BIND(handle, api, CommCuDevice, "ncclCommCuDevice");
  HSAP_BIND(handle, api, CommSplit, "ncclCommSplit");
  HSAP_BIND(handle, api, Send, "ncclSend");
  HSAP_BIND(handle, api, Recv, "ncclRecv");
  HSAP_BIND(handle, api, GroupStart, "ncclGroupStart");
  HSAP_BIND(handle, api, GroupEnd, "ncclGroupEnd");
  HSAP_RETURN_IF_ERROR(api->Check(api->GetVersion(&api->version), "ncclGetVersion"));
  return api;
}

#undef HSAP_BIND

}  // namespace

absl::Status CudaRuntimeApi::Check(cudaError e, absl::string_view what) const {
  if (e == kCudaSuccess) return absl::OkStatus();
  const char* text = GetErrorString != nullptr ? GetErrorString(e) : nullptr;
  std::string msg = absl::StrCat(what, " failed: ", text != nullptr ? text : "unknown error",
                                 " (cudaError ", e, ")");
  if (e == 2) return absl::ResourceExhaustedError(msg);  // cudaErrorMemoryAllocation
  return absl::InternalError(msg);
}

CudaDeviceScope::CudaDeviceScope(const CudaRuntimeApi& rt, int device) : rt_(rt) {
  int current = -1;
  status_ = rt.Check(rt.GetDevice(&current), "cudaGetDevice");
  if (!status_.ok() || current == device) return;
  status_ = rt.Check(rt.SetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  if (status_.ok()) previous_ = current;
}

CudaDeviceScope::~CudaDeviceScope() {
  if (previous_ >= 0) rt_.SetDevice(previous_);
}

absl::Status CudaDriverApi::Check(CUresult r, absl::string_view what) const {
  if (r == 0) return absl::OkStatus();
  const char* text = nullptr;
  if (GetErrorString != nullptr) GetErrorString(r, &text);
  return absl::InternalError(
      absl::StrCat(what, " failed: ", text != nullptr ? text : "unknown", " (CUresult ", r, ")"));
}

absl::Status NcclApi::Check(ncclResult r, absl::string_view what) const {
  if (r == kNcclSuccess) return absl::OkStatus();
  const char* text = GetErrorString != nullptr ? GetErrorString(r) : nullptr;
  std::string msg = absl::StrCat(what, " failed: ", text != nullptr ? text : "unknown error",
                                 " (ncclResult ", r, ")");
  if (GetLastError != nullptr) {
    const char* last = GetLastError(nullptr);
    if (last != nullptr && last[0] != '\0') absl::StrAppend(&msg, ": ", last);
  }
  return absl::InternalError(msg);
}

std::vector<std::string> CudaLibrarySearchPath() {
  if (const std::optional<std::string> only = GetParam(Param::kCudaLibPath); only.has_value()) {
    std::vector<std::string> dirs;
    for (absl::string_view d : absl::StrSplit(*only, ':', absl::SkipEmpty())) {
      dirs.emplace_back(d.data(), d.size());
    }
    // An empty or blank variable still means "only these": none.
    if (dirs.empty()) dirs.push_back("/nonexistent-hsap-cuda-lib-path");
    return dirs;
  }
  std::vector<std::string> dirs;
  if (const std::string home = GetStringParam(Param::kCudaHome); !home.empty()) {
    dirs.push_back(absl::StrCat(home, "/lib64"));
    dirs.push_back(absl::StrCat(home, "/lib"));
  }
  for (const char* d : {"/usr/local/cuda/lib64", "/usr/local/cuda/lib"}) {
    if (std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  }
  dirs.push_back("");
  return dirs;
}

absl::StatusOr<const CudaRuntimeApi*> LoadCudaRuntime() {
  return LoadOnce<CudaRuntimeApi>(&LoadRuntimeImpl);
}
absl::StatusOr<const CudaDriverApi*> LoadCudaDriver() {
  return LoadOnce<CudaDriverApi>(&LoadDriverImpl);
}
absl::StatusOr<const NcclApi*> LoadNccl() { return LoadOnce<NcclApi>(&LoadNcclImpl); }

absl::StatusOr<int> CudaDeviceCount() {
  // The driver first: without it cudart only says "insufficient driver".
  if (absl::StatusOr<const CudaDriverApi*> d = LoadCudaDriver(); !d.ok()) return d.status();
  HSAP_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
  int count = 0;
  const cudaError e = rt->GetDeviceCount(&count);
  if (e != kCudaSuccess) {
    return absl::UnimplementedError(absl::StrCat(
        "no CUDA device: cudaGetDeviceCount failed: ", rt->GetErrorString(e), " (", e, ")"));
  }
  return count;
}

absl::Status CheckCudaDevice() {
  HSAP_ASSIGN_OR_RETURN(int count, CudaDeviceCount());
  if (count < 1) return absl::UnimplementedError("no CUDA device: cudaGetDeviceCount is 0");
  return absl::OkStatus();
}

absl::Status CheckNcclDevice() {
  HSAP_RETURN_IF_ERROR(CheckCudaDevice());
  return LoadNccl().status();
}

}  // namespace hsap::cuda
