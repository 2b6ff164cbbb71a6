// The JIT CUDA kernels of one configuration, loaded on the current CUDA device.
//
// Generates and compiles the configuration with NVRTC (jit/cuda_kernels.h, through the
// compile cache: a cubin for the device's architecture, or PTX the driver finishes when
// NVRTC has no cubin target for it), loads the image with cuModuleLoadData, looks the
// kernels up by their lowered names, raises the dynamic shared memory limit of the
// attention kernels to what their tiles need, and launches them with cuLaunchKernel
// (grids as hsap_params.cuh says; the row-wise helpers use at most 8 CTAs per SM).
#ifndef HSAP_LIB_CUDA_EXEC_JIT_DEVICE_KERNELS_H_
#define HSAP_LIB_CUDA_EXEC_JIT_DEVICE_KERNELS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "jit/codegen_cuda.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::cuda {

// `config.arch` empty: the current device's (CurrentCudaArch; JitArchForDevice below). Unimplemented without a
// CUDA device or NVRTC; the compile or load error otherwise.
absl::StatusOr<std::unique_ptr<DeviceKernels>> LoadJitDeviceKernels(jit::CudaKernelConfig config);

// The architecture the JIT compiles `config` for on a GPU of `device_arch`: with
// HSAP_JIT_SM90A=1, jit::JitCudaArch ("sm_90a" on compute capability 9.0 where the wgmma/TMA
// forward applies); else (the default, until that forward has run on a GPU) `device_arch`.
// InvalidArgument naming the variable when its value is not a boolean.
absl::StatusOr<std::string> JitArchForDevice(const std::string& device_arch,
                                             const jit::CudaKernelConfig& config);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_JIT_DEVICE_KERNELS_H_
