// Layout entry points of the C ABI: conversions between hsapMaskSlice_t and MaskSlice, and
// argument checks. The layout rules themselves (cu_seqlens order, parameters per kind,
// overlapping slices) are checked by hsap::Layout.
#include "attention/layout.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"

namespace hsap {
namespace {

// Guards the arithmetic on user-given counts (n + 1, n * sizeof) against overflow; far
// beyond any real packed row.
constexpr int64_t kMaxCount = int64_t{1} << 40;

// Enums of the caller's arrays are read through RawEnum: they may hold any integer.
absl::StatusOr<MaskKind> MaskKindFromC(const hsapMaskKind_t& kind, int64_t index) {
  const auto raw = RawEnum(kind);
  switch (raw) {
    case hsapMaskCausal:
      return MaskKind::kCausal;
    case hsapMaskFull:
      return MaskKind::kFull;
    case hsapMaskPrefixLM:
      return MaskKind::kPrefixLM;
    case hsapMaskSlidingWindow:
      return MaskKind::kSlidingWindow;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("kinds[", index, "] is ", static_cast<int64_t>(raw),
                   ", not a mask kind; use hsapMaskCausal, hsapMaskFull, hsapMaskPrefixLM or "
                   "hsapMaskSlidingWindow"));
}

absl::StatusOr<MaskSlice> SliceFromC(const hsapMaskSlice_t& s, int64_t index) {
  const auto raw_kind = RawEnum(s.kind);
  switch (raw_kind) {
    case hsapSliceFull:
      if (s.window != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("slices[", index, "] is hsapSliceFull with window ", s.window,
                         "; a window applies only to hsapSliceCausal (set window to 0)"));
      }
      return MaskSlice::Full(s.qBegin, s.qEnd, s.kBegin, s.kEnd);
    case hsapSliceCausal:
      if (s.window < 0) {
        return absl::InvalidArgumentError(absl::StrCat("slices[", index, "].window is ", s.window,
                                                       "; use 0 (unlimited) or a positive window"));
      }
      return MaskSlice::Causal(s.qBegin, s.qEnd, s.kBegin, s.kEnd, s.window);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("slices[", index, "].kind is ", static_cast<int64_t>(raw_kind),
                   ", not a slice kind; use hsapSliceFull or hsapSliceCausal"));
}

hsapMaskSlice_t MakeCSlice(int64_t qb, int64_t qe, int64_t kb, int64_t ke, hsapSliceKind_t kind,
                           int64_t window) {
  hsapMaskSlice_t c{};
  c.qBegin = qb;
  c.qEnd = qe;
  c.kBegin = kb;
  c.kEnd = ke;
  c.kind = kind;
  c.window = window;
  return c;
}

// Appends C slices covering exactly the visible pairs of `s`. The C form ties the diagonal
// to the slice's corner, so a band that does not pass through the corner is split: an
// upper bound hi > 0 leaves a full block of the first hi + 1 key columns, hi < 0 leaves the
// first -hi query rows empty. Bands of other shapes fall back to one full slice per row
// (exact, only longer).
void AppendCSlices(const MaskSlice& s, std::vector<hsapMaskSlice_t>& out) {
  if (s.q_begin >= s.q_end || s.k_begin >= s.k_end) return;
  if (s.IsFull()) {
    out.push_back(MakeCSlice(s.q_begin, s.q_end, s.k_begin, s.k_end, hsapSliceFull, 0));
    return;
  }
  const bool unlimited_below = s.diag_lo <= -kNoDiagLimit;
  const bool unlimited_above = s.diag_hi >= kNoDiagLimit;
  if (!unlimited_above && s.diag_hi == 0 && (unlimited_below || s.diag_lo <= 0)) {
    const int64_t window = unlimited_below ? 0 : 1 - s.diag_lo;
    out.push_back(MakeCSlice(s.q_begin, s.q_end, s.k_begin, s.k_end, hsapSliceCausal, window));
    return;
  }
  if (unlimited_below && !unlimited_above) {
    const int64_t hi = s.diag_hi;
    if (hi > 0) {
      const int64_t full_end = std::min(s.k_end, s.k_begin + hi + 1);
      out.push_back(MakeCSlice(s.q_begin, s.q_end, s.k_begin, full_end, hsapSliceFull, 0));
      if (full_end < s.k_end && s.q_begin + 1 < s.q_end) {
        out.push_back(MakeCSlice(s.q_begin + 1, s.q_end, full_end, s.k_end, hsapSliceCausal, 0));
      }
    } else if (s.q_begin - hi < s.q_end) {
      out.push_back(MakeCSlice(s.q_begin - hi, s.q_end, s.k_begin, s.k_end, hsapSliceCausal, 0));
    }
    return;
  }
  for (int64_t q = s.q_begin; q < s.q_end; ++q) {
    const int64_t i = q - s.q_begin;
    const int64_t lo = unlimited_below ? 0 : std::max<int64_t>(0, i + s.diag_lo);
    const int64_t hi = unlimited_above ? s.k_end - s.k_begin - 1
                                       : std::min(s.k_end - s.k_begin - 1, i + s.diag_hi);
    if (lo <= hi) {
      out.push_back(MakeCSlice(q, q + 1, s.k_begin + lo, s.k_begin + hi + 1, hsapSliceFull, 0));
    }
  }
}

absl::StatusOr<const Layout*> GetLayout(hsapLayout_t layout) {
  if (layout == nullptr) {
    return absl::InvalidArgumentError(
        "layout is null; create one with hsapLayoutCreate or hsapLayoutCreateFromSlices");
  }
  return &layout->layout;
}

}  // namespace
}  // namespace hsap

