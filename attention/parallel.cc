#include "attention/parallel.h"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <vector>

namespace hsap {

int HardwareThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void ParallelFor(int64_t n, int num_threads, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (num_threads <= 0) num_threads = HardwareThreads();
  const int64_t threads = std::min<int64_t>(num_threads, n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Items are handed out one at a time: tasks differ widely in cost (a query block of a
  // long document against one of a short one), so static chunks would leave threads idle.
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // out of threads: the ones running (and this one) take all items
    }
  }
  worker();
  for (std::thread& t : pool) t.join();
}

}  // namespace hsap
