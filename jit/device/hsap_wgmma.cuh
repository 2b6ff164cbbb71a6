// The sm_90a warpgroup instruction layer: wgmma.mma_async (bf16 / f16 in, fp32 accumulate,
// m64nNk16, A from shared memory or registers, B from shared memory) with its fence and
// commit / wait groups, the 64-bit shared-memory matrix descriptor, and setmaxnreg. One
// function per PTX instruction, like hsap_mma.cuh; the FlashAttention-3-style kernel
// (hsap_attention_wgmma_fwd.cuh) is written on these and on hsap_tma.cuh (TMA, mbarrier).
// They exist on sm_90a only (the "a" target: NVRTC --gpu-architecture=sm_90a, or compute_90a;
// plain sm_90 refuses wgmma and setmaxnreg at ptxas).
//
// NVRTC-clean (no include at all); include after hsap_device.cuh (HSAP_DEV). Under
// HSAP_DEVICE_EMULATION each instruction calls the CPU emulator (tests/support/
// emulated_wgmma.h), written from the same PTX ISA sections as below, separately from any kernel.
//
// ---- PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions" ----
// A warpgroup is 4 contiguous warps whose first warp's rank is a multiple of 4 (threads
// 128w .. 128w + 127). wgmma.mma_async is issued by all 128 threads together.
//
// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16}
//     d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b   (SS)
//     d, {a0, a1, a2, a3}, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-b      (RS)
//   D (64 x N, fp32) = A (64 x 16) * B (16 x N) + (scale-d ? D : 0); N a multiple of 8 in
//   [8, 256] (this layer: multiples of 16). imm-scale-a/b are 1 here (no negation).
//   Accumulator D ("Register Fragments ... Matrix D", m64nNk16): warp w = (thread % 128) / 32
//   of the warpgroup holds rows 16w .. 16w + 15; with lane = thread % 32, g = lane >> 2,
//   t = lane % 4, register d[4j + i] (j = 0 .. N/8 - 1, i = 0..3) holds
//     D[16w + g + 8 * (i >> 1)][8j + 2t + (i & 1)]
//   i.e. mma.m16n8k16's C layout (hsap_mma.cuh) repeated over the N / 8 column blocks.
//   A in registers (RS, "Matrix A" register fragment): the same as mma.m16n8k16's A fragment
//   for warp w's 16 rows: a[0] = A[16w + g][2t, 2t+1], a[1] = A[16w + g + 8][2t, 2t+1],
//   a[2] = A[16w + g][2t+8, 2t+9], a[3] = A[16w + g + 8][2t+8, 2t+9] (low half: lower column).
//   Asynchrony: the instruction only starts the operation. Until a wgmma.wait_group that
//   covers it returns, the accumulator registers and the A registers must not be accessed
//   (read or written) except by further wgmma.mma_async on the same accumulators (the ISA
//   orders those), and the shared memory it reads must not be written: the ISA leaves the
//   results undefined otherwise.
//   wgmma.fence.sync.aligned: required before the first wgmma.mma_async of a warpgroup and
//   between any other access of a thread to the accumulator or A registers and a
//   wgmma.mma_async that uses them. Shared memory written by ordinary stores (the generic
//   proxy) must also be made visible to wgmma (the async proxy) with fence.proxy.async before
//   the wgmma reads it (hsap_tma.cuh's fence_proxy_async_shared); TMA writes need no fence.
//   wgmma.commit_group.sync.aligned: the thread's wgmma.mma_async issued since its last
//   commit form one wgmma-group. wgmma.wait_group.sync.aligned N: waits until at most N of the
//   thread's most recent wgmma-groups are pending (and all earlier ones complete).
//   The compiler knows none of this: between the mma and the wait it may move ordinary reads
//   of the accumulators across the wait. wgmma_fence_operand(d) (an empty asm that "writes"
//   each register) pins them: call it on the accumulators after wgmma_wait_group and before
//   the wgmma that follows their ordinary use (CUTLASS does the same); on an RS operation's
//   A fragment (unsigned[4]) after the wait that frees it.
//
// ---- The shared-memory matrix descriptor ("Asynchronous Warpgroup Level Matrix Shared
//      Memory Layout", "Matrix Descriptor Format") ----
//   bits [13:0]  start address >> 4 (a .shared::cta address, 16-byte aligned)
//   bits [29:16] leading dimension byte offset (LBO) >> 4
//   bits [45:32] stride dimension byte offset (SBO) >> 4
//   bits [51:49] matrix base offset (0 here: the operand's swizzle pattern starts aligned)
//   bits [63:62] swizzle: 0 none, 1 128B, 2 64B, 3 32B (WgmmaSwizzle)
// The operand is a 64 x 16 (A) or N x 16 (B^T) matrix of 16-bit elements, seen as "core
// matrices" of 8 rows x 16 bytes. With rows along M / N ("MN") and 16 elements along K:
//   K-major (A always in SS; B with kTransB = false, i.e. B^T stored N rows of K elements,
//   e.g. K for S = Q K^T), element (mn, k) at byte
//     no swizzle:   start + (mn / 8) * SBO + (k / 8) * LBO + (mn % 8) * 16 + (k % 8) * 2
//     swizzle S:    start + (mn / 8) * SBO + (mn % 8) * S + k * 2          (LBO unused)
//   MN-major (B with kTransB = true: B stored K rows of N elements, e.g. V for O = P V), with
//   E = S / 2 elements per swizzled row:
//     no swizzle:   start + (mn / 8) * SBO + (k / 8) * LBO + (k % 8) * 16 + (mn % 8) * 2
//     swizzle S:    start + (mn / E) * LBO + (k / 8) * SBO + (k % 8) * S + (mn % E) * 2
//   then the mode's XOR (tests/support/emulated_swizzle.h) on the resulting shared address:
//   a tile written by TMA with the same swizzle mode (box inner dimension S bytes, rows S
//   bytes apart) is read back in its logical order. With 128B swizzle and K-major tiles of 64
//   elements per row, the k-th 16-column slice starts 32 * k bytes into the tile (SBO = 1024,
//   8 rows of 128 bytes); the tile itself starts at a multiple of 1024 bytes.
//
// ---- setmaxnreg (PTX ISA "Miscellaneous Instructions: setmaxnreg", sm_90a) ----
// setmaxnreg.{inc,dec}.sync.aligned.u32 N: every thread of the warp's warpgroup asks for a
// new per-thread register count N, a multiple of 8 in [24, 256]; .inc requires N >= the
// current count (it blocks until registers are free), .dec N <= it. All warps of the
// warpgroup must execute the same setmaxnreg. The kernel must be compiled with a register
// count the pool can satisfy (__launch_bounds__ / --maxrregcount).
#ifndef HSAP_JIT_DEVICE_HSAP_WGMMA_CUH_
#define HSAP_JIT_DEVICE_HSAP_WGMMA_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

namespace hsap_dev {

enum WgmmaSwizzle : int { kSwizzleNone = 0, kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };

// The descriptor's bits from a .shared::cta byte address (see above). The low 4 bits of the
// address and of the offsets are dropped by the format: callers pass multiples of 16.
HSAP_DEV unsigned long long wgmma_desc_bits(unsigned shared_address, unsigned leading_byte_offset,
                                            unsigned stride_byte_offset, int swizzle) {
  return static_cast<unsigned long long>((shared_address & 0x3ffffu) >> 4) |
         (static_cast<unsigned long long>((leading_byte_offset >> 4) & 0x3fffu) << 16) |
         (static_cast<unsigned long long>((stride_byte_offset >> 4) & 0x3fffu) << 32) |
         (static_cast<unsigned long long>(swizzle & 3) << 62);
}

// The descriptor of the address `bytes` (a multiple of 16) past desc's start, other fields
// kept: the start-address field (bits 0-13, address >> 4) advanced. Shared addresses are below
// 2^18, so it cannot carry into the leading byte offset. One descriptor per tile and an add per
// k-step, rather than a descriptor per k-step that ptxas may hoist out of the tile loop and
// keep in registers; the add is on the low word, so the high one (stride byte offset and
// swizzle: compile-time constants) stays a constant.
HSAP_DEV unsigned long long wgmma_desc_advance(unsigned long long desc, unsigned bytes) {
  const unsigned lo = static_cast<unsigned>(desc) + (bytes >> 4);
  return (desc & 0xffffffff00000000ull) | lo;
}

// desc with its leading byte offset (bits 16-29, bytes >> 4) replaced: the same tile read
// MN-major instead of K-major, one instruction from the descriptor already formed.
HSAP_DEV unsigned long long wgmma_desc_with_lbo(unsigned long long desc,
                                                unsigned leading_byte_offset) {
  const unsigned lo =
      (static_cast<unsigned>(desc) & 0xc000ffffu) | (((leading_byte_offset >> 4) & 0x3fffu) << 16);
  return (desc & 0xffffffff00000000ull) | lo;
}

template <int N>
struct WgmmaShapeCheck {
  static_assert(N >= 16 && N <= 256 && N % 16 == 0,
                "wgmma m64nNk16: this layer provides N = 16, 32, .., 256");
  static constexpr bool ok = true;
};
template <int kRegs>
struct SetmaxnregCheck {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0,
                "setmaxnreg: the register count must be a multiple of 8 in [24, 256]");
  static constexpr bool ok = true;
};

#ifdef HSAP_DEVICE_EMULATION

HSAP_DEV unsigned long long wgmma_desc(const void* smem, unsigned leading_byte_offset,
                                       unsigned stride_byte_offset, int swizzle) {
  hsap_emu_wgmma_check_desc(smem, leading_byte_offset, stride_byte_offset, swizzle);
  return wgmma_desc_bits(hsap_emu_shared_offset(smem), leading_byte_offset, stride_byte_offset,
                         swizzle);
}
HSAP_DEV void wgmma_fence() { hsap_emu_wgmma_fence(); }
HSAP_DEV void wgmma_commit_group() { hsap_emu_wgmma_commit_group(); }
template <int N>
HSAP_DEV void wgmma_wait_group() {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes an immediate in [0, 7]");
  hsap_emu_wgmma_wait_group(N);
}
template <int N, bool kBf16, bool kTransB>
HSAP_DEV void wgmma_m64k16_ss(float (&d)[N / 2], unsigned long long a_desc,
                              unsigned long long b_desc, bool accumulate) {
  static_assert(WgmmaShapeCheck<N>::ok, "");
  hsap_emu_wgmma_mma_async(N, kBf16, kTransB, d, nullptr, a_desc, b_desc, accumulate);
}
template <int N, bool kBf16, bool kTransB>
HSAP_DEV void wgmma_m64k16_rs(float (&d)[N / 2], const unsigned (&a)[4],
                              unsigned long long b_desc, bool accumulate) {
  static_assert(WgmmaShapeCheck<N>::ok, "");
  hsap_emu_wgmma_mma_async(N, kBf16, kTransB, d, a, 0, b_desc, accumulate);
}
HSAP_DEV void wgmma_opaque(int&) {}
HSAP_DEV void wgmma_opaque(long long&) {}
template <int kRegs>
HSAP_DEV void wgmma_fence_operand(float (&)[kRegs]) {}
template <int kRegs>
HSAP_DEV void wgmma_fence_operand(unsigned (&)[kRegs]) {}
template <int kRegs>
HSAP_DEV void setmaxnreg_inc() {
  static_assert(SetmaxnregCheck<kRegs>::ok, "");
  hsap_emu_setmaxnreg(/*inc=*/true, kRegs);
}
template <int kRegs>
HSAP_DEV void setmaxnreg_dec() {
  static_assert(SetmaxnregCheck<kRegs>::ok, "");
  hsap_emu_setmaxnreg(/*inc=*/false, kRegs);
}

