// The communicator entry points of the C ABI, including every bad input.
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"
#include "lib/comm/communicator.h"
#include "tests/support/scoped_env.h"

namespace {

using ::testing::HasSubstr;

std::string LastError() { return hsapGetLastError(); }

TEST(ApiCommTest, InitAllCountRankDestroy) {
  std::vector<hsapComm_t> comms(4, nullptr);
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.timeoutMs = 1000;
  config.numThreads = 2;
  ASSERT_EQ(hsapCommInitAll(comms.data(), 4, &config), hsapSuccess) << LastError();
  for (int r = 0; r < 4; ++r) {
    ASSERT_NE(comms[r], nullptr);
    int count = -1, rank = -1;
    EXPECT_EQ(hsapCommCount(comms[r], &count), hsapSuccess);
    EXPECT_EQ(hsapCommUserRank(comms[r], &rank), hsapSuccess);
    EXPECT_EQ(count, 4);
    EXPECT_EQ(rank, r);
    EXPECT_EQ(comms[r]->comm->timeout(), absl::Milliseconds(1000));
    EXPECT_EQ(comms[r]->comm->num_threads(), 2);
  }
  for (hsapComm_t c : comms) EXPECT_EQ(hsapCommDestroy(c), hsapSuccess);
  EXPECT_EQ(hsapCommDestroy(nullptr), hsapSuccess);
}

TEST(ApiCommTest, NullConfigUsesDefaults) {
  hsapComm_t comm = nullptr;
  ASSERT_EQ(hsapCommInitAll(&comm, 1, nullptr), hsapSuccess) << LastError();
  EXPECT_GE(comm->comm->num_threads(), 1);
  EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess);
}

TEST(ApiCommTest, BadInitArgumentsLeaveNothingBehind) {
  hsapComm_t sentinel = reinterpret_cast<hsapComm_t>(0x1);
  std::vector<hsapComm_t> comms(3, sentinel);

  EXPECT_EQ(hsapCommInitAll(nullptr, 2, nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("hsapCommInitAll: comms"));

  for (int n : {0, -1, 4097}) {
    EXPECT_EQ(hsapCommInitAll(comms.data(), n, nullptr), hsapInvalidArgument) << n;
    EXPECT_THAT(LastError(), HasSubstr("nranks"));
  }

  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.magic = 0;
  EXPECT_EQ(hsapCommInitAll(comms.data(), 3, &config), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("HSAP_COMM_CONFIG_INITIALIZER"));

  config = HSAP_COMM_CONFIG_INITIALIZER;
  config.size = 8;
  EXPECT_EQ(hsapCommInitAll(comms.data(), 3, &config), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("size"));

  config = HSAP_COMM_CONFIG_INITIALIZER;
  config.timeoutMs = -1;
  EXPECT_EQ(hsapCommInitAll(comms.data(), 3, &config), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("timeoutMs"));

  config = HSAP_COMM_CONFIG_INITIALIZER;
  config.numThreads = -2;
  EXPECT_EQ(hsapCommInitAll(comms.data(), 3, &config), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("numThreads"));

  // A malformed environment is reported when the config asks for it.
  {
    hsap::testing::ScopedEnv timeout("HSAP_TIMEOUT_MS", "later");
    EXPECT_EQ(hsapCommInitAll(comms.data(), 3, nullptr), hsapInvalidArgument);
    EXPECT_THAT(LastError(), HasSubstr("HSAP_TIMEOUT_MS"));
  }

  for (hsapComm_t c : comms) EXPECT_EQ(c, sentinel) << "a failed init wrote a handle";
}

TEST(ApiCommTest, AccessorsRejectNulls) {
  hsapComm_t comm = nullptr;
  ASSERT_EQ(hsapCommInitAll(&comm, 1, nullptr), hsapSuccess);
  int value = 0;
  EXPECT_EQ(hsapCommCount(nullptr, &value), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("hsapCommCount: comm is null"));
  EXPECT_EQ(hsapCommCount(comm, nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("count"));
  EXPECT_EQ(hsapCommUserRank(nullptr, &value), hsapInvalidArgument);
  EXPECT_EQ(hsapCommUserRank(comm, nullptr), hsapInvalidArgument);
  EXPECT_THAT(LastError(), HasSubstr("rank"));
  EXPECT_EQ(hsapCommAbort(nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess);
}

TEST(ApiCommTest, AbortFromAnotherThreadReleasesAWaitingRank) {
  std::vector<hsapComm_t> comms(2, nullptr);
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.timeoutMs = 60000;
  ASSERT_EQ(hsapCommInitAll(comms.data(), 2, &config), hsapSuccess);
  std::thread aborter([&]() {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_EQ(hsapCommAbort(comms[1]), hsapSuccess);
  });
  int x = 0;
  absl::Status s =
      comms[0]->comm->transport().Exchange({}, {{hsap::RecvOp{1, &x, sizeof(x), 3}}}, "waiting");
  aborter.join();
  EXPECT_EQ(hsap::ResultFromStatus(s), hsapAborted) << s;
  EXPECT_THAT(s.message(), HasSubstr("hsapCommAbort called on rank 1"));
  for (hsapComm_t c : comms) EXPECT_EQ(hsapCommDestroy(c), hsapSuccess);
}

}  // namespace
