// The cuDNN baseline of the bench: its host geometry (ragged offsets, seq lens, strides, FLOP
// count) everywhere; its creation fails cleanly without a GPU or without libcudnn; on a GPU
// (ctest -R Cuda) cuDNN's output on a packed row matches the fp64 reference.
#include "bench/cudnn_attention.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "tests/support/scoped_env.h"
#include "tests/support/tolerance.h"

namespace hsap::bench {
namespace {

using ::hsap::testing::ExpectWithinRule;
using ::hsap::testing::kCudaKernelFloor;
using ::hsap::testing::MaxAbs;
using ::hsap::testing::MaxAbsError;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

CudnnAttentionShape Shape(std::vector<int64_t> lengths, int hq = 8, int hkv = 2, int d = 64,
                          bool causal = true) {
  CudnnAttentionShape s;
  s.doc_lengths = std::move(lengths);
  s.heads_q = hq;
  s.heads_kv = hkv;
  s.head_dim = d;
  s.dtype = DType::kBF16;
  s.causal = causal;
  return s;
}

// The pairs the library counts for the same documents (all causal or all full).
int64_t LayoutPairs(const std::vector<int64_t>& lengths, bool causal) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  std::vector<MaskKind> kinds(lengths.size(), causal ? MaskKind::kCausal : MaskKind::kFull);
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? layout->VisiblePairs() : -1;
}

TEST(CudnnGeometryTest, SingleDocument) {
  absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(Shape({100}));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->batch, 1);
  EXPECT_EQ(g->max_seq_len, 100);
  EXPECT_EQ(g->total_tokens, 100);
  EXPECT_THAT(g->seq_lens, ElementsAre(100));
  EXPECT_THAT(g->qo_offsets, ElementsAre(0, 100 * 8 * 64));
  EXPECT_THAT(g->kv_offsets, ElementsAre(0, 100 * 2 * 64));
  // Our packed [T, H, D] rows seen as [B, H, S, D]: head stride D, token stride H * D.
  EXPECT_THAT(g->q_dims, ElementsAre(1, 8, 100, 64));
  EXPECT_THAT(g->q_strides, ElementsAre(100 * 8 * 64, 64, 8 * 64, 1));
  EXPECT_THAT(g->kt_dims, ElementsAre(1, 2, 64, 100));
  EXPECT_THAT(g->kt_strides, ElementsAre(100 * 2 * 64, 64, 1, 2 * 64));
  EXPECT_THAT(g->v_dims, ElementsAre(1, 2, 100, 64));
  EXPECT_THAT(g->v_strides, ElementsAre(100 * 2 * 64, 64, 2 * 64, 1));
  EXPECT_THAT(g->score_dims, ElementsAre(1, 8, 100, 100));
  EXPECT_THAT(g->score_strides, ElementsAre(8 * 100 * 100, 100 * 100, 100, 1));
  EXPECT_THAT(g->stats_dims, ElementsAre(1, 8, 100, 1));
  EXPECT_THAT(g->stats_strides, ElementsAre(8 * 100, 100, 1, 1));
  EXPECT_EQ(g->stats_elements, 8 * 100);
  EXPECT_EQ(VisiblePairs({100}, true), 100.0 * 101 / 2);
  EXPECT_EQ(ForwardFlops({100}, 8, 64, true), 4.0 * 64 * 8 * (100.0 * 101 / 2));
}