#else  // the GPU: inline PTX, sm_90a

// "+f"(d[8k]) .. "+f"(d[8k + 7]): the k-th group of 8 accumulator operands; and the text of
// their registers, "%8k, .., %8k+7".
#define HSAP_WGMMA_D8(k)                                                                   \
  "+f"(d[8 * (k) + 0]), "+f"(d[8 * (k) + 1]), "+f"(d[8 * (k) + 2]), "+f"(d[8 * (k) + 3]), \
      "+f"(d[8 * (k) + 4]), "+f"(d[8 * (k) + 5]), "+f"(d[8 * (k) + 6]), "+f"(d[8 * (k) + 7])
#define HSAP_WGMMA_R8_0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define HSAP_WGMMA_R8_1 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define HSAP_WGMMA_R8_2 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define HSAP_WGMMA_R8_3 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define HSAP_WGMMA_R8_4 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define HSAP_WGMMA_R8_5 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define HSAP_WGMMA_R8_6 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define HSAP_WGMMA_R8_7 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define HSAP_WGMMA_R8_8 ", %64, %65, %66, %67, %68, %69, %70, %71"
#define HSAP_WGMMA_R8_9 ", %72, %73, %74, %75, %76, %77, %78, %79"
#define HSAP_WGMMA_R8_10 ", %80, %81, %82, %83, %84, %85, %86, %87"
#define HSAP_WGMMA_R8_11 ", %88, %89, %90, %91, %92, %93, %94, %95"
#define HSAP_WGMMA_R8_12 ", %96, %97, %98, %99, %100, %101, %102, %103"
#define HSAP_WGMMA_R8_13 ", %104, %105, %106, %107, %108, %109, %110, %111"
#define HSAP_WGMMA_R8_14 ", %112, %113, %114, %115, %116, %117, %118, %119"
#define HSAP_WGMMA_R8_15 ", %120, %121, %122, %123, %124, %125, %126, %127"
// m64nNk16 (N / 2 accumulators): HSAP_WGMMA_D<N>, the accumulator operands; HSAP_WGMMA_R<N>, the
// text of their registers; HSAP_WGMMA_SS<N>(TYPE) / HSAP_WGMMA_RS<N>(TYPE), the instruction,
// whose inputs follow the accumulators: SS a-desc, b-desc, accumulate (.b32, 0 or 1: the
// scale-d predicate), imm-trans-b; RS a0..a3, b-desc, accumulate, imm-trans-b.
#define HSAP_WGMMA_D16 HSAP_WGMMA_D8(0)
#define HSAP_WGMMA_R16 HSAP_WGMMA_R8_0
#define HSAP_WGMMA_SS16(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R16 "}, %8, %9, p, 1, 1, 0, %11;\n}\n"
#define HSAP_WGMMA_RS16(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R16 "}, {%8, %9, %10, %11}, %12, p, 1, 1, %14;\n}\n"
#define HSAP_WGMMA_D32 HSAP_WGMMA_D16, HSAP_WGMMA_D8(1)
#define HSAP_WGMMA_R32 HSAP_WGMMA_R16 HSAP_WGMMA_R8_1
#define HSAP_WGMMA_SS32(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R32 "}, %16, %17, p, 1, 1, 0, %19;\n}\n"
#define HSAP_WGMMA_RS32(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R32 "}, {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
#define HSAP_WGMMA_D48 HSAP_WGMMA_D32, HSAP_WGMMA_D8(2)
#define HSAP_WGMMA_R48 HSAP_WGMMA_R32 HSAP_WGMMA_R8_2
#define HSAP_WGMMA_SS48(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\nwgmma.mma_async.sync.aligned.m64n48k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R48 "}, %24, %25, p, 1, 1, 0, %27;\n}\n"
#define HSAP_WGMMA_RS48(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\nwgmma.mma_async.sync.aligned.m64n48k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R48 "}, {%24, %25, %26, %27}, %28, p, 1, 1, %30;\n}\n"
#define HSAP_WGMMA_D64 HSAP_WGMMA_D48, HSAP_WGMMA_D8(3)
#define HSAP_WGMMA_R64 HSAP_WGMMA_R48 HSAP_WGMMA_R8_3
#define HSAP_WGMMA_SS64(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R64 "}, %32, %33, p, 1, 1, 0, %35;\n}\n"
#define HSAP_WGMMA_RS64(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R64 "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
#define HSAP_WGMMA_D80 HSAP_WGMMA_D64, HSAP_WGMMA_D8(4)
#define HSAP_WGMMA_R80 HSAP_WGMMA_R64 HSAP_WGMMA_R8_4
#define HSAP_WGMMA_SS80(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\nwgmma.mma_async.sync.aligned.m64n80k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R80 "}, %40, %41, p, 1, 1, 0, %43;\n}\n"
#define HSAP_WGMMA_RS80(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\nwgmma.mma_async.sync.aligned.m64n80k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R80 "}, {%40, %41, %42, %43}, %44, p, 1, 1, %46;\n}\n"
#define HSAP_WGMMA_D96 HSAP_WGMMA_D80, HSAP_WGMMA_D8(5)
#define HSAP_WGMMA_R96 HSAP_WGMMA_R80 HSAP_WGMMA_R8_5
#define HSAP_WGMMA_SS96(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\nwgmma.mma_async.sync.aligned.m64n96k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R96 "}, %48, %49, p, 1, 1, 0, %51;\n}\n"
#define HSAP_WGMMA_RS96(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\nwgmma.mma_async.sync.aligned.m64n96k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R96 "}, {%48, %49, %50, %51}, %52, p, 1, 1, %54;\n}\n"
#define HSAP_WGMMA_D112 HSAP_WGMMA_D96, HSAP_WGMMA_D8(6)
#define HSAP_WGMMA_R112 HSAP_WGMMA_R96 HSAP_WGMMA_R8_6
#define HSAP_WGMMA_SS112(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %58, 0;\nwgmma.mma_async.sync.aligned.m64n112k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R112 "}, %56, %57, p, 1, 1, 0, %59;\n}\n"
#define HSAP_WGMMA_RS112(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %61, 0;\nwgmma.mma_async.sync.aligned.m64n112k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R112 "}, {%56, %57, %58, %59}, %60, p, 1, 1, %62;\n}\n"
#define HSAP_WGMMA_D128 HSAP_WGMMA_D112, HSAP_WGMMA_D8(7)
#define HSAP_WGMMA_R128 HSAP_WGMMA_R112 HSAP_WGMMA_R8_7
#define HSAP_WGMMA_SS128(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R128 "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
#define HSAP_WGMMA_RS128(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R128 "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
#define HSAP_WGMMA_D144 HSAP_WGMMA_D128, HSAP_WGMMA_D8(8)
#define HSAP_WGMMA_R144 HSAP_WGMMA_R128 HSAP_WGMMA_R8_8
#define HSAP_WGMMA_SS144(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %74, 0;\nwgmma.mma_async.sync.aligned.m64n144k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R144 "}, %72, %73, p, 1, 1, 0, %75;\n}\n"
#define HSAP_WGMMA_RS144(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %77, 0;\nwgmma.mma_async.sync.aligned.m64n144k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R144 "}, {%72, %73, %74, %75}, %76, p, 1, 1, %78;\n}\n"
#define HSAP_WGMMA_D160 HSAP_WGMMA_D144, HSAP_WGMMA_D8(9)
#define HSAP_WGMMA_R160 HSAP_WGMMA_R144 HSAP_WGMMA_R8_9
#define HSAP_WGMMA_SS160(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\nwgmma.mma_async.sync.aligned.m64n160k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R160 "}, %80, %81, p, 1, 1, 0, %83;\n}\n"
#define HSAP_WGMMA_RS160(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %85, 0;\nwgmma.mma_async.sync.aligned.m64n160k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R160 "}, {%80, %81, %82, %83}, %84, p, 1, 1, %86;\n}\n"
#define HSAP_WGMMA_D176 HSAP_WGMMA_D160, HSAP_WGMMA_D8(10)
#define HSAP_WGMMA_R176 HSAP_WGMMA_R160 HSAP_WGMMA_R8_10
#define HSAP_WGMMA_SS176(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\nwgmma.mma_async.sync.aligned.m64n176k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R176 "}, %88, %89, p, 1, 1, 0, %91;\n}\n"
#define HSAP_WGMMA_RS176(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %93, 0;\nwgmma.mma_async.sync.aligned.m64n176k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R176 "}, {%88, %89, %90, %91}, %92, p, 1, 1, %94;\n}\n"
#define HSAP_WGMMA_D192 HSAP_WGMMA_D176, HSAP_WGMMA_D8(11)
#define HSAP_WGMMA_R192 HSAP_WGMMA_R176 HSAP_WGMMA_R8_11
#define HSAP_WGMMA_SS192(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\nwgmma.mma_async.sync.aligned.m64n192k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R192 "}, %96, %97, p, 1, 1, 0, %99;\n}\n"
#define HSAP_WGMMA_RS192(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\nwgmma.mma_async.sync.aligned.m64n192k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R192 "}, {%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n"
#define HSAP_WGMMA_D208 HSAP_WGMMA_D192, HSAP_WGMMA_D8(12)
#define HSAP_WGMMA_R208 HSAP_WGMMA_R192 HSAP_WGMMA_R8_12
#define HSAP_WGMMA_SS208(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %106, 0;\nwgmma.mma_async.sync.aligned.m64n208k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R208 "}, %104, %105, p, 1, 1, 0, %107;\n}\n"
#define HSAP_WGMMA_RS208(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %109, 0;\nwgmma.mma_async.sync.aligned.m64n208k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R208 "}, {%104, %105, %106, %107}, %108, p, 1, 1, %110;\n}\n"
#define HSAP_WGMMA_D224 HSAP_WGMMA_D208, HSAP_WGMMA_D8(13)
#define HSAP_WGMMA_R224 HSAP_WGMMA_R208 HSAP_WGMMA_R8_13
#define HSAP_WGMMA_SS224(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %114, 0;\nwgmma.mma_async.sync.aligned.m64n224k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R224 "}, %112, %113, p, 1, 1, 0, %115;\n}\n"
#define HSAP_WGMMA_RS224(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %117, 0;\nwgmma.mma_async.sync.aligned.m64n224k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R224 "}, {%112, %113, %114, %115}, %116, p, 1, 1, %118;\n}\n"
#define HSAP_WGMMA_D240 HSAP_WGMMA_D224, HSAP_WGMMA_D8(14)
#define HSAP_WGMMA_R240 HSAP_WGMMA_R224 HSAP_WGMMA_R8_14
#define HSAP_WGMMA_SS240(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %122, 0;\nwgmma.mma_async.sync.aligned.m64n240k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R240 "}, %120, %121, p, 1, 1, 0, %123;\n}\n"
#define HSAP_WGMMA_RS240(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %125, 0;\nwgmma.mma_async.sync.aligned.m64n240k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R240 "}, {%120, %121, %122, %123}, %124, p, 1, 1, %126;\n}\n"
#define HSAP_WGMMA_D256 HSAP_WGMMA_D240, HSAP_WGMMA_D8(15)
#define HSAP_WGMMA_R256 HSAP_WGMMA_R240 HSAP_WGMMA_R8_15
#define HSAP_WGMMA_SS256(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R256 "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
#define HSAP_WGMMA_RS256(TYPE)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE \
  "." TYPE " {" HSAP_WGMMA_R256 "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"

