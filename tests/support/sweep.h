// Sweeps: tests that run the same code over many inputs (every shipped cluster x lengths,
// every emulated production tile). They run in full in the optimised pass and on a small,
// fixed, representative subset where each input costs many times more: the sanitizer build,
// whose tests CMake runs with HSAP_TEST_SWEEP=subset (tests/CMakeLists.txt). Any other value,
// or none, is the full sweep.
//
//   for (const char* name : Sweep({"a", "b", "c", "d"}, 2)) ...  // subset: "a", "d"
//
// The subset is the first and the last input and evenly spaced ones between them, so it
// keeps the sweep's extremes (the smallest and the largest cluster, the first and the last
// tile); it never depends on the run.
#ifndef HSAP_TESTS_SUPPORT_SWEEP_H_
#define HSAP_TESTS_SUPPORT_SWEEP_H_

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace hsap::testing {

// True where sweeps run on their subset (HSAP_TEST_SWEEP=subset).
inline bool SweepIsSubset() {
  const char* mode = std::getenv("HSAP_TEST_SWEEP");
  return mode != nullptr && std::strcmp(mode, "subset") == 0;
}

// `all` in full, or `subset_size` (at least 1) of its elements, first and last included.
template <typename T>
std::vector<T> Sweep(std::vector<T> all, size_t subset_size) {
  if (!SweepIsSubset() || subset_size == 0 || all.size() <= subset_size) return all;
  std::vector<T> picked;
  if (subset_size == 1) {
    picked.push_back(all.front());
    return picked;
  }
  for (size_t i = 0; i < subset_size; ++i) {
    picked.push_back(all[i * (all.size() - 1) / (subset_size - 1)]);
  }
  return picked;
}
template <typename T>
std::vector<T> Sweep(std::initializer_list<T> all, size_t subset_size) {
  return Sweep(std::vector<T>(all), subset_size);
}

// Whether `value` is one of Sweep(all, subset_size)'s picks: for parameterized tests, whose
// instantiation lists every case (a case left out of the subset skips, saying so).
template <typename T>
bool SweepIncludes(const std::vector<T>& all, const T& value, size_t subset_size) {
  for (const T& picked : Sweep(all, subset_size)) {
    if (picked == value) return true;
  }
  return false;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_SWEEP_H_
