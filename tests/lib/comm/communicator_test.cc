#include "lib/comm/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_env.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

TEST(ResolveTimeoutTest, RequestedWins) {
  testing::ScopedEnv env("HSAP_TIMEOUT_MS", "1234");
  EXPECT_EQ(*ResolveTimeout(absl::Milliseconds(250)), absl::Milliseconds(250));
}

TEST(ResolveTimeoutTest, DefaultIsFiveMinutes) {
  testing::ScopedEnv env("HSAP_TIMEOUT_MS", nullptr);
  EXPECT_EQ(*ResolveTimeout(absl::ZeroDuration()), absl::Minutes(5));
}

TEST(ResolveTimeoutTest, EnvironmentHonoured) {
  testing::ScopedEnv env("HSAP_TIMEOUT_MS", "1234");
  EXPECT_EQ(*ResolveTimeout(absl::ZeroDuration()), absl::Milliseconds(1234));
}

TEST(ResolveTimeoutTest, MalformedOrNonPositiveEnvironmentRejected) {
  for (const char* bad : {"", "abc", "12ms", "1.5", "0", "-5", "99999999999999999999999"}) {
    testing::ScopedEnv env("HSAP_TIMEOUT_MS", bad);
    absl::StatusOr<absl::Duration> t = ResolveTimeout(absl::ZeroDuration());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(t.status().message(), HasSubstr("HSAP_TIMEOUT_MS")) << "'" << bad << "'";
  }
}

TEST(ResolveTimeoutTest, NegativeRequestRejected) {
  EXPECT_EQ(ResolveTimeout(absl::Milliseconds(-1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CommunicatorTest, CreateHostWorld) {
  testing::ScopedEnv env("HSAP_TIMEOUT_MS", nullptr);
  CommOptions options;
  options.timeout = absl::Milliseconds(700);
  auto comms = Communicator::CreateHostWorld(3, options);
  ASSERT_TRUE(comms.ok()) << comms.status();
  ASSERT_EQ(comms->size(), 3u);
  const int hardware = static_cast<int>(std::thread::hardware_concurrency());
  for (int r = 0; r < 3; ++r) {
    const Communicator& c = *(*comms)[r];
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.size(), 3);
    EXPECT_EQ(c.timeout(), absl::Milliseconds(700));
    EXPECT_EQ(c.num_threads(), std::max(1, hardware / 3));
  }
  options.num_threads = 5;
  comms = Communicator::CreateHostWorld(1, options);
  ASSERT_TRUE(comms.ok());
  EXPECT_EQ((*comms)[0]->num_threads(), 5);
}

TEST(CommunicatorTest, TimeoutFromEnvironmentReachesTheTransport) {
  testing::ScopedEnv env("HSAP_TIMEOUT_MS", "150");
  auto comms = Communicator::CreateHostWorld(2, CommOptions{});
  ASSERT_TRUE(comms.ok()) << comms.status();
  EXPECT_EQ((*comms)[0]->timeout(), absl::Milliseconds(150));
  int x = 0;
  const absl::Time start = absl::Now();
  absl::Status s = (*comms)[0]->transport().Exchange({}, {{RecvOp{1, &x, sizeof(x), 1}}}, "env");
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("timed out after 150 ms"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(CommunicatorTest, AbortReachesEveryRank) {
  auto comms = Communicator::CreateHostWorld(
      2, CommOptions{.timeout = absl::Seconds(30), .num_threads = 1, .rank_nodes = {}});
  ASSERT_TRUE(comms.ok());
  (*comms)[0]->Abort("stop");
  EXPECT_TRUE((*comms)[1]->transport().aborted());
}

TEST(CommunicatorTest, RejectsBadOptions) {
  testing::ScopedEnv env("HSAP_TIMEOUT_MS", nullptr);
  EXPECT_EQ(Communicator::CreateHostWorld(0, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Communicator::CreateHostWorld(-3, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Communicator::CreateHostWorld(100000, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Communicator::CreateHostWorld(
          2, CommOptions{.timeout = absl::Milliseconds(-5), .num_threads = 0, .rank_nodes = {}})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Communicator::CreateHostWorld(
          2, CommOptions{.timeout = absl::ZeroDuration(), .num_threads = -1, .rank_nodes = {}})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  testing::ScopedEnv bad_env("HSAP_TIMEOUT_MS", "soon");
  absl::Status s = Communicator::CreateHostWorld(2, {}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("HSAP_TIMEOUT_MS"));
}

}  // namespace
}  // namespace hsap
