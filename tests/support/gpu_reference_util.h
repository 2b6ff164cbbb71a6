// Inputs and comparisons for the tests of the GPU reference (lib/cuda/exec/gpu_reference.h):
// random storage-typed tensors with fixed seeds, the layouts that cover every mask kind, and
// the accuracy rule of the exact results.
#ifndef HSAP_TESTS_SUPPORT_GPU_REFERENCE_UTIL_H_
#define HSAP_TESTS_SUPPORT_GPU_REFERENCE_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "gtest/gtest.h"
#include "lib/cuda/exec/gpu_reference.h"

namespace hsap::testing {

// A tensor of n values in a storage dtype, uniform in [-1, 1].
inline std::vector<uint8_t> RandomStorage(DType dtype, size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> bytes(n * DTypeSize(dtype));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) StoreFromFloat(dtype, bytes.data(), i, u(rng));
  return bytes;
}

// Random q, k, v, dout of one row (seeded), and the ReferenceInputs that point at them.
class RowInputs {
 public:
  RowInputs(DType dtype, int64_t tokens, const AttentionDims& dims, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const size_t q_elems = static_cast<size_t>(tokens) * dims.heads_q * dims.head_dim;
    const size_t kv_elems = static_cast<size_t>(tokens) * dims.heads_kv * dims.head_dim;
    q_ = RandomStorage(dtype, q_elems, rng);
    k_ = RandomStorage(dtype, kv_elems, rng);
    v_ = RandomStorage(dtype, kv_elems, rng);
    dout_ = RandomStorage(dtype, q_elems, rng);
    in_.dims = dims;
    in_.dtype = dtype;
    in_.q = q_.data();
    in_.k = k_.data();
    in_.v = v_.data();
  }
  RowInputs(const RowInputs&) = delete;
  RowInputs& operator=(const RowInputs&) = delete;

  const ReferenceInputs& in() const { return in_; }
  const void* dout() const { return dout_.data(); }

 private:
  std::vector<uint8_t> q_, k_, v_, dout_;
  ReferenceInputs in_;
};

inline AttentionDims RefDims(int heads_q, int heads_kv, int head_dim) {
  AttentionDims d;
  d.heads_q = heads_q;
  d.heads_kv = heads_kv;
  d.head_dim = head_dim;
  d.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  return d;
}

// Documents of every mask kind, with an empty and a one-token document: causal 23, full 17,
// prefix-LM 20 (prefix 7), sliding window 25 (window 6), empty, causal 1, full 9 (95 tokens).
inline Layout EveryMaskKindLayout() {
  const std::vector<int64_t> cu = {0, 23, 40, 60, 85, 85, 86, 95};
  const std::vector<MaskKind> kinds = {
      MaskKind::kCausal, MaskKind::kFull,   MaskKind::kPrefixLM, MaskKind::kSlidingWindow,
      MaskKind::kCausal, MaskKind::kCausal, MaskKind::kFull};
  const std::vector<int64_t> params = {0, 0, 7, 6, 0, 0, 0};
  return *Layout::FromDocuments(cu, kinds, params);
}

// Slices no document layout makes: queries 0..9 see two separate key blocks, queries 10..29 a
// window and a far block, queries 30..39 keys after them, queries 40..49 nothing, keys 30..39
// no query, queries 50..69 a shifted causal band (70 tokens).
inline Layout ScatteredSliceLayout() {
  return *Layout::FromSlices(
      70, {MaskSlice::Full(0, 10, 0, 10), MaskSlice::Full(0, 10, 40, 50),
           MaskSlice::Causal(10, 30, 10, 30, /*window=*/5), MaskSlice::Full(10, 30, 60, 62),
           MaskSlice::Full(30, 40, 60, 70), MaskSlice::Causal(50, 70, 0, 20)});
}

// The accuracy rule of the exact GPU reference against the host's fp64 reference, per tensor:
//   max_i |gpu_i - host_i| <= 1e-12 * max(1, max_i |host_i|),
// with -inf (an lse where a query sees nothing) matched exactly. The two differ only in the
// order of fp64 sums, about 1e-16 relative; 1e-12 leaves room for long rows and cancellation
// without letting any real error (a missed key, a wrong head) through.
inline constexpr double kExactRelTol = 1e-12;

inline void ExpectExactMatch(const std::vector<double>& gpu, const std::vector<double>& host,
                             const std::string& what) {
  ASSERT_EQ(gpu.size(), host.size()) << what;
  double magnitude = 1.0, err = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    if (std::isinf(host[i])) {
      ASSERT_EQ(gpu[i], host[i]) << what << " element " << i;
      continue;
    }
    magnitude = std::max(magnitude, std::abs(host[i]));
    const double e = std::abs(gpu[i] - host[i]);
    if (!(e <= err)) {
      err = e;
      worst = i;
    }
  }
  EXPECT_LE(err, kExactRelTol * magnitude)
      << what << ": element " << worst << " gpu " << gpu[worst] << " host " << host[worst];
}

// A GPU reference run's fp64 out, lse, dq, dk, dv against the host's fp64 reference of the
// same row, within kExactRelTol.
inline void ExpectMatchesHostReference(const cuda::GpuReferenceResult& gpu, const Layout& layout,
                                       const ReferenceInputs& in, const void* dout) {
  const ReferenceForwardResult ref = ReferenceForward(layout, in);
  const ReferenceGradients gref = ReferenceBackward(layout, in, dout);
  ExpectExactMatch(gpu.forward.out, ref.out, "out");
  ExpectExactMatch(gpu.forward.lse, ref.lse, "lse");
  ExpectExactMatch(gpu.backward.dq, gref.dq, "dq");
  ExpectExactMatch(gpu.backward.dk, gref.dk, "dk");
  ExpectExactMatch(gpu.backward.dv, gref.dv, "dv");
}

// Bit-for-bit equality (the rounded results in the emulator, whose expf/logf are the host's).
inline void ExpectIdentical(const std::vector<double>& gpu, const std::vector<double>& host,
                            const std::string& what) {
  ASSERT_EQ(gpu.size(), host.size()) << what;
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    if (!(gpu[i] == host[i]) && !(std::isnan(gpu[i]) && std::isnan(host[i]))) {
      if (differ++ == 0) first = i;
    }
  }
  EXPECT_EQ(differ, 0u) << what << ": first at " << first << " gpu " << gpu[first] << " host "
                        << host[first];
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_GPU_REFERENCE_UTIL_H_
