#include "jit/codegen_cuda.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "jit/embed_file.h"
#include "jit/nvrtc.h"

// Included for the build's dependency tracking only: the .cuh bodies are visible to CUDA
// compilers alone (hsap_params.cuh is plain C++). Their text is embedded below.
#include "jit/device/hsap_attention.cuh"
#include "jit/device/hsap_attention_mma_bwd.cuh"
#include "jit/device/hsap_attention_mma_fwd.cuh"
#include "jit/device/hsap_attention_wgmma_bwd.cuh"
#include "jit/device/hsap_attention_wgmma_bwd_tile.cuh"
#include "jit/device/hsap_attention_wgmma_fwd.cuh"
#include "jit/device/hsap_device.cuh"
#include "jit/device/hsap_mma.cuh"
#include "jit/device/hsap_params.cuh"
#include "jit/device/hsap_sync.cuh"
#include "jit/device/hsap_wgmma.cuh"
#include "jit/device/hsap_worklist.cuh"

// The device headers' text, embedded at build time (jit/embed_file.h).
HSAP_EMBED_FILE(hsap_embedded_params_cuh, "jit/device/hsap_params.cuh");
HSAP_EMBED_FILE(hsap_embedded_device_cuh, "jit/device/hsap_device.cuh");
HSAP_EMBED_FILE(hsap_embedded_sync_cuh, "jit/device/hsap_sync.cuh");
HSAP_EMBED_FILE(hsap_embedded_worklist_cuh, "jit/device/hsap_worklist.cuh");
HSAP_EMBED_FILE(hsap_embedded_mma_cuh, "jit/device/hsap_mma.cuh");
HSAP_EMBED_FILE(hsap_embedded_wgmma_cuh, "jit/device/hsap_wgmma.cuh");
HSAP_EMBED_FILE(hsap_embedded_attention_mma_fwd_cuh, "jit/device/hsap_attention_mma_fwd.cuh");
HSAP_EMBED_FILE(hsap_embedded_attention_cuh, "jit/device/hsap_attention.cuh");
HSAP_EMBED_FILE(hsap_embedded_attention_mma_bwd_cuh, "jit/device/hsap_attention_mma_bwd.cuh");
HSAP_EMBED_FILE(hsap_embedded_tma_cuh, "jit/device/hsap_tma.cuh");
HSAP_EMBED_FILE(hsap_embedded_attention_wgmma_fwd_cuh, "jit/device/hsap_attention_wgmma_fwd.cuh");
HSAP_EMBED_FILE(hsap_embedded_attention_wgmma_bwd_cuh, "jit/device/hsap_attention_wgmma_bwd.cuh");
HSAP_EMBED_FILE(hsap_embedded_attention_wgmma_bwd_tile_cuh,
                "jit/device/hsap_attention_wgmma_bwd_tile.cuh");

