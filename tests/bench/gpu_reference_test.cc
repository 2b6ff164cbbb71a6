// The bench's choice of reference (bench/gpu_reference.h): the policy of --reference, and the
// row reference from the host (and, without a GPU, the GPU's clear refusal).
#include "bench/gpu_reference.h"

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

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

// A stand-in for ComputeRowReference: records the sites asked for, fails the GPU with
// `gpu_status` when it is not OK.
struct FakeCompute {
  absl::Status gpu_status = absl::OkStatus();
  std::vector<ReferenceSite> calls;
  absl::StatusOr<RowReference> operator()(ReferenceSite site) {
    calls.push_back(site);
    if (site == ReferenceSite::kGpu && !gpu_status.ok()) return gpu_status;
    RowReference r;
    r.site = site;
    return r;
  }
};

TEST(GpuReferenceChoice, ObtainsTheChosenReference) {
  ReferencePolicy p;  // auto, host up to 4 GFLOP, GPU up to 20000
  std::string gpu_error;
  FakeCompute f;
  ObtainedReference got =
      ObtainRowReference(p, /*cuda_backend=*/true, 100.0, std::ref(f), &gpu_error);
  ASSERT_TRUE(got.ref.has_value());
  EXPECT_EQ(got.ref->site, ReferenceSite::kGpu);
  EXPECT_EQ(got.note, "");
  got = ObtainRowReference(p, /*cuda_backend=*/false, 1.0, std::ref(f), &gpu_error);
  ASSERT_TRUE(got.ref.has_value());
  EXPECT_EQ(got.ref->site, ReferenceSite::kHost);
  EXPECT_THAT(f.calls, ::testing::ElementsAre(ReferenceSite::kGpu, ReferenceSite::kHost));
  EXPECT_EQ(gpu_error, "");

  // Beyond the limits: nothing computed, the limit named.
  got = ObtainRowReference(p, true, 30000.0, std::ref(f), &gpu_error);
  EXPECT_FALSE(got.ref.has_value());
  EXPECT_THAT(got.note, HasSubstr("not checked: 30000 GFLOP"));
  EXPECT_THAT(got.note, HasSubstr("--gpu-ref-max-gflop 20000"));
  got = ObtainRowReference(p, false, 10.0, std::ref(f), &gpu_error);
  EXPECT_FALSE(got.ref.has_value());
  EXPECT_THAT(got.note, HasSubstr("above --ref-max-gflop 4; --reference gpu checks it"));
  EXPECT_EQ(f.calls.size(), 2u);
}

TEST(GpuReferenceChoice, FallsBackToTheHostWhenTheGpuFails) {
  ReferencePolicy p;
  p.choice = ReferenceChoice::kGpu;
  std::string gpu_error;
  FakeCompute f;
  f.gpu_status = absl::UnimplementedError("libcuda.so.1 not found");
  // Within the host's limit: the host's, saying why.
  ObtainedReference got = ObtainRowReference(p, false, 1.0, std::ref(f), &gpu_error);
  ASSERT_TRUE(got.ref.has_value());
  EXPECT_EQ(got.ref->site, ReferenceSite::kHost);
  EXPECT_THAT(got.note, HasSubstr("the GPU reference failed (UNIMPLEMENTED: libcuda.so.1"));
  EXPECT_THAT(got.note, HasSubstr("the host's instead"));
  EXPECT_THAT(gpu_error, HasSubstr("libcuda.so.1 not found"));
  // The GPU is not tried again; a row beyond the host's limit is not checked, and says why.
  got = ObtainRowReference(p, false, 10.0, std::ref(f), &gpu_error);
  EXPECT_FALSE(got.ref.has_value());
  EXPECT_THAT(got.note, HasSubstr("not checked: the GPU reference failed on an earlier row"));
  EXPECT_THAT(got.note, HasSubstr("10 GFLOP is above --ref-max-gflop 4"));
  got = ObtainRowReference(p, false, 2.0, std::ref(f), &gpu_error);
  ASSERT_TRUE(got.ref.has_value());
  EXPECT_EQ(got.ref->site, ReferenceSite::kHost);
  EXPECT_EQ(got.note, "the GPU reference failed on an earlier row; the host's instead");
  EXPECT_THAT(f.calls, ::testing::ElementsAre(ReferenceSite::kGpu, ReferenceSite::kHost,
                                              ReferenceSite::kHost));
}

}  // namespace
}  // namespace hsap::bench
