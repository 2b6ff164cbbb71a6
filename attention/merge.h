// Merging partial attention results by their log-sum-exp.
//
// A partial result (o, lse) of a query over a key set K is the softmax-weighted average of
// the values of K and the log-sum-exp of its scores. For disjoint K1, K2:
//   lse = log(exp(lse1) + exp(lse2)),  o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2,
// computed stably. A row that saw no key has lse = -inf and o = 0; merging it is exact.
#ifndef HSAP_ATTENTION_MERGE_H_
#define HSAP_ATTENTION_MERGE_H_

#include <cstdint>

namespace hsap {

// Merges (o2, lse2) into (o1, lse1) in place. o: [rows, heads, head_dim] fp32 with row
// stride heads*head_dim; lse: [heads, lse_stride] fp32 (lse_stride >= rows, the rows of a
// larger buffer may be merged by passing offset pointers).
void MergePartial(float* o1, float* lse1, const float* o2, const float* lse2, int64_t rows,
                  int heads, int head_dim, int64_t lse_stride1, int64_t lse_stride2);

// One row of one head: the building block of the above.
void MergePartialRow(float* o1, float* lse1, const float* o2, float lse2, int head_dim);

}  // namespace hsap

#endif  // HSAP_ATTENTION_MERGE_H_
