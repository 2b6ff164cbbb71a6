// CUDA runtime, CUDA driver and NCCL, loaded at run time.
//
// libhsap never links a CUDA library: the three libraries are dlopen()ed on first use, so
// one libhsap.so runs the host backend on machines without them. The C types we need are
// declared here (opaque pointers and ints), so no CUDA header is needed to build.
//
// Search. When $HSAP_CUDA_LIB_PATH is set, only its directories (colon-separated) are
// tried -- tests point it at an empty directory to simulate a machine without CUDA.
// Otherwise: $CUDA_HOME/lib64, $CUDA_HOME/lib, /usr/local/cuda/lib64, /usr/local/cuda/lib,
// then the default loader path. Names tried: libcudart.so.13/.12/.so, libcuda.so.1,
// libnccl.so.2.
//
// Every missing piece is absl::UnimplementedError (hsapUnsupported at the C ABI) whose
// message says what is missing: "libcuda.so.1 not found: no NVIDIA driver", "no CUDA
// device", "libnccl.so.2 not found", "libcudart not found".
#ifndef HSAP_LIB_CUDA_RUNTIME_CUDA_LOADER_H_
#define HSAP_LIB_CUDA_RUNTIME_CUDA_LOADER_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsap::cuda {

// CUDA runtime types (ABI-compatible stand-ins).
using cudaError = int;  // 0: cudaSuccess; 600: cudaErrorNotReady
using cudaStream = struct CUstream_st*;
using cudaEvent = struct CUevent_st*;
inline constexpr cudaError kCudaSuccess = 0;
inline constexpr cudaError kCudaErrorNotReady = 600;
// cudaMemcpyKind.
inline constexpr int kCudaMemcpyHostToHost = 0;
inline constexpr int kCudaMemcpyHostToDevice = 1;
inline constexpr int kCudaMemcpyDeviceToHost = 2;
inline constexpr int kCudaMemcpyDeviceToDevice = 3;
inline constexpr int kCudaMemcpyDefault = 4;
inline constexpr unsigned kCudaStreamNonBlocking = 1;
inline constexpr unsigned kCudaEventDisableTiming = 2;
inline constexpr int kCudaDevAttrMultiProcessorCount = 16;
inline constexpr int kCudaDevAttrComputeCapabilityMajor = 75;
inline constexpr int kCudaDevAttrComputeCapabilityMinor = 76;

// cudaIpcMemHandle_t: 64 opaque bytes, passed by value.
struct CudaIpcMemHandle {
  char reserved[64];
};
inline constexpr unsigned kCudaIpcMemLazyEnablePeerAccess = 1;
inline constexpr int kCudaDevP2PAttrNativeAtomicSupported = 3;

struct CudaRuntimeApi {
  std::string path;
  cudaError (*GetDeviceCount)(int*) = nullptr;
  cudaError (*SetDevice)(int) = nullptr;
  cudaError (*GetDevice)(int*) = nullptr;
  const char* (*GetErrorString)(cudaError) = nullptr;
  cudaError (*Malloc)(void**, size_t) = nullptr;
  cudaError (*Free)(void*) = nullptr;
  cudaError (*Memcpy)(void*, const void*, size_t, int) = nullptr;
  cudaError (*MemcpyAsync)(void*, const void*, size_t, int, cudaStream) = nullptr;
  cudaError (*MemsetAsync)(void*, int, size_t, cudaStream) = nullptr;
  cudaError (*StreamCreateWithFlags)(cudaStream*, unsigned) = nullptr;
  cudaError (*StreamDestroy)(cudaStream) = nullptr;
  cudaError (*StreamSynchronize)(cudaStream) = nullptr;
  cudaError (*StreamWaitEvent)(cudaStream, cudaEvent, unsigned) = nullptr;
  cudaError (*EventCreateWithFlags)(cudaEvent*, unsigned) = nullptr;
  cudaError (*EventDestroy)(cudaEvent) = nullptr;
  cudaError (*EventRecord)(cudaEvent, cudaStream) = nullptr;
  cudaError (*EventQuery)(cudaEvent) = nullptr;
  cudaError (*EventSynchronize)(cudaEvent) = nullptr;
  cudaError (*EventElapsedTime)(float*, cudaEvent, cudaEvent) = nullptr;
  cudaError (*DeviceSynchronize)() = nullptr;
  cudaError (*DeviceGetAttribute)(int*, int, int) = nullptr;  // (value, cudaDeviceAttr, device)
  cudaError (*DeviceGetPCIBusId)(char*, int, int) = nullptr;
  cudaError (*DeviceGetByPCIBusId)(int*, const char*) = nullptr;
  cudaError (*DeviceCanAccessPeer)(int*, int, int) = nullptr;
  cudaError (*DeviceGetP2PAttribute)(int*, int, int, int) = nullptr;  // (value, attr, src, dst)
  cudaError (*IpcGetMemHandle)(CudaIpcMemHandle*, void*) = nullptr;
  cudaError (*IpcOpenMemHandle)(void**, CudaIpcMemHandle, unsigned) = nullptr;
  cudaError (*IpcCloseMemHandle)(void*) = nullptr;

  // "cudaMalloc(1024 bytes) failed: out of memory (2)" style message; OK for success.
  absl::Status Check(cudaError e, absl::string_view what) const;
};

