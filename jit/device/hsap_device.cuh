// hsap's own device helpers: storage types and conversions, warp reductions, the online
// softmax state and the log-sum-exp merge.
//
// NVRTC-clean and nvcc-clean: no include at all (NVRTC is given no include path), no host
// function, no dependency on cuda_fp16.h / cuda_bf16.h. Conversions use PTX cvt with
// round-to-nearest-even (the host's attention/dtype.h rounds the same way).
// The body is visible only to CUDA compilers; a host C++ file may include this header to
// record the dependency and sees nothing. HSAP_DEVICE_EMULATION (tests/jit/cuda_emulator.h)
// compiles the same code as host C++ with threads standing in for CUDA threads; the few
// inline-PTX statements then have plain C++ equivalents.
#ifndef HSAP_JIT_DEVICE_HSAP_DEVICE_CUH_
#define HSAP_JIT_DEVICE_HSAP_DEVICE_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#define HSAP_DEV __device__ __forceinline__

// Loop unrolling hints (no-ops for the host compiler of the emulation).
#ifdef HSAP_DEVICE_EMULATION
#define HSAP_UNROLL
#define HSAP_UNROLL_N(n)
#else
#define HSAP_PRAGMA(x) _Pragma(#x)
#define HSAP_UNROLL HSAP_PRAGMA(unroll)
#define HSAP_UNROLL_N(n) HSAP_PRAGMA(unroll n)
#endif

namespace hsap_dev {

// Raw 16-bit storage types (bit patterns, like hsap::BF16 / hsap::F16 on the host).
struct bf16 {
  unsigned short bits;
};
struct f16 {
  unsigned short bits;
};

HSAP_DEV float neg_inf() { return __int_as_float(0xff800000); }
HSAP_DEV float pos_inf() { return __int_as_float(0x7f800000); }
HSAP_DEV float quiet_nan() { return __int_as_float(0x7fc00000); }

HSAP_DEV float to_float(float x) { return x; }
HSAP_DEV float to_float(bf16 x) { return __uint_as_float(static_cast<unsigned int>(x.bits) << 16); }
HSAP_DEV float to_float(f16 x) {
#ifdef HSAP_DEVICE_EMULATION
  return hsap_emu_f16_to_float(x.bits);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
#endif
}

template <typename T>
struct FromFloat;
template <>
struct FromFloat<float> {
  static HSAP_DEV float cvt(float f) { return f; }
};
template <>
struct FromFloat<bf16> {
  static HSAP_DEV bf16 cvt(float f) {
    bf16 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#else
    // Round to nearest even on the 16 dropped bits; NaN stays a (quiet) NaN.
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      r.bits = static_cast<unsigned short>((u >> 16) | 0x40u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      r.bits = static_cast<unsigned short>(u >> 16);
    }
#endif
    return r;
  }
};
template <>
struct FromFloat<f16> {
  static HSAP_DEV f16 cvt(float f) {
    f16 r;
#ifdef HSAP_DEVICE_EMULATION
    r.bits = hsap_emu_float_to_f16(f);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#endif
    return r;
  }
};
template <typename T>
HSAP_DEV T from_float(float f) {
  return FromFloat<T>::cvt(f);
}

// Element i of a storage-typed buffer, as float.
template <typename T>
HSAP_DEV float load_float(const void* base, long long i) {
  return to_float(static_cast<const T*>(base)[i]);
}

// Same, with ld.global.cg (L2 only, skipping the non-coherent L1): for buffers written by
// other CTAs of the running kernel and published through a flag.
#ifdef HSAP_DEVICE_EMULATION
template <typename T>
HSAP_DEV float load_float_cg(const void* base, long long i) {
  return load_float<T>(base, i);
}
#else
template <typename T>
HSAP_DEV float load_float_cg(const void* base, long long i);
template <>
HSAP_DEV float load_float_cg<float>(const void* base, long long i) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(static_cast<const float*>(base) + i));
  return v;
}
template <>
HSAP_DEV float load_float_cg<bf16>(const void* base, long long i) {
  bf16 v;
  asm volatile("ld.global.cg.u16 %0, [%1];"
               : "=h"(v.bits)
               : "l"(static_cast<const bf16*>(base) + i));
  return to_float(v);
}
template <>
HSAP_DEV float load_float_cg<f16>(const void* base, long long i) {
  f16 v;
  asm volatile("ld.global.cg.u16 %0, [%1];"
               : "=h"(v.bits)
               : "l"(static_cast<const f16*>(base) + i));
  return to_float(v);
}
#endif

