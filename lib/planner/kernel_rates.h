// What an attention engine sustains on one device kind: TFLOP/s as a function of the block
// length and the head dim, forward and backward apart (docs/cost_model.md, section 1). The
// cost model and the run simulator price a piece of attention work with it instead of a
// flat fraction of the datasheet peak; lib/planner/calibration.h fills it from measured and
// published figures.
//
// Block length: the sequence length L of the causal call the figure was measured on (one
// causal document of L tokens, FLOPs over its visible pairs). A piece of work of P visible
// (query, key) pairs over R query rows has P / R keys per query row on average, as a
// causal call of L = 2 P / R tokens has; that L is the piece's block length
// (BlockTokensOf). What makes short blocks slow is that a query tile's loop over keys is
// short against its fixed cost (prologue, epilogue, the causal diagonal), which is what the
// mean keys per row measures.
#ifndef HSAP_LIB_PLANNER_KERNEL_RATES_H_
#define HSAP_LIB_PLANNER_KERNEL_RATES_H_

#include <cstdint>
#include <string>
#include <vector>

namespace hsap {

// A relative curve over block length: the built-in short-block shape of an engine (the
// ratio of its TFLOP/s at L to its TFLOP/s at the shape's longest point), log-linear
// between points, flat past the longest, and proportional to L below the shortest (a
// kernel's time stops shrinking below one tile of keys per row).
struct RateShape {
  std::vector<std::pair<double, double>> points;  // (block tokens, relative rate), sorted
  double At(double block_tokens) const;
};

// Measured TFLOP/s of one engine on one device kind at one head dim, in one direction.
struct RateCurve {
  int head_dim = 0;
  std::vector<std::pair<double, double>> points;  // (block tokens, FLOP/s), sorted
  // FLOP/s at `block_tokens`: log-linear between points, flat past the longest; below the
  // shortest, that point's rate scaled by `shape` (At(L) / At(shortest)).
  double At(double block_tokens, const RateShape& shape) const;
};

// The rates of the engine that runs on a device kind.
struct AttentionRates {
  std::string engine;  // "jit", "cudnn", "fa2", "fa3"
  std::string source;  // where the figures come from, for the "# priced:" line
  std::vector<RateCurve> forward, backward;  // one per head dim measured
  RateShape forward_shape, backward_shape;
  // FLOP/s of a piece of `block_tokens` (BlockTokensOf) at `head_dim`: the curve of the
  // nearest head dim measured (log distance; ties: the larger).
  double Rate(bool backward, double block_tokens, int head_dim) const;
};

// The block length of a piece of `pairs` visible pairs over `query_rows` query rows (per
// head): 2 pairs / rows, at least 1.
double BlockTokensOf(double pairs, double query_rows);

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_KERNEL_RATES_H_
