// Random packed rows with fixed seeds, shared by the partition, schedule and distributed
// tests.
#ifndef HSAP_TESTS_SUPPORT_RANDOM_LAYOUTS_H_
#define HSAP_TESTS_SUPPORT_RANDOM_LAYOUTS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attention/layout.h"

namespace hsap::testing {

enum class DocMix {
  kLongTail,  // a few long documents and many short ones (Pareto lengths)
  kUniform,   // lengths uniform in [1, 2 * mean]
  kTiny,      // lengths 1..3
  kOneHuge,   // one document of ~70% of the row plus small ones
  kSingle,    // one document covering the row
};

inline std::string DocMixName(DocMix m) {
  switch (m) {
    case DocMix::kLongTail:
      return "longtail";
    case DocMix::kUniform:
      return "uniform";
    case DocMix::kTiny:
      return "tiny";
    case DocMix::kOneHuge:
      return "onehuge";
    case DocMix::kSingle:
      return "single";
  }
  return "?";
}

// Document lengths summing to num_tokens.
inline std::vector<int64_t> RandomDocLengths(int64_t num_tokens, DocMix mix, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<int64_t> lens;
  int64_t left = num_tokens;
  if (mix == DocMix::kSingle) return {num_tokens};
  if (mix == DocMix::kOneHuge) {
    const int64_t huge = std::max<int64_t>(1, num_tokens * 7 / 10);
    lens.push_back(huge);
    left -= huge;
  }
  const int64_t mean = std::max<int64_t>(2, num_tokens / 12);
  while (left > 0) {
    int64_t len = 1;
    switch (mix) {
      case DocMix::kLongTail:
        len = static_cast<int64_t>(4.0 * std::pow(1.0 - unit(rng), -1.0 / 1.1));
        break;
      case DocMix::kUniform:
        len = 1 + static_cast<int64_t>(unit(rng) * 2.0 * static_cast<double>(mean));
        break;
      case DocMix::kTiny:
        len = 1 + static_cast<int64_t>(unit(rng) * 3.0);
        break;
      case DocMix::kOneHuge:
        len = 1 + static_cast<int64_t>(unit(rng) * 20.0);
        break;
      case DocMix::kSingle:
        len = left;
        break;
    }
    len = std::clamp<int64_t>(len, 1, left);
    lens.push_back(len);
    left -= len;
  }
  // Shuffle so that the huge document is not always first.
  std::shuffle(lens.begin(), lens.end(), rng);
  return lens;
}

// A document layout with random mask kinds (all causal when `causal_only`), and now and
// then an empty document.
inline Layout RandomLayout(int64_t num_tokens, DocMix mix, uint64_t seed, bool causal_only) {
  std::vector<int64_t> lens = RandomDocLengths(num_tokens, mix, seed);
  std::mt19937_64 rng(seed * 7919 + 1);
  std::vector<int64_t> cu{0};
  std::vector<MaskKind> kinds;
  std::vector<int64_t> params;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (rng() % 17 == 0) {  // an empty document
      cu.push_back(cu.back());
      kinds.push_back(MaskKind::kCausal);
      params.push_back(0);
    }
    cu.push_back(cu.back() + lens[i]);
    MaskKind kind = MaskKind::kCausal;
    int64_t param = 0;
    if (!causal_only) {
      kind = static_cast<MaskKind>(rng() % 4);
      if (kind == MaskKind::kPrefixLM) param = static_cast<int64_t>(rng() % (lens[i] + 1));
      if (kind == MaskKind::kSlidingWindow) {
        param = 1 + static_cast<int64_t>(rng() % std::min<int64_t>(40, lens[i]));
      }
    }
    kinds.push_back(kind);
    params.push_back(param);
  }
  return *Layout::FromDocuments(cu, kinds, params);
}

// A layout from user slices: blocks of a block-sparse mask (a diagonal band of causal
// blocks plus some full off-diagonal rectangles), non-overlapping.
inline Layout RandomSliceLayout(int64_t num_tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> cuts{0};
  while (cuts.back() < num_tokens) {
    cuts.push_back(std::min<int64_t>(num_tokens, cuts.back() + 8 + rng() % 90));
  }
  std::vector<MaskSlice> slices;
  for (size_t b = 0; b + 1 < cuts.size(); ++b) {
    const int64_t window = (rng() % 3 == 0) ? 1 + static_cast<int64_t>(rng() % 30) : 0;
    slices.push_back(MaskSlice::Causal(cuts[b], cuts[b + 1], cuts[b], cuts[b + 1], window));
    // A full rectangle onto an earlier block now and then (global-token style attention).
    if (b > 0 && rng() % 2 == 0) {
      const size_t e = rng() % b;
      slices.push_back(MaskSlice::Full(cuts[b], cuts[b + 1], cuts[e], cuts[e + 1]));
    }
  }
  return *Layout::FromSlices(num_tokens, slices);
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_RANDOM_LAYOUTS_H_
