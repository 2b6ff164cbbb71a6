// The tolerance rule of the distributed and C-API tests, in one place:
//   error <= 2 x (error of the same computation done naively in the storage precision)
//            + 4 rounding units of the storage type x max(1, magnitude of the result),
// errors measured as the largest |got - fp64 reference| over all elements.
#ifndef HSAP_TESTS_SUPPORT_TOLERANCE_H_
#define HSAP_TESTS_SUPPORT_TOLERANCE_H_

#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "gtest/gtest.h"

namespace hsap::testing {

// Largest |got - want|; `got` is any tensor with At(i) (read in its storage type). NaN wins.
template <typename TensorT>
double MaxAbsError(const TensorT& got, const std::vector<double>& want) {
  double err = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = std::abs(static_cast<double>(got.At(i)) - want[i]);
    if (!(e <= err)) err = e;
  }
  return err;
}

// Same for fp64 results; equal infinities (the -inf lse of a row that sees no key) match.
inline double MaxAbsError(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double e = std::abs(got[i] - want[i]);
    if (!(e <= err)) err = e;
  }
  return err;
}

// Largest finite |x|.
inline double MaxAbs(const std::vector<double>& x) {
  double m = 0.0;
  for (double v : x) {
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  }
  return m;
}

// The rounding unit of a storage type: results are stored in that type once.
inline double Unit(DType t) {
  return t == DType::kF32    ? std::ldexp(1.0, -24)
         : t == DType::kBF16 ? std::ldexp(1.0, -8)
                             : std::ldexp(1.0, -11);
}

// The floor of the CUDA kernels' rule (tests/jit/cuda_emulation_test.cc): their softmax runs
// through exp2 with an fp32 log-sum-exp, a few fp32 ulps of the result beyond the naive
// computation's error, so their floor is at least 1e-6 of the magnitude.
inline constexpr double kCudaKernelFloor = 1e-6;

// min_floor: a floor (relative to the magnitude) the rule must not go below.
inline void ExpectWithinRule(std::string_view what, double err, double naive_err, double magnitude,
                             DType dtype, double min_floor = 0.0) {
  const double floor = std::max(4.0 * Unit(dtype), min_floor) * std::max(1.0, magnitude);
  EXPECT_LE(err, 2.0 * naive_err + floor) << what << " (" << DTypeName(dtype) << "): error " << err
                                          << ", naive error " << naive_err << ", floor " << floor;
}

// Checks a whole-row result against ReferenceForward (out, and lse [heads_q, T] in fp32) and,
// when `backward`, ReferenceBackward (dq, dk, dv), each under the rule with the error of
// NaiveForward/NaiveBackward on the same inputs. Outputs: any struct with those members,
// tensors readable with At(i) and lse a std::vector<float>. min_floor: as ExpectWithinRule
// (kCudaKernelFloor for results of the CUDA kernels).
template <typename Outputs>
void ExpectMatchesReference(const Layout& layout, const ReferenceInputs& ri, const void* dout,
                            const Outputs& got, bool backward, double min_floor = 0.0) {
  const ReferenceForwardResult ref = ReferenceForward(layout, ri);
  const ReferenceForwardResult naive = NaiveForward(layout, ri);
  ExpectWithinRule("out", MaxAbsError(got.out, ref.out), MaxAbsError(naive.out, ref.out),
                   MaxAbs(ref.out), ri.dtype, min_floor);
  const std::vector<double> lse(got.lse.begin(), got.lse.end());
  ExpectWithinRule("lse", MaxAbsError(lse, ref.lse), MaxAbsError(naive.lse, ref.lse),
                   MaxAbs(ref.lse), DType::kF32, min_floor);
  if (!backward) return;
  const ReferenceGradients gref = ReferenceBackward(layout, ri, dout);
  const ReferenceGradients gnaive = NaiveBackward(layout, ri, dout);
  ExpectWithinRule("dq", MaxAbsError(got.dq, gref.dq), MaxAbsError(gnaive.dq, gref.dq),
                   MaxAbs(gref.dq), ri.dtype, min_floor);
  ExpectWithinRule("dk", MaxAbsError(got.dk, gref.dk), MaxAbsError(gnaive.dk, gref.dk),
                   MaxAbs(gref.dk), ri.dtype, min_floor);
  ExpectWithinRule("dv", MaxAbsError(got.dv, gref.dv), MaxAbsError(gnaive.dv, gref.dv),
                   MaxAbs(gref.dv), ri.dtype, min_floor);
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_TOLERANCE_H_
