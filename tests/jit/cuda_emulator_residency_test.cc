// The CUDA emulator's residency model (tests/support/cuda_emulator.h, Residency): a device
// keeps at most `limit` CTAs resident, CTAs start in blockIdx order as slots free up,
// launches from different threads (streams) share the slots, and CTAs that wait on CTAs that
// cannot become resident are reported as a deadlock by the watchdog instead of hanging.
// The emulator must come before the device code.
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_sync.cuh"
// clang-format on

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

constexpr auto kWatchdog = std::chrono::milliseconds(300);

// Every CTA but the last waits until the last one has started: a grid-wide dependency on
// the CTA that starts last.
absl::Status LaunchWaitingOnTheLastCta(hsap_emu::Residency& residency, unsigned int grid) {
  unsigned int last_started = 0;
  return hsap_emu::Launch(&residency, "waiter", grid, 1, 32, 0, /*all_concurrent=*/true, [&] {
    if (blockIdx.x + 1 == gridDim.x) {
      hsap_dev::cta_signal_add_gpu(&last_started, 1);
    } else {
      hsap_dev::cta_wait_geq_gpu(&last_started, 1);
    }
  });
}

TEST(EmulatorResidency, WaitingOnACtaThatCannotStartIsADeadlock) {
  hsap_emu::Residency residency(3, kWatchdog);
  const absl::Status s = LaunchWaitingOnTheLastCta(residency, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(s.message(), HasSubstr("deadlock: 3 CTAs resident and waiting, 1 CTA of waiter not "
                                     "resident; residency limit 3"));
  EXPECT_EQ(residency.peak(), 3);
  // The error is sticky: a later launch on the device fails at once.
  const absl::Status later = LaunchWaitingOnTheLastCta(residency, 1);
  EXPECT_THAT(later.message(), HasSubstr("the device deadlocked before: deadlock: 3 CTAs"));
  // The same kernel completes when its grid fits.
  hsap_emu::Residency fresh(3, kWatchdog);
  EXPECT_EQ(LaunchWaitingOnTheLastCta(fresh, 3), absl::OkStatus());
  EXPECT_EQ(fresh.peak(), 3);
}

TEST(EmulatorResidency, GridThatFitsCompletes) {
  hsap_emu::Residency residency(8, kWatchdog);
  EXPECT_EQ(LaunchWaitingOnTheLastCta(residency, 8), absl::OkStatus());
  EXPECT_EQ(residency.peak(), 8);
}

// With one slot the CTAs run one after the other, in blockIdx order (x, then y).
TEST(EmulatorResidency, CtasStartInBlockIdxOrder) {
  hsap_emu::Residency residency(1, kWatchdog);
  std::mutex mu;
  std::vector<std::pair<unsigned int, unsigned int>> order;
  std::atomic<int> resident{0}, most{0};
  ASSERT_EQ(hsap_emu::Launch(&residency, "order", 3, 2, 32, 0, /*all_concurrent=*/true,
                             [&] {
                               if (threadIdx.x == 0) {
                                 const int now = resident.fetch_add(1) + 1;
                                 most.store(std::max(most.load(), now));
                                 std::lock_guard<std::mutex> lock(mu);
                                 order.push_back({blockIdx.x, blockIdx.y});
                               }
                               __syncthreads();
                               if (threadIdx.x == 0) resident.fetch_sub(1);
                             }),
            absl::OkStatus());
  const std::vector<std::pair<unsigned int, unsigned int>> want = {{0, 0}, {1, 0}, {2, 0},
                                                                   {0, 1}, {1, 1}, {2, 1}};
  EXPECT_EQ(order, want);
  EXPECT_EQ(most.load(), 1);
  EXPECT_EQ(residency.peak(), 1);
}

// Two launches from two threads share the device's slots: never more than the limit at once.
TEST(EmulatorResidency, LaunchesFromSeveralStreamsShareTheSlots) {
  hsap_emu::Residency residency(3, kWatchdog);
  std::atomic<int> resident{0}, most{0};
  auto kernel = [&] {
    if (threadIdx.x == 0) {
      const int now = resident.fetch_add(1) + 1;
      int seen = most.load();
      while (now > seen && !most.compare_exchange_weak(seen, now)) {
      }
      // Holds the slot until the device is full (the last CTAs: briefly), so that the
      // launches overlap however fast the emulated CTAs run.
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
      while (resident.load() < 3 && std::chrono::steady_clock::now() < until) __nanosleep(100);
    }
    for (int i = 0; i < 20; ++i) __syncthreads();
    if (threadIdx.x == 0) resident.fetch_sub(1);
  };
  absl::Status a, b;
  std::thread ta([&] { a = hsap_emu::Launch(&residency, "a", 6, 1, 32, 0, true, kernel); });
  std::thread tb([&] { b = hsap_emu::Launch(&residency, "b", 5, 1, 64, 0, false, kernel); });
  ta.join();
  tb.join();
  EXPECT_EQ(a, absl::OkStatus());
  EXPECT_EQ(b, absl::OkStatus());
  EXPECT_LE(most.load(), 3);
  EXPECT_EQ(residency.peak(), most.load());
}

// CTAs of one kernel that wait for a kernel of another stream which cannot become resident
// (the first holds every slot): both launches are stopped, naming the CTAs left out.
TEST(EmulatorResidency, WaitingOnAnotherKernelThatCannotStartIsADeadlock) {
  hsap_emu::Residency residency(2, kWatchdog);
  unsigned int other_ran = 0;
  std::atomic<int> holder_resident{0};
  absl::Status holder, other;
  std::thread th([&] {
    holder = hsap_emu::Launch(&residency, "holder", 2, 1, 32, 0, true, [&] {
      if (threadIdx.x == 0) holder_resident.fetch_add(1);
      hsap_dev::cta_wait_geq_gpu(&other_ran, 1);
    });
  });
  while (holder_resident.load() < 2) std::this_thread::yield();
  other = hsap_emu::Launch(&residency, "other", 1, 1, 32, 0, true,
                           [&] { hsap_dev::cta_signal_add_gpu(&other_ran, 1); });
  th.join();
  for (const absl::Status& s : {holder, other}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_THAT(s.message(), HasSubstr("deadlock: 2 CTAs resident and waiting, 1 CTA of other not "
                                       "resident; residency limit 2"));
  }
  EXPECT_EQ(other_ran, 0u);
}

// A CTA that works (passes barriers) for longer than the watchdog while another waits for
// its slot is progress, not a deadlock.
TEST(EmulatorResidency, LongRunningCtasAreNotADeadlock) {
  hsap_emu::Residency residency(1, std::chrono::milliseconds(100));
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(400);
  EXPECT_EQ(hsap_emu::Launch(&residency, "busy", 2, 1, 32, 0, true,
                             [&] {
                               if (blockIdx.x != 0) return;
                               bool more = true;
                               while (more) {
                                 __syncthreads();
                                 more = std::chrono::steady_clock::now() < until;
                                 __syncthreads();
                               }
                             }),
            absl::OkStatus());
}

}  // namespace
}  // namespace hsap
