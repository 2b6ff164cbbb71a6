#include "lib/sched/json_text.h"

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(JsonTextTest, ValidTextParses) {
  absl::StatusOr<nlohmann::json> j = ParseJsonText(R"({"a": [1, 2]})");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["a"][1], 2);
}

TEST(JsonTextTest, ErrorsGiveByteLineAndColumn) {
  absl::StatusOr<nlohmann::json> j = ParseJsonText("{\n  \"a\": tx}");
  ASSERT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(j.status().message(), HasSubstr("not valid JSON at byte "));
  EXPECT_THAT(j.status().message(), HasSubstr("line 2, column"));
  EXPECT_THAT(j.status().message(), Not(HasSubstr("[json.exception")));
  // Not a parse error, still no exception out of the call.
  EXPECT_EQ(ParseJsonText("1e999").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseJsonText("").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsap
