// Inputs of the emulated CUDA kernel tests (tests/jit/cuda_*emulation_test.cc): a work list
// in the device's structs, and 16-bit Q/K/V of a packed row. Include after the device headers
// (jit/device/hsap_params.cuh, through tests/support/cuda_emulator.h and the kernels').
#ifndef HSAP_TESTS_SUPPORT_EMULATED_KERNEL_INPUTS_H_
#define HSAP_TESTS_SUPPORT_EMULATED_KERNEL_INPUTS_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "attention/worklist.h"

namespace hsap::testing {

inline std::vector<hsap_dev::QueryBlock> DeviceBlocks(const WorkList& w) {
  std::vector<hsap_dev::QueryBlock> out;
  for (const QueryBlock& b : w.blocks) out.push_back({b.q_begin, b.q_end, b.seg_begin, b.seg_end});
  return out;
}
inline std::vector<hsap_dev::KeySegment> DeviceSegments(const WorkList& w) {
  std::vector<hsap_dev::KeySegment> out;
  for (const KeySegment& s : w.segments) out.push_back({s.k_begin, s.k_end, s.diag_lo, s.diag_hi});
  return out;
}

// 16-bit storage (bf16 or f16 bits), 16-byte aligned as cp.async and TMA require of a global
// address (and as device allocations are).
struct Bits {
  std::vector<uint16_t> v;
  DType dtype;
  Bits(DType t, size_t n) : v(n + 8, 0), dtype(t) {}
  uint16_t* data() {
    auto p = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + ((16 - p % 16) % 16) / 2;
  }
  const uint16_t* data() const { return const_cast<Bits*>(this)->data(); }
  void Set(size_t i, float x) {
    data()[i] = dtype == DType::kBF16 ? FloatToBF16(x).bits : FloatToF16(x).bits;
  }
  float Get(size_t i) const {
    return dtype == DType::kBF16 ? BF16ToFloat(BF16{data()[i]}) : F16ToFloat(F16{data()[i]});
  }
};

// A packed row of [tokens][heads][head_dim] 16-bit Q, K, V.
struct BitsProblem {
  Layout layout;
  AttentionDims dims;
  DType dtype;
  Bits q, k, v;
  int64_t T() const { return layout.num_tokens(); }
};

// Uniform q, k in [-2, 2] and v in [-1, 1]: scores of a few units, so that softmax rows are
// neither flat nor one-hot.
inline BitsProblem MakeBitsProblem(Layout layout, DType dtype, int head_dim, int heads_q,
                                   int heads_kv, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  AttentionDims dims;
  dims.heads_q = heads_q;
  dims.heads_kv = heads_kv;
  dims.head_dim = head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t T = layout.num_tokens();
  BitsProblem p{std::move(layout),
                dims,
                dtype,
                Bits(dtype, T * heads_q * head_dim),
                Bits(dtype, T * heads_kv * head_dim),
                Bits(dtype, T * heads_kv * head_dim)};
  for (Bits* x : {&p.q, &p.k}) {
    for (size_t i = 0; i + 8 < x->v.size(); ++i) x->Set(i, 2.0f * u(rng));
  }
  for (size_t i = 0; i + 8 < p.v.v.size(); ++i) p.v.Set(i, u(rng));
  return p;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_EMULATED_KERNEL_INPUTS_H_
