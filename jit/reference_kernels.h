// The NVRTC program of the GPU reference attention (jit/device/hsap_reference.cuh).
//
// One program per (storage dtype, head dim) holds eight kernels: ref_fwd_kernel,
// ref_rowdot_kernel, ref_dq_kernel and ref_dkdv_kernel, each in the exact (fp64) and the
// rounded (same-precision, NaiveForward/Backward) arithmetic. The source is a handful of
// explicit instantiations; the kernel bodies are the embedded hsap_reference.cuh (with
// hsap_device.cuh), given to NVRTC as in-memory headers. Compiles go through the compile
// cache like the attention kernels' (jit/nvrtc.h).
#ifndef HSAP_JIT_REFERENCE_KERNELS_H_
#define HSAP_JIT_REFERENCE_KERNELS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/dtype.h"
#include "jit/nvrtc.h"

namespace hsap::jit {

class CompileCache;

enum class RefKernel { kForward, kRowDot, kDq, kDkDv };
inline constexpr RefKernel kAllRefKernels[] = {RefKernel::kForward, RefKernel::kRowDot,
                                               RefKernel::kDq, RefKernel::kDkDv};

// The arithmetic of a reference kernel: fp64 (ReferenceForward/Backward) or every intermediate
// rounded to the storage dtype (NaiveForward/Backward).
enum class RefArith { kExact, kRounded };

// "fwd", "rowdot", "dq", "dkdv".
absl::string_view RefKernelName(RefKernel kernel);

// The name expression of one kernel, e.g.
// "hsap_dev::ref_fwd_kernel<hsap_dev::bf16, hsap_dev::RefExact, 128>".
std::string RefKernelExpression(RefKernel kernel, RefArith arith, DType dtype, int head_dim);

// Checks that the reference kernels take this head dim: [8, 256], a multiple of 8 (the
// attention kernels' range, attention/kernel.h, and smaller for tests). InvalidArgument
// otherwise.
absl::Status ValidateRefHeadDim(int head_dim);

// The program (source, headers, the eight name expressions) for `arch` ("sm_90", ...).
absl::StatusOr<CudaCompileRequest> ReferenceKernelsRequest(DType dtype, int head_dim,
                                                           absl::string_view arch);

// Compiles it (cubin, or PTX where NVRTC has no cubin target for `arch`) with ptxas' verbose
// report in the log. `cache` may be null (no caching).
absl::StatusOr<CudaBinary> CompileReferenceKernels(DType dtype, int head_dim,
                                                   absl::string_view arch, CompileCache* cache);

}  // namespace hsap::jit

#endif  // HSAP_JIT_REFERENCE_KERNELS_H_