// The kernel's dynamic shared memory (sized at launch).
HSAP_DEV float* dynamic_smem() {
#ifdef HSAP_DEVICE_EMULATION
  return hsap_emu_dynamic_smem();
#else
  extern __shared__ float4 hsap_smem_f4[];
  return reinterpret_cast<float*>(hsap_smem_f4);
#endif
}

// ---- warp reductions over aligned groups of kWidth lanes (kWidth a power of two <= 32;
// every lane of the warp must call) ----
template <int kWidth>
HSAP_DEV float group_max(float v) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "group width");
  HSAP_UNROLL
  for (int offset = kWidth / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}
template <int kWidth>
HSAP_DEV float group_sum(float v) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "group width");
  HSAP_UNROLL
  for (int offset = kWidth / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
HSAP_DEV float warp_sum(float v) { return group_sum<32>(v); }

// ---- online softmax, in the log2 domain (scores pre-multiplied by scale * log2(e)) ----
//
// State of one query row: running max m (-inf before any visible key) and running sum l of
// 2^(x - m). For each tile: rescale = begin_tile(tile_max); p = weight(x) per score; then
// end_tile(sum of p). The accumulator is multiplied by `rescale` before adding p * v.
struct OnlineSoftmax {
  float m;
  float l;
  float m_use;  // m, or 0 while m is -inf, so that 2^(x - m_use) is 0 for x = -inf

  HSAP_DEV void init() {
    m = neg_inf();
    l = 0.0f;
    m_use = 0.0f;
  }
  HSAP_DEV float begin_tile(float tile_max) {
    const float m_new = fmaxf(m, tile_max);
    const float next_use = m_new == neg_inf() ? 0.0f : m_new;
    const float rescale = exp2f(m - next_use);  // 0 when m is -inf
    m = m_new;
    m_use = next_use;
    l *= rescale;
    return rescale;
  }
  HSAP_DEV float weight(float x) const { return exp2f(x - m_use); }  // 0 for x = -inf
  HSAP_DEV void end_tile(float tile_sum) { l += tile_sum; }
  // Natural-log lse of the row, -inf when no key was visible.
  HSAP_DEV float lse() const { return l > 0.0f ? (m + log2f(l)) * 0.6931471805599453f : neg_inf(); }
  HSAP_DEV float inv_l() const { return l > 0.0f ? 1.0f / l : 0.0f; }
};

constexpr float kLog2E = 1.4426950408889634f;  // log2(e): e^x = 2^(x log2(e))

// ex2.approx.ftz.f32 (PTX ISA, "Floating Point Instructions: ex2"): 2^x with a maximum
// relative error of 2 ulp, subnormal inputs and results flushed to zero; -inf gives +0,
// +inf gives +inf, NaN gives NaN. One MUFU.EX2, without exp2f's handling of subnormal
// results (two FMULs and a compare around it).
HSAP_DEV float ex2_approx(float x) {
#ifdef HSAP_DEVICE_EMULATION
  return hsap_emu_ex2_approx_ftz(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// The backward's probability e^(s * scale - lse) as 2^(s * scale_log2 - lse_log2), with
// scale_log2 = scale * log2(e) and lse_log2 = lse * log2(e) (the tensor-core backwards keep
// their rows' lse so): one FFMA and one ex2.approx, no branch (expf has a slow path).
HSAP_DEV float prob_from_log2(float s, float scale_log2, float lse_log2) {
  return ex2_approx(fmaf(s, scale_log2, -lse_log2));
}

// The online softmax of the tensor-core forward kernels, on unscaled scores: the row max is
// taken over the raw scores s and the weight is 2^(s * scale_log2 - m * scale_log2), one FFMA
// and one ex2.approx per score (FlashAttention-2's form). scale_log2 = scale * log2(e) > 0
// (the C ABI refuses a negative scale), so the max of the raw scores is that of the scaled
// ones. NaN and +inf need no per-score test: a NaN score makes its weight NaN, a +inf score
// makes m +inf and its weight 2^(inf - inf) = NaN, and a NaN l stays NaN through every later
// rescale, so the row's l is NaN exactly when the FMA core's per-score flag would be set
// (row_is_nan below). A row whose visible scores are all -inf keeps l = 0.
struct FoldedOnlineSoftmax {
  float m;  // max of the raw scores, -inf before any visible key
  float l;

  HSAP_DEV void init() {
    m = neg_inf();
    l = 0.0f;
  }
  // m * scale_log2, or 0 while m is -inf (so that 2^(-inf - 0) is 0). Not kept: two registers
  // per row are worth more to the accumulators than the FMUL per tile that recomputes it (the
  // compiler computes it once for the tile's weights).
  HSAP_DEV float m_scaled(float scale_log2) const { return m == neg_inf() ? 0.0f : m * scale_log2; }
  // tile_max: the max of the tile's raw scores (-inf where none is visible).
  HSAP_DEV float begin_tile(float tile_max, float scale_log2) {
    const float m_old = m;
    m = fmaxf(m, tile_max);
    const float rescale = ex2_approx(m_old * scale_log2 - m_scaled(scale_log2));  // 0: m_old -inf
    l *= rescale;
    return rescale;
  }
  HSAP_DEV float weight(float s, float scale_log2) const {
    return ex2_approx(fmaf(s, scale_log2, -m_scaled(scale_log2)));  // 0 for s = -inf
  }
  HSAP_DEV void end_tile(float tile_sum) { l += tile_sum; }
  // The row's result is NaN: a NaN or +inf score (l NaN), or visible keys whose scores are
  // all -inf (the naive softmax's 0 / 0); saw_key says whether any key was visible.
  HSAP_DEV bool row_is_nan(bool saw_key) const { return !(l == l) || (saw_key && l == 0.0f); }
  // Natural-log lse of the row, -inf when no key was visible (l = 0).
  HSAP_DEV float lse(float scale_log2) const {
    return l == 0.0f ? neg_inf() : (m_scaled(scale_log2) + log2f(l)) * 0.6931471805599453f;
  }
  HSAP_DEV float inv_l() const { return l > 0.0f ? 1.0f / l : 0.0f; }
};

// ---- merge of partial results (attention/merge.h) ----
//
// Given lse1 (existing) and lse2 (new), returns the merged lse and the weights w1, w2 with
// o = w1 * o1 + w2 * o2. A side with lse = -inf has weight 0; both -inf keeps -inf, w1 = 1.
struct LseMerge {
  float lse, w1, w2;
};
HSAP_DEV LseMerge merge_lse(float lse1, float lse2) {
  LseMerge r;
  if (lse2 == neg_inf()) {
    r.lse = lse1;
    r.w1 = 1.0f;
    r.w2 = 0.0f;
  } else if (lse1 == neg_inf()) {
    r.lse = lse2;
    r.w1 = 0.0f;
    r.w2 = 1.0f;
  } else {
    const float mx = fmaxf(lse1, lse2);
    r.lse = mx + logf(expf(lse1 - mx) + expf(lse2 - mx));
    r.w1 = expf(lse1 - r.lse);
    r.w2 = expf(lse2 - r.lse);
  }
  return r;
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_DEVICE_CUH_
