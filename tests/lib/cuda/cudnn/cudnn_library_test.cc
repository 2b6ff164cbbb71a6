// Opening libcudnn.so.9 without it: clean Unimplemented errors naming what was tried and
// the fix, and an engine choice that falls back to the JIT kernels saying why.
#include "lib/cuda/cudnn/cudnn_library.h"

#include <cstdlib>
#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_env.h"

namespace hsap::cuda {
namespace {

using ::testing::HasSubstr;

std::string EmptyDir() {
  const char* base = std::getenv("HSAP_TEST_TMPDIR");
  const std::filesystem::path dir =
      std::filesystem::path(base != nullptr ? base : "/tmp") / "cudnn_library_empty_dir";
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(CudnnLibraryTest, SearchPathHonoursTheVariable) {
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", "/a:/b");
  EXPECT_THAT(CudnnLibrarySearchPath(), ::testing::ElementsAre("/a", "/b"));
}

TEST(CudnnLibraryTest, WithoutTheLibraryItSaysWhatItTried) {
  const std::string dir = EmptyDir();
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", dir.c_str());
  const absl::StatusOr<const CudnnLibrary*> lib = OpenCudnnLibrary();
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(lib.status().message(), HasSubstr(dir + "/libcudnn.so.9"));
  EXPECT_THAT(lib.status().message(), HasSubstr("$HSAP_CUDA_LIB_PATH"));

  const CudnnAvailability probe = ProbeCudnn();
  EXPECT_FALSE(probe.loaded.ok());
  const absl::Status batch = CudnnTakesBatch({DType::kBF16, 128, 8, 8, true}, probe);
  EXPECT_THAT(batch.message(), HasSubstr("cuDNN is not available: libcudnn.so.9 not found"));
  const AttentionPiece piece{0, 8, 0, 8, {CudnnMaskKind::kCausalTopLeft, 0}, 36};
  EXPECT_EQ(DecidePiece(piece, EngineMode::kAuto, batch, probe.version).engine,
            AttentionEngine::kJit);
  EXPECT_THAT(CheckEngineMode(EngineMode::kCudnn, batch).message(),
              HasSubstr("HSAP_ATTENTION_ENGINE=cudnn, but cuDNN cannot run this batch"));
}

}  // namespace
}  // namespace hsap::cuda