HSAP_DEV unsigned long long wgmma_desc(const void* smem, unsigned leading_byte_offset,
                                       unsigned stride_byte_offset, int swizzle) {
  return wgmma_desc_bits(static_cast<unsigned>(__cvta_generic_to_shared(smem)),
                         leading_byte_offset, stride_byte_offset, swizzle);
}
HSAP_DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
HSAP_DEV void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
HSAP_DEV void wgmma_wait_group() {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes an immediate in [0, 7]");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// One `if constexpr` per N: each asm statement names its N / 2 accumulators.
#define HSAP_WGMMA_SS_CASE(NN)                                                            \
  if constexpr (N == NN) {                                                                \
    if constexpr (kBf16) {                                                                \
      asm volatile(HSAP_WGMMA_SS##NN("bf16")                                              \
                   : HSAP_WGMMA_D##NN                                                     \
                   : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransB ? 1 : 0));       \
    } else {                                                                              \
      asm volatile(HSAP_WGMMA_SS##NN("f16")                                               \
                   : HSAP_WGMMA_D##NN                                                     \
                   : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransB ? 1 : 0));       \
    }                                                                                     \
  }
#define HSAP_WGMMA_RS_CASE(NN)                                                            \
  if constexpr (N == NN) {                                                                \
    if constexpr (kBf16) {                                                                \
      asm volatile(HSAP_WGMMA_RS##NN("bf16")                                              \
                   : HSAP_WGMMA_D##NN                                                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc),             \
                     "r"(scale_d), "n"(kTransB ? 1 : 0));                                 \
    } else {                                                                              \
      asm volatile(HSAP_WGMMA_RS##NN("f16")                                               \
                   : HSAP_WGMMA_D##NN                                                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc),             \
                     "r"(scale_d), "n"(kTransB ? 1 : 0));                                 \
    }                                                                                     \
  }