TEST(CudnnGeometryTest, UnevenLengthsAndEmptyDocuments) {
  // Lengths that are multiples of nothing, with empty documents cuDNN never sees.
  const std::vector<int64_t> lengths = {7, 0, 13, 1, 129, 0};
  absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(Shape(lengths, 6, 3, 128));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->batch, 4);
  EXPECT_EQ(g->max_seq_len, 129);
  EXPECT_EQ(g->total_tokens, 150);
  EXPECT_THAT(g->seq_lens, ElementsAre(7, 13, 1, 129));
  const int64_t qrow = 6 * 128, kvrow = 3 * 128;
  EXPECT_THAT(g->qo_offsets, ElementsAre(0, 7 * qrow, 20 * qrow, 21 * qrow, 150 * qrow));
  EXPECT_THAT(g->kv_offsets, ElementsAre(0, 7 * kvrow, 20 * kvrow, 21 * kvrow, 150 * kvrow));
  EXPECT_THAT(g->q_dims, ElementsAre(4, 6, 129, 128));
  EXPECT_EQ(g->stats_elements, 4 * 6 * 129);
  for (bool causal : {true, false}) {
    EXPECT_EQ(VisiblePairs(lengths, causal), static_cast<double>(LayoutPairs(lengths, causal)));
  }
}

TEST(CudnnGeometryTest, ManyTinyDocuments) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> len(1, 16);
  std::vector<int64_t> lengths;
  int64_t total = 0;
  while (total < 5000) {
    lengths.push_back(std::min<int64_t>(len(rng), 5000 - total));
    total += lengths.back();
  }
  absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(Shape(lengths, 16, 4, 128));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->batch, static_cast<int64_t>(lengths.size()));
  EXPECT_LE(g->max_seq_len, 16);
  EXPECT_EQ(g->total_tokens, 5000);
  ASSERT_EQ(g->qo_offsets.size(), lengths.size() + 1);
  int64_t cu = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_EQ(g->qo_offsets[i], cu * 16 * 128);
    EXPECT_EQ(g->kv_offsets[i], cu * 4 * 128);
    EXPECT_EQ(g->seq_lens[i], lengths[i]);
    cu += lengths[i];
  }
  EXPECT_EQ(g->qo_offsets.back(), 5000 * 16 * 128);
  EXPECT_EQ(VisiblePairs(lengths, true), static_cast<double>(LayoutPairs(lengths, true)));
  EXPECT_EQ(ForwardFlops(lengths, 16, 128, true),
            4.0 * 128 * 16 * static_cast<double>(LayoutPairs(lengths, true)));
}

TEST(CudnnGeometryTest, RejectsWhatCudnnCannotTake) {
  CudnnAttentionShape fp32 = Shape({64});
  fp32.dtype = DType::kF32;
  for (const CudnnAttentionShape& s :
       {fp32, Shape({64}, 6, 4), Shape({64}, 8, 0), Shape({64}, 8, 2, 100), Shape({64}, 8, 2, 512),
        Shape({}), Shape({0, 0}), Shape({5, -1})}) {
    absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(s);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << g.status();
    EXPECT_FALSE(g.status().message().empty());
  }
  // Element offsets beyond int32: 2^20 tokens x 64 heads x 128.
  absl::StatusOr<CudnnRaggedGeometry> big = MakeRaggedGeometry(Shape({1 << 20}, 64, 8, 128));
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(big.status().message(), HasSubstr("int32"));
}