namespace hsap::jit {
namespace {

constexpr int kMaxPeers = 15;

// The parameter list of the sm_90a forward, as its explicit instantiation spells it.
// (nvcc requires the __grid_constant__ annotations of the declaration there too.)
constexpr char kWgmmaFwdParams[] =
    "hsap_dev::FwdParams, const __grid_constant__ hsap_dev::TensorMap, const __grid_constant__ "
    "hsap_dev::TensorMap, const __grid_constant__ hsap_dev::TensorMap";
// The sm_90a fused forward's: the forward's Params, a FusedCopy, then the forward's maps.
constexpr char kWgmmaFusedParams[] =
    "hsap_dev::FwdParams, const hsap_dev::FusedCopy, const __grid_constant__ hsap_dev::TensorMap, "
    "const __grid_constant__ hsap_dev::TensorMap, const __grid_constant__ hsap_dev::TensorMap";
// The sm_90a backward's: Params, then the tensor maps of q, k, v and dout.
constexpr char kWgmmaBwdParams[] =
    "hsap_dev::BwdParams, const __grid_constant__ hsap_dev::TensorMap, const __grid_constant__ "
    "hsap_dev::TensorMap, const __grid_constant__ hsap_dev::TensorMap, const __grid_constant__ "
    "hsap_dev::TensorMap";

// Threads per query row: head dims above 128 split a row over 4 lanes to keep the
// per-thread accumulator at <= 64 floats.
int ThreadsPerRow(int head_dim) { return head_dim <= 128 ? 2 : 4; }

int Padded(int n) { return n + 1; }

// The fused forward's steps per launch: this rank's own K/V and one step per peer.
int MaxFusedSteps(const CudaKernelConfig& c) {
  return c.role.num_peers > 0 ? c.role.num_peers + 1 : 0;
}

int FwdSmemBytes(int d, int bm, int bn) {
  return 4 * ((bm + 2 * bn) * Padded(d) + bm * Padded(bn));
}
int BwdSmemBytes(int d, int bm, int bn) {
  return 4 * ((2 * bm + 2 * bn) * Padded(d) + 2 * bm * Padded(bn));
}

// The tensor-core forward (hsap_attention_mma_fwd.cuh, MmaFwdShape): the Q tile and kStages
// K and V tiles of 16-bit elements, rows padded by 8 elements (16 bytes), a 32-byte
// KeyTileInfo per stage and one more, and 128 bytes of key-tile walk.
int MmaFwdSmemBytes(int d, int bm, int bn, int stages) {
  return 2 * (bm + 2 * stages * bn) * (d + 8) + 32 * (stages + 1) + 128;
}

// The tensor-core forward's tiles, 4 warps. Per thread the O accumulator takes D/2 fp32
// registers per m16 row block and S kBN/2; Q's A fragments D/4 per row block.
//   D = 64:   128 x 64, two row blocks per warp (FlashAttention-2's shape): each K/V fragment
//             and copy serves 32 rows (issue model: x1.11); 238-240 registers, Q's fragments
//             in registers.
//   D = 128:  64 x 64, one row block per warp. Two row blocks spill under ptxas (CUDA 13) at
//             64 keys (80-104 bytes on sm_90, 16 on sm_80) and at 48 (16 / 40), however the
//             walk and the row state are trimmed; at 32 keys they fit (254 registers) but the
//             per-tile row work (max, O rescale) doubles per pair and the model gives no gain.
//   D > 128:  64 x 32, one row block (O alone is up to 128 registers).
// Q's fragments stay in registers only at D = 64: at D = 128 holding them (32 registers)
// took the forward to 255 registers and the fused forward, whose step loop keeps more state
// live, to spills on sm_80, so from D = 128 on they are re-read with ldmatrix per k-step
// (1/8 more shared-memory traffic than the K and V tiles). Two stages of K/V: enough to cover
// an L2 latency behind one tile's math at these sizes, and the most that keeps two CTAs of
// D = 128 within an sm_90 SM. See docs/gpu_backend.md.
absl::Status ChooseMmaForwardTiles(const CudaKernelConfig& c, int limit, CudaTiles* t) {
  t->fwd_stages = 2;
  t->q_in_registers = c.head_dim <= 64;
  if (c.block_m > 0 || c.block_n > 0 || c.threads > 0) {
    if (c.block_m <= 0 || c.block_n <= 0 || c.threads <= 0) {
      return absl::InvalidArgumentError(
          "CudaKernelConfig: block_m, block_n and threads must be set together");
    }
    if (c.threads % 32 != 0 ||
        (c.block_m != 16 * (c.threads / 32) && c.block_m != 32 * (c.threads / 32)) ||
        c.block_n % 16 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("CudaKernelConfig tiles ", c.block_m, "x", c.block_n, " on ", c.threads,
                       " threads: the tensor-core forward needs block_m = 16 or 32 * warps and "
                       "block_n a multiple of 16"));
    }
    t->block_m = c.block_m;
    t->block_n = c.block_n;
    t->threads = c.threads;
  } else {
    t->block_m = c.head_dim <= 64 ? 128 : 64;
    t->threads = 128;
    for (int bn : {c.head_dim <= 128 ? 64 : 32, 16}) {
      t->block_n = bn;
      if (MmaFwdSmemBytes(c.head_dim, t->block_m, bn, t->fwd_stages) <= limit) break;
    }
  }
  t->fwd_smem_bytes = MmaFwdSmemBytes(c.head_dim, t->block_m, t->block_n, t->fwd_stages);
  return absl::OkStatus();
}

// The sm_90a forward (hsap_attention_wgmma_fwd.cuh, WgmmaFwdShape::kSmemBytes): 1 KiB of
// slack to align the tiles to the 1024-byte atoms of the 128-byte swizzle, the Q tile of 128
// rows and `stages` K and V tiles of `bn` rows, 16-bit elements without padding (the swizzle
// spreads the rows over the banks), then 2 * stages + 3 mbarriers, a 32-byte descriptor per
// stage (KeyTileInfo) and 16 bytes for the chunk's tile count.
int WgmmaFwdSmemBytes(int d, int bn, int stages) {
  return 1024 + 2 * (128 + 2 * stages * bn) * d + 8 * (2 * stages + 3) + 32 * stages + 16;
}

// The sm_90a forward's key tiles. Per consumer thread the O accumulator takes D/2 fp32
// registers and S bn/2 (64 query rows x N over 128 threads), P bn/4 packed pairs; the
// setmaxnreg budget of a consumer is 240 (the producer keeps 24). D 64 and 128: 128 keys
// per tile (O + S + P = 128 or 160 registers), a ring of 3 or 2 K/V stages (113 and 161
// KiB). D 256: 64 keys (O alone is 128 registers), 2 stages (193 KiB). One CTA per SM: the
// two consumer warpgroups keep the tensor cores busy between them while the producer
// streams the next tiles.
void ChooseWgmmaForwardTiles(const CudaKernelConfig& c, CudaTiles* t) {
  t->wgmma_fwd = true;
  t->wgmma_block_n = c.head_dim <= 128 ? 128 : 64;
  t->wgmma_stages = c.head_dim <= 64 ? 3 : 2;
  t->wgmma_smem_bytes = WgmmaFwdSmemBytes(c.head_dim, t->wgmma_block_n, t->wgmma_stages);
}

// The tensor-core backward's tiles (hsap_attention_mma_bwd.cuh states the register budget
// behind them), 4 warps each:
//   D <= 128: 32 queries x 64 keys; a warp owns 16 keys x all of D of dK/dV (2 * 64 floats
//             per thread at D = 128).
//   D > 128:  32 x 32; two warps split D for dK/dV (and for dQ in the dq pass).
// 32-query tiles halve the key pass's per-tile work (barriers, lse/delta, the walk) per pair;
// they fit since the exponential became an FFMA and an ex2.approx (before, 32 x 64 spilled
// at D = 128 on sm_90), and at D = 112 and 240 since every head dim copies by chunk columns
// (hsap_mma.cuh cp_async_rows; before, 32 spilled 16-248 bytes there and those took 16, and
// the D = 240 dq pass 16-key tiles). Every one is spill-free under ptxas (CUDA 13) for
// bf16/f16, deterministic and atomic dq, GQA 1 and 8, band and full, on sm_80 and sm_90 at
// every head dim (`hsap_roofline --sweep`; the variant compile test holds the shipped ones
// to zero spills). Not 16 x 64 at D = 64: ptxas caps that kernel at 168 registers (3 CTAs
// per SM) on sm_80 and spills to get there. Explicit bwd tiles still select the tensor-core
// kernel (tests).
struct MmaBwdTile {
  int bm = 0, bn = 0, threads = 0;  // bm == 0: no tensor-core backward
};
MmaBwdTile MmaBwdTileFor(int head_dim) {
  if (head_dim < 64) return {};
  if (head_dim <= 128) return {32, 64, 128};
  return {32, 32, 128};
}

// MmaBwdShape<Cfg>::kSmemBytes: the larger of the key pass (K, V, two stages of Q, dO with
// lse and delta, dS^T for atomic dq) and the dq pass (Q, dO of 16 rows per warp, or per two
// warps above head dim 128, two stages of MmaDqBlockN-key K, V tiles), rows
// padded by 8 elements, after 256 bytes of shared walk state.
int MmaBwdSmemBytes(int d, int bm, int bn, int threads, bool deterministic_dq) {
  const int row = 2 * (d + 8), ctrl = 256, qm = 16 * (threads / 32) / (d > 128 ? 2 : 1);
  const int key_pass = ctrl + 2 * bn * row + 2 * 2 * bm * row + 2 * 2 * bm * 4 +
                       (deterministic_dq ? 0 : bn * (bm + 8) * 2);
  const int dq_bn = MmaDqBlockN(bn);
  const int dq_pass = ctrl + 2 * qm * row + 2 * 2 * dq_bn * row;
  return std::max(key_pass, dq_pass);
}

// The sm_90a backward (hsap_attention_wgmma_bwd.cuh, WgmmaBwdShape::kSmemBytes): 1 KiB of
// alignment slack, K and V of a key item's 128 keys (64 per consumer warpgroup), two stages
// of Q and dO of bm rows (16-bit elements without padding; the dq items use the same tiles
// the other way round), P^T and dS^T of each consumer warpgroup (64 rows of 128 bytes), lse
// and delta [2][2][bm] floats, 256 bytes of walk state and stage slots, then 6 mbarriers.
int WgmmaBwdSmemBytes(int d, int bm) {
  return 1024 + 2 * 128 * d * 2 + 4 * bm * d * 2 + 4 * 64 * 128 + 16 * bm + 256 + 8 * 6;
}

// The sm_90a backward's stage tile: block_m rows (a key item's query rows: wgmma N of S^T and
// dP^T; a dq chunk's keys: N of S and dP). Per thread of a consumer warpgroup (232 registers
// after setmaxnreg) dK and dV of its 64 keys take D fp32 registers (128 at D = 128) and S^T
// and dP^T block_m: 64 rows at D = 64; at D = 128, 64 rows left ptxas spilling 12-68 bytes
// whatever the code's arrangement, even at 240 registers (2026-12-05: set 64 here and run
// jit_cuda_wgmma_nvrtc_test); 48 rows (16 registers fewer) none (the compile test holds it
// to zero spills).
void ChooseWgmmaBackwardTiles(const CudaKernelConfig& c, CudaTiles* t) {
  t->wgmma_bwd = true;
  t->wgmma_bwd_block_m = c.head_dim == 128 ? 48 : 64;
  t->wgmma_bwd_box_rows = WgmmaBwdBoxRows(t->wgmma_bwd_block_m);
  t->wgmma_bwd_smem_bytes = WgmmaBwdSmemBytes(c.head_dim, t->wgmma_bwd_block_m);
}

const char* CudaTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float";
    case DType::kBF16:
      return "hsap_dev::bf16";
    case DType::kF16:
      return "hsap_dev::f16";
  }
  return "float";
}

}  // namespace

