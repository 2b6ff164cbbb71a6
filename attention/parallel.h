// A minimal parallel-for for the host kernels.
#ifndef HSAP_ATTENTION_PARALLEL_H_
#define HSAP_ATTENTION_PARALLEL_H_

#include <cstdint>
#include <functional>

namespace hsap {

// Number of hardware threads (at least 1).
int HardwareThreads();

// Runs fn(i) for i in [0, n) on up to num_threads threads (<= 0: HardwareThreads()). Items
// are handed out dynamically; fn must not depend on which thread runs it. Blocks until all
// are done. With one thread (or n <= 1) runs inline.
void ParallelFor(int64_t n, int num_threads, const std::function<void(int64_t)>& fn);

}  // namespace hsap

#endif  // HSAP_ATTENTION_PARALLEL_H_