std::string EmptyDir() {
  const char* base = std::getenv("HSAP_TEST_TMPDIR");
  const std::filesystem::path dir =
      std::filesystem::path(base != nullptr ? base : "/tmp") / "cudnn_empty_lib_dir";
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(CudnnAttentionTest, SearchPathHonoursTheVariable) {
  {
    testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", "/a:/b");
    EXPECT_THAT(CudnnLibrarySearchPath(), ElementsAre("/a", "/b"));
  }
  if (std::getenv("HSAP_CUDA_LIB_PATH") == nullptr) {
    const std::vector<std::string> dirs = CudnnLibrarySearchPath();
    ASSERT_FALSE(dirs.empty());
    EXPECT_EQ(dirs.back(), "");  // the default loader path last
    EXPECT_THAT(dirs, ::testing::Contains("/usr/local/cuda-13.0/lib"));
  }
}

TEST(CudnnAttentionTest, WithoutLibraryCreateSaysWhatIsMissing) {
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", EmptyDir().c_str());
  absl::StatusOr<std::unique_ptr<CudnnAttention>> attn = CudnnAttention::Create(Shape({64, 32}));
  ASSERT_FALSE(attn.ok());
  EXPECT_EQ(attn.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(attn.status().message(),
              AnyOf(HasSubstr("libcudnn.so.9 not found"), HasSubstr("built without")));
  std::vector<uint8_t> buf(96 * 8 * 64 * 2);
  absl::StatusOr<CudnnForwardRun> run =
      RunCudnnForward(Shape({64, 32}), buf.data(), buf.data(), buf.data(), 0, 1, nullptr);
  EXPECT_FALSE(run.ok());
}

TEST(CudnnAttentionTest, WithoutGpuCreateFailsCleanly) {
  if (cuda::CheckCudaDevice().ok()) GTEST_SKIP() << "a CUDA device is present";
  // Whether or not libcudnn is installed here, no GPU means a clear error, never a crash.
  absl::StatusOr<std::unique_ptr<CudnnAttention>> attn = CudnnAttention::Create(Shape({64, 32}));
  ASSERT_FALSE(attn.ok());
  EXPECT_EQ(attn.status().code(), absl::StatusCode::kUnimplemented) << attn.status();
  EXPECT_THAT(attn.status().message(), AnyOf(HasSubstr("no CUDA device"), HasSubstr("not found"),
                                             HasSubstr("built without")));
}

// On a GPU: cuDNN's forward on a packed row (GQA, uneven documents, one of a single token)
// against the fp64 reference under the tests' rule.
TEST(CudnnAttentionCudaTest, PackedRowMatchesReference) {
  if (absl::Status s = cuda::CheckCudaDevice(); !s.ok()) GTEST_SKIP() << s.message();
  const std::vector<int64_t> lengths = {37, 1, 200, 64, 130};
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    CudnnAttentionShape shape = Shape(lengths, 4, 2, 64, causal);
    int64_t T = 0;
    for (int64_t l : lengths) T += l;
    std::vector<uint16_t> q(T * 4 * 64), k(T * 2 * 64), v(T * 2 * 64), out(T * 4 * 64);
    std::mt19937 rng(3);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto* t : {&q, &k, &v}) {
      for (size_t i = 0; i < t->size(); ++i) StoreFromFloat(DType::kBF16, t->data(), i, n(rng));
    }
    absl::StatusOr<CudnnForwardRun> run =
        RunCudnnForward(shape, q.data(), k.data(), v.data(), 1, 2, out.data());
    if (!run.ok() && run.status().code() == absl::StatusCode::kUnimplemented &&
        (absl::StrContains(run.status().message(), "libcudnn.so.9 not found") ||
         absl::StrContains(run.status().message(), "built without"))) {
      GTEST_SKIP() << run.status().message();
    }
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_GT(run->forward_ms, 0.0);
    std::vector<int64_t> cu{0};
    for (int64_t l : lengths) cu.push_back(cu.back() + l);
    std::vector<MaskKind> kinds(lengths.size(), causal ? MaskKind::kCausal : MaskKind::kFull);
    absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds);
    ASSERT_TRUE(layout.ok());
    ReferenceInputs ri;
    ri.dims.heads_q = 4;
    ri.dims.heads_kv = 2;
    ri.dims.head_dim = 64;
    ri.dims.scale = 1.0f / std::sqrt(64.0f);
    ri.dtype = DType::kBF16;
    ri.q = q.data();
    ri.k = k.data();
    ri.v = v.data();
    const ReferenceForwardResult ref = ReferenceForward(*layout, ri);
    const ReferenceForwardResult naive = NaiveForward(*layout, ri);
    std::vector<double> got(out.size());
    for (size_t i = 0; i < out.size(); ++i) got[i] = LoadAsFloat(DType::kBF16, out.data(), i);
    ExpectWithinRule("cuDNN out", MaxAbsError(got, ref.out), MaxAbsError(naive.out, ref.out),
                     MaxAbs(ref.out), DType::kBF16, kCudaKernelFloor);
  }
}

}  // namespace
}  // namespace hsap::bench
