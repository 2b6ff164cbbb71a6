#include "attention/kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention/layout.h"
#include "attention/merge.h"
#include "attention/parallel.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

constexpr int kTileQ = static_cast<int>(kKernelBlockQ);
constexpr int kTileK = static_cast<int>(kKernelBlockK);
static_assert(kTileK % 16 == 0 && kTileK <= 64, "column blocking assumes 16 | kTileK");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// What a forward row has met among its visible scores (kernel_isa.inc, ForwardTask).
constexpr float kRowSawNoKey = 0.0f;
constexpr float kRowSawKey = 1.0f;
constexpr float kRowIsNaN = 2.0f;

int RoundUp8(int x) { return (x + 7) & ~7; }

// Visible columns [begin, end) of tile row i: query buffer row q, tile keys start at k0
// and number `cols`, band lo <= k - q <= hi (buffer rows).
struct ColumnRange {
  int begin, end;
};
inline ColumnRange VisibleColumns(const KeySegment& seg, int64_t q, int64_t k0, int cols) {
  int64_t b = 0, e = cols;
  if (seg.diag_lo > -kNoDiagLimit) b = std::max<int64_t>(b, seg.diag_lo + q - k0);
  if (seg.diag_hi < kNoDiagLimit) e = std::min<int64_t>(e, seg.diag_hi + q - k0 + 1);
  return {static_cast<int>(b), static_cast<int>(std::max(b, e))};
}

enum class TileVisibility { kEmpty, kFull, kPartial };

// Rows [q0, q1) against keys [k0, k1) under the segment's band.
TileVisibility Classify(const KeySegment& seg, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  const int64_t min_rel = k0 - (q1 - 1), max_rel = (k1 - 1) - q0;
  const bool lo_all = seg.diag_lo <= -kNoDiagLimit || min_rel >= seg.diag_lo;
  const bool hi_all = seg.diag_hi >= kNoDiagLimit || max_rel <= seg.diag_hi;
  if ((seg.diag_lo > -kNoDiagLimit && max_rel < seg.diag_lo) ||
      (seg.diag_hi < kNoDiagLimit && min_rel > seg.diag_hi)) {
    return TileVisibility::kEmpty;
  }
  return lo_all && hi_all ? TileVisibility::kFull : TileVisibility::kPartial;
}

