// Storage types of attention tensors and their conversions to and from float.
//
// Tensors are stored as fp32, bf16 or fp16; all arithmetic of the kernels is fp32 (or
// fp64 in the reference). Conversions round to nearest even, like the hardware.
#ifndef HSAP_ATTENTION_DTYPE_H_
#define HSAP_ATTENTION_DTYPE_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace hsap {

enum class DType { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
constexpr std::string_view DTypeName(DType t) {
  return t == DType::kF32 ? "fp32" : t == DType::kBF16 ? "bf16" : "fp16";
}

// Raw 16-bit storage types. Distinct structs so that overloads cannot mix them up.
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float BF16ToFloat(BF16 x) { return std::bit_cast<float>(uint32_t{x.bits} << 16); }

inline BF16 FloatToBF16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return BF16{static_cast<uint16_t>(u >> 16)};
}

inline float F16ToFloat(F16 x) {
  const uint32_t sign = uint32_t{x.bits & 0x8000u} << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t man = x.bits & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return std::bit_cast<float>(sign);
    // Subnormal: value = man * 2^-24.
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

inline F16 FloatToF16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return F16{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return F16{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow: inf
  if (abs < 0x38800000u) {
    // Subnormal or zero in fp16: round abs / 2^-24 to nearest even integer.
    const float a = std::bit_cast<float>(abs);
    const float scaled = a * 16777216.0f;  // exact: power of two
    uint32_t m = static_cast<uint32_t>(scaled);
    const float frac = scaled - static_cast<float>(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return F16{static_cast<uint16_t>(sign | m)};
  }
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15 (in the float layout)
  v += 0xfffu + ((v >> 13) & 1u);  // round to nearest even on the 13 dropped bits
  return F16{static_cast<uint16_t>(sign | (v >> 13))};
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(BF16 x) { return BF16ToFloat(x); }
inline float ToFloat(F16 x) { return F16ToFloat(x); }

template <typename T>
T FromFloat(float f);
template <>
inline float FromFloat<float>(float f) {
  return f;
}
template <>
inline BF16 FromFloat<BF16>(float f) {
  return FloatToBF16(f);
}
template <>
inline F16 FromFloat<F16>(float f) {
  return FloatToF16(f);
}

// Rounds f to the nearest value representable in `t` (the identity for fp32).
inline float RoundTo(DType t, float f) {
  switch (t) {
    case DType::kF32:
      return f;
    case DType::kBF16:
      return BF16ToFloat(FloatToBF16(f));
    case DType::kF16:
      return F16ToFloat(FloatToF16(f));
  }
  return f;
}

// Element i of a buffer of dtype t, as float.
inline float LoadAsFloat(DType t, const void* base, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kBF16:
      return BF16ToFloat(static_cast<const BF16*>(base)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const F16*>(base)[i]);
  }
  return 0.0f;
}

inline void StoreFromFloat(DType t, void* base, size_t i, float f) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(base)[i] = f;
      return;
    case DType::kBF16:
      static_cast<BF16*>(base)[i] = FloatToBF16(f);
      return;
    case DType::kF16:
      static_cast<F16*>(base)[i] = FloatToF16(f);
      return;
  }
}

// Calls fn.template operator()<T>() with T the C++ storage type of t.
template <typename Fn>
decltype(auto) DispatchDType(DType t, Fn&& fn) {
  switch (t) {
    case DType::kBF16:
      return fn.template operator()<BF16>();
    case DType::kF16:
      return fn.template operator()<F16>();
    case DType::kF32:
    default:
      return fn.template operator()<float>();
  }
}

}  // namespace hsap

#endif  // HSAP_ATTENTION_DTYPE_H_
