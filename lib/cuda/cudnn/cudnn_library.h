// libcudnn.so.9, opened with dlopen like CUDA, NVRTC and NCCL (lib/cuda/runtime/cuda_loader.h),
// so that one libhsap.so runs with or without cuDNN; and what cuDNN offers on the current
// device, for the engine choice (engine_choice.h).
//
// Search: $HSAP_CUDA_LIB_PATH (only its directories; tests point it at an empty directory),
// else CudaLibrarySearchPath()'s defaults with /usr/local/cuda-13.0/lib before the default
// loader path. Only cudnnGetVersion is resolved here and no cuDNN header is needed; users of
// the graph API resolve their functions on the handle (cudnn_descriptors.h).
#ifndef HSAP_LIB_CUDA_CUDNN_CUDNN_LIBRARY_H_
#define HSAP_LIB_CUDA_CUDNN_CUDNN_LIBRARY_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/cuda/cudnn/engine_choice.h"

namespace hsap::cuda {

// The directories searched for libcudnn.so.9, in order ("" is the default loader path).
std::vector<std::string> CudnnLibrarySearchPath();

struct CudnnLibrary {
  void* handle = nullptr;  // dlopen's, never closed
  std::string path;        // what was opened
  int version = 0;         // cudnnGetVersion(), e.g. 91900
};

// Opened once per distinct search path and never unloaded. Unimplemented naming the paths
// tried (and the fix) when no libcudnn.so.9 opens, or when the library lacks cudnnGetVersion
// or is older than cuDNN 9.
absl::StatusOr<const CudnnLibrary*> OpenCudnnLibrary();

// cuDNN on the current CUDA device: `loaded` OK with the version and the device's compute
// capability, or the reason it is not there (no library, no GPU). Never fails otherwise.
CudnnAvailability ProbeCudnn();

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_CUDNN_CUDNN_LIBRARY_H_