#define HSAP_WGMMA_ALL_N(CASE)                                                             \
  CASE(16) CASE(32) CASE(48) CASE(64) CASE(80) CASE(96) CASE(112) CASE(128) CASE(144)      \
  CASE(160) CASE(176) CASE(192) CASE(208) CASE(224) CASE(240) CASE(256)

template <int N, bool kBf16, bool kTransB>
HSAP_DEV void wgmma_m64k16_ss(float (&d)[N / 2], unsigned long long a_desc,
                              unsigned long long b_desc, bool accumulate) {
  static_assert(WgmmaShapeCheck<N>::ok, "");
  const unsigned scale_d = accumulate ? 1u : 0u;
  HSAP_WGMMA_ALL_N(HSAP_WGMMA_SS_CASE)
}
template <int N, bool kBf16, bool kTransB>
HSAP_DEV void wgmma_m64k16_rs(float (&d)[N / 2], const unsigned (&a)[4],
                              unsigned long long b_desc, bool accumulate) {
  static_assert(WgmmaShapeCheck<N>::ok, "");
  const unsigned scale_d = accumulate ? 1u : 0u;
  HSAP_WGMMA_ALL_N(HSAP_WGMMA_RS_CASE)
}

// Makes x opaque at this point: what the code after it derives from x (addresses, indices)
// is computed here, in the enclosing loop, rather than hoisted out of it by the compiler and
// held in registers across the loop (which, next to wgmma accumulators, spilled). A no-op in
// the emulator.
HSAP_DEV void wgmma_opaque(int& x) { asm volatile("" : "+r"(x)); }
HSAP_DEV void wgmma_opaque(long long& x) { asm volatile("" : "+l"(x)); }

// Pins the accumulators (float) or an A fragment (unsigned) in place around the
// asynchronous window (see the top of the file).
template <int kRegs>
HSAP_DEV void wgmma_fence_operand(float (&d)[kRegs]) {
  HSAP_UNROLL
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int kRegs>
HSAP_DEV void wgmma_fence_operand(unsigned (&r)[kRegs]) {
  HSAP_UNROLL
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

template <int kRegs>
HSAP_DEV void setmaxnreg_inc() {
  static_assert(SetmaxnregCheck<kRegs>::ok, "");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
HSAP_DEV void setmaxnreg_dec() {
  static_assert(SetmaxnregCheck<kRegs>::ok, "");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

#endif  // HSAP_DEVICE_EMULATION

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_WGMMA_CUH_
