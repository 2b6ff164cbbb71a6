#include "lib/planner/kernel_rates.h"

#include <algorithm>
#include <cmath>

namespace hsap {
namespace {

// Log-linear interpolation in the block length over sorted points, clamped at both ends.
double Interpolate(const std::vector<std::pair<double, double>>& points, double block) {
  if (block <= points.front().first) return points.front().second;
  if (block >= points.back().first) return points.back().second;
  auto hi = std::lower_bound(points.begin(), points.end(), block,
                             [](const auto& p, double b) { return p.first < b; });
  auto lo = hi - 1;
  const double t = std::log(block / lo->first) / std::log(hi->first / lo->first);
  return lo->second + t * (hi->second - lo->second);
}

}  // namespace

double RateShape::At(double block_tokens) const {
  if (points.empty()) return 1.0;
  const double shortest = points.front().first;
  if (block_tokens < shortest) return points.front().second * block_tokens / shortest;
  return Interpolate(points, block_tokens);
}

double RateCurve::At(double block_tokens, const RateShape& shape) const {
  const double shortest = points.front().first;
  if (block_tokens >= shortest) return Interpolate(points, block_tokens);
  return points.front().second * shape.At(block_tokens) / shape.At(shortest);
}

double AttentionRates::Rate(bool backward_pass, double block_tokens, int head_dim) const {
  const std::vector<RateCurve>& curves = backward_pass ? backward : forward;
  const RateCurve* best = &curves.front();
  double best_distance = 1e300;
  for (const RateCurve& c : curves) {
    const double distance = std::abs(std::log(static_cast<double>(c.head_dim) / head_dim));
    if (distance < best_distance - 1e-12 ||
        (std::abs(distance - best_distance) <= 1e-12 && c.head_dim > best->head_dim)) {
      best = &c;
      best_distance = distance;
    }
  }
  return best->At(block_tokens, backward_pass ? backward_shape : forward_shape);
}

double BlockTokensOf(double pairs, double query_rows) {
  if (!(query_rows > 0) || !(pairs > 0)) return 1.0;
  return std::max(1.0, 2.0 * pairs / query_rows);
}

}  // namespace hsap
