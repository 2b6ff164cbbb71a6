#include "attention/tolerance.h"

#include <cmath>
#include <random>

#include "attention/dtype.h"
#include "gtest/gtest.h"

namespace hsap {
namespace {

// RoundingUnit is the unit roundoff of the storage conversions: rounding never errs by
// more than it (relative), and some values come close to it, so it is not loose either.
TEST(ToleranceTest, RoundingUnitBoundsTheStorageConversions) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-10, 10);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const double unit = RoundingUnit(t);
    double worst = 0.0;
    for (int i = 0; i < 20000; ++i) {
      const double x = std::ldexp(mantissa(rng), exponent(rng)) * (i % 2 == 0 ? 1 : -1);
      // fp32 rounds from fp64; the 16-bit types from fp32 (exact for these mantissas'
      // leading bits: the fp32 step is far below their unit).
      const double rounded = t == DType::kF32 ? static_cast<double>(static_cast<float>(x))
                                              : RoundTo(t, static_cast<float>(x));
      const double relative = std::abs(rounded - x) / std::abs(x);
      EXPECT_LE(relative, unit * (1 + 1e-6)) << DTypeName(t) << " x = " << x;
      worst = std::max(worst, relative);
    }
    EXPECT_GT(worst, 0.9 * unit) << DTypeName(t);
  }
  EXPECT_EQ(RoundingUnit(DType::kF32), std::ldexp(1.0, -24));
  EXPECT_EQ(RoundingUnit(DType::kBF16), std::ldexp(1.0, -8));
  EXPECT_EQ(RoundingUnit(DType::kF16), std::ldexp(1.0, -11));
}

TEST(ToleranceTest, StorageFloorIsFourRoundingUnits) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    EXPECT_EQ(StorageFloor(t), 4.0 * RoundingUnit(t)) << DTypeName(t);
  }
}

TEST(ToleranceTest, BoundIsTwiceTheNaiveErrorPlusTheFloorOfTheMagnitude) {
  EXPECT_DOUBLE_EQ(ToleranceBound(0.25, 8.0, 0.01), 0.5 + 0.08);
  // Magnitudes below 1 count as 1: small results keep an absolute floor.
  EXPECT_DOUBLE_EQ(ToleranceBound(0.25, 0.125, 0.01), 0.5 + 0.01);
  EXPECT_DOUBLE_EQ(ToleranceBound(0.0, 0.0, kKernelFloor), kKernelFloor);
  EXPECT_DOUBLE_EQ(ToleranceBound(0.0, 3.0, StorageFloor(DType::kBF16)), 3.0 * 4.0 / 256.0);
}

}  // namespace
}  // namespace hsap
