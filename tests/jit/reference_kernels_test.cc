// The NVRTC program of the GPU reference (jit/reference_kernels.h): its name expressions, and
// cubins for sm_80 and sm_90 that define all eight kernels, with ptxas' register report
// (skipped where NVRTC is missing).
#include "jit/reference_kernels.h"

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/cuda_kernels.h"
#include "jit/device/hsap_reference.cuh"
#include "jit/nvrtc.h"

namespace hsap::jit {
namespace {

using ::testing::HasSubstr;

TEST(ReferenceKernels, NameExpressionsAndProgram) {
  EXPECT_EQ(RefKernelExpression(RefKernel::kForward, RefArith::kExact, DType::kBF16, 128),
            "hsap_dev::ref_fwd_kernel<hsap_dev::bf16, hsap_dev::RefExact, 128>");
  EXPECT_EQ(RefKernelExpression(RefKernel::kDkDv, RefArith::kRounded, DType::kF16, 64),
            "hsap_dev::ref_dkdv_kernel<hsap_dev::f16, hsap_dev::RefRounded<hsap_dev::f16>, 64>");
  EXPECT_EQ(RefKernelExpression(RefKernel::kRowDot, RefArith::kRounded, DType::kF32, 32),
            "hsap_dev::ref_rowdot_kernel<float, hsap_dev::RefRounded<float>, 32>");

  absl::StatusOr<CudaCompileRequest> r = ReferenceKernelsRequest(DType::kBF16, 128, "sm_90");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->name_expressions.size(), 8u);
  EXPECT_EQ(std::set<std::string>(r->name_expressions.begin(), r->name_expressions.end()).size(),
            8u);
  std::set<std::string> headers;
  for (const auto& [name, text] : r->headers) {
    headers.insert(name);
    EXPECT_FALSE(text.empty()) << name;
  }
  EXPECT_EQ(headers, (std::set<std::string>{"hsap_device.cuh", "hsap_reference.cuh"}));
  EXPECT_THAT(r->source, HasSubstr("#include \"hsap_reference.cuh\""));

  for (int bad : {0, 4, 12, 264}) {
    EXPECT_EQ(ReferenceKernelsRequest(DType::kF32, bad, "sm_90").status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(ReferenceKernelsRequest(DType::kF32, 64, "gfx90a").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReferenceKernels, SharedMemoryFitsEveryArchitecture) {
  // sm_80 gives a CTA at most 163 KB of shared memory (sm_90: 227 KB).
  for (int d = 8; d <= 256; d += 8) {
    for (int vb : {4, 8}) {
      EXPECT_LE(hsap_dev::ref_fwd_smem_bytes(d, vb), 163 * 1024) << d;
      EXPECT_LE(hsap_dev::ref_dq_smem_bytes(d, vb), 163 * 1024) << d;
      EXPECT_LE(hsap_dev::ref_dkdv_smem_bytes(d, vb), 163 * 1024) << d;
    }
  }
}

TEST(ReferenceKernels, CompileForSm80AndSm90) {
  if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message();
  struct Case {
    const char* arch;
    DType dtype;
    int head_dim;
  };
  // Every dtype and both architectures; both tile sizes (d <= 128: 32, else 16) with the
  // largest shared memory of each (d 128, d 256 in fp64) and a head dim that is not a
  // multiple of 16.
  for (Case c : {Case{"sm_90", DType::kBF16, 128}, Case{"sm_90", DType::kF32, 256},
                 Case{"sm_80", DType::kF16, 40}}) {
    const char* arch = c.arch;
    SCOPED_TRACE(absl::StrCat(arch, " ", std::string(DTypeName(c.dtype)), " d ", c.head_dim));
    absl::StatusOr<CudaBinary> b = CompileReferenceKernels(c.dtype, c.head_dim, arch, nullptr);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->kind, CudaBinary::Kind::kCubin);
    EXPECT_EQ(b->target, arch);
    absl::StatusOr<std::vector<ElfSymbol>> symbols = ReadElfSymbols(b->image);
    ASSERT_TRUE(symbols.ok()) << symbols.status();
    std::set<std::string> functions;
    for (const ElfSymbol& s : *symbols) {
      if (s.type == 2) functions.insert(s.name);
    }
    for (RefArith arith : {RefArith::kExact, RefArith::kRounded}) {
      for (RefKernel kernel : kAllRefKernels) {
        const std::string expression = RefKernelExpression(kernel, arith, c.dtype, c.head_dim);
        absl::StatusOr<std::string> name = b->LoweredName(expression);
        ASSERT_TRUE(name.ok()) << expression;
        EXPECT_TRUE(functions.count(*name)) << expression;
      }
    }
    absl::StatusOr<std::vector<CudaKernelResources>> resources = ParsePtxasResources(b->log);
    ASSERT_TRUE(resources.ok()) << resources.status();
    EXPECT_EQ(resources->size(), 8u);
    for (const CudaKernelResources& k : *resources) {
      // 256 threads per CTA: at most 255 registers each. Spills are slow, not wrong: shown.
      EXPECT_LE(k.registers, 255) << k.function;
      std::printf("%s %s: %d registers, %d bytes spilled\n", arch, k.function.c_str(), k.registers,
                  k.spill_store_bytes);
    }
  }
}

}  // namespace
}  // namespace hsap::jit
