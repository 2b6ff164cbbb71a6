// The GPU reference (lib/cuda/exec/gpu_reference.h) without the emulator: its interval lists
// against the layout's own visibility, its launch grids, its status without a GPU, and, on a
// machine with a CUDA device (CudaGpuReference.*, skipped elsewhere), the JIT kernels against
// the host's attention/reference.h:
//  - exact results against ReferenceForward/Backward under kExactRelTol
//    (max |gpu - host| <= 1e-12 * max(1, max |host|) per tensor);
//  - the same-precision results stand for NaiveForward/Backward: a GPU's expf/logf may round
//    differently from the host's, so they are not compared bit for bit (the emulator test does
//    that) but by what they are used for, the error against the fp64 reference: per tensor,
//    the GPU's max |naive - ref| is within a factor 2 of the host's.
// HSAP_GPU_REFERENCE_TOKENS=N (a GPU machine) adds the timing of a row of N tokens, one
// causal document, bf16, 16 heads, head dim 128 (the bench's GPU-sized row at N = 32768).
#include "lib/cuda/exec/gpu_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "tests/support/attention_test_util.h"
#include "tests/support/gpu_reference_util.h"
#include "tests/support/scoped_env.h"
#include "tests/support/test_files.h"

namespace hsap::cuda {
namespace {

using jit::RefArith;
using jit::RefKernel;
using testing::ExpectExactMatch;
using ::testing::HasSubstr;
using testing::RefDims;
using testing::RowInputs;

// Checks `iv` against layout.Visible: every row's intervals are sorted, disjoint, maximal and
// hold exactly the visible columns; every tile's are the merged union of its rows'.
void CheckIntervals(const Layout& layout, bool by_key, int tile) {
  SCOPED_TRACE(
      absl::StrCat(by_key ? "queries of each key" : "keys of each query", ", tile ", tile));
  const RefRowIntervals iv = BuildRefIntervals(layout, by_key, tile);
  const int64_t n = layout.num_tokens();
  ASSERT_EQ(iv.row_offsets.size(), static_cast<size_t>(n + 1));
  const int64_t tiles = (n + tile - 1) / tile;
  ASSERT_EQ(iv.tile_offsets.size(), static_cast<size_t>(tiles + 1));
  ASSERT_EQ(iv.lo.size(), iv.hi.size());
  EXPECT_EQ(iv.row_offsets[0], 0);
  EXPECT_EQ(iv.tile_offsets[0], iv.row_offsets[n]);
  EXPECT_EQ(iv.tile_offsets[tiles], static_cast<int64_t>(iv.lo.size()));
  auto covered = [&](int64_t first, int64_t last, int64_t col) {
    for (int64_t i = first; i < last; ++i) {
      if (col >= iv.lo[i] && col < iv.hi[i]) return true;
    }
    return false;
  };
  auto check_sorted = [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      ASSERT_LT(iv.lo[i], iv.hi[i]);
      if (i > first) {
        ASSERT_LT(iv.hi[i - 1], iv.lo[i]) << "not disjoint or not merged";
      }
    }
  };
  for (int64_t r = 0; r < n; ++r) {
    check_sorted(iv.row_offsets[r], iv.row_offsets[r + 1]);
    for (int64_t c = 0; c < n; ++c) {
      const bool visible = by_key ? layout.Visible(c, r) : layout.Visible(r, c);
      ASSERT_EQ(covered(iv.row_offsets[r], iv.row_offsets[r + 1], c), visible)
          << "row " << r << " column " << c;
    }
  }
  for (int64_t t = 0; t < tiles; ++t) {
    check_sorted(iv.tile_offsets[t], iv.tile_offsets[t + 1]);
    const int64_t first_row = t * tile, last_row = std::min(n, (t + 1) * tile);
    for (int64_t c = 0; c < n; ++c) {
      const bool any = covered(iv.row_offsets[first_row], iv.row_offsets[last_row], c);
      ASSERT_EQ(covered(iv.tile_offsets[t], iv.tile_offsets[t + 1], c), any)
          << "tile " << t << " column " << c;
    }
  }
}

TEST(GpuReference, IntervalsHoldExactlyTheVisiblePairs) {
  std::mt19937_64 rng(3);
  std::vector<Layout> layouts = {testing::EveryMaskKindLayout(), testing::ScatteredSliceLayout(),
                                 *Layout::FromDocuments(std::vector<int64_t>{0, 0})};
  for (int i = 0; i < 3; ++i) layouts.push_back(testing::RandomDocumentLayout(rng, 150, 70));
  for (const Layout& layout : layouts) {
    for (bool by_key : {false, true}) {
      for (int tile : {1, 16, 32}) CheckIntervals(layout, by_key, tile);
    }
  }
}

TEST(GpuReference, DocumentRowsHaveOneIntervalEach) {
  // Prefix-LM: the full prefix block and the causal rest merge into one interval per query.
  const Layout layout = testing::EveryMaskKindLayout();
  const RefRowIntervals iv = BuildRefIntervals(layout, /*by_key=*/false, 32);
  for (int64_t r = 0; r < layout.num_tokens(); ++r) {
    EXPECT_EQ(iv.row_offsets[r + 1] - iv.row_offsets[r], 1) << r;
  }
}

TEST(GpuReference, LaunchGrids) {
  const RefLaunch fwd = RefLaunchOf(RefKernel::kForward, RefArith::kExact, 128, 32768, 16, 4);
  EXPECT_EQ(fwd.grid_x, 1024u);
  EXPECT_EQ(fwd.grid_y, 16u);
  EXPECT_EQ(fwd.threads, 256);
  EXPECT_EQ(fwd.smem_bytes, hsap_dev::ref_fwd_smem_bytes(128, 8));
  const RefLaunch dkdv = RefLaunchOf(RefKernel::kDkDv, RefArith::kRounded, 256, 100, 16, 4);
  EXPECT_EQ(dkdv.grid_x, 7u);  // tiles of 16 above head dim 128
  EXPECT_EQ(dkdv.grid_y, 4u);
  EXPECT_EQ(dkdv.smem_bytes, hsap_dev::ref_dkdv_smem_bytes(256, 4));
  const RefLaunch rowdot = RefLaunchOf(RefKernel::kRowDot, RefArith::kExact, 64, 1000, 3, 1);
  EXPECT_EQ(rowdot.grid_x, 12u);  // ceil(3000 / 256)
  EXPECT_EQ(rowdot.smem_bytes, 0);
  EXPECT_TRUE(RefLaunchOf(RefKernel::kDq, RefArith::kExact, 64, 0, 3, 1).empty());
}

TEST(GpuReference, WithoutAGpuSaysSo) {
  const std::string empty_dir = testing::MakeTestTempDir("gpu_reference_test");
  testing::ScopedEnv env("HSAP_CUDA_LIB_PATH", empty_dir.c_str());
  const Layout layout = testing::EveryMaskKindLayout();
  const RowInputs row(DType::kBF16, layout.num_tokens(), RefDims(2, 1, 64), 1);
  absl::StatusOr<GpuReferenceResult> r = GpuReference(layout, row.in(), row.dout());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("libcuda"));
  std::filesystem::remove_all(empty_dir);
}

// ---- on a GPU ----

#define REQUIRE_CUDA_DEVICE()                                                 \
  do {                                                                        \
    if (!CheckCudaDevice().ok()) GTEST_SKIP() << CheckCudaDevice().message(); \
  } while (0)

double MaxAbsError(const std::vector<double>& a, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) && a[i] == ref[i]) continue;
    e = std::max(e, std::abs(a[i] - ref[i]));
  }
  return e;
}

void CheckOnGpu(const Layout& layout, DType dtype, const AttentionDims& dims, uint64_t seed,
                const std::string& what) {
  SCOPED_TRACE(what);
  const RowInputs row(dtype, layout.num_tokens(), dims, seed);
  absl::StatusOr<GpuReferenceResult> gpu = GpuReference(layout, row.in(), row.dout());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const ReferenceForwardResult ref = ReferenceForward(layout, row.in());
  const ReferenceGradients gref = ReferenceBackward(layout, row.in(), row.dout());
  ExpectExactMatch(gpu->forward.out, ref.out, "out");
  ExpectExactMatch(gpu->forward.lse, ref.lse, "lse");
  ExpectExactMatch(gpu->backward.dq, gref.dq, "dq");
  ExpectExactMatch(gpu->backward.dk, gref.dk, "dk");
  ExpectExactMatch(gpu->backward.dv, gref.dv, "dv");

  const ReferenceForwardResult naive = NaiveForward(layout, row.in());
  const ReferenceGradients gnaive = NaiveBackward(layout, row.in(), row.dout());
  struct Tensor {
    const char* name;
    const std::vector<double>& gpu;
    const std::vector<double>& host;
    const std::vector<double>& ref;
  };
  for (const Tensor& t : {Tensor{"out", gpu->naive_forward.out, naive.out, ref.out},
                          Tensor{"lse", gpu->naive_forward.lse, naive.lse, ref.lse},
                          Tensor{"dq", gpu->naive_backward.dq, gnaive.dq, gref.dq},
                          Tensor{"dk", gpu->naive_backward.dk, gnaive.dk, gref.dk},
                          Tensor{"dv", gpu->naive_backward.dv, gnaive.dv, gref.dv}}) {
    const double gpu_err = MaxAbsError(t.gpu, t.ref), host_err = MaxAbsError(t.host, t.ref);
    size_t differ = 0;
    for (size_t i = 0; i < t.host.size(); ++i) differ += t.gpu[i] != t.host[i];
    std::printf("%s %s: same-precision error gpu %.4g host %.4g; %zu of %zu elements differ\n",
                what.c_str(), t.name, gpu_err, host_err, differ, t.host.size());
    EXPECT_LE(gpu_err, 2 * host_err) << t.name;
    EXPECT_GE(gpu_err, 0.5 * host_err) << t.name;
  }
}

