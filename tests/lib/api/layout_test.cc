// The layout entry points of the C ABI: the parameter ranges of hsap.h and messages that
// speak the caller's terms.
#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

hsapResult_t CreateOneDocument(int64_t length, hsapMaskKind_t kind, int64_t param) {
  const int64_t cu[] = {0, length};
  hsapLayout_t layout = nullptr;
  const hsapResult_t result = hsapLayoutCreate(&layout, cu, 1, &kind, &param);
  if (layout != nullptr) hsapLayoutDestroy(layout);  // (keeps hsapGetLastError() on failure)
  return result;
}

TEST(ApiLayoutTest, WindowAndPrefixRangesAreAsDocumented) {
  // Window >= 1 (longer than the document: clamped to it), prefix in [0, L].
  EXPECT_EQ(CreateOneDocument(10, hsapMaskSlidingWindow, 1), hsapSuccess);
  EXPECT_EQ(CreateOneDocument(10, hsapMaskSlidingWindow, 10), hsapSuccess);
  EXPECT_EQ(CreateOneDocument(10, hsapMaskSlidingWindow, 11), hsapSuccess);
  EXPECT_EQ(CreateOneDocument(1, hsapMaskSlidingWindow, 4096), hsapSuccess);
  EXPECT_EQ(CreateOneDocument(10, hsapMaskPrefixLM, 0), hsapSuccess);
  EXPECT_EQ(CreateOneDocument(10, hsapMaskPrefixLM, 10), hsapSuccess);
  for (const auto& [kind, param] :
       std::vector<std::pair<hsapMaskKind_t, int64_t>>{{hsapMaskSlidingWindow, 0},
                                                       {hsapMaskSlidingWindow, -1},
                                                       {hsapMaskPrefixLM, 11},
                                                       {hsapMaskPrefixLM, -1}}) {
    EXPECT_EQ(CreateOneDocument(10, kind, param), hsapInvalidArgument)
        << "kind " << kind << " param " << param;
    EXPECT_THAT(hsapGetLastError(), HasSubstr("params[0] = " + std::to_string(param)));
  }
  // Empty documents and kinds without a parameter ignore it.
  EXPECT_EQ(CreateOneDocument(0, hsapMaskSlidingWindow, -5), hsapSuccess);
  EXPECT_EQ(CreateOneDocument(10, hsapMaskCausal, 99), hsapSuccess);
}

TEST(ApiLayoutTest, SliceErrorsShowTheSlicesAsWritten) {
  // A causal slice with a window of 3, one without, and a full slice that meets the first.
  const hsapMaskSlice_t slices[] = {{0, 8, 0, 8, hsapSliceCausal, 3},
                                    {8, 16, 8, 16, hsapSliceCausal, 0},
                                    {4, 8, 2, 4, hsapSliceFull, 0}};
  hsapLayout_t layout = nullptr;
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 16, slices, 3), hsapInvalidArgument);
  const std::string message = hsapGetLastError();
  EXPECT_THAT(message, HasSubstr("{q [0, 8), k [0, 8), causal, window 3}"));
  EXPECT_THAT(message, HasSubstr("{q [4, 8), k [2, 4), full}"));
  EXPECT_THAT(message, Not(HasSubstr("1152921504606846976")));

  const hsapMaskSlice_t outside[] = {{8, 20, 8, 20, hsapSliceCausal, 0}};
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 16, outside, 1), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("{q [8, 20), k [8, 20), causal} lies outside"));
  EXPECT_EQ(layout, nullptr);
}

}  // namespace

// The largest row, 2^31 tokens, keeps every visible-pair count within int64; a longer row is
// an error that states the limit, never a wrapped count.
TEST(ApiLayoutTest, RowsUpToTheLimitCountTheirPairsExactly) {
  constexpr int64_t kMaxRow = int64_t{1} << 31;
  const hsapMaskKind_t full = hsapMaskFull;
  for (const int64_t length : {kMaxRow + 1, int64_t{3040000000}, int64_t{1} << 40}) {
    const int64_t cu[] = {0, length};
    hsapLayout_t layout = nullptr;
    EXPECT_EQ(hsapLayoutCreate(&layout, cu, 1, &full, nullptr), hsapInvalidArgument) << length;
    EXPECT_THAT(hsapGetLastError(), HasSubstr("at most 2^31 = 2147483648 tokens"));
    EXPECT_EQ(layout, nullptr);

    const hsapMaskSlice_t slice = {0, length, 0, length, hsapSliceFull, 0};
    EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, length, &slice, 1), hsapInvalidArgument);
    EXPECT_THAT(hsapGetLastError(), HasSubstr("[0, 2^31 = 2147483648]"));
  }

  const int64_t cu[] = {0, kMaxRow};
  hsapLayout_t layout = nullptr;
  int64_t pairs = 0;
  ASSERT_EQ(hsapLayoutCreate(&layout, cu, 1, &full, nullptr), hsapSuccess);
  ASSERT_EQ(hsapLayoutGetVisiblePairs(layout, &pairs), hsapSuccess);
  EXPECT_EQ(pairs, kMaxRow * kMaxRow);
  hsapLayoutDestroy(layout);

  ASSERT_EQ(hsapLayoutCreate(&layout, cu, 1, nullptr, nullptr), hsapSuccess);  // causal
  ASSERT_EQ(hsapLayoutGetVisiblePairs(layout, &pairs), hsapSuccess);
  EXPECT_EQ(pairs, kMaxRow / 2 * (kMaxRow + 1));
  hsapLayoutDestroy(layout);

  const hsapMaskSlice_t slice = {0, kMaxRow, 0, kMaxRow, hsapSliceFull, 0};
  ASSERT_EQ(hsapLayoutCreateFromSlices(&layout, kMaxRow, &slice, 1), hsapSuccess);
  ASSERT_EQ(hsapLayoutGetVisiblePairs(layout, &pairs), hsapSuccess);
  EXPECT_EQ(pairs, kMaxRow * kMaxRow);
  hsapLayoutDestroy(layout);
}
