// Error messages of the C ABI say the real limit, print values as the caller wrote them and
// point into bad JSON.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Stores `value` in an enum field as a C caller may.
template <typename E>
void StoreInt(E& field, int value) {
  static_assert(sizeof(E) == sizeof(int));
  std::memcpy(&field, &value, sizeof(value));
}

TEST(ApiMessagesTest, HeadCountsBeyondTheLimitNameIt) {
  const int kHuge = 1 << 30;
  const int group_sizes[] = {1}, group_ranks[] = {0}, head_counts[] = {1}, heads[] = {0};
  hsapPlan_t plan = nullptr;
  EXPECT_EQ(hsapPlanCreate(&plan, 1, kHuge, 1, 1, group_sizes, group_ranks, nullptr, nullptr,
                           head_counts, heads, nullptr),
            hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("numHeadsQ = 1073741824; it must be in [1, 65535]"));
  EXPECT_EQ(hsapPlanCreate(&plan, 1, 1, 65536, 1, group_sizes, group_ranks, nullptr, nullptr,
                           head_counts, heads, nullptr),
            hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("numHeadsKV = 65536; it must be in [1, 65535]"));

  const int64_t cu[] = {0, 8};
  hsapLayout_t layout = nullptr;
  ASSERT_EQ(hsapLayoutCreate(&layout, cu, 1, nullptr, nullptr), hsapSuccess);
  hsapComm_t comm = nullptr;
  ASSERT_EQ(hsapCommInitAll(&comm, 1, nullptr), hsapSuccess);
  hsapBatchConfig_t config = HSAP_BATCH_CONFIG_INITIALIZER;
  config.dtype = hsapFloat32;
  config.numHeadsQ = kHuge;
  config.numHeadsKV = 1;
  config.headDim = 32;
  hsapBatch_t batch = nullptr;
  EXPECT_EQ(hsapBatchCreate(&batch, comm, layout, nullptr, &config), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(),
              HasSubstr("config->numHeadsQ = 1073741824; it must be in [1, 65535]"));
  EXPECT_EQ(batch, nullptr);

  // Local attention checks the tensors' heads before it sizes anything from them.
  std::vector<float> data(8 * 32);
  hsapTensor_t q = {data.data(), hsapFloat32, 8, kHuge, 32};
  hsapTensor_t kv = {data.data(), hsapFloat32, 8, 1, 32};
  std::vector<float> lse(8);
  EXPECT_EQ(hsapAttentionForwardLocal(nullptr, layout, &q, &kv, &kv, &q, lse.data()),
            hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("q has 1073741824 heads; it needs [1, 65535]"));

  EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess);
  hsapLayoutDestroy(layout);
}

TEST(ApiMessagesTest, NegativeEnumsPrintAsWritten) {
  const int64_t cu[] = {0, 8};
  hsapMaskKind_t kind = hsapMaskCausal;
  StoreInt(kind, -1);
  hsapLayout_t layout = nullptr;
  EXPECT_EQ(hsapLayoutCreate(&layout, cu, 1, &kind, nullptr), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("kinds[0] is -1,"));
  EXPECT_THAT(hsapGetLastError(), Not(HasSubstr("4294967295")));

  hsapMaskSlice_t slice = {0, 8, 0, 8, hsapSliceFull, 0};
  StoreInt(slice.kind, -1);
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 8, &slice, 1), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("slices[0].kind is -1,"));

  ASSERT_EQ(hsapLayoutCreate(&layout, cu, 1, nullptr, nullptr), hsapSuccess);
  std::vector<float> data(8 * 32);
  hsapTensor_t t = {data.data(), hsapFloat32, 8, 1, 32};
  hsapTensor_t q = t;
  StoreInt(q.dtype, -1);
  std::vector<float> lse(8);
  EXPECT_EQ(hsapAttentionForwardLocal(nullptr, layout, &q, &t, &t, &t, lse.data()),
            hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("unknown data type -1;"));
  hsapLayoutDestroy(layout);
}

TEST(ApiMessagesTest, PlanJsonHeadsBeyondTheLimitAreRejectedBeforeSizingAnything) {
  const int group_sizes[] = {1}, group_ranks[] = {0}, head_counts[] = {2}, heads[] = {0, 1};
  hsapPlan_t plan = nullptr;
  ASSERT_EQ(hsapPlanCreate(&plan, 1, 2, 1, 1, group_sizes, group_ranks, nullptr, nullptr,
                           head_counts, heads, nullptr),
            hsapSuccess);
  size_t size = 0;
  ASSERT_EQ(hsapPlanToJson(plan, nullptr, &size), hsapSuccess);
  std::string json(size, '\0');
  ASSERT_EQ(hsapPlanToJson(plan, json.data(), &size), hsapSuccess);
  hsapPlanDestroy(plan);
  const std::string field = "\"heads_q\": 2";
  const size_t at = json.find(field);
  ASSERT_NE(at, std::string::npos) << json;
  json.replace(at, field.size(), "\"heads_q\": 1073741824");
  plan = nullptr;
  EXPECT_EQ(hsapPlanCreateFromJson(&plan, json.c_str()), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("heads_q = 1073741824 must be in [1, 65535]"));
  EXPECT_EQ(plan, nullptr);
}

TEST(ApiMessagesTest, PlanJsonErrorsSayWhere) {
  hsapPlan_t plan = nullptr;
  EXPECT_EQ(hsapPlanCreateFromJson(&plan, "{\"groups\": [1, 2,, 3]}"), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("not valid JSON at byte 18"));
  EXPECT_THAT(hsapGetLastError(), HasSubstr("line 1, column 18"));
  EXPECT_EQ(hsapPlanCreateFromJson(&plan, "{\n  \"groups\": [\n  }"), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("line 3, column 3"));
  EXPECT_EQ(plan, nullptr);
}

}  // namespace
