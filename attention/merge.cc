#include "attention/merge.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace hsap {

void MergePartialRow(float* o1, float* lse1, const float* o2, float lse2, int head_dim) {
  const float l1 = *lse1;
  if (lse2 == -INFINITY) return;  // (o2, lse2) saw no key: nothing to add
  if (l1 == -INFINITY) {
    std::copy(o2, o2 + head_dim, o1);
    *lse1 = lse2;
    return;
  }
  // Weights relative to the larger lse, so that neither exponential overflows.
  const float m = std::max(l1, lse2);
  const float e1 = std::exp(l1 - m);
  const float e2 = std::exp(lse2 - m);
  const float sum = e1 + e2;
  const float w1 = e1 / sum, w2 = e2 / sum;
  for (int d = 0; d < head_dim; ++d) o1[d] = w1 * o1[d] + w2 * o2[d];
  *lse1 = m + std::log(sum);
}

void MergePartial(float* o1, float* lse1, const float* o2, const float* lse2, int64_t rows,
                  int heads, int head_dim, int64_t lse_stride1, int64_t lse_stride2) {
  const int64_t row_stride = static_cast<int64_t>(heads) * head_dim;
  for (int h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      MergePartialRow(o1 + r * row_stride + static_cast<int64_t>(h) * head_dim,
                      lse1 + h * lse_stride1 + r,
                      o2 + r * row_stride + static_cast<int64_t>(h) * head_dim,
                      lse2[h * lse_stride2 + r], head_dim);
    }
  }
}

}  // namespace hsap
