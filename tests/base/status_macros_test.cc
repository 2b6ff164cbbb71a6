#include "base/status_macros.h"

#include <memory>

#include "gtest/gtest.h"

namespace hsap {
namespace {

absl::StatusOr<std::unique_ptr<int>> MakeInt(int v) {
  if (v < 0) return absl::InvalidArgumentError("negative");
  return std::make_unique<int>(v);
}

absl::Status Twice(int v, int& calls, int& out) {
  HSAP_RETURN_IF_ERROR(++calls > 0 ? absl::OkStatus() : absl::InternalError("never"));
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<int> p, MakeInt(v));  // move-only value
  HSAP_RETURN_IF_ERROR(MakeInt(v - 10));                      // a StatusOr as a status
  out = 2 * *p;
  return absl::OkStatus();
}

absl::StatusOr<int> Plus(int v) {
  HSAP_ASSIGN_OR_RETURN(auto p, MakeInt(v));
  return *p + 1;
}

TEST(StatusMacros, PropagateAndAssign) {
  int calls = 0, out = 0;
  EXPECT_TRUE(Twice(12, calls, out).ok());
  EXPECT_EQ(out, 24);
  EXPECT_EQ(calls, 1);  // the expression is evaluated once
  EXPECT_EQ(Twice(-1, calls, out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Twice(5, calls, out).message(), "negative");  // from the second RETURN_IF_ERROR
  EXPECT_EQ(out, 24);
  EXPECT_EQ(*Plus(3), 4);
  EXPECT_EQ(Plus(-3).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsap
