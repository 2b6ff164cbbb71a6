// jit/device/hsap_mma.cuh compiles with NVRTC for sm_80 and sm_90 (ptxas accepts every
// instruction), and each wrapper emits the PTX instruction it names.
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/nvrtc.h"
#include "tests/support/test_files.h"

namespace hsap::jit {
namespace {

using ::hsap::testing::ReadFile;
using ::testing::HasSubstr;

// One warp uses every function of hsap_mma.cuh once.
constexpr const char* kEveryInstruction = R"(
#include "hsap_device.cuh"
#include "hsap_mma.cuh"
extern "C" __global__ void every_mma_instruction(const unsigned short* in, float* out) {
  using namespace hsap_dev;
  __shared__ __align__(16) unsigned short tile[4 * 64];
  const int lane = threadIdx.x;
  cp_async_16(tile + lane * 8, in + lane * 8);
  cp_async_commit();
  cp_async_16_zfill(tile + 128 + (lane % 16) * 8, in + 256 + lane * 8, lane < 16);
  cp_async_commit();
  cp_async_wait<1>();
  cp_async_wait<0>();
  __syncthreads();
  const unsigned short* row = tile + (lane % 16) * 8 + (lane / 16) * 128;
  unsigned a[4], at[4], b[2], bt[2], x1[1], x1t[1];
  ldmatrix_x4(a, row);
  ldmatrix_x4_trans(at, row);
  ldmatrix_x2(b, row);
  ldmatrix_x2_trans(bt, row);
  ldmatrix_x1(x1, row);
  ldmatrix_x1_trans(x1t, row);
  const float c[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  float d[4], e[4];
  mma_m16n8k16_bf16(d, a, b, c);
  const unsigned a2[4] = {at[0] ^ x1[0], at[1], at[2], at[3]};
  const unsigned b2[2] = {bt[0], bt[1] ^ x1t[0]};
  mma_m16n8k16_f16(e, a2, b2, d);
  const unsigned p = pack_bf16x2(e[0], e[1]) ^ pack_f16x2(e[2], e[3]);
  out[lane] = e[0] + e[1] + e[2] + e[3] + __uint_as_float(p);
}
)";

CudaCompileRequest EveryInstruction(const std::string& arch) {
  CudaCompileRequest r;
  r.program_name = "hsap_mma_test.cu";
  r.source = kEveryInstruction;
  for (const char* name : {"hsap_device.cuh", "hsap_mma.cuh"}) {
    r.headers.emplace_back(name, ReadFile(absl::StrCat(HSAP_SOURCE_DIR, "/jit/device/", name)));
  }
  r.arch = arch;
  return r;
}

TEST(HsapMmaNvrtc, CompilesToCubinForAmpereAndHopper) {
  if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message();
  for (const char* arch : {"sm_80", "sm_90"}) {
    absl::StatusOr<CudaBinary> b = CompileCuda(EveryInstruction(arch), nullptr);
    ASSERT_TRUE(b.ok()) << arch << ": " << b.status();
    EXPECT_EQ(b->kind, CudaBinary::Kind::kCubin) << arch;
    EXPECT_EQ(b->target, arch);
  }
}

TEST(HsapMmaNvrtc, EmitsTheNamedInstructions) {
  if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message();
  for (const char* arch : {"sm_80", "sm_90"}) {
    CudaCompileRequest r = EveryInstruction(arch);
    r.force_ptx = true;
    absl::StatusOr<CudaBinary> b = CompileCuda(r, nullptr);
    ASSERT_TRUE(b.ok()) << arch << ": " << b.status();
    ASSERT_EQ(b->kind, CudaBinary::Kind::kPtx);
    const std::string& ptx = b->image;
    for (const char* instruction : {
             "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
             "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
             "ldmatrix.sync.aligned.m8n8.x1.shared.b16",
             "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
             "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
             "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16",
             "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
             "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
             "cp.async.cg.shared.global",
             "cp.async.commit_group",
             "cp.async.wait_group 1",
             "cp.async.wait_group 0",
             "cvt.rn.bf16x2.f32",
             "cvt.rn.f16x2.f32",
         }) {
      EXPECT_THAT(ptx, HasSubstr(instruction)) << arch;
    }
  }
}

}  // namespace
}  // namespace hsap::jit
