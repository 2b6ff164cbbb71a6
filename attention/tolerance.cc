#include "attention/tolerance.h"

#include <algorithm>
#include <cmath>

namespace hsap {

double RoundingUnit(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return std::ldexp(1.0, -24);
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    case DType::kF16:
      return std::ldexp(1.0, -11);
  }
  return std::ldexp(1.0, -8);
}

double StorageFloor(DType dtype) { return 4.0 * RoundingUnit(dtype); }

double ToleranceBound(double naive_error, double magnitude, double floor) {
  return 2.0 * naive_error + floor * std::max(1.0, magnitude);
}

}  // namespace hsap