// Scratch memory of one thread, reused across tasks.
struct Scratch {
  std::vector<float> buffer;
  float* Get(size_t floats) {
    if (buffer.size() < floats) buffer.resize(floats);
    return buffer.data();
  }
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

absl::Status CheckWork(const WorkList& work, int64_t q_rows, int64_t k_rows) {
  const int64_t num_segments = static_cast<int64_t>(work.segments.size());
  for (size_t b = 0; b < work.blocks.size(); ++b) {
    const QueryBlock& blk = work.blocks[b];
    if (blk.q_begin < 0 || blk.q_begin > blk.q_end || blk.q_end > q_rows || blk.seg_begin < 0 ||
        blk.seg_begin > blk.seg_end || blk.seg_end > num_segments) {
      return absl::InvalidArgumentError(
          absl::StrCat("work.blocks[", b, "] = {q [", blk.q_begin, ", ", blk.q_end, "), segments [",
                       blk.seg_begin, ", ", blk.seg_end, ")} does not fit q_rows = ", q_rows,
                       " and ", num_segments, " segments; build the work list for these buffers"));
    }
  }
  for (size_t s = 0; s < work.segments.size(); ++s) {
    const KeySegment& seg = work.segments[s];
    if (seg.k_begin < 0 || seg.k_begin > seg.k_end || seg.k_end > k_rows ||
        seg.diag_lo > seg.diag_hi) {
      return absl::InvalidArgumentError(absl::StrCat(
          "work.segments[", s, "] = {k [", seg.k_begin, ", ", seg.k_end, "), ",
          DescribeDiagBand(seg.diag_lo, seg.diag_hi), "} does not fit k_rows = ", k_rows));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBuffers(std::initializer_list<std::pair<const void*, const char*>> buffers) {
  for (const auto& [ptr, name] : buffers) {
    if (ptr == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
    }
  }
  return absl::OkStatus();
}

// One unit of the fused backward: query rows [q0, q0 + rows) of work-list block `block`
// against key chunk `chunk` (keys [chunk * kTileK, + kTileK)), through the block's segments
// touching[chunk][first, last).
struct BackwardPair {
  int64_t chunk;
  int64_t block;
  int64_t q0;
  int rows;
  int32_t first, last;
};

// The pairs of a backward call in waves: no two pairs of one wave share a query tile or a
// key chunk, so a wave's pairs (times the kv heads) run in parallel, each adding straight
// into dq, dk and dv. A tile's dq and a chunk's dk/dv therefore sum their contributions in
// wave order, which does not depend on the number of threads.
struct BackwardSchedule {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> touching;  // (block, segment) by chunk
  std::vector<BackwardPair> pairs;                                 // grouped by wave
  std::vector<size_t> wave_begin;                // wave w: pairs[wave_begin[w], wave_begin[w + 1])
  std::vector<std::vector<int>> heads_of_group;  // q heads by kv head
};

// ---------------------------------------------------------------------------------------
// The hot loops, once per instruction set (attention/kernel_isa.inc). Every header is
// included above, outside the target regions.

#if defined(__x86_64__) || defined(__i386__)
#define HSAP_KERNEL_X86 1
#define HSAP_KERNEL_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define HSAP_KERNEL_TARGET_BEGIN(isa) \
  HSAP_KERNEL_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define HSAP_KERNEL_TARGET_END() HSAP_KERNEL_PRAGMA(clang attribute pop)
#else
#define HSAP_KERNEL_TARGET_BEGIN(isa) \
  HSAP_KERNEL_PRAGMA(GCC push_options) HSAP_KERNEL_PRAGMA(GCC target(isa))
#define HSAP_KERNEL_TARGET_END() HSAP_KERNEL_PRAGMA(GCC pop_options)
#endif
#else
#define HSAP_KERNEL_X86 0
#endif

namespace isa_baseline {
#include "attention/kernel_isa.inc"
}  // namespace isa_baseline

#if HSAP_KERNEL_X86
HSAP_KERNEL_TARGET_BEGIN("avx2,fma")
namespace isa_avx2 {
#include "attention/kernel_isa.inc"
}  // namespace isa_avx2
HSAP_KERNEL_TARGET_END()

HSAP_KERNEL_TARGET_BEGIN("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")
namespace isa_avx512 {
#include "attention/kernel_isa.inc"
}  // namespace isa_avx512
HSAP_KERNEL_TARGET_END()
#endif

// ---------------------------------------------------------------------------------------
// Run-time choice of the copy.

struct IsaCopy {
  void (*forward)(const ForwardArgs&, const WorkList&, int num_threads);
  void (*backward)(const BackwardArgs&, const WorkList&, const BackwardSchedule&, int num_threads);
};

IsaCopy CopyFor(KernelIsa isa) {
  switch (isa) {
#if HSAP_KERNEL_X86
    case KernelIsa::kAvx512:
      return {&isa_avx512::Forward, &isa_avx512::Backward};
    case KernelIsa::kAvx2:
      return {&isa_avx2::Forward, &isa_avx2::Backward};
#endif
    default:
      return {&isa_baseline::Forward, &isa_baseline::Backward};
  }
}

bool DetectSupport(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kBaseline:
      return true;
#if HSAP_KERNEL_X86
    case KernelIsa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case KernelIsa::kAvx512:
      __builtin_cpu_init();
      return DetectSupport(KernelIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq");
#endif
    default:
      return false;
  }
}

absl::Status CheckSupported(KernelIsa isa) {
  if (CpuSupportsKernelIsa(isa)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this CPU cannot run the ", std::string(KernelIsaName(isa)),
                   " copy of the hand-written kernels; use HandWrittenKernels()"));
}

absl::Status ForwardWith(KernelIsa isa, const ForwardArgs& args, const WorkList& work,
                         int num_threads) {
  HSAP_RETURN_IF_ERROR(CheckSupported(isa));
  HSAP_RETURN_IF_ERROR(ValidateDims(args.dims));
  if (args.q_rows < 0 || args.k_rows < 0) {
    return absl::InvalidArgumentError("q_rows and k_rows must be non-negative");
  }
  HSAP_RETURN_IF_ERROR(CheckWork(work, args.q_rows, args.k_rows));
  if (work.blocks.empty()) return absl::OkStatus();
  HSAP_RETURN_IF_ERROR(CheckBuffers(
      {{args.q, "q"}, {args.k, "k"}, {args.v, "v"}, {args.out, "out"}, {args.lse, "lse"}}));
  CopyFor(isa).forward(args, work, num_threads);
  return absl::OkStatus();
}

absl::Status BackwardWith(KernelIsa isa, const BackwardArgs& args, const WorkList& work,
                          int num_threads) {
  HSAP_RETURN_IF_ERROR(CheckSupported(isa));
  HSAP_RETURN_IF_ERROR(ValidateDims(args.dims));
  if (args.q_rows < 0 || args.k_rows < 0) {
    return absl::InvalidArgumentError("q_rows and k_rows must be non-negative");
  }
  HSAP_RETURN_IF_ERROR(CheckWork(work, args.q_rows, args.k_rows));
  if (work.blocks.empty()) return absl::OkStatus();
  HSAP_RETURN_IF_ERROR(CheckBuffers({{args.q, "q"},
                                     {args.dout, "dout"},
                                     {args.lse, "lse"},
                                     {args.delta, "delta"},
                                     {args.k, "k"},
                                     {args.v, "v"},
                                     {args.dq, "dq"},
                                     {args.dk, "dk"},
                                     {args.dv, "dv"}}));
  const AttentionDims& dims = args.dims;
  BackwardSchedule schedule;
  const int64_t num_chunks = (args.k_rows + kTileK - 1) / kTileK;
  schedule.touching.resize(num_chunks);
  for (int64_t b = 0; b < static_cast<int64_t>(work.blocks.size()); ++b) {
    const QueryBlock& blk = work.blocks[b];
    if (blk.q_begin >= blk.q_end) continue;
    for (int64_t s = blk.seg_begin; s < blk.seg_end; ++s) {
      const KeySegment& seg = work.segments[s];
      if (seg.k_begin >= seg.k_end) continue;
      for (int64_t c = seg.k_begin / kTileK; c <= (seg.k_end - 1) / kTileK; ++c) {
        schedule.touching[c].emplace_back(b, s);
      }
    }
  }
  // Query tiles are numbered over the blocks in order; pair (tile u, chunk c) goes to wave
  // (u - c) mod L, a matching since u < L and c < L.
  std::vector<int64_t> first_tile(work.blocks.size() + 1, 0);
  for (size_t b = 0; b < work.blocks.size(); ++b) {
    const QueryBlock& blk = work.blocks[b];
    first_tile[b + 1] = first_tile[b] + (blk.q_end - blk.q_begin + kTileQ - 1) / kTileQ;
  }
  const int64_t num_waves = std::max<int64_t>(first_tile.back(), num_chunks);
  std::vector<int64_t> wave_of;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const std::vector<std::pair<int64_t, int64_t>>& touching = schedule.touching[c];
    const int64_t c0 = c * kTileK, c1 = std::min<int64_t>(c0 + kTileK, args.k_rows);
    for (size_t first = 0, last; first < touching.size(); first = last) {
      const int64_t b = touching[first].first;
      for (last = first + 1; last < touching.size() && touching[last].first == b;) ++last;
      const QueryBlock& blk = work.blocks[b];
      for (int64_t q0 = blk.q_begin; q0 < blk.q_end; q0 += kTileQ) {
        const int64_t q1 = std::min<int64_t>(q0 + kTileQ, blk.q_end);
        bool visible = false;
        for (size_t i = first; i < last && !visible; ++i) {
          const KeySegment& seg = work.segments[touching[i].second];
          visible = Classify(seg, q0, q1, std::max(seg.k_begin, c0), std::min(seg.k_end, c1)) !=
                    TileVisibility::kEmpty;
        }
        if (!visible) continue;
        const int64_t u = first_tile[b] + (q0 - blk.q_begin) / kTileQ;
        schedule.pairs.push_back({c, b, q0, static_cast<int>(q1 - q0), static_cast<int32_t>(first),
                                  static_cast<int32_t>(last)});
        wave_of.push_back(((u - c) % num_waves + num_waves) % num_waves);
      }
    }
  }
  // Counting sort by wave (stable: within a wave, pairs stay in chunk order).
  std::vector<size_t> count(num_waves + 1, 0);
  for (int64_t w : wave_of) ++count[w + 1];
  for (int64_t w = 0; w < num_waves; ++w) count[w + 1] += count[w];
  std::vector<BackwardPair> sorted(schedule.pairs.size());
  for (size_t i = 0; i < wave_of.size(); ++i) sorted[count[wave_of[i]]++] = schedule.pairs[i];
  schedule.pairs = std::move(sorted);
  schedule.wave_begin.push_back(0);
  for (int64_t w = 0; w < num_waves; ++w) {
    if (count[w] != schedule.wave_begin.back()) schedule.wave_begin.push_back(count[w]);
  }
  schedule.heads_of_group.resize(dims.heads_kv);
  for (int h = 0; h < dims.heads_q; ++h) schedule.heads_of_group[dims.KvHead(h)].push_back(h);
  CopyFor(isa).backward(args, work, schedule, num_threads);
  return absl::OkStatus();
}

class HandWritten final : public KernelSet {
 public:
  HandWritten(KernelIsa isa, std::string name) : isa_(isa), name_(std::move(name)) {}
  absl::Status Forward(const ForwardArgs& args, const WorkList& work,
                       int num_threads) const override {
    return ForwardWith(isa_, args, work, num_threads);
  }
  absl::Status Backward(const BackwardArgs& args, const WorkList& work,
                        int num_threads) const override {
    return BackwardWith(isa_, args, work, num_threads);
  }
  std::string_view name() const override { return name_; }

 private:
  KernelIsa isa_;
  std::string name_;
};

}  // namespace

absl::Status ValidateDims(const AttentionDims& dims) {
  if (dims.heads_q <= 0 || dims.heads_kv <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heads_q = ", dims.heads_q, ", heads_kv = ", dims.heads_kv, "; both must be positive"));
  }
  if (dims.kv_head_of_q.empty()) {
    if (dims.heads_q % dims.heads_kv != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "heads_q = ", dims.heads_q, " is not a multiple of heads_kv = ", dims.heads_kv,
          "; pass kv_head_of_q for an irregular grouping"));
    }
  } else {
    if (static_cast<int>(dims.kv_head_of_q.size()) != dims.heads_q) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_head_of_q has ", dims.kv_head_of_q.size(),
                       " entries; it needs heads_q = ", dims.heads_q));
    }
    for (size_t h = 0; h < dims.kv_head_of_q.size(); ++h) {
      if (dims.kv_head_of_q[h] < 0 || dims.kv_head_of_q[h] >= dims.heads_kv) {
        return absl::InvalidArgumentError(
            absl::StrCat("kv_head_of_q[", h, "] = ", dims.kv_head_of_q[h],
                         " is not a kv head in [0, ", dims.heads_kv, ")"));
      }
    }
  }
  if (dims.head_dim < 32 || dims.head_dim > 256 || dims.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim = ", dims.head_dim, "; it must be a multiple of 8 in [32, 256]"));
  }
  if (!std::isfinite(dims.scale) || dims.scale <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scale = ", dims.scale, "; it must be finite and positive (usually 1/sqrt(head_dim))"));
  }
  return absl::OkStatus();
}

