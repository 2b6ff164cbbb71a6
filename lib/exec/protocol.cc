#include "lib/exec/protocol.h"

#include <algorithm>
#include <tuple>

namespace hsap::protocol {

std::vector<BackwardGroup> BackwardPostingOrder(absl::Span<const int> steps) {
  std::vector<std::tuple<int, bool, size_t>> keyed;
  for (size_t i = 0; i < steps.size(); ++i) {
    keyed.emplace_back(2 * steps[i], false, i);
    keyed.emplace_back(2 * steps[i] + 3, true, i);
  }
  std::sort(keyed.begin(), keyed.end());
  std::vector<BackwardGroup> order;
  order.reserve(keyed.size());
  for (const auto& [key, is_grad, index] : keyed) order.push_back({is_grad, index});
  return order;
}

}  // namespace hsap::protocol
