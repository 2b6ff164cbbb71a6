// hsap_attn_perf's check of a row (bench/attn_perf_check.h): the max errors and the '# check'
// line printed after each row.
#include "bench/attn_perf_check.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsap::bench::attn_perf {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(AttnPerfCheck, MaxAbsDiffKeepsNaN) {
  EXPECT_EQ(MaxAbsDiff({1.0, -2.0, 3.0}, {1.5, 1.0, 3.0}), 3.0);
  EXPECT_EQ(MaxAbsDiff({}, {}), 0.0);
  EXPECT_TRUE(std::isnan(MaxAbsDiff({std::numeric_limits<double>::quiet_NaN(), 9.0}, {0, 0})));
}

TEST(AttnPerfCheck, CheckLineSaysWhatCheckedTheRowAndBothErrors) {
  RowCheck c;
  c.site = ReferenceSite::kGpu;
  c.seconds = 3.6;
  const double ours[4] = {1.95e-3, 3.05e-5, 2.44e-4, 9.77e-4};
  const double naive[4] = {3.9e-3, 6.1e-5, 4.88e-4, 0.25};
  for (int t = 0; t < 4; ++t) c.ours_err[t] = ours[t], c.naive_err[t] = naive[t];
  EXPECT_EQ(CheckLine(32768, c),
            "# check     32768 ref gpu     3.600s max|err| out,dq,dk,dv: ours 1.95e-03 3.05e-05 "
            "2.44e-04 9.77e-04 same-precision 3.90e-03 6.10e-05 4.88e-04 2.50e-01");

  c.site = ReferenceSite::kHost;
  c.note = "the GPU reference failed (UNIMPLEMENTED: no GPU); the host's instead";
  EXPECT_THAT(CheckLine(512, c), StartsWith("# check       512 ref host "));
  EXPECT_THAT(CheckLine(512, c), HasSubstr("2.50e-01; the GPU reference failed (UNIMPLEMENTED"));

  RowCheck none;
  none.note = "not checked: 4400 GFLOP of forward work, above --ref-max-gflop 4";
  EXPECT_EQ(CheckLine(32768, none),
            "# check     32768 ref -     not checked: 4400 GFLOP of forward work, above "
            "--ref-max-gflop 4");
}

}  // namespace
}  // namespace hsap::bench::attn_perf
