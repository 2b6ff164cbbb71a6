// Generator of the host attention kernels: C++ source of the partial-attention forward,
// backward and LSE merge (the contract of attention/kernel.h), specialised at compile time
// on the storage dtype, head dim, GQA ratio, tile sizes, whether any segment carries a
// diagonal band (lists with only full segments get no band-masking code), and the host ISA
// (AVX-512 or AVX2+FMA intrinsics, with register-blocked micro-kernels sized for it).
//
// The source is self-contained (<immintrin.h>, <math.h>, <stdint.h> and the ABI header
// jit/host_abi.h) and exports the extern "C" entry points listed in jit/host_abi.h. Every
// task is computed in a fixed order, so results are bitwise reproducible and independent
// of the number of threads.
#ifndef HSAP_JIT_CODEGEN_HOST_H_
#define HSAP_JIT_CODEGEN_HOST_H_

#include <string>

#include "absl/status/status.h"
#include "attention/dtype.h"

namespace hsap::jit {

enum class HostIsa { kAuto = 0, kAvx512 = 1, kAvx2 = 2 };

// The ISA this CPU runs (kAvx512 when it has AVX-512 F/BW/VL/DQ, else kAvx2); errors are
// reported by ValidateHostKernelSpec when not even AVX2+FMA+F16C is present.
HostIsa DetectHostIsa();
const char* HostIsaName(HostIsa isa);

struct HostKernelSpec {
  DType dtype = DType::kBF16;
  int head_dim = 128;
  int gqa_ratio = 1;       // heads_q / heads_kv
  bool band_masks = true;  // some segment is not full (causal, window, prefix-LM)
  int block_q = 64;        // query rows per task; work lists are cut to this
  int block_k = 64;        // keys per tile (packed K/V tiles)
  HostIsa isa = HostIsa::kAuto;

  friend bool operator==(const HostKernelSpec&, const HostKernelSpec&) = default;
};

// head_dim in [32, 256] and a multiple of 8; gqa_ratio in [1, 64]; block_q in [4, 256] and
// a multiple of 4; block_k in [16, 256] and a multiple of the vector width times 2; the
// ISA (after kAuto is resolved) runnable on this CPU.
absl::Status ValidateHostKernelSpec(const HostKernelSpec& spec);

// The spec with kAuto resolved.
HostKernelSpec ResolveHostKernelSpec(HostKernelSpec spec);

// Register blocking chosen for a spec (also compiled into the source).
struct HostKernelTiling {
  int vector_width = 16;  // fp32 lanes
  int padded_head_dim = 0;
  int ra = 6, ca = 4;  // S = A.B^T micro-kernel: ra rows x ca vectors of keys
  int rb = 4, cb = 4;  // C += P.B micro-kernel: rb rows x cb vectors of head dim
  int spare_rows = 6;  // zero rows an fp32 q/dout copy needs after its last row
  int64_t scratch_floats = 0;
};
HostKernelTiling TilingFor(const HostKernelSpec& resolved_spec);

// The C++ source for `spec` (kAuto resolved). Does not validate: an unsupported head dim
// yields source whose static_assert fails at compile time (tests use this).
std::string GenerateHostKernelSource(const HostKernelSpec& spec);

}  // namespace hsap::jit

#endif  // HSAP_JIT_CODEGEN_HOST_H_
