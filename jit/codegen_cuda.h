// The CUDA kernel generator: one CUDA C++ translation unit per kernel configuration.
//
// A configuration fixes what changes code: architecture, storage dtype, head dim, GQA ratio,
// tile shapes, whether banded (causal / sliding-window / prefix-LM) segments can occur, and
// the topology role (the number of peers, which sizes the fused kernel's step array). Sequence
// lengths, offsets and work lists stay runtime arguments (the Params structs of
// jit/device/hsap_params.cuh), so a new packed layout never recompiles.
//
// The generated source is short: a `HsapCfg` struct of compile-time constants, the includes
// of our device headers (jit/device/*.cuh, embedded in the library, given to NVRTC as
// in-memory headers) and explicit instantiations of the kernel templates of
// hsap_attention.cuh. Each kernel is named by a name expression (e.g.
// "hsap_dev::attn_fwd_kernel<HsapCfg>") whose lowered name the runtime looks up in the cubin.
#ifndef HSAP_JIT_CODEGEN_CUDA_H_
#define HSAP_JIT_CODEGEN_CUDA_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/dtype.h"

namespace hsap::jit {

// The group-topology role of a rank for the fused kernels.
struct CudaTopologyRole {
  int num_peers = 0;  // other ranks this rank receives K/V from (0..15)

  friend bool operator==(const CudaTopologyRole&, const CudaTopologyRole&) = default;
};

// The arithmetic of the attention kernels ("fwd", "bwd", "fused_fwd").
//   kFma:        fp32 FMA loops over fp32 shared-memory tiles (hsap_attention.cuh); every
//                dtype and head dim, sm_70 and up.
//   kTensorCore: mma.sync m16n8k16 on bf16/f16 operands with fp32 accumulation, ldmatrix
//                fragment loads and cp.async K/V pipelines (hsap_attention_mma_*.cuh); bf16
//                and f16, head dims that are multiples of 16 in [64, 256], sm_80 and up.
//   kAuto:       kTensorCore where it applies, else kFma (ResolveCudaMath). fp32 stays on
//                kFma: TF32 would round the scores to 10 mantissa bits, which fp32 callers
//                have not asked for.
enum class CudaMath { kAuto, kFma, kTensorCore };

struct CudaKernelConfig {
  std::string arch = "sm_90";  // sm_XX, or sm_90a for the sm_90a forward (JitCudaArch)
  DType dtype = DType::kBF16;
  int head_dim = 128;
  int gqa = 1;           // heads_q / heads_kv (a runtime kv_head_of_q map may override)
  bool has_band = true;  // false: work lists hold only full segments
  CudaTopologyRole role;
  CudaMath math = CudaMath::kAuto;
  // Tile shapes; 0 = chosen by ChooseCudaTiles.
  int block_m = 0, block_n = 0, threads = 0;
  int bwd_block_m = 0, bwd_block_n = 0, bwd_threads = 0;
  // Tensor-core backward only: dq reduced in a fixed order (query-major pass, bitwise
  // reproducible) when true, fp32 atomicAdd from the key-major pass (fewer flops, not
  // reproducible) when false. The FMA backward ignores it (its dq is always deterministic).
  bool deterministic_dq = true;
  // Emit the source even if the configuration is unsupported (tests: the device code's
  // static_asserts must then fail the compile with a clear log).
  bool skip_validation = false;

