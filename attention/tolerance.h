// The tolerance rule of the tests and benches: how far a result of hsap may lie from the
// fp64 reference (attention/reference.h). For every tensor (out, lse, dq, dk, dv):
//
//   max |got - ref| <= 2 * max |naive - ref| + floor * max(1, max |ref|)
//
// ref is ReferenceForward/Backward; naive is the same attention with every intermediate
// rounded to the storage type (NaiveForward/Backward), so the first term grows with what
// the storage precision costs any implementation. The floor covers tensors that the naive
// computation happens to get (almost) exactly, e.g. a row with a single visible key where
// out = v exactly:
//  - results stored in their dtype (batches, local attention): StorageFloor(dtype), 4
//    rounding units of that type (one rounding of the result, plus slack);
//  - the kernels' fp32 results: kKernelFloor, about 8 fp32 ulps (the kernels round their
//    scores, exponentials and sums in fp32 a few times).
#ifndef HSAP_ATTENTION_TOLERANCE_H_
#define HSAP_ATTENTION_TOLERANCE_H_

#include "attention/dtype.h"

namespace hsap {

// The unit roundoff of a storage type: rounding x to it errs by at most
// RoundingUnit * |x| (2^-24 for fp32, 2^-8 for bf16, 2^-11 for fp16).
double RoundingUnit(DType dtype);

// The floor of results stored in `dtype`: 4 rounding units.
double StorageFloor(DType dtype);

// The floor of the kernels' fp32 results (attention/kernel.h, the JIT CUDA kernels).
inline constexpr double kKernelFloor = 1e-6;

// The largest error the rule allows: 2 * naive_error + floor * max(1, magnitude), where
// magnitude is the largest finite |ref|.
double ToleranceBound(double naive_error, double magnitude, double floor);

}  // namespace hsap

#endif  // HSAP_ATTENTION_TOLERANCE_H_
