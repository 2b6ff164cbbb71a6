// Random layouts and token runs for the attention tests (fixed seeds via the caller's rng).
#ifndef HSAP_TESTS_SUPPORT_ATTENTION_TEST_UTIL_H_
#define HSAP_TESTS_SUPPORT_ATTENTION_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "attention/layout.h"
#include "attention/worklist.h"

namespace hsap::testing {

// A random document length: often tiny (0, 1, a few tokens), sometimes around a tile edge
// (63..65, 127..129), sometimes long.
inline int64_t RandomDocLength(std::mt19937_64& rng, int64_t max_len) {
  std::uniform_int_distribution<int> pick(0, 9);
  int64_t len = 0;
  switch (pick(rng)) {
    case 0:
      len = 0;
      break;
    case 1:
      len = 1;
      break;
    case 2:
    case 3:
      len = std::uniform_int_distribution<int64_t>(2, 8)(rng);
      break;
    case 4:
      len = std::uniform_int_distribution<int64_t>(63, 65)(rng);
      break;
    case 5:
      len = std::uniform_int_distribution<int64_t>(127, 129)(rng);
      break;
    default:
      len = std::uniform_int_distribution<int64_t>(1, max_len)(rng);
      break;
  }
  return std::min(len, max_len);
}

// Documents filling exactly `num_tokens` tokens with random kinds and parameters.
inline Layout RandomDocumentLayout(std::mt19937_64& rng, int64_t num_tokens, int64_t max_doc_len) {
  std::vector<int64_t> cu{0};
  std::vector<MaskKind> kinds;
  std::vector<int64_t> params;
  while (cu.back() < num_tokens) {
    const int64_t len = std::min(RandomDocLength(rng, max_doc_len), num_tokens - cu.back());
    cu.push_back(cu.back() + len);
    const auto kind = static_cast<MaskKind>(std::uniform_int_distribution<int>(0, 3)(rng));
    kinds.push_back(kind);
    int64_t param = 0;
    if (len > 0 && kind == MaskKind::kPrefixLM) {
      param = std::uniform_int_distribution<int64_t>(0, len)(rng);
    } else if (len > 0 && kind == MaskKind::kSlidingWindow) {
      param = std::uniform_int_distribution<int64_t>(1, len)(rng);
    }
    params.push_back(param);
  }
  return *Layout::FromDocuments(cu, kinds, params);
}

// User slices with documents that overlap: a shared prompt P (causal) seen in full by each
// of several continuations, each causal over itself; plus a bidirectional tail.
inline Layout SharedPromptLayout(int64_t prompt, std::vector<int64_t> continuations, int64_t tail) {
  std::vector<MaskSlice> slices;
  slices.push_back(MaskSlice::Causal(0, prompt, 0, prompt));
  int64_t pos = prompt;
  for (int64_t len : continuations) {
    slices.push_back(MaskSlice::Full(pos, pos + len, 0, prompt));
    slices.push_back(MaskSlice::Causal(pos, pos + len, pos, pos + len));
    pos += len;
  }
  if (tail > 0) slices.push_back(MaskSlice::Full(pos, pos + tail, pos, pos + tail));
  return *Layout::FromSlices(pos + tail, std::move(slices));
}

// Splits [0, num_tokens) into `pieces` random runs and keeps each with probability
// `keep`, storing the kept ones in a shuffled buffer order (like a rank's shard).
inline std::vector<TokenRun> RandomRuns(std::mt19937_64& rng, int64_t num_tokens, int pieces,
                                        double keep) {
  std::vector<int64_t> cuts{0, num_tokens};
  for (int i = 1; i < pieces; ++i) {
    cuts.push_back(std::uniform_int_distribution<int64_t>(0, num_tokens)(rng));
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<TokenRun> runs;
  std::bernoulli_distribution kept(keep);
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    if (cuts[i + 1] > cuts[i] && kept(rng)) runs.push_back({cuts[i], 0, cuts[i + 1] - cuts[i]});
  }
  std::shuffle(runs.begin(), runs.end(), rng);
  int64_t local = 0;
  for (TokenRun& r : runs) {
    r.local_begin = local;
    local += r.length;
  }
  return runs;
}

inline int64_t RunRows(const std::vector<TokenRun>& runs) {
  int64_t rows = 0;
  for (const TokenRun& r : runs) rows = std::max(rows, r.local_begin + r.length);
  return rows;
}

// Global position of each buffer row.
inline std::vector<int64_t> GlobalOfLocal(const std::vector<TokenRun>& runs) {
  std::vector<int64_t> global(RunRows(runs), -1);
  for (const TokenRun& r : runs) {
    for (int64_t i = 0; i < r.length; ++i) global[r.local_begin + i] = r.global_begin + i;
  }
  return global;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_ATTENTION_TEST_UTIL_H_