  // A short identifier, e.g. "sm90_bf16_d128_g8_band_p3_tc" ("_tc": tensor-core math;
  // "_fma": the FMA kernels forced where tensor cores would apply).
  std::string Name() const;
};

struct CudaTiles {
  int block_m = 0, block_n = 0, threads = 0;
  int bwd_block_m = 0, bwd_block_n = 0, bwd_threads = 0;
  int fwd_smem_bytes = 0, bwd_smem_bytes = 0;  // dynamic shared memory per CTA
  // Tensor-core forward: depth of the cp.async K/V ring, and whether Q's A fragments stay in
  // registers for a whole query chunk (else re-read from shared memory per k-step). 0/false
  // for the FMA kernels.
  int fwd_stages = 0;
  bool q_in_registers = false;
  // "bwd" is the tensor-core backward (hsap_attention_mma_bwd.cuh): the math resolves to
  // kTensorCore and its tiles fit the architecture's shared memory.
  bool bwd_tensor_core = false;
  // "fwd" is the sm_90a forward (hsap_attention_wgmma_fwd.cuh, CudaWgmmaForwardApplies):
  // 128 query rows per CTA of 384 threads (a TMA producer warpgroup, two wgmma consumer
  // warpgroups of 64 rows each), wgmma_block_n keys per K/V tile, a ring of wgmma_stages
  // K/V tiles, wgmma_smem_bytes of dynamic shared memory; "fused_fwd" (roles with peers) is
  // then fused_fwd_wgmma_kernel, the same CTAs plus copy CTAs, one launch per step. The
  // fields above (block_m, fwd_smem_bytes, ...) still describe the mma.sync core.
  bool wgmma_fwd = false;
  int wgmma_block_n = 0, wgmma_stages = 0, wgmma_smem_bytes = 0;
  // "bwd" is the sm_90a backward (hsap_attention_wgmma_bwd.cuh, CudaWgmmaBackwardApplies): a
  // producer and two consumer warpgroups; key items of 128 keys (64 per consumer) over query
  // tiles of wgmma_bwd_block_m rows, dq chunks of 128 rows over key tiles of as many keys,
  // loaded by TMA in boxes of wgmma_bwd_box_rows rows (WgmmaBwdBoxRows);
  // wgmma_bwd_smem_bytes of dynamic shared memory.
  bool wgmma_bwd = false;
  int wgmma_bwd_block_m = 0, wgmma_bwd_box_rows = 0, wgmma_bwd_smem_bytes = 0;
};

// Whether `config` can use the tensor-core kernels: bf16 or f16, head dim a multiple of 16 in
// [64, 256], sm_80 or newer.
bool CudaTensorCoreApplies(const CudaKernelConfig& config);

// The math the kernels of `config` use: kFma when asked for or when tensor cores do not
// apply (an explicit kTensorCore that does not apply fails ValidateCudaKernelConfig),
// kTensorCore otherwise. Never kAuto.
CudaMath ResolveCudaMath(const CudaKernelConfig& config);

// Whether the "fwd" kernel of `config` is the sm_90a forward (wgmma, TMA, warp-specialized;
// hsap_attention_wgmma_fwd.cuh): arch "sm_90a", tensor-core math, head dim 64, 128 or 256
// (the TMA boxes and wgmma operands are 64-element panels of the head dim). Other head dims
// on sm_90a keep the mma.sync forward.
bool CudaWgmmaForwardApplies(const CudaKernelConfig& config);

// Whether the "bwd" kernel of `config` is the sm_90a backward (wgmma, TMA;
// hsap_attention_wgmma_bwd.cuh): arch "sm_90a", tensor-core math, head dim 64 or 128,
// deterministic dq, and no explicit backward tiles. Other configurations on sm_90a keep the
// mma.sync backward.
bool CudaWgmmaBackwardApplies(const CudaKernelConfig& config);

// The rows of the sm_90a backward's TMA boxes (all four tensors) for its stage tile of
// `block_m` rows: gcd(64, block_m), so that boxes tile both the stage tiles and the 64-row
// halves a consumer warpgroup reads (hsap_attention_wgmma_bwd.cuh WgmmaBwdShape::kBoxRows).
int WgmmaBwdBoxRows(int block_m);

// The architecture the JIT compiles `config` for on a device of `device_arch` (e.g. "sm_90"
// from CurrentCudaArch): "sm_90a" on compute capability 9.0 when the sm_90a forward applies
// to `config` with that arch, else `device_arch` (sm_80, sm_89, ... keep their kernels).
std::string JitCudaArch(absl::string_view device_arch, const CudaKernelConfig& config);

// Dynamic shared memory a CTA may use on `arch` (opt-in maximum), e.g. 232448 on sm_90.
int CudaMaxSharedMemory(int arch);
// Shared memory of one SM on `arch`, e.g. 233472 on sm_90 (each CTA also costs 1 KiB of
// it for the driver's reservation).
int CudaSharedMemoryPerSm(int arch);

// Checks the configuration: arch sm_XX >= sm_70, head dim a multiple of 8 in [32, 256],
// gqa in [1, 64], 0 <= num_peers <= 15, explicit tiles consistent, math = kTensorCore only
// where CudaTensorCoreApplies.
absl::Status ValidateCudaKernelConfig(const CudaKernelConfig& config);

// The tile shapes used for `config`: explicit ones kept, the others the largest that fit
// the architecture's shared memory, or for tensor-core math the mma tiles (see
// codegen_cuda.cc for why they are what they are).
absl::StatusOr<CudaTiles> ChooseCudaTiles(const CudaKernelConfig& config);

// The key tile of the tensor-core backward's deterministic dq pass, given the key pass's
// (CudaTiles::bwd_block_n): 32 keys, 16 below 32 (hsap_attention_mma_bwd.cuh, kDqBN).
int MmaDqBlockN(int bwd_block_n);

// One kernel of a generated program.
struct CudaKernelEntry {
  // "fwd", "bwd", "delta", "merge", "init", "convert", "accumulate", "copy_chunks",
  // "add_chunks", "merge_entries", "gather_stats", "add_entries" (the cuDNN engine's
  // helpers), "fused_fwd"
  std::string role;
  std::string name_expression;  // e.g. "hsap_dev::attn_fwd_kernel<HsapCfg>"
  int threads = 0;              // blockDim.x
  int dynamic_smem_bytes = 0;
  bool tensor_core = false;  // computes with mma.sync (its SASS holds HMMA) or wgmma
  // The sm_90a forward or backward: computes with wgmma (HGMMA) and loads with TMA (UTMALDG);
  // its arguments are the Params followed by `__grid_constant__ const hsap_dev::TensorMap`s
  // (forward: Q, K, V; backward: Q, K, V, dO; the kernels' headers state their geometry).
  bool wgmma = false;
  // The CTAs per SM the tiles were chosen for (registers, threads and shared memory must
  // allow at least this many; the variant compile test checks it).
  int min_ctas_per_sm = 1;
};

struct CudaKernelSource {
  CudaKernelConfig config;
  CudaTiles tiles;
  std::string program_name;  // "<Name()>.cu"
  std::string source;
  std::vector<std::pair<std::string, std::string>> headers;  // CudaDeviceHeaders()
  std::vector<CudaKernelEntry> kernels;

