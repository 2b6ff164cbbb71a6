// The CUDA kernel variants hsap ships, and compiling them.
//
// ShippedCudaConfigs() lists the configurations the CUDA runtime (issue 7) requests: the
// dtypes, head dims, GQA ratios, mask kinds and topology roles of the supported models (and
// one tensor-core variant with atomic dq, compiled so that its kernel stays checked). Each
// configuration is one NVRTC program holding all its kernels (forward, backward, delta,
// merge, init, convert, and the fused forward for roles with peers); the test suite
// compiles every one of them for sm_80 and sm_90 and checks that the cubin defines the
// kernels by their lowered names.
//
// Compiles go through the compile cache (jit/cache.h); CompileShippedCudaKernels also
// reports the NVRTC time of each variant, for the JIT bench.
#ifndef HSAP_JIT_CUDA_KERNELS_H_
#define HSAP_JIT_CUDA_KERNELS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "jit/codegen_cuda.h"
#include "jit/nvrtc.h"

namespace hsap::jit {

class CompileCache;

// The architectures with shipped cubins (others get PTX through CompileCudaKernels).
const std::vector<std::string>& ShippedCudaArchs();

// The shipped configurations for one architecture ("sm_80", "sm_90", ...).
std::vector<CudaKernelConfig> ShippedCudaConfigs(absl::string_view arch);

// What ptxas reports for one kernel of a cubin (NVRTC --ptxas-options=-v).
struct CudaKernelResources {
  std::string function;  // the lowered name
  int registers = 0;     // per thread
  int stack_frame_bytes = 0;
  int spill_store_bytes = 0, spill_load_bytes = 0;
  int static_smem_bytes = 0;
};

// The kernels of a ptxas verbose log, in the order of the log. InvalidArgument when an entry
// lacks its register count.
absl::StatusOr<std::vector<CudaKernelResources>> ParsePtxasResources(absl::string_view log);

// CTAs of `threads` threads, `registers` registers per thread (allocated per warp in units of
// 256) and `smem_bytes` of shared memory (plus the driver's 1 KiB per CTA on sm_80+) that fit
// on one SM of `arch`; `limiter` (may be null) names the binding resource: "registers",
// "threads", "CTA slots" or "shared memory".
int CudaCtasPerSm(int arch, int threads, int registers, int smem_bytes,
                  std::string* limiter = nullptr);

struct CompiledCudaKernels {
  CudaKernelSource source;
  CudaBinary binary;

  // ptxas' report of each kernel, in the order of source.kernels (CompileCudaKernels asks
  // ptxas for it). FailedPrecondition for PTX (no ptxas ran).
  absl::StatusOr<std::vector<CudaKernelResources>> Resources() const;

  // The entry of kernel `role` ("fwd", "bwd", ...) and its lowered name in the binary.
  absl::StatusOr<CudaKernelEntry> Entry(absl::string_view role) const;
  absl::StatusOr<std::string> LoweredName(absl::string_view role) const;
};

// Generates and compiles `config` (cubin, or PTX when `force_ptx` or when NVRTC has no cubin
// target for the arch), with ptxas' verbose report in the log. `cache` may be null (no
// caching).
absl::StatusOr<CompiledCudaKernels> CompileCudaKernels(const CudaKernelConfig& config,
                                                       CompileCache* cache, bool force_ptx = false);

// Checks that a cubin's ELF symbol table defines every kernel of `compiled` as a global
// function under its lowered name.
absl::Status VerifyCubinSymbols(const CompiledCudaKernels& compiled);

struct CudaVariantTiming {
  std::string name;        // CudaKernelConfig::Name()
  std::string target;      // "sm_90"
  double seconds = 0;      // NVRTC wall time; 0 when served by the cache
  double cpu_seconds = 0;  // NVRTC CPU time (what it costs on an idle machine)
  bool from_cache = false;
  size_t image_bytes = 0;
};

// Compiles every shipped configuration of `archs` with `threads` compile threads (>= 1),
// verifying each cubin's symbols. Returns the timings in the order of the configurations,
// or the first error.
absl::StatusOr<std::vector<CudaVariantTiming>> CompileShippedCudaKernels(
    const std::vector<std::string>& archs, CompileCache* cache, int threads);

}  // namespace hsap::jit

#endif  // HSAP_JIT_CUDA_KERNELS_H_