int MmaDqBlockN(int bwd_block_n) { return bwd_block_n < 32 ? 16 : 32; }

int WgmmaBwdBoxRows(int block_m) { return std::gcd(64, block_m); }

std::string CudaKernelConfig::Name() const {
  std::string arch_digits = arch;
  if (arch_digits.rfind("sm_", 0) == 0) arch_digits = "sm" + arch_digits.substr(3);
  const std::string_view dtype_name = DTypeName(dtype);
  std::string name =
      absl::StrCat(arch_digits, "_", absl::string_view(dtype_name.data(), dtype_name.size()), "_d",
                   head_dim, "_g", gqa, has_band ? "_band" : "_full");
  if (role.num_peers > 0) absl::StrAppend(&name, "_p", role.num_peers);
  if (ResolveCudaMath(*this) == CudaMath::kTensorCore) {
    absl::StrAppend(&name, "_tc");
    if (!deterministic_dq) absl::StrAppend(&name, "_adq");
  } else if (math == CudaMath::kFma && CudaTensorCoreApplies(*this)) {
    absl::StrAppend(&name, "_fma");
  }
  if (block_m || block_n || threads || bwd_block_m || bwd_block_n || bwd_threads) {
    absl::StrAppend(&name, "_t", block_m, "x", block_n, "x", threads, "_b", bwd_block_m, "x",
                    bwd_block_n, "x", bwd_threads);
  }
  return name;
}