  std::vector<std::string> NameExpressions() const;
};

absl::StatusOr<CudaKernelSource> GenerateCudaKernels(const CudaKernelConfig& config);

// The struct of compile-time constants that GenerateCudaKernels emits as `struct HsapCfg`
// (the Cfg of jit/device/hsap_attention.cuh), for `config` with its chosen `tiles`, under
// the name `struct_name` (which may be a template specialisation, e.g. "Cfg<float, 2>").
// Host tests render the same text to run the kernels in an emulator.
std::string CudaConfigStruct(const CudaKernelConfig& config, const CudaTiles& tiles,
                             absl::string_view struct_name);

// Our device headers, (include name, content), embedded in the library at build time from
// jit/device/*.cuh: hsap_params.cuh, hsap_device.cuh, hsap_sync.cuh, hsap_worklist.cuh,
// hsap_mma.cuh, hsap_attention_mma_fwd.cuh, hsap_attention.cuh, hsap_attention_mma_bwd.cuh,
// hsap_wgmma.cuh, hsap_tma.cuh, hsap_attention_wgmma_fwd.cuh, hsap_attention_wgmma_bwd.cuh,
// hsap_attention_wgmma_bwd_tile.cuh.
const std::vector<std::pair<std::string, std::string>>& CudaDeviceHeaders();

}  // namespace hsap::jit

#endif  // HSAP_JIT_CODEGEN_CUDA_H_