TEST(CudaGpuReference, MatchesTheHostReference) {
  REQUIRE_CUDA_DEVICE();
  CheckOnGpu(testing::EveryMaskKindLayout(), DType::kBF16, RefDims(4, 2, 128), 21,
             "every mask kind, bf16, 4/2 heads, d 128");
  AttentionDims dims = RefDims(3, 2, 40);
  dims.kv_head_of_q = {1, 0, 1};
  CheckOnGpu(testing::ScatteredSliceLayout(), DType::kF32, dims, 22, "slices, f32, kv map, d 40");
  std::mt19937_64 rng(23);
  CheckOnGpu(testing::RandomDocumentLayout(rng, 800, 500), DType::kF16, RefDims(4, 1, 64), 24,
             "800 random tokens, f16, 4/1 heads, d 64");
  CheckOnGpu(*Layout::FromDocuments(std::vector<int64_t>{0, 360, 400}), DType::kBF16,
             RefDims(2, 2, 256), 25, "400 causal tokens, bf16, 2/2 heads, d 256");
}

TEST(CudaGpuReference, GpuSizedRowTiming) {
  REQUIRE_CUDA_DEVICE();
  const char* tokens_env = std::getenv("HSAP_GPU_REFERENCE_TOKENS");
  if (tokens_env == nullptr) GTEST_SKIP() << "set HSAP_GPU_REFERENCE_TOKENS to time a row";
  const int64_t tokens = std::atoll(tokens_env);
  const Layout layout = *Layout::FromDocuments(std::vector<int64_t>{0, tokens});
  const AttentionDims dims = RefDims(16, 16, 128);
  const RowInputs row(DType::kBF16, tokens, dims, 31);
  const double pairs = static_cast<double>(layout.VisiblePairs()) * dims.heads_q;
  GpuReferenceOptions exact_only;
  exact_only.rounded = false;
  // The first call compiles the kernels (NVRTC) and is not timed.
  {
    const Layout small = *Layout::FromDocuments(std::vector<int64_t>{0, 64});
    const RowInputs small_row(DType::kBF16, 64, dims, 1);
    ASSERT_TRUE(GpuReference(small, small_row.in(), small_row.dout()).ok());
  }
  GpuReferenceOptions forward_only = exact_only;
  forward_only.backward = false;
  absl::StatusOr<GpuReferenceResult> fwd = GpuReference(layout, row.in(), nullptr, forward_only);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  absl::StatusOr<GpuReferenceResult> exact = GpuReference(layout, row.in(), row.dout(), exact_only);
  ASSERT_TRUE(exact.ok()) << exact.status();
  // The exact kernels' multiply-adds per visible (query, key, head): 4 D forward (three passes),
  // 3 D dq, 4 D dk/dv.
  const double exact_flop = pairs * 11 * dims.head_dim * 2;
  std::printf(
      "GPU reference, %lld tokens, causal, bf16, 16 heads, d 128: exact forward %.2f s, "
      "exact fwd+bwd %.2f s (%.2f TFLOP/s fp64 over its 11 D multiply-adds per pair; "
      "uploads and downloads included)\n",
      static_cast<long long>(tokens), fwd->seconds, exact->seconds,
      exact_flop / exact->seconds * 1e-12);
  std::fflush(stdout);
  absl::StatusOr<GpuReferenceResult> both = GpuReference(layout, row.in(), row.dout());
  ASSERT_TRUE(both.ok()) << both.status();
  std::printf("GPU reference, same row: exact + same-precision fwd+bwd %.2f s\n", both->seconds);
  std::fflush(stdout);
  std::printf("same-precision max|naive - ref|: out %.4g lse %.4g dq %.4g dk %.4g dv %.4g\n",
              MaxAbsError(both->naive_forward.out, both->forward.out),
              MaxAbsError(both->naive_forward.lse, both->forward.lse),
              MaxAbsError(both->naive_backward.dq, both->backward.dq),
              MaxAbsError(both->naive_backward.dk, both->backward.dk),
              MaxAbsError(both->naive_backward.dv, both->backward.dv));
  EXPECT_EQ(both->forward.out, exact->forward.out) << "deterministic";
  EXPECT_EQ(both->backward.dk, exact->backward.dk) << "deterministic";
  for (double x : exact->forward.lse) ASSERT_TRUE(std::isfinite(x));
}

}  // namespace
}  // namespace hsap::cuda