bool CudaTensorCoreApplies(const CudaKernelConfig& c) {
  absl::StatusOr<int> arch = ParseCudaArch(c.arch);
  return arch.ok() && *arch >= 80 && (c.dtype == DType::kBF16 || c.dtype == DType::kF16) &&
         c.head_dim % 16 == 0 && c.head_dim >= 64 && c.head_dim <= 256;
}

bool CudaWgmmaForwardApplies(const CudaKernelConfig& c) {
  return c.arch == "sm_90a" && ResolveCudaMath(c) == CudaMath::kTensorCore &&
         (c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256);
}

bool CudaWgmmaBackwardApplies(const CudaKernelConfig& c) {
  return c.arch == "sm_90a" && ResolveCudaMath(c) == CudaMath::kTensorCore &&
         (c.head_dim == 64 || c.head_dim == 128) && c.deterministic_dq && c.bwd_block_m == 0 &&
         c.bwd_block_n == 0 && c.bwd_threads == 0;
}

std::string JitCudaArch(absl::string_view device_arch, const CudaKernelConfig& config) {
  if (device_arch != "sm_90") return std::string(device_arch);
  CudaKernelConfig specific = config;
  specific.arch = "sm_90a";
  return CudaWgmmaForwardApplies(specific) ? "sm_90a" : std::string(device_arch);
}

CudaMath ResolveCudaMath(const CudaKernelConfig& c) {
  return c.math != CudaMath::kFma && CudaTensorCoreApplies(c) ? CudaMath::kTensorCore
                                                              : CudaMath::kFma;
}

