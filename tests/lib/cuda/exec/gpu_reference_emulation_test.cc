// The GPU reference (lib/cuda/exec/gpu_reference.h) with the kernels of
// jit/device/hsap_reference.cuh run on the CPU by the CUDA emulator (one std::thread per CUDA
// thread) on an emulated device: the whole path (interval lists, uploads, Params, grids,
// kernels, downloads) against the host's attention/reference.h on small rows of every mask
// kind, arbitrary slices (rows with two key blocks, rows and keys that see nothing), GQA (a
// ratio and an arbitrary kv-head map), every storage dtype, head dims that are and are not
// multiples of 16, and both tile sizes (32 up to head dim 128, 16 above). Seeds are fixed.
//
// The rules:
//  - exact results (RefExact) against ReferenceForward/Backward: for out, lse, dq, dk, dv,
//      max |gpu - host| <= 1e-12 * max(1, max |host|)   (kExactRelTol),
//    -inf lse entries equal: they differ only in the order of fp64 sums;
//  - rounded results (RefRounded) against NaiveForward/Backward: identical, bit for bit (the
//    emulator's expf/logf are the host's; same operations in the same order).
// The emulator must come before the device code.
// clang-format off
#include "tests/support/emulated_device.h"
#include "jit/device/hsap_reference.cuh"
// clang-format on

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "attention/reference.h"
#include "gtest/gtest.h"
#include "lib/cuda/exec/gpu_reference.h"
#include "tests/support/attention_test_util.h"
#include "tests/support/gpu_reference_util.h"

namespace hsap {
namespace {

using cuda::GpuReferenceResult;
using jit::RefArith;
using jit::RefKernel;
using testing::EmulatedDevice;
using testing::ExpectExactMatch;
using testing::ExpectIdentical;
using testing::RefDims;
using testing::RowInputs;

// The kernels of one (storage type T, head dim D), run by the emulator on the grids the GPU
// gets (cuda::RefLaunchOf).
template <typename T, int D>
class EmulatedReferenceKernels : public cuda::ReferenceKernels {
 public:
  explicit EmulatedReferenceKernels(DType dtype) : dtype_(dtype) {}
  DType dtype() const override { return dtype_; }
  int head_dim() const override { return D; }
  absl::Status Forward(RefArith a, const hsap_dev::RefFwdParams& p,
                       cuda::cudaStream) const override {
    return Run(RefKernel::kForward, a, p.tokens, p.heads_q, p.heads_kv,
               [&]<typename A>() { hsap_dev::ref_fwd_kernel<T, A, D>(p); });
  }
  absl::Status RowDot(RefArith a, const hsap_dev::RefRowDotParams& p,
                      cuda::cudaStream) const override {
    return Run(RefKernel::kRowDot, a, p.tokens, p.heads_q, 1,
               [&]<typename A>() { hsap_dev::ref_rowdot_kernel<T, A, D>(p); });
  }
  absl::Status Dq(RefArith a, const hsap_dev::RefBwdParams& p, cuda::cudaStream) const override {
    return Run(RefKernel::kDq, a, p.tokens, p.heads_q, p.heads_kv,
               [&]<typename A>() { hsap_dev::ref_dq_kernel<T, A, D>(p); });
  }
  absl::Status DkDv(RefArith a, const hsap_dev::RefBwdParams& p, cuda::cudaStream) const override {
    return Run(RefKernel::kDkDv, a, p.tokens, p.heads_q, p.heads_kv,
               [&]<typename A>() { hsap_dev::ref_dkdv_kernel<T, A, D>(p); });
  }

 private:
  template <typename Fn>
  absl::Status Run(RefKernel kernel, RefArith arith, long long tokens, int heads_q, int heads_kv,
                   Fn fn) const {
    const cuda::RefLaunch l = cuda::RefLaunchOf(kernel, arith, D, tokens, heads_q, heads_kv);
    if (l.empty()) return absl::OkStatus();
    return hsap_emu::Launch(l.grid_x, l.grid_y, l.threads, static_cast<size_t>(l.smem_bytes),
                            /*all_concurrent=*/false, [&] {
                              if (arith == RefArith::kExact) {
                                fn.template operator()<hsap_dev::RefExact>();
                              } else {
                                fn.template operator()<hsap_dev::RefRounded<T>>();
                              }
                            });
  }

