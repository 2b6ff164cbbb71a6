// The pieces of the variant compile test's resource and SASS checks
// (ShippedCudaKernelsOf/AllVariantsCompile (one test per architecture) in codegen_cuda_test.cc): ptxas'
// verbose report parsed per kernel, the occupancy it allows, and cuobjdump telling a
// tensor-core kernel (HMMA) from an FMA one.
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/cuda_kernels.h"
#include "jit/nvrtc.h"
#include "tests/support/cuobjdump.h"
#include "tests/support/test_files.h"

namespace hsap::jit {
namespace {

using ::testing::HasSubstr;

#define REQUIRE_NVRTC()                                                    \
  do {                                                                     \
    if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message(); \
  } while (0)

TEST(ParsePtxasResources, ReadsEveryEntry) {
  const std::string log =
      "ptxas info    : 0 bytes gmem\n"
      "ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z3fooPf\n"
      "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
      "ptxas info    : Used 168 registers, used 1 barriers, 16 bytes cumulative stack size, "
      "384 bytes smem\n"
      "ptxas info    : Compiling entry function '_Z3barv' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z3barv\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 32 registers, used 0 barriers\n"
      "ptxas info    : Compile time = 12.5 ms\n";
  absl::StatusOr<std::vector<CudaKernelResources>> r = ParsePtxasResources(log);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].function, "_Z3fooPf");
  EXPECT_EQ((*r)[0].registers, 168);
  EXPECT_EQ((*r)[0].stack_frame_bytes, 16);
  EXPECT_EQ((*r)[0].spill_store_bytes, 8);
  EXPECT_EQ((*r)[0].spill_load_bytes, 12);
  EXPECT_EQ((*r)[0].static_smem_bytes, 384);
  EXPECT_EQ((*r)[1].function, "_Z3barv");
  EXPECT_EQ((*r)[1].registers, 32);
  EXPECT_EQ((*r)[1].spill_store_bytes, 0);
  EXPECT_EQ((*r)[1].static_smem_bytes, 0);
  // An entry without its register line is not a ptxas -v log.
  EXPECT_FALSE(ParsePtxasResources("ptxas info    : Compiling entry function 'x' for 'sm_90'\n"
                                   "ptxas info    : Compiling entry function 'y' for 'sm_90'\n")
                   .ok());
}

TEST(CudaCtasPerSm, NamesTheBindingResource) {
  std::string why;
  // 128 threads at 255 registers: 4 warps x 8192 registers -> 2 CTAs of 65536.
  EXPECT_EQ(CudaCtasPerSm(90, 128, 255, 0, &why), 2);
  EXPECT_EQ(why, "registers");
  // Shared memory: 87040 bytes + 1 KiB reserved, twice, fit 228 KiB; three do not.
  EXPECT_EQ(CudaCtasPerSm(90, 128, 64, 87040, &why), 2);
  EXPECT_EQ(why, "shared memory");
  EXPECT_EQ(CudaCtasPerSm(80, 128, 64, 87040, &why), 1);  // 164 KiB on sm_80
  EXPECT_EQ(CudaCtasPerSm(90, 1024, 16, 0, &why), 2);
  EXPECT_EQ(why, "threads");
  EXPECT_EQ(CudaCtasPerSm(90, 32, 16, 0, &why), 32);
  EXPECT_EQ(why, "CTA slots");
  EXPECT_EQ(CudaCtasPerSm(90, 128, 64, 300000), 0);
}

// The HMMA check of the variant compile test (codegen_cuda_test.cc) needs cuobjdump; this
// says where it is, or skips with the reason, and checks it on a tensor-core kernel and an
// FMA one.
TEST(Cuobjdump, FindsHmmaInATensorCoreKernel) {
  REQUIRE_NVRTC();
  const std::string cuobjdump = testing::FindCuobjdump();
  if (cuobjdump.empty()) {
    GTEST_SKIP() << "no cuobjdump, so the variant compile test checks no SASS: install PyPI's "
                    "nvidia-cuda-cuobjdump (scripts/install_deps.sh) or set HSAP_CUOBJDUMP";
  }
  std::printf("[ cuobjdump ] %s\n", cuobjdump.c_str());
  CudaCompileRequest r;
  r.arch = "sm_80";
  r.source =
      "extern \"C\" __global__ void tc(float* d, const unsigned* a) {\n"
      "  float c[4] = {d[0], d[1], d[2], d[3]};\n"
      "  asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\" : \"+f\"(c[0]), \"+f\"(c[1]), \"+f\"(c[2]), "
      "\"+f\"(c[3]) : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(a[4]), "
      "\"r\"(a[5]));\n"
      "  for (int i = 0; i < 4; ++i) d[i] = c[i];\n"
      "}\n"
      "extern \"C\" __global__ void plain(float* d) { d[0] = d[1] * d[2] + d[3]; }\n";
  absl::StatusOr<CudaBinary> b = CompileCuda(r, nullptr);
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string dir = testing::MakeTestTempDir("cuda_resources_test");
  const std::map<std::string, std::string> sass = testing::SassByFunction(cuobjdump, b->image, dir);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(sass.count("tc") && sass.count("plain"));
  EXPECT_THAT(sass.at("tc"), HasSubstr("HMMA"));
  EXPECT_THAT(sass.at("plain"), ::testing::Not(HasSubstr("HMMA")));
}

}  // namespace
}  // namespace hsap::jit