int CudaSharedMemoryPerSm(int arch) {
  switch (arch) {
    case 70:
    case 72:
      return 98304;
    case 75:
      return 65536;
    case 80:
    case 87:
      return 167936;
    case 90:
    case 100:
    case 101:
    case 103:
    case 110:
      return 233472;
    default:
      return arch >= 80 ? 102400 : 49152;
  }
}

int CudaMaxSharedMemory(int arch) {
  switch (arch) {
    case 70:
    case 72:
      return 98304;
    case 75:
      return 65536;
    case 80:
    case 87:
      return 166912;
    case 90:
    case 100:
    case 101:
    case 103:
    case 110:
      return 232448;
    default:
      return arch >= 80 ? 101376 : 49152;  // sm_86/89/120 class; conservative otherwise
  }
}

absl::Status ValidateCudaKernelConfig(const CudaKernelConfig& c) {
  HSAP_ASSIGN_OR_RETURN(int arch, ParseCudaArch(c.arch));
  if (c.arch.rfind("sm_", 0) != 0 || arch < 70) {
    return absl::InvalidArgumentError(absl::StrCat("CudaKernelConfig.arch = ", c.arch,
                                                   ": the kernels need sm_70 or newer, as sm_XX"));
  }
  if (c.head_dim < 32 || c.head_dim > 256 || c.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaKernelConfig.head_dim = ", c.head_dim,
                     ": the CUDA kernels support multiples of 8 in [32, 256]"));
  }
  if (c.gqa < 1 || c.gqa > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaKernelConfig.gqa = ", c.gqa, ": must be in [1, 64]"));
  }
  if (c.role.num_peers < 0 || c.role.num_peers > kMaxPeers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CudaKernelConfig.role: num_peers = %d (must be in [0, %d])", c.role.num_peers, kMaxPeers));
  }
  if (c.math == CudaMath::kTensorCore && !CudaTensorCoreApplies(c)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CudaKernelConfig.math = kTensorCore needs bf16 or f16, a head dim that is a multiple "
        "of 16 in [64, 256] and sm_80 or newer (got ",
        std::string(DTypeName(c.dtype)), ", head dim ", c.head_dim, ", ", c.arch, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaTiles> ChooseCudaTiles(const CudaKernelConfig& c) {
  HSAP_ASSIGN_OR_RETURN(int arch, ParseCudaArch(c.arch));
  const int limit = CudaMaxSharedMemory(arch);
  const int tpr = ThreadsPerRow(c.head_dim);
  CudaTiles t;

  // Forward: the mma tiles, or the largest of these tiles whose shared memory fits.
  constexpr int kFwdCandidates[][2] = {{64, 64}, {64, 32}, {32, 32}, {16, 32}, {16, 16}};
  const bool tensor_core = ResolveCudaMath(c) == CudaMath::kTensorCore;
  if (tensor_core) {
    HSAP_RETURN_IF_ERROR(ChooseMmaForwardTiles(c, limit, &t));
    if (CudaWgmmaForwardApplies(c)) ChooseWgmmaForwardTiles(c, &t);
  } else if (c.block_m > 0 || c.block_n > 0 || c.threads > 0) {
    if (c.block_m <= 0 || c.block_n <= 0 || c.threads <= 0) {
      return absl::InvalidArgumentError(
          "CudaKernelConfig: block_m, block_n and threads must be set together");
    }
    t.block_m = c.block_m;
    t.block_n = c.block_n;
    t.threads = c.threads;
  } else {
    for (const auto& [bm, bn] : kFwdCandidates) {
      if (FwdSmemBytes(c.head_dim, bm, bn) <= limit) {
        t.block_m = bm;
        t.block_n = bn;
        t.threads = bm * tpr;
        break;
      }
    }
  }
  constexpr int kBwdCandidates[][2] = {{64, 32}, {32, 32}, {16, 32}, {16, 16}, {8, 16}};
  if (c.bwd_block_m > 0 || c.bwd_block_n > 0 || c.bwd_threads > 0) {
    if (c.bwd_block_m <= 0 || c.bwd_block_n <= 0 || c.bwd_threads <= 0) {
      return absl::InvalidArgumentError(
          "CudaKernelConfig: bwd_block_m, bwd_block_n and bwd_threads must be set together");
    }
    t.bwd_block_m = c.bwd_block_m;
    t.bwd_block_n = c.bwd_block_n;
    t.bwd_threads = c.bwd_threads;
    t.bwd_tensor_core = ResolveCudaMath(c) == CudaMath::kTensorCore;
  } else if (const MmaBwdTile m = MmaBwdTileFor(c.head_dim);
             ResolveCudaMath(c) == CudaMath::kTensorCore && m.bm > 0 &&
             MmaBwdSmemBytes(c.head_dim, m.bm, m.bn, m.threads, c.deterministic_dq) <= limit) {
    t.bwd_block_m = m.bm;
    t.bwd_block_n = m.bn;
    t.bwd_threads = m.threads;
    t.bwd_tensor_core = true;
    if (CudaWgmmaBackwardApplies(c)) ChooseWgmmaBackwardTiles(c, &t);
  } else {
    // The FMA backward: fp32, other head dims, or tensor-core tiles that do not fit the
    // shared memory (head dim 256 on sm_86/89: 99 KB).
    for (const auto& [bm, bn] : kBwdCandidates) {
      if (BwdSmemBytes(c.head_dim, bm, bn) <= limit) {
        t.bwd_block_m = bm;
        t.bwd_block_n = bn;
        t.bwd_threads = bm * tpr;
        break;
      }
    }
  }
  if (t.block_m == 0 || t.bwd_block_m == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("no tile of head dim ", c.head_dim, " fits the shared memory of ", c.arch));
  }
  if (!tensor_core) t.fwd_smem_bytes = FwdSmemBytes(c.head_dim, t.block_m, t.block_n);
  t.bwd_smem_bytes = t.bwd_tensor_core ? MmaBwdSmemBytes(c.head_dim, t.bwd_block_m, t.bwd_block_n,
                                                         t.bwd_threads, c.deterministic_dq)
                                       : BwdSmemBytes(c.head_dim, t.bwd_block_m, t.bwd_block_n);
  if (!c.skip_validation && (t.fwd_smem_bytes > limit || t.bwd_smem_bytes > limit ||
                             t.wgmma_smem_bytes > limit || t.wgmma_bwd_smem_bytes > limit)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaKernelConfig tiles need ", t.fwd_smem_bytes, "/", t.bwd_smem_bytes,
                     " bytes of shared memory (fwd/bwd); ", c.arch, " allows ", limit));
  }
  return t;
}

