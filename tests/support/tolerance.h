// Checks of results against the fp64 reference under the tolerance rule of
// attention/tolerance.h (errors measured as the largest |got - ref| over all elements), for
// the distributed and C-API tests.
#ifndef HSAP_TESTS_SUPPORT_TOLERANCE_H_
#define HSAP_TESTS_SUPPORT_TOLERANCE_H_

#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
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

// The floor of the CUDA kernels' results (their softmax runs through exp2 with an fp32
// log-sum-exp): the kernels' floor of the rule.
inline constexpr double kCudaKernelFloor = kKernelFloor;

// The rule with the floor of results stored in `dtype`, or min_floor where that is larger.
inline void ExpectWithinRule(std::string_view what, double err, double naive_err, double magnitude,
                             DType dtype, double min_floor = 0.0) {
  const double floor = std::max(StorageFloor(dtype), min_floor);
  EXPECT_LE(err, ToleranceBound(naive_err, magnitude, floor))
      << what << " (" << DTypeName(dtype) << "): error " << err << ", naive error " << naive_err
      << ", floor " << floor * std::max(1.0, magnitude);
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
