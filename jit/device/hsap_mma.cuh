// The tensor-core instruction layer: mma.sync m16n8k16 (bf16 / f16 in, fp32 accumulate),
// ldmatrix, cp.async with commit/wait groups, and the bf16x2 / f16x2 packing that feeds them.
// Each function is one PTX instruction (sm_80 and up), except the tile copy at the end, built
// on cp.async; the kernels of hsap_attention.cuh are written on top of these and of nothing
// else tensor-core specific.
//
// NVRTC-clean (no include at all); include after hsap_device.cuh (HSAP_DEV, hsap_dev::bf16).
// Under HSAP_DEVICE_EMULATION each instruction is a warp-collective operation of the CPU
// emulator (tests/support/emulated_ptx.h), written from the same PTX ISA tables as below.
//
// ---- Fragment layouts (PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions") ----
// Notation: lane = %laneid (0..31), g = lane >> 2 ("groupID"), t = lane % 4
// ("threadID_in_group"). A .b32 register holding two 16-bit elements holds the lower-indexed
// element (a0 of a0,a1) in its LOW half.
//
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 d, a, b, c
// (section "Matrix Fragments for mma.m16n8k16 with floating point type"):
//   A, 16x16 (M x K), row-major; a[4] hold a0..a7, two per register:
//     a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
//     a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
//     (ISA: row = g for a0,a1,a4,a5, g+8 otherwise; col = 2t + (i & 1), +8 for i >= 4.)
//   B, 16x8 (K x N), column-major; b[2] hold b0..b3:
//     b[0] = B[2t, 2t+1  ][g]        b[1] = B[2t+8, 2t+9][g]
//     (ISA: row = 2t + (i & 1) for i < 2, +8 for i >= 2; col = g.)
//     So b[0] is the 32-bit word at column g, rows 2t..2t+1 of B: in memory laid out as B^T
//     (N rows of K elements, e.g. the K tile for S = Q K^T), one aligned word of row g.
//   C and D, 16x8 (M x N), fp32, one element per register:
//     c[0] = C[g][2t]   c[1] = C[g][2t+1]   c[2] = C[g + 8][2t]   c[3] = C[g + 8][2t+1]
//     (ISA: row = g for c0,c1, g+8 for c2,c3; col = 2t + (i & 1).)
//   D = A * B + C with every product exact in fp32 and the sum order unspecified by the ISA.
//
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 r, [row]
// (section "Warp-level matrix load instruction: ldmatrix"):
//   Loads 1, 2 or 4 matrices of 8x8 16-bit elements. Each matrix row is 16 contiguous bytes
//   at a 16-byte aligned shared address given by one lane: lanes 8m .. 8m+7 give rows 0..7
//   of matrix m (x1 reads lanes 0-7, x2 lanes 0-15, x4 all; the other lanes' addresses are
//   ignored). Register r[m] of every lane receives two elements of matrix m:
//     without .trans: r[m] = M_m[g][2t, 2t+1]       (row g, columns 2t and 2t+1)
//     with .trans:    r[m] = M_m[2t, 2t+1][g]       (column g, rows 2t and 2t+1)
//   i.e. with .trans the lanes get the fragment of the transposed matrix.
//   Typical uses (smem row-major tiles):
//     - A fragment of mma from a row-major 16x16 tile: x4, lane l gives the address of row
//       (l % 16), column 8 * (l / 16); then r[0..3] are exactly a[0..3] above.
//     - B fragment from an N x K (K-contiguous) tile, e.g. K for Q K^T: x2, lane l (< 16)
//       gives row (l % 8), column 8 * (l / 8); then r[0..1] are b[0..1].
//     - B fragment from a K x N (N-contiguous) tile, e.g. V for P V: x2.trans, lane l (< 16)
//       gives row (l % 16) (k), column 0 of the 8-wide n slice; then r[0..1] are b[0..1].
//
// cp.async.cg.shared.global [smem], [gmem], 16{, src_size}
// (sections "Data Movement and Conversion Instructions: cp.async", "cp.async.commit_group",
//  "cp.async.wait_group"):
//   Copies 16 bytes (both addresses 16-byte aligned) asynchronously, bypassing L1. With
//   src_size 0 (cp_async_16_zfill with valid = false) nothing is read and the 16 bytes of
//   smem are zero-filled. cp.async.ca.shared.global [smem], [gmem], 4{, src_size}
//   (cp_async_4_zfill): the same for 4 bytes (both addresses 4-byte aligned), through L1
//   (.cg takes 16 bytes only). The copies a thread issued since its last commit form one group
//   at cp_async_commit(); cp_async_wait<N>() waits until at most the N most recent groups of
//   THIS thread are pending. Nothing else (not __syncthreads) completes a copy: the usual
//   pattern is cp_async_wait<N>() then __syncthreads() before other threads read the tile.
//
// pack_bf16x2 / pack_f16x2: cvt.rn.{bf16x2,f16x2}.f32, round to nearest even; lo goes to
// the low half (the lower-indexed element of a fragment register).
#ifndef HSAP_JIT_DEVICE_HSAP_MMA_CUH_
#define HSAP_JIT_DEVICE_HSAP_MMA_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

namespace hsap_dev {

#ifdef HSAP_DEVICE_EMULATION

HSAP_DEV void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                const float (&c)[4]) {
  hsap_emu_mma_m16n8k16(/*bf16=*/true, d, a, b, c);
}
HSAP_DEV void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                               const float (&c)[4]) {
  hsap_emu_mma_m16n8k16(/*bf16=*/false, d, a, b, c);
}
HSAP_DEV void ldmatrix_x1(unsigned (&r)[1], const void* row) {
  hsap_emu_ldmatrix(1, false, r, row);
}
HSAP_DEV void ldmatrix_x2(unsigned (&r)[2], const void* row) {
  hsap_emu_ldmatrix(2, false, r, row);
}
HSAP_DEV void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  hsap_emu_ldmatrix(4, false, r, row);
}
HSAP_DEV void ldmatrix_x1_trans(unsigned (&r)[1], const void* row) {
  hsap_emu_ldmatrix(1, true, r, row);
}
HSAP_DEV void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) {
  hsap_emu_ldmatrix(2, true, r, row);
}
HSAP_DEV void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  hsap_emu_ldmatrix(4, true, r, row);
}
HSAP_DEV void cp_async_16(void* smem, const void* gmem) { hsap_emu_cp_async(smem, gmem, 16, true); }
HSAP_DEV void cp_async_16_zfill(void* smem, const void* gmem, bool valid) {
  hsap_emu_cp_async(smem, gmem, 16, valid);
}
HSAP_DEV void cp_async_4_zfill(void* smem, const void* gmem, bool valid) {
  hsap_emu_cp_async(smem, gmem, 4, valid);
}
HSAP_DEV void cp_async_commit() { hsap_emu_cp_async_commit(); }
template <int N>
HSAP_DEV void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group takes a non-negative count");
  hsap_emu_cp_async_wait(N);
}

#else  // the GPU: inline PTX, sm_80 and up

HSAP_DEV unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

HSAP_DEV void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}
HSAP_DEV void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                               const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// The "memory" clobbers keep the compiler from moving ordinary shared-memory stores across
// the loads (ldmatrix) and reads of the destination across the waits.
HSAP_DEV void ldmatrix_x1(unsigned (&r)[1], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(shared_address(row))
               : "memory");
}
HSAP_DEV void ldmatrix_x2(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row))
               : "memory");
}
HSAP_DEV void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}
HSAP_DEV void ldmatrix_x1_trans(unsigned (&r)[1], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(shared_address(row))
               : "memory");
}
HSAP_DEV void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row))
               : "memory");
}
HSAP_DEV void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}

HSAP_DEV void cp_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
               :
               : "r"(shared_address(smem)), "l"(gmem)
               : "memory");
}
HSAP_DEV void cp_async_16_zfill(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :
               : "r"(shared_address(smem)), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
HSAP_DEV void cp_async_4_zfill(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               :
               : "r"(shared_address(smem)), "l"(gmem), "r"(valid ? 4 : 0)
               : "memory");
}
HSAP_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
HSAP_DEV void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group takes a non-negative count");
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#endif  // HSAP_DEVICE_EMULATION

HSAP_DEV unsigned pack_bf16x2(float lo, float hi) {
#ifdef HSAP_DEVICE_EMULATION
  return static_cast<unsigned>(from_float<bf16>(lo).bits) |
         (static_cast<unsigned>(from_float<bf16>(hi).bits) << 16);
#else
  unsigned r;
  // cvt packs its first source into the upper half.
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}
HSAP_DEV unsigned pack_f16x2(float lo, float hi) {
#ifdef HSAP_DEVICE_EMULATION
  return static_cast<unsigned>(from_float<f16>(lo).bits) |
         (static_cast<unsigned>(from_float<f16>(hi).bits) << 16);
#else
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// The mma (accumulating in place: d = a * b + d) and the packing of two fp32 values, for
// storage type T (the kernels are templates over bf16 and f16).
template <typename T>
struct MmaOps;
template <>
struct MmaOps<bf16> {
  static HSAP_DEV void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    mma_m16n8k16_bf16(d, a, b, d);
  }
  static HSAP_DEV unsigned pack(float lo, float hi) { return pack_bf16x2(lo, hi); }
};
template <>
struct MmaOps<f16> {
  static HSAP_DEV void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    mma_m16n8k16_f16(d, a, b, d);
  }
  static HSAP_DEV unsigned pack(float lo, float hi) { return pack_f16x2(lo, hi); }
};