std::vector<std::string> CudaKernelSource::NameExpressions() const {
  std::vector<std::string> out;
  for (const CudaKernelEntry& k : kernels) out.push_back(k.name_expression);
  return out;
}

std::string CudaConfigStruct(const CudaKernelConfig& config, const CudaTiles& t,
                             absl::string_view struct_name) {
  std::string s = absl::StrCat("struct ", struct_name, " {\n");
  absl::StrAppend(&s, "  using T = ", CudaTypeName(config.dtype), ";\n");
  absl::StrAppend(&s, "  static constexpr int kHeadDim = ", config.head_dim, ";\n");
  absl::StrAppend(&s, "  static constexpr bool kTensorCore = ",
                  ResolveCudaMath(config) == CudaMath::kTensorCore ? "true" : "false", ";\n");
  absl::StrAppend(&s, "  static constexpr int kGqa = ", config.gqa, ";\n");
  absl::StrAppend(&s, "  static constexpr int kBlockM = ", t.block_m, ", kBlockN = ", t.block_n,
                  ", kThreads = ", t.threads, ";\n");
  absl::StrAppend(&s, "  static constexpr int kBwdBlockM = ", t.bwd_block_m,
                  ", kBwdBlockN = ", t.bwd_block_n, ", kBwdThreads = ", t.bwd_threads, ";\n");
  absl::StrAppend(&s, "  static constexpr bool kHasBand = ", config.has_band ? "true" : "false",
                  ";\n");
  absl::StrAppend(&s, "  static constexpr int kNumPeers = ", config.role.num_peers, ";\n");
  absl::StrAppend(&s, "  static constexpr int kMaxSteps = ", MaxFusedSteps(config), ";\n");
  absl::StrAppend(&s, "  static constexpr int kFwdStages = ", t.fwd_stages, ";\n");
  absl::StrAppend(
      &s, "  static constexpr bool kQInRegisters = ", t.q_in_registers ? "true" : "false", ";\n");
  absl::StrAppend(&s, "  static constexpr int kFwdSmemBytes = ", t.fwd_smem_bytes, ";\n");
  absl::StrAppend(&s, "  static constexpr int kBwdSmemBytes = ", t.bwd_smem_bytes, ";\n");
  absl::StrAppend(&s, "  static constexpr bool kDeterministicDq = ",
                  config.deterministic_dq ? "true" : "false", ";\n");
  absl::StrAppend(&s, "  static constexpr bool kWgmmaFwd = ", t.wgmma_fwd ? "true" : "false",
                  ";\n");
  absl::StrAppend(&s, "  static constexpr int kWgmmaBlockN = ", t.wgmma_block_n,
                  ", kWgmmaStages = ", t.wgmma_stages, ", kWgmmaSmemBytes = ", t.wgmma_smem_bytes,
                  ";\n");
  absl::StrAppend(&s, "  static constexpr bool kWgmmaBwd = ", t.wgmma_bwd ? "true" : "false",
                  ";\n");
  absl::StrAppend(&s, "  static constexpr int kWgmmaBwdBlockM = ", t.wgmma_bwd_block_m,
                  ", kWgmmaBwdBoxRows = ", t.wgmma_bwd_box_rows,
                  ", kWgmmaBwdSmemBytes = ", t.wgmma_bwd_smem_bytes, ";\n");
  absl::StrAppend(&s, "};\n");
  return s;
}

