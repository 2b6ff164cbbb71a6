// The shared-memory swizzle of sm_90's asynchronous units, for the CUDA emulator: the one
// permutation both the TMA unit (cp.async.bulk.tensor writing a box with a tensor map's
// swizzle mode) and the wgmma unit (reading an operand through a matrix descriptor's swizzle
// field) apply to shared-memory byte addresses. Written from NVIDIA's PTX ISA, "Tensor
// Swizzling Modes" (5.5.x, under "Tensors") and "Asynchronous Warpgroup Level Matrix Shared
// Memory Layout" (the wgmma "Shared Memory Matrix Layout" / "Matrix Descriptor Format"
// sections), and the CUDA driver API's CUtensorMapSwizzle.
//
// The pattern. Shared memory is seen as 128-byte lines of eight 16-byte chunks. A mode of
// span S (32, 64 or 128 bytes) XORs the chunk index (address bits [6:4]) with the low
// log2(S / 16) bits of the line index (address bits [9:7]):
//   128B: bits [6:4] ^= bits [9:7]     (the pattern repeats every 1024 bytes)
//    64B: bits [5:4] ^= bits [8:7]     (repeats every 512 bytes)
//    32B: bit  [4]   ^= bit  [7]       (repeats every 256 bytes)
// so a 16-byte chunk never leaves its S-byte segment, and a tile whose rows are S bytes long
// (the TMA box's inner dimension, the wgmma operand's swizzle atom: 8 rows of S bytes) has
// its chunks spread over the banks. Bits [3:0] (the byte within a chunk) and every bit above
// the repeat are never changed; the permutation is an involution.
//
// Addresses. The hardware applies the XOR to the shared-memory address itself (the offset in
// the CTA's shared window, whose base is aligned far beyond 1024 bytes), not to an offset from
// the start of the tile: a tile whose start is not aligned to the mode's repeat (S * 8 bytes)
// sees the pattern shifted. The alignment each user requires (ISA and driver API):
//   - TMA (cp.async.bulk.tensor, tiled mode): the shared-memory destination must be 128-byte
//     aligned (the ISA's "the shared memory address must be aligned to 128 bytes"); with a
//     swizzle mode the box lands with the pattern of its absolute address, so a kernel that
//     wants the atom to start at the box's first byte aligns the box to the repeat (CUTLASS
//     and FlashAttention-3 align their swizzled buffers to 1024 bytes). The inner box
//     dimension in bytes must not exceed the span (CUtensorMapSwizzle's rule).
//   - wgmma descriptors: the start address is 16-byte aligned (its field drops the low 4
//     bits); with a swizzle the "matrix base offset" field (bits [51:49]) is 0 when the
//     operand starts at an address aligned to the repeat, which is how this project uses it.
// SwizzleRepeatBytes / SwizzleSpanBytes state these sizes; SwizzleSharedOffset is the
// permutation on a byte offset in the CTA's shared window.
//
// Encodings: the same modes are numbered differently by the two users. The wgmma
// descriptor's 2-bit field (bits [63:62]): 0 none, 1 128B, 2 64B, 3 32B. CUtensorMapSwizzle:
// 0 none, 1 32B, 2 64B, 3 128B. SwizzleMode below is neither: its value is the span in bytes,
// and the two converters name the encoding they read.
#ifndef HSAP_TESTS_SUPPORT_EMULATED_SWIZZLE_H_
#define HSAP_TESTS_SUPPORT_EMULATED_SWIZZLE_H_

#include <cstdint>
#include <optional>

namespace hsap_emu {

enum class SwizzleMode : int { kNone = 0, k32B = 32, k64B = 64, k128B = 128 };

// The span S: the bytes of one swizzled row, S / 16 chunks (0 for kNone).
constexpr std::uint32_t SwizzleSpanBytes(SwizzleMode mode) {
  return static_cast<std::uint32_t>(mode);
}

// The period of the pattern, S * 8 bytes (16 for kNone: the 16-byte chunk, the granule both
// TMA and wgmma address).
constexpr std::uint32_t SwizzleRepeatBytes(SwizzleMode mode) {
  return mode == SwizzleMode::kNone ? 16u : SwizzleSpanBytes(mode) * 8u;
}

// The permutation on a byte offset in the CTA's shared window (see the header comment).
constexpr std::uint32_t SwizzleSharedOffset(std::uint32_t offset, SwizzleMode mode) {
  if (mode == SwizzleMode::kNone) return offset;
  const std::uint32_t chunk_mask = SwizzleSpanBytes(mode) / 16u - 1u;  // 1, 3 or 7
  const std::uint32_t line = (offset >> 7) & chunk_mask;  // the 128-byte line, low bits
  return offset ^ (line << 4);                            // into the chunk index
}

// The wgmma matrix descriptor's swizzle field (bits [63:62]): 0 none, 1 128B, 2 64B, 3 32B.
constexpr std::optional<SwizzleMode> SwizzleFromWgmmaField(int field) {
  switch (field) {
    case 0:
      return SwizzleMode::kNone;
    case 1:
      return SwizzleMode::k128B;
    case 2:
      return SwizzleMode::k64B;
    case 3:
      return SwizzleMode::k32B;
    default:
      return std::nullopt;
  }
}

// CUtensorMapSwizzle (cuda.h): 0 CU_TENSOR_MAP_SWIZZLE_NONE, 1 _32B, 2 _64B, 3 _128B. The
// later 128B_ATOM_* modes (CUDA 12.8+, sm_100) are not modelled: nullopt.
constexpr std::optional<SwizzleMode> SwizzleFromTensorMap(int cu_tensor_map_swizzle) {
  switch (cu_tensor_map_swizzle) {
    case 0:
      return SwizzleMode::kNone;
    case 1:
      return SwizzleMode::k32B;
    case 2:
      return SwizzleMode::k64B;
    case 3:
      return SwizzleMode::k128B;
    default:
      return std::nullopt;
  }
}

constexpr const char* SwizzleName(SwizzleMode mode) {
  switch (mode) {
    case SwizzleMode::kNone:
      return "none";
    case SwizzleMode::k32B:
      return "32B";
    case SwizzleMode::k64B:
      return "64B";
    case SwizzleMode::k128B:
      return "128B";
  }
  return "invalid";
}

}  // namespace hsap_emu

#endif  // HSAP_TESTS_SUPPORT_EMULATED_SWIZZLE_H_