// ---- Tile copies on cp.async (used by the forward and the backward) ----
//
// Rows [0, kRows) of head `head` of a [rows, heads, kD] 16-bit tensor, starting at row
// `row0`, into dst (kLd elements per row) by 16-byte cp.async; rows [valid, kRows) are
// zero-filled without reading global memory. The caller commits the group.
// The first kRowStep * kChunks threads (kRowStep = kThreads / kChunks rows at a time, kChunks
// = kD / 8 16-byte chunks per row: all 128 threads at head dims 64, 128 and 256, 120 of them
// at 80 or 240, ...) each copy one fixed chunk column of rows r, r + kRowStep, ...: the
// source address is computed once per call (one 64-bit multiply-add) and bumped by a constant
// stride per copy, the shared address is the same register plus a compile-time offset, and
// the zero-fill is one compare with an immediate; the other threads (fewer than kChunks)
// copy nothing. A walk over every (row, chunk) pair that recomputes the 64-bit row address
// and selects per copy took ~29 instructions per copy against ~4 (docs/gpu_backend.md, "Why
// 137 and 93"); it is what head dims whose chunks do not divide the threads ran until
// 2026-12-05. Addresses are computed as integers: those of zero-filled rows may lie past the
// tensor and are never read.
template <int kRows, int kD, int kLd, int kThreads>
HSAP_DEV void cp_async_rows(void* dst, const void* src, long long row0, int valid, int heads,
                            int head) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  static_assert(kChunks <= kThreads, "hsap: a row's chunks outnumber the threads");
  constexpr int kRowStep = kThreads / kChunks;  // rows between two copies of a thread
  constexpr int kCopies = (kRows + kRowStep - 1) / kRowStep;
  unsigned short* const to = static_cast<unsigned short*>(dst);
  if (kThreads % kChunks == 0 || static_cast<int>(threadIdx.x) < kRowStep * kChunks) {
    const int r = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks;
    const long long row_elems = static_cast<long long>(heads) * kD;
    unsigned long long at =
        reinterpret_cast<unsigned long long>(src) +
        2ull * static_cast<unsigned long long>((row0 + r) * row_elems + head * kD + c * 8);
    const unsigned long long step = 2ull * static_cast<unsigned long long>(kRowStep * row_elems);
    unsigned short* const first = to + r * kLd + c * 8;
    const int left = valid - r;  // copy i reads global memory iff i * kRowStep < left
    HSAP_UNROLL
    for (int i = 0; i < kCopies; ++i) {
      if (kRows % kRowStep == 0 || r + i * kRowStep < kRows) {
        cp_async_16_zfill(first + i * kRowStep * kLd, reinterpret_cast<const void*>(at),
                          i * kRowStep < left);
      }
      at += step;
    }
  }
}

// Two tensors with the same rows (K and V, or Q and dO): `a` into dst, `b` into dst + kGap
// elements. One row offset, one zero-fill test and one shared address serve both.
template <int kRows, int kD, int kLd, int kThreads, int kGap>
HSAP_DEV void cp_async_rows_pair(void* dst, const void* a, const void* b, long long row0,
                                 int valid, int heads, int head) {
  constexpr int kChunks = kD / 8;
  static_assert(kChunks <= kThreads, "hsap: a row's chunks outnumber the threads");
  constexpr int kRowStep = kThreads / kChunks;
  constexpr int kCopies = (kRows + kRowStep - 1) / kRowStep;
  unsigned short* const to = static_cast<unsigned short*>(dst);
  if (kThreads % kChunks == 0 || static_cast<int>(threadIdx.x) < kRowStep * kChunks) {
    const int r = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks;
    const long long row_elems = static_cast<long long>(heads) * kD;
    const unsigned long long off =
        2ull * static_cast<unsigned long long>((row0 + r) * row_elems + head * kD + c * 8);
    unsigned long long at_a = reinterpret_cast<unsigned long long>(a) + off;
    unsigned long long at_b = reinterpret_cast<unsigned long long>(b) + off;
    const unsigned long long step = 2ull * static_cast<unsigned long long>(kRowStep * row_elems);
    unsigned short* const first = to + r * kLd + c * 8;
    const int left = valid - r;
    HSAP_UNROLL
    for (int i = 0; i < kCopies; ++i) {
      if (kRows % kRowStep == 0 || r + i * kRowStep < kRows) {
        const bool ok = i * kRowStep < left;
        cp_async_16_zfill(first + i * kRowStep * kLd, reinterpret_cast<const void*>(at_a), ok);
        cp_async_16_zfill(first + kGap + i * kRowStep * kLd, reinterpret_cast<const void*>(at_b),
                          ok);
      }
      at_a += step;
      at_b += step;
    }
  }
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_MMA_CUH_