absl::StatusOr<CudaKernelSource> GenerateCudaKernels(const CudaKernelConfig& config) {
  if (!config.skip_validation) {
    HSAP_RETURN_IF_ERROR(ValidateCudaKernelConfig(config));
  } else if (absl::StatusOr<int> arch = ParseCudaArch(config.arch); !arch.ok()) {
    return arch.status();
  }
  HSAP_ASSIGN_OR_RETURN(CudaTiles tiles, ChooseCudaTiles(config));
  const CudaTiles& t = tiles;
  const int max_steps = MaxFusedSteps(config);
  const bool tc = ResolveCudaMath(config) == CudaMath::kTensorCore;

  CudaKernelSource out;
  out.config = config;
  out.tiles = t;
  out.program_name = absl::StrCat("hsap_", config.Name(), ".cu");
  out.headers = CudaDeviceHeaders();

  std::string& s = out.source;
  absl::StrAppend(&s, "// Generated by hsap jit/codegen_cuda for ", config.Name(), ".\n",
                  "// Kernel contracts: hsap_params.cuh. Kernel bodies: hsap_attention.cuh",
                  tc ? " (tensor-core forward: hsap_attention_mma_fwd.cuh)" : "", ".\n",
                  "#include \"hsap_attention.cuh\"\n");
  const bool tc_bwd = t.bwd_tensor_core;
  if (tc_bwd) absl::StrAppend(&s, "#include \"hsap_attention_mma_bwd.cuh\"\n");
  if (t.wgmma_fwd) absl::StrAppend(&s, "#include \"hsap_attention_wgmma_fwd.cuh\"\n");
  if (t.wgmma_bwd) absl::StrAppend(&s, "#include \"hsap_attention_wgmma_bwd.cuh\"\n");
  absl::StrAppend(&s, "\n");
  absl::StrAppend(&s, CudaConfigStruct(config, t, "HsapCfg"), "\n");

  struct Kernel {
    const char* role;
    const char* name;
    const char* params;
    int threads, smem;
    bool tensor_core = false;
    bool wgmma = false;
  };
  std::vector<Kernel> kernels = {
      t.wgmma_fwd ? Kernel{"fwd", "attn_fwd_wgmma_kernel", kWgmmaFwdParams, 384, t.wgmma_smem_bytes,
                           true, true}
                  : Kernel{"fwd", "attn_fwd_kernel", "hsap_dev::FwdParams", t.threads,
                           t.fwd_smem_bytes, tc},
      t.wgmma_bwd ? Kernel{"bwd", "attn_bwd_wgmma_kernel", kWgmmaBwdParams, 384,
                           t.wgmma_bwd_smem_bytes, true, true}
                  : Kernel{"bwd", tc_bwd ? "attn_bwd_mma_kernel" : "attn_bwd_kernel",
                           "hsap_dev::BwdParams", t.bwd_threads, t.bwd_smem_bytes, tc_bwd},
      {"delta", "attn_delta_kernel", "hsap_dev::DeltaParams", 256, 0},
      {"merge", "lse_merge_kernel", "hsap_dev::MergeParams", 256, 0},
      {"init", "init_partial_kernel", "hsap_dev::InitParams", 256, 0},
      {"convert", "convert_out_kernel", "hsap_dev::ConvertParams", 256, 0},
      {"accumulate", "accumulate_kernel", "hsap_dev::AccumulateParams", 256, 0},
      {"copy_chunks", "copy_chunks_kernel", "hsap_dev::ChunksParams", 256, 0},
      {"add_chunks", "add_chunks_kernel", "hsap_dev::ChunksParams", 256, 0},
      {"merge_entries", "merge_entries_kernel", "hsap_dev::EntryMergeParams", 256, 0},
      {"gather_stats", "gather_stats_kernel", "hsap_dev::StatsGatherParams", 256, 0},
      {"add_entries", "add_entries_kernel", "hsap_dev::EntryAddParams", 256, 0},
  };
  std::string fused_params;
  if (max_steps > 0 && t.wgmma_fwd) {
    // The sm_90a core: one launch per step (hsap_params.cuh FusedCopy).
    kernels.push_back({"fused_fwd", "fused_fwd_wgmma_kernel", kWgmmaFusedParams, 384,
                       t.wgmma_smem_bytes, true, true});
  } else if (max_steps > 0) {
    fused_params = absl::StrCat("hsap_dev::FusedFwdParamsT<", max_steps, ">");
    kernels.push_back(
        {"fused_fwd", "fused_fwd_kernel", fused_params.c_str(), t.threads, t.fwd_smem_bytes, tc});
  }
  absl::StrAppend(&s,
                  "// Explicit instantiations (NVRTC also instantiates them through the name\n"
                  "// expressions; nvcc needs these).\n");
  for (const Kernel& k : kernels) {
    absl::StrAppend(&s, "template __global__ void hsap_dev::", k.name, "<HsapCfg>(const ", k.params,
                    ");\n");
    // The tensor-core forward was sized for two CTAs per SM wherever their shared memory
    // fits one SM (ChooseMmaForwardTiles); everything else for at least one (the sm_90a
    // forward for exactly one: 384 threads that share the register file by setmaxnreg).
    const int arch = *ParseCudaArch(config.arch);
    const int min_ctas =
        k.tensor_core && !k.wgmma && 2 * (k.smem + 1024) <= CudaSharedMemoryPerSm(arch) ? 2 : 1;
    out.kernels.push_back({k.role, absl::StrCat("hsap_dev::", k.name, "<HsapCfg>"), k.threads,
                           k.smem, k.tensor_core, k.wgmma, min_ctas});
  }
  return out;
}