extern "C" {

hsapResult_t hsapLayoutCreate(hsapLayout_t* layout, const int64_t* cuSeqlens, int64_t numDocs,
                              const hsapMaskKind_t* kinds, const int64_t* params) {
  return hsap::RunApi("hsapLayoutCreate", [&]() -> absl::Status {
    using hsap::kMaxCount;
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(layout, "layout"));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(cuSeqlens, "cuSeqlens"));
    if (numDocs < 0 || numDocs > kMaxCount) {
      return absl::InvalidArgumentError(absl::StrCat("numDocs is ", numDocs, "; it must be in [0, ",
                                                     kMaxCount,
                                                     "] (cuSeqlens holds numDocs + 1 entries)"));
    }
    std::vector<hsap::MaskKind> doc_kinds;
    if (kinds != nullptr) {
      doc_kinds.reserve(static_cast<size_t>(numDocs));
      for (int64_t d = 0; d < numDocs; ++d) {
        HSAP_ASSIGN_OR_RETURN(hsap::MaskKind kind, hsap::MaskKindFromC(kinds[d], d));
        doc_kinds.push_back(kind);
      }
    }
    absl::Span<const int64_t> param_span;
    if (params != nullptr) param_span = absl::MakeConstSpan(params, static_cast<size_t>(numDocs));
    HSAP_ASSIGN_OR_RETURN(hsap::Layout built,
                          hsap::Layout::FromDocuments(
                              absl::MakeConstSpan(cuSeqlens, static_cast<size_t>(numDocs) + 1),
                              doc_kinds, param_span));
    *layout = new hsapLayout_st{std::move(built)};
    return absl::OkStatus();
  });
}

hsapResult_t hsapLayoutCreateFromSlices(hsapLayout_t* layout, int64_t numTokens,
                                        const hsapMaskSlice_t* slices, int64_t numSlices) {
  return hsap::RunApi("hsapLayoutCreateFromSlices", [&]() -> absl::Status {
    using hsap::kMaxCount;
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(layout, "layout"));
    if (numTokens < 0 || numTokens > hsap::kMaxRowTokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "numTokens is ", numTokens, "; it must be in [0, 2^31 = ", hsap::kMaxRowTokens,
          "], the largest row (see Limits in hsap.h)"));
    }
    if (numSlices < 0 || numSlices > kMaxCount) {
      return absl::InvalidArgumentError(
          absl::StrCat("numSlices is ", numSlices, "; it must be in [0, ", kMaxCount, "]"));
    }
    if (numSlices > 0 && slices == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("slices is null but numSlices is ", numSlices));
    }
    std::vector<hsap::MaskSlice> converted;
    converted.reserve(static_cast<size_t>(numSlices));
    for (int64_t i = 0; i < numSlices; ++i) {
      HSAP_ASSIGN_OR_RETURN(hsap::MaskSlice s, hsap::SliceFromC(slices[i], i));
      converted.push_back(s);
    }
    HSAP_ASSIGN_OR_RETURN(hsap::Layout built,
                          hsap::Layout::FromSlices(numTokens, std::move(converted)));
    *layout = new hsapLayout_st{std::move(built)};
    return absl::OkStatus();
  });
}

hsapResult_t hsapLayoutDestroy(hsapLayout_t layout) {
  // Like free(): destroying NULL does nothing.
  return hsap::RunApi("hsapLayoutDestroy", [&]() -> absl::Status {
    delete layout;
    return absl::OkStatus();
  });
}

hsapResult_t hsapLayoutGetNumTokens(hsapLayout_t layout, int64_t* numTokens) {
  return hsap::RunApi("hsapLayoutGetNumTokens", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(const hsap::Layout* l, hsap::GetLayout(layout));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(numTokens, "numTokens"));
    *numTokens = l->num_tokens();
    return absl::OkStatus();
  });
}

hsapResult_t hsapLayoutGetVisiblePairs(hsapLayout_t layout, int64_t* pairs) {
  return hsap::RunApi("hsapLayoutGetVisiblePairs", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(const hsap::Layout* l, hsap::GetLayout(layout));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(pairs, "pairs"));
    *pairs = l->VisiblePairs();
    return absl::OkStatus();
  });
}

hsapResult_t hsapLayoutGetSlices(hsapLayout_t layout, hsapMaskSlice_t* slices, int64_t* numSlices) {
  return hsap::RunApi("hsapLayoutGetSlices", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(const hsap::Layout* l, hsap::GetLayout(layout));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(numSlices, "numSlices"));
    if (slices != nullptr && *numSlices < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("*numSlices is ", *numSlices,
                       "; set it to the capacity of slices (or pass slices = "
                       "NULL to query the count)"));
    }
    std::vector<hsapMaskSlice_t> converted;
    for (const hsap::MaskSlice& s : l->slices()) hsap::AppendCSlices(s, converted);
    const int64_t count = static_cast<int64_t>(converted.size());
    if (slices != nullptr) {
      std::copy_n(converted.begin(), std::min(count, *numSlices), slices);
    }
    *numSlices = count;
    return absl::OkStatus();
  });
}

}  // extern "C"
