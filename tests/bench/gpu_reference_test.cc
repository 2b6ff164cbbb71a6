// The bench's choice of reference (bench/gpu_reference.h): the policy of --reference, and the
// row reference from the host (and, without a GPU, the GPU's clear refusal).
#include "bench/gpu_reference.h"

#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/gpu_reference_util.h"
#include "tests/support/scoped_env.h"
#include "tests/support/test_files.h"

namespace hsap::bench {
namespace {

using ::testing::HasSubstr;

TEST(GpuReferenceChoice, ParsesTheThreeNames) {
  EXPECT_EQ(*ParseReferenceChoice("auto"), ReferenceChoice::kAuto);
  EXPECT_EQ(*ParseReferenceChoice("host"), ReferenceChoice::kHost);
  EXPECT_EQ(*ParseReferenceChoice("gpu"), ReferenceChoice::kGpu);
  for (const char* bad : {"", "GPU", "device", "cpu"}) {
    EXPECT_EQ(ParseReferenceChoice(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(GpuReferenceChoice, PicksBySizeAndBackend) {
  ReferencePolicy p;  // auto, host up to 4 GFLOP, GPU up to 20000
  EXPECT_EQ(PickReference(p, /*cuda_backend=*/false, 0.1), ReferenceSite::kHost);
  EXPECT_EQ(PickReference(p, false, 4.0), ReferenceSite::kHost);
  EXPECT_EQ(PickReference(p, false, 4.5), ReferenceSite::kNone);
  EXPECT_EQ(PickReference(p, true, 0.1), ReferenceSite::kHost);  // below kAutoGpuAboveGflop
  EXPECT_EQ(PickReference(p, true, 1.0), ReferenceSite::kGpu);
  EXPECT_EQ(PickReference(p, true, 4400.0), ReferenceSite::kGpu);  // 32K x 16 heads x d 128
  EXPECT_EQ(PickReference(p, true, 30000.0), ReferenceSite::kNone);
  p.choice = ReferenceChoice::kHost;
  EXPECT_EQ(PickReference(p, true, 1.0), ReferenceSite::kHost);
  EXPECT_EQ(PickReference(p, true, 4400.0), ReferenceSite::kNone);
  p.choice = ReferenceChoice::kGpu;
  EXPECT_EQ(PickReference(p, false, 0.01), ReferenceSite::kGpu);
  EXPECT_EQ(PickReference(p, true, 30000.0), ReferenceSite::kNone);
  EXPECT_EQ(ReferenceSiteName(ReferenceSite::kGpu), "gpu");
  EXPECT_EQ(ReferenceSiteName(ReferenceSite::kNone), "-");

  const ReferencePolicy a;
  EXPECT_THAT(DescribeReferencePolicy(a, true), HasSubstr("on the GPU"));
  EXPECT_THAT(DescribeReferencePolicy(a, true), HasSubstr("above 0.5 GFLOP"));
  EXPECT_THAT(DescribeReferencePolicy(a, false), ::testing::Not(HasSubstr("GPU")));
}

TEST(GpuReferenceChoice, HostRowReferenceIsTheHostsAndTheGpuOneSaysWhyNot) {
  const Layout layout = testing::EveryMaskKindLayout();
  const testing::RowInputs row(DType::kBF16, layout.num_tokens(), testing::RefDims(2, 1, 32), 7);
  absl::StatusOr<RowReference> host =
      ComputeRowReference(ReferenceSite::kHost, layout, row.in(), row.dout());
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(host->site, ReferenceSite::kHost);
  EXPECT_EQ(host->ref.out, ReferenceForward(layout, row.in()).out);
  EXPECT_EQ(host->gnaive.dk, NaiveBackward(layout, row.in(), row.dout()).dk);

  const std::string empty_dir = testing::MakeTestTempDir("bench_gpu_reference_test");
  testing::ScopedEnv env("HSAP_CUDA_LIB_PATH", empty_dir.c_str());
  absl::StatusOr<RowReference> gpu =
      ComputeRowReference(ReferenceSite::kGpu, layout, row.in(), row.dout());
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kUnimplemented) << gpu.status();
  std::filesystem::remove_all(empty_dir);
}

}  // namespace
}  // namespace hsap::bench