const std::vector<std::pair<std::string, std::string>>& CudaDeviceHeaders() {
  static const auto* headers = new std::vector<std::pair<std::string, std::string>>{
      {"hsap_params.cuh", std::string(hsap_embedded_params_cuh, hsap_embedded_params_cuh_end)},
      {"hsap_device.cuh", std::string(hsap_embedded_device_cuh, hsap_embedded_device_cuh_end)},
      {"hsap_sync.cuh", std::string(hsap_embedded_sync_cuh, hsap_embedded_sync_cuh_end)},
      {"hsap_worklist.cuh",
       std::string(hsap_embedded_worklist_cuh, hsap_embedded_worklist_cuh_end)},
      {"hsap_mma.cuh", std::string(hsap_embedded_mma_cuh, hsap_embedded_mma_cuh_end)},
      {"hsap_wgmma.cuh", std::string(hsap_embedded_wgmma_cuh, hsap_embedded_wgmma_cuh_end)},
      {"hsap_attention_mma_fwd.cuh",
       std::string(hsap_embedded_attention_mma_fwd_cuh, hsap_embedded_attention_mma_fwd_cuh_end)},
      {"hsap_attention.cuh",
       std::string(hsap_embedded_attention_cuh, hsap_embedded_attention_cuh_end)},
      {"hsap_attention_mma_bwd.cuh",
       std::string(hsap_embedded_attention_mma_bwd_cuh, hsap_embedded_attention_mma_bwd_cuh_end)},
      {"hsap_tma.cuh", std::string(hsap_embedded_tma_cuh, hsap_embedded_tma_cuh_end)},
      {"hsap_attention_wgmma_fwd.cuh", std::string(hsap_embedded_attention_wgmma_fwd_cuh,
                                                   hsap_embedded_attention_wgmma_fwd_cuh_end)},
      {"hsap_attention_wgmma_bwd.cuh", std::string(hsap_embedded_attention_wgmma_bwd_cuh,
                                                   hsap_embedded_attention_wgmma_bwd_cuh_end)},
      {"hsap_attention_wgmma_bwd_tile.cuh",
       std::string(hsap_embedded_attention_wgmma_bwd_tile_cuh,
                   hsap_embedded_attention_wgmma_bwd_tile_cuh_end)},
  };
  return *headers;
}

}  // namespace hsap::jit
