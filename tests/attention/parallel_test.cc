#include "attention/parallel.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace hsap {
namespace {

TEST(ParallelForTest, RunsEveryItemExactlyOnce) {
  EXPECT_GE(HardwareThreads(), 1);
  for (int threads : {-1, 0, 1, 3, 16}) {
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      ParallelFor(n, threads, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << i;
    }
  }
}

TEST(ParallelForTest, OneThreadRunsInOrderOnTheCaller) {
  std::vector<int64_t> order;
  ParallelFor(5, 1, [&](int64_t i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace hsap