// Makes `device` the calling thread's current CUDA device (cudaSetDevice of `rt`) for the
// scope, and the device current before again at its end. A device's streams and events are
// its own ("streams and events are created in association with the currently set device",
// and an event is recorded only on a stream of its device), so code that owns streams of one
// device makes that device current before it creates or records events for them, whatever
// device the calling thread had current. status(): the cudaGetDevice / cudaSetDevice result.
class CudaDeviceScope {
 public:
  CudaDeviceScope(const CudaRuntimeApi& rt, int device);
  ~CudaDeviceScope();
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  const CudaRuntimeApi& rt_;
  int previous_ = -1;  // -1: nothing to restore
  absl::Status status_;
};

// CUDA driver API (kernels of the JIT: module load and launch).
using CUresult = int;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUcontext = struct CUctx_st*;
struct CudaDriverApi {
  std::string path;
  CUresult (*Init)(unsigned) = nullptr;
  CUresult (*CtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*CtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleUnload)(CUmodule) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction, int, int) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, cudaStream, void**, void**) = nullptr;
  // (numBlocks, function, blockSize, dynamicSMemSize)
  CUresult (*OccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t) = nullptr;
  // Stream memory operations (stream, CUdeviceptr, value, flags), the _v2 entry points.
  CUresult (*StreamWriteValue32)(cudaStream, unsigned long long, unsigned, unsigned) = nullptr;
  CUresult (*StreamWaitValue32)(cudaStream, unsigned long long, unsigned, unsigned) = nullptr;
  // What a device is (CUdevice is an int): its handle by ordinal, name and memory.
  CUresult (*DeviceGet)(int*, int) = nullptr;
  CUresult (*DeviceGetName)(char*, int, int) = nullptr;
  CUresult (*DeviceTotalMem)(size_t*, int) = nullptr;  // cuDeviceTotalMem_v2
  // cuTensorMapEncodeTiled (CUDA 12.0+; null when the driver lacks it): (tensorMap,
  // CUtensorMapDataType, tensorRank, globalAddress, globalDim, globalStrides, boxDim,
  // elementStrides, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
  // CUtensorMapFloatOOBfill); the enums are C ints. Use lib/cuda/runtime/tensor_map.h.
  CUresult (*TensorMapEncodeTiled)(void*, int, unsigned, void*, const unsigned long long*,
                                   const unsigned long long*, const unsigned*, const unsigned*,
                                   int, int, int, int) = nullptr;
  absl::Status Check(CUresult r, absl::string_view what) const;
};
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
inline constexpr int kCuFuncAttributeMaxDynamicSharedSize = 8;
// CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0; CU_STREAM_WRITE_VALUE_DEFAULT.
inline constexpr unsigned kCuStreamWaitValueGeq = 0;
inline constexpr unsigned kCuStreamWriteValueDefault = 0;

// NCCL types.
using ncclResult = int;  // 0: ncclSuccess; 7: ncclInProgress
using ncclComm = struct hsapNcclCommOpaque*;
inline constexpr ncclResult kNcclSuccess = 0;
inline constexpr ncclResult kNcclInProgress = 7;
inline constexpr int kNcclUint8 = 1;  // ncclUint8
inline constexpr int kNcclSplitNoColor = -1;
// ncclUniqueId: 128 opaque bytes.
struct NcclUniqueId {
  char internal[128];
};

struct NcclApi {
  std::string path;
  int version = 0;  // ncclGetVersion: e.g. 22809
  ncclResult (*GetVersion)(int*) = nullptr;
  const char* (*GetErrorString)(ncclResult) = nullptr;
  const char* (*GetLastError)(ncclComm) = nullptr;  // may be null (old NCCL)
  ncclResult (*GetUniqueId)(NcclUniqueId*) = nullptr;
  ncclResult (*CommInitRank)(ncclComm*, int, NcclUniqueId, int) = nullptr;
  ncclResult (*CommDestroy)(ncclComm) = nullptr;
  ncclResult (*CommAbort)(ncclComm) = nullptr;
  ncclResult (*CommGetAsyncError)(ncclComm, ncclResult*) = nullptr;
  ncclResult (*CommCount)(ncclComm, int*) = nullptr;
  ncclResult (*CommUserRank)(ncclComm, int*) = nullptr;
  ncclResult (*CommCuDevice)(ncclComm, int*) = nullptr;  // the communicator's CUDA device
  // ncclCommSplit(comm, color, key, newcomm, config): config may be null.
  ncclResult (*CommSplit)(ncclComm, int, int, ncclComm*, void*) = nullptr;
  ncclResult (*Send)(const void*, size_t, int, int, ncclComm, cudaStream) = nullptr;
  ncclResult (*Recv)(void*, size_t, int, int, ncclComm, cudaStream) = nullptr;
  ncclResult (*GroupStart)() = nullptr;
  ncclResult (*GroupEnd)() = nullptr;

  absl::Status Check(ncclResult r, absl::string_view what) const;
};

// The directories searched (see above), in order; "" stands for the default loader path.
std::vector<std::string> CudaLibrarySearchPath();

// Each loaded once per distinct search path and never unloaded. Unimplemented when the
// library (or one of its symbols) is missing.
absl::StatusOr<const CudaRuntimeApi*> LoadCudaRuntime();
absl::StatusOr<const CudaDriverApi*> LoadCudaDriver();  // also calls cuInit(0)
absl::StatusOr<const NcclApi*> LoadNccl();

// OK when a GPU path can run: the driver loads, the runtime loads, and at least one CUDA
// device is visible. Otherwise Unimplemented naming what is missing.
absl::Status CheckCudaDevice();
// CheckCudaDevice() and NCCL loads.
absl::Status CheckNcclDevice();
// Number of visible CUDA devices; Unimplemented as above.
absl::StatusOr<int> CudaDeviceCount();

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_RUNTIME_CUDA_LOADER_H_