  DType dtype_;
};

// Runs the emulated GPU reference and the host's, and checks them under the rules above.
template <typename T, int D>
void CheckAgainstHost(const Layout& layout, DType dtype, const AttentionDims& dims, uint64_t seed,
                      const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(dims.head_dim, D);
  const RowInputs row(dtype, layout.num_tokens(), dims, seed);
  EmulatedDevice device;
  const EmulatedReferenceKernels<T, D> kernels(dtype);
  absl::StatusOr<GpuReferenceResult> gpu =
      cuda::RunGpuReference(device, kernels, layout, row.in(), row.dout());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ(device.live_allocations(), 0u) << "the reference frees what it allocates";

  testing::ExpectMatchesHostReference(*gpu, layout, row.in(), row.dout());

  const ReferenceForwardResult naive = NaiveForward(layout, row.in());
  const ReferenceGradients gnaive = NaiveBackward(layout, row.in(), row.dout());
  ExpectIdentical(gpu->naive_forward.out, naive.out, "naive out");
  ExpectIdentical(gpu->naive_forward.lse, naive.lse, "naive lse");
  ExpectIdentical(gpu->naive_backward.dq, gnaive.dq, "naive dq");
  ExpectIdentical(gpu->naive_backward.dk, gnaive.dk, "naive dk");
  ExpectIdentical(gpu->naive_backward.dv, gnaive.dv, "naive dv");
}

TEST(GpuReferenceEmulation, EveryMaskKindBf16WithGqa) {
  CheckAgainstHost<hsap_dev::bf16, 32>(testing::EveryMaskKindLayout(), DType::kBF16,
                                       RefDims(4, 2, 32), 11, "bf16, 4/2 heads, d 32");
}

TEST(GpuReferenceEmulation, EveryMaskKindF16AndF32) {
  CheckAgainstHost<hsap_dev::f16, 16>(testing::EveryMaskKindLayout(), DType::kF16,
                                      RefDims(2, 1, 16), 12, "f16, 2/1 heads, d 16");
  CheckAgainstHost<float, 16>(testing::EveryMaskKindLayout(), DType::kF32, RefDims(2, 2, 16), 13,
                              "f32, 2/2 heads, d 16");
}

TEST(GpuReferenceEmulation, ScatteredSlicesWithAnArbitraryKvHeadMap) {
  AttentionDims dims = RefDims(3, 2, 40);  // d 40: the last 16-wide column of dims is partial
  dims.kv_head_of_q = {1, 0, 1};
  CheckAgainstHost<float, 40>(testing::ScatteredSliceLayout(), DType::kF32, dims, 14,
                              "f32 slices, kv map {1, 0, 1}, d 40");
  CheckAgainstHost<hsap_dev::bf16, 40>(testing::ScatteredSliceLayout(), DType::kBF16, dims, 15,
                                       "bf16 slices, kv map {1, 0, 1}, d 40");
}

TEST(GpuReferenceEmulation, LargeHeadDimUsesSmallTiles) {
  static_assert(hsap_dev::ref_tile(136) == 16);
  const Layout layout = *Layout::FromDocuments(
      std::vector<int64_t>{0, 21, 37, 40},
      std::vector<MaskKind>{MaskKind::kCausal, MaskKind::kPrefixLM, MaskKind::kFull},
      std::vector<int64_t>{0, 5, 0});
  CheckAgainstHost<hsap_dev::bf16, 136>(layout, DType::kBF16, RefDims(2, 1, 136), 16,
                                        "bf16, 2/1 heads, d 136");
}

TEST(GpuReferenceEmulation, RandomDocumentsOfEveryKind) {
  std::mt19937_64 rng(17);
  for (int i = 0; i < 2; ++i) {
    const Layout layout = testing::RandomDocumentLayout(rng, 80, 40);
    CheckAgainstHost<hsap_dev::f16, 24>(layout, DType::kF16, RefDims(2, 1, 24), 18 + i,
                                        absl::StrCat("random documents #", i));
  }
}

TEST(GpuReferenceEmulation, ForwardOnlyAndExactOnly) {
  const Layout layout = testing::EveryMaskKindLayout();
  const RowInputs row(DType::kBF16, layout.num_tokens(), RefDims(2, 2, 16), 20);
  EmulatedDevice device;
  const EmulatedReferenceKernels<hsap_dev::bf16, 16> kernels(DType::kBF16);
  cuda::GpuReferenceOptions options;
  options.backward = false;
  options.rounded = false;
  absl::StatusOr<GpuReferenceResult> gpu =
      cuda::RunGpuReference(device, kernels, layout, row.in(), /*dout=*/nullptr, options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const ReferenceForwardResult ref = ReferenceForward(layout, row.in());
  ExpectExactMatch(gpu->forward.out, ref.out, "out");
  ExpectExactMatch(gpu->forward.lse, ref.lse, "lse");
  EXPECT_TRUE(gpu->backward.dq.empty());
  EXPECT_TRUE(gpu->naive_forward.out.empty());
  EXPECT_EQ(device.live_allocations(), 0u);
}

}  // namespace
}  // namespace hsap
