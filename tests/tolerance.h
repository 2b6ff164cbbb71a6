// The tolerance rule of the distributed and C-API tests, in one place:
//   error <= 2 x (error of the same computation done naively in the storage precision)
//            + 4 rounding units of the storage type x max(1, magnitude of the result),
// errors measured as the largest |got - fp64 reference| over all elements.
#ifndef HSAP_TESTS_TOLERANCE_H_
#define HSAP_TESTS_TOLERANCE_H_

#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "attention/dtype.h"
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

inline void ExpectWithinRule(std::string_view what, double err, double naive_err, double magnitude,
                             DType dtype) {
  const double floor = 4.0 * Unit(dtype) * std::max(1.0, magnitude);
  EXPECT_LE(err, 2.0 * naive_err + floor) << what << " (" << DTypeName(dtype) << "): error " << err
                                          << ", naive error " << naive_err << ", floor " << floor;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_TOLERANCE_H_
