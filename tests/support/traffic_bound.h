// The bytes a batch must move, recomputed independently of the schedule from the ranks'
// ranges and brute-force visibility: each K/V row is delivered once to each rank that needs
// it (forward), and in backward once more plus its fp32 dK/dV partial back to its owner.
// Equality with hsapBatchGetTraffic is the exactly-once delivery check.
#ifndef HSAP_TESTS_SUPPORT_TRAFFIC_BOUND_H_
#define HSAP_TESTS_SUPPORT_TRAFFIC_BOUND_H_

#include <cstdint>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "hsap/hsap.h"
#include "tests/support/distributed_harness.h"

namespace hsap::testing {

struct Expected {
  std::vector<hsapTraffic_t> per_rank;
};

inline Expected LowerBound(const Layout& layout, const RowOutputs& got, const DistCase& c) {
  const int R = c.ranks;
  const int64_t T = layout.num_tokens();
  std::vector<int> owner(T, -1);
  for (int r = 0; r < R; ++r) {
    for (size_t i = 0; i + 1 < got.ranges[r].size(); i += 2) {
      for (int64_t t = got.ranges[r][i]; t < got.ranges[r][i + 1]; ++t) owner[t] = r;
    }
  }
  // need[r][k]: some query of rank r sees key k, which another rank holds.
  std::vector<std::vector<char>> need(R, std::vector<char>(T, 0));
  for (int64_t q = 0; q < T; ++q) {
    for (int64_t k = 0; k < T; ++k) {
      if (owner[q] != owner[k] && layout.Visible(q, k)) need[owner[q]][k] = 1;
    }
  }
  const uint64_t kv = 2ull * c.heads_kv * c.head_dim * DTypeSize(c.dtype);
  const uint64_t grad = 2ull * c.heads_kv * c.head_dim * sizeof(float);
  std::vector<uint64_t> in_rows(R, 0), out_rows(R, 0);
  for (int r = 0; r < R; ++r) {
    for (int64_t k = 0; k < T; ++k) {
      if (need[r][k]) {
        ++in_rows[r];
        ++out_rows[owner[k]];
      }
    }
  }
  Expected e;
  for (int r = 0; r < R; ++r) {
    hsapTraffic_t t{};
    t.forwardBytesSent = out_rows[r] * kv;
    t.forwardBytesReceived = in_rows[r] * kv;
    t.backwardBytesSent = out_rows[r] * kv + in_rows[r] * grad;
    t.backwardBytesReceived = in_rows[r] * kv + out_rows[r] * grad;
    e.per_rank.push_back(t);
  }
  return e;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_TRAFFIC_BOUND_H_