void InitPartial(float* out, float* lse, int64_t rows, int heads, int head_dim) {
  std::fill(out, out + rows * heads * static_cast<int64_t>(head_dim), 0.0f);
  std::fill(lse, lse + rows * heads, kNegInf);
}

std::string_view KernelIsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kBaseline:
      return "baseline";
    case KernelIsa::kAvx2:
      return "avx2";
    case KernelIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool CpuSupportsKernelIsa(KernelIsa isa) {
  static const bool supported[] = {DetectSupport(KernelIsa::kBaseline),
                                   DetectSupport(KernelIsa::kAvx2),
                                   DetectSupport(KernelIsa::kAvx512)};
  const int i = static_cast<int>(isa);
  return i >= 0 && i < 3 && supported[i];
}

KernelIsa BestKernelIsa() {
  static const KernelIsa best = CpuSupportsKernelIsa(KernelIsa::kAvx512) ? KernelIsa::kAvx512
                                : CpuSupportsKernelIsa(KernelIsa::kAvx2) ? KernelIsa::kAvx2
                                                                         : KernelIsa::kBaseline;
  return best;
}

absl::Status KernelForward(const ForwardArgs& args, const WorkList& work, int num_threads) {
  return ForwardWith(BestKernelIsa(), args, work, num_threads);
}

absl::Status KernelBackward(const BackwardArgs& args, const WorkList& work, int num_threads) {
  return BackwardWith(BestKernelIsa(), args, work, num_threads);
}

const KernelSet& HandWrittenKernels() {
  static const HandWritten* const kernels = new HandWritten(BestKernelIsa(), "host-handwritten");
  return *kernels;
}

const KernelSet& HandWrittenKernels(KernelIsa isa) {
  static const HandWritten* const copies[] = {
      new HandWritten(KernelIsa::kBaseline, "host-handwritten/baseline"),
      new HandWritten(KernelIsa::kAvx2, "host-handwritten/avx2"),
      new HandWritten(KernelIsa::kAvx512, "host-handwritten/avx512")};
  return *copies[static_cast<int>(isa)];
}

void ComputeDelta(DType dtype, const void* dout, const void* out, int64_t rows, int heads,
                  int head_dim, float* delta) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      const size_t base = (static_cast<size_t>(r) * heads + h) * head_dim;
      float sum = 0.0f;
      for (int d = 0; d < head_dim; ++d) {
        sum += LoadAsFloat(dtype, dout, base + d) * LoadAsFloat(dtype, out, base + d);
      }
      delta[h * rows + r] = sum;
    }
  }
}

}  // namespace hsap