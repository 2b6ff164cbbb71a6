// Reference attention: a plain, dense implementation, independent of work lists and tiles,
// that reads the mask straight from the layout.
//
// ReferenceForward/Backward accumulate in fp64 and are the ground truth of every test.
// NaiveForward/Backward do the same computation with every intermediate rounded to the
// storage precision; their error against the fp64 reference sets the tolerance of the
// kernels ("at most 2x the error of a same-precision single-device computation").
#ifndef HSAP_ATTENTION_REFERENCE_H_
#define HSAP_ATTENTION_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "attention/dtype.h"
#include "attention/kernel.h"
#include "attention/layout.h"

namespace hsap {

// Inputs for the references: q [T, Hq, D], k/v [T, Hkv, D] in `dtype`, T = num_tokens.
struct ReferenceInputs {
  AttentionDims dims;
  DType dtype = DType::kF32;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
};

struct ReferenceForwardResult {
  std::vector<double> out;  // [T, Hq, D]
  std::vector<double> lse;  // [Hq, T]; -inf where no key is visible
};

struct ReferenceGradients {
  std::vector<double> dq;  // [T, Hq, D]
  std::vector<double> dk;  // [T, Hkv, D]
  std::vector<double> dv;  // [T, Hkv, D]
};

ReferenceForwardResult ReferenceForward(const Layout& layout, const ReferenceInputs& in);
// dout [T, Hq, D] in in.dtype.
ReferenceGradients ReferenceBackward(const Layout& layout, const ReferenceInputs& in,
                                     const void* dout);

// Same computation with every intermediate (scores, probabilities, products, sums) rounded
// to in.dtype: what a straightforward single-device implementation in that precision gets.
// Scores are sequential dot products (each product and partial sum rounded), times the
// fp32 scale, rounded; p = round(exp(round(s - max))) / round(sum) rounded; outputs,
// gradients and their sums accumulate sequentially in that precision (dk/dv over heads,
// then queries). For fp32 this is plain fp32 arithmetic.
ReferenceForwardResult NaiveForward(const Layout& layout, const ReferenceInputs& in);
ReferenceGradients NaiveBackward(const Layout& layout, const ReferenceInputs& in, const void* dout);

}  // namespace hsap

#endif  // HSAP_ATTENTION_REFERENCE_H_
