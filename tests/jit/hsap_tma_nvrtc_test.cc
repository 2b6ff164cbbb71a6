// jit/device/hsap_tma.cuh compiles with NVRTC for sm_90a, the target of the kernels that use
// it (ptxas accepts every instruction; none needs the "a", but one compile keeps the test
// short), the SASS holds the TMA loads (UTMALDG.2D/3D/4D),
// the tensor-map prefetch (UTMACCTL.PF) and the mbarrier operations (SYNCS.*), ptxas reports
// no spill, each wrapper emits the PTX instruction it names, and sm_80 refuses the sm_90
// instructions with a log that names one.
#include <filesystem>
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

using ::hsap::testing::ReadFile;
using ::testing::HasSubstr;

// A producer thread loads three boxes (2d, 3d, 4d) on one barrier with expect-tx; every
// thread waits, reads, and arrives on a second barrier: every function of hsap_tma.cuh once,
// the map a __grid_constant__ parameter as the kernels pass it.
constexpr const char* kEveryInstruction = R"(
#include "hsap_device.cuh"
#include "hsap_tma.cuh"
extern "C" __global__ void __launch_bounds__(128)
every_tma_instruction(const __grid_constant__ hsap_dev::TensorMap map, float* out) {
  using namespace hsap_dev;
  __shared__ __align__(1024) unsigned short tile[3 * 4096];
  __shared__ __align__(8) unsigned long long bar[2];
  if (threadIdx.x == 0) {
    prefetch_tensormap(&map);
    mbarrier_init(&bar[0], 1);
    mbarrier_init(&bar[1], blockDim.x);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar[0], 3 * 8192);
    tma_load_2d(tile, &map, 0, blockIdx.x, &bar[0]);
    tma_load_3d(tile + 4096, &map, 0, 1, blockIdx.x, &bar[0]);
    tma_load_4d(tile + 8192, &map, 0, 1, 2, blockIdx.x, &bar[0]);
  }
  mbarrier_wait_parity(&bar[0], 0);
  out[threadIdx.x] = tile[threadIdx.x * 3];
  fence_proxy_async_shared();
  mbarrier_arrive(&bar[1]);
  out[blockDim.x + threadIdx.x] = mbarrier_try_wait_parity(&bar[1], 0) ? 1.0f : 0.0f;
}
)";

CudaCompileRequest EveryInstruction(const std::string& arch) {
  CudaCompileRequest r;
  r.program_name = "hsap_tma_test.cu";
  r.source = kEveryInstruction;
  for (const char* name : {"hsap_device.cuh", "hsap_tma.cuh"}) {
    r.headers.emplace_back(name, ReadFile(absl::StrCat(HSAP_SOURCE_DIR, "/jit/device/", name)));
  }
  r.arch = arch;
  r.extra_options = {"--ptxas-options=-v"};
  return r;
}

TEST(HsapTmaNvrtc, CompilesWithTmaAndMbarrierSassAndNoSpill) {
  if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message();
  const std::string cuobjdump = testing::FindCuobjdump();
  for (const char* arch : {"sm_90a"}) {
    absl::StatusOr<CudaBinary> b = CompileCuda(EveryInstruction(arch), nullptr);
    ASSERT_TRUE(b.ok()) << arch << ": " << b.status();
    EXPECT_EQ(b->kind, CudaBinary::Kind::kCubin) << arch;
    EXPECT_EQ(b->target, arch);
    absl::StatusOr<std::vector<CudaKernelResources>> res = ParsePtxasResources(b->log);
    ASSERT_TRUE(res.ok()) << res.status() << "\n" << b->log;
    ASSERT_EQ(res->size(), 1u) << b->log;
    EXPECT_EQ((*res)[0].spill_store_bytes, 0) << arch;
    EXPECT_EQ((*res)[0].spill_load_bytes, 0) << arch;
    EXPECT_EQ((*res)[0].static_smem_bytes, 3 * 8192 + 16) << arch;
    if (cuobjdump.empty()) continue;
    const std::string dir = testing::MakeTestTempDir("tma_sass");
    const auto sass = testing::SassByFunction(cuobjdump, b->image, dir);
    std::filesystem::remove_all(dir);
    ASSERT_EQ(sass.count("every_tma_instruction"), 1u) << arch;
    const std::string& text = sass.at("every_tma_instruction");
    for (const char* op :
         {"UTMALDG.2D", "UTMALDG.3D", "UTMALDG.4D", "UTMACCTL.PF", "SYNCS.EXCH.64",
          "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64", "FENCE.VIEW.ASYNC.S"}) {
      EXPECT_THAT(text, HasSubstr(op)) << arch << "\n" << text;
    }
  }
  if (cuobjdump.empty()) GTEST_SKIP() << "no cuobjdump: the SASS was not checked";
}

TEST(HsapTmaNvrtc, EmitsTheNamedInstructions) {
  if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message();
  CudaCompileRequest r = EveryInstruction("sm_90a");
  r.force_ptx = true;
  absl::StatusOr<CudaBinary> b = CompileCuda(r, nullptr);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->kind, CudaBinary::Kind::kPtx);
  for (const char* instruction : {
           "mbarrier.init.shared::cta.b64",
           "mbarrier.arrive.shared::cta.b64",
           "mbarrier.arrive.expect_tx.shared::cta.b64",
           "mbarrier.try_wait.parity.shared::cta.b64",
           "fence.mbarrier_init.release.cluster",
           "fence.proxy.async.shared::cta",
           "prefetch.tensormap",
           "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
           "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes",
           "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes",
       }) {
    EXPECT_THAT(b->image, HasSubstr(instruction));
  }
}

// Before sm_90 the instructions do not exist: ptxas refuses, and the log names one.
TEST(HsapTmaNvrtc, Sm80RefusesWithAClearLog) {
  if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message();
  absl::StatusOr<CudaBinary> b = CompileCuda(EveryInstruction("sm_80"), nullptr);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr("sm_90"));
  EXPECT_THAT(b.status().message(),
              ::testing::AnyOf(HasSubstr("mbarrier"), HasSubstr("cp.async.bulk.tensor"),
                               HasSubstr("prefetch"), HasSubstr("fence")));
}

}  // namespace
}  // namespace hsap::jit
