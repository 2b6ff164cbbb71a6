#include "jit/nvrtc.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/cache.h"
#include "jit/compile_error.h"
#include "lib/api/result.h"
#include "tests/support/scoped_env.h"
#include "tests/support/test_files.h"

namespace hsap::jit {
namespace {

using ::hsap::testing::ReadFile;

using ::testing::HasSubstr;

constexpr const char* kTemplateKernel = R"(
#include "scale.cuh"
namespace demo {
template <int kScale>
__global__ void scale_kernel(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= kScale * kHeaderFactor;
}
}  // namespace demo
)";

CudaCompileRequest TemplateRequest(const std::string& arch) {
  CudaCompileRequest r;
  r.program_name = "scale.cu";
  r.source = kTemplateKernel;
  r.headers = {{"scale.cuh", "constexpr int kHeaderFactor = 3;\n"}};
  r.arch = arch;
  r.name_expressions = {"demo::scale_kernel<2>", "demo::scale_kernel<5>"};
  return r;
}

// Skips the calling test when this machine has no NVRTC.
#define REQUIRE_NVRTC()                                                    \
  do {                                                                     \
    if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message(); \
  } while (0)

std::string TempDir() { return testing::MakeTestTempDir("nvrtc_test"); }

TEST(ParseCudaArch, AcceptsSmAndComputeOnly) {
  EXPECT_EQ(*ParseCudaArch("sm_90"), 90);
  EXPECT_EQ(*ParseCudaArch("sm_80"), 80);
  EXPECT_EQ(*ParseCudaArch("compute_75"), 75);
  EXPECT_EQ(*ParseCudaArch("sm_100"), 100);
  EXPECT_EQ(*ParseCudaArch("sm_90a"), 90);
  EXPECT_EQ(*ParseCudaArch("compute_90a"), 90);
  EXPECT_TRUE(IsArchSpecificTarget("sm_90a"));
  EXPECT_FALSE(IsArchSpecificTarget("sm_90"));
  for (const char* bad : {"", "sm_", "sm90", "sm_9x", "gfx90a", "sm_-1", "sm_123456", "sm_1",
                          "sm_a", "sm_90aa", "sm_9a", "sm_a90"}) {
    absl::StatusOr<int> a = ParseCudaArch(bad);
    ASSERT_FALSE(a.ok()) << bad;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(a.status().message(), HasSubstr("sm_XX"));
  }
}

TEST(LoadNvrtc, FindsTheToolkitWithItsArchitectures) {
  REQUIRE_NVRTC();
  const NvrtcApi* api = *LoadNvrtc();
  EXPECT_GE(api->major, 11);
  EXPECT_TRUE(api->SupportsCubin(80));
  EXPECT_TRUE(api->SupportsCubin(90));
  EXPECT_FALSE(api->SupportsCubin(91));
  EXPECT_THAT(api->Identity(), HasSubstr("nvrtc "));
  // Loading twice gives the same library.
  EXPECT_EQ(*LoadNvrtc(), api);
}

TEST(LoadNvrtc, EmptySearchPathIsUnimplemented) {
  const std::string empty_dir = TempDir();
  for (const std::string& path : {empty_dir, std::string(), std::string(":")}) {
    testing::ScopedEnv env("HSAP_NVRTC_PATH", path.c_str());
    absl::StatusOr<const NvrtcApi*> api = LoadNvrtc();
    ASSERT_FALSE(api.ok()) << path;
    EXPECT_EQ(api.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_THAT(api.status().message(), HasSubstr("NVRTC not found"));
    EXPECT_THAT(api.status().message(), HasSubstr("CUDA_HOME"));
    EXPECT_EQ(ResultFromStatus(api.status()), hsapUnsupported);

    absl::StatusOr<CudaBinary> binary = CompileCuda(TemplateRequest("sm_90"), nullptr);
    ASSERT_FALSE(binary.ok());
    EXPECT_EQ(binary.status().code(), absl::StatusCode::kUnimplemented);
  }
  std::filesystem::remove_all(empty_dir);
  // The variable gone, NVRTC is found again (where installed).
  if (::access("/usr/local/cuda/lib64/libnvrtc.so", F_OK) == 0) {
    EXPECT_TRUE(LoadNvrtc().ok());
  }
}

TEST(CompileCuda, CubinDefinesTheLoweredNames) {
  REQUIRE_NVRTC();
  for (const char* arch : {"sm_80", "sm_90"}) {
    absl::StatusOr<CudaBinary> b = CompileCuda(TemplateRequest(arch), nullptr);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->kind, CudaBinary::Kind::kCubin);
    EXPECT_EQ(b->target, arch);
    EXPECT_FALSE(b->from_cache);
    EXPECT_GT(b->compile_seconds, 0.0);
    ASSERT_EQ(b->lowered_names.size(), 2u);
    const std::string two = *b->LoweredName("demo::scale_kernel<2>");
    const std::string five = *b->LoweredName("demo::scale_kernel<5>");
    EXPECT_NE(two, five);
    EXPECT_THAT(two, HasSubstr("scale_kernel"));
    EXPECT_EQ(b->LoweredName("demo::scale_kernel<7>").status().code(), absl::StatusCode::kNotFound);

    absl::StatusOr<std::vector<ElfSymbol>> symbols = ReadElfSymbols(b->image);
    ASSERT_TRUE(symbols.ok()) << symbols.status();
    int found = 0;
    for (const ElfSymbol& s : *symbols) {
      if (s.name == two || s.name == five) {
        EXPECT_EQ(s.type, 2);                           // function
        EXPECT_TRUE(s.binding == 1 || s.binding == 2);  // global, or weak (a template)
        EXPECT_GT(s.size, 0u);
        ++found;
      }
    }
    EXPECT_EQ(found, 2);
  }
}

TEST(CompileCuda, PtxWhenAskedAndForUnknownArchitectures) {
  REQUIRE_NVRTC();
  const NvrtcApi* api = *LoadNvrtc();
  CudaCompileRequest forced = TemplateRequest("sm_90");
  forced.force_ptx = true;
  absl::StatusOr<CudaBinary> b = CompileCuda(forced, nullptr);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->kind, CudaBinary::Kind::kPtx);
  EXPECT_EQ(b->target, "compute_90");
  EXPECT_THAT(b->image, HasSubstr(".target sm_90"));
  EXPECT_THAT(b->image, HasSubstr(".entry " + *b->LoweredName("demo::scale_kernel<2>")));
  EXPECT_EQ(b->image.find('\0'), std::string::npos);

  // An architecture newer than this NVRTC knows: PTX for the newest one it does know.
  absl::StatusOr<CudaBinary> future = CompileCuda(TemplateRequest("sm_999"), nullptr);
  ASSERT_TRUE(future.ok()) << future.status();
  EXPECT_EQ(future->kind, CudaBinary::Kind::kPtx);
  EXPECT_EQ(future->target, "compute_" + std::to_string(api->supported_archs.back()));

  // Older than every supported architecture: Unimplemented, not a crash.
  absl::StatusOr<CudaBinary> ancient = CompileCuda(TemplateRequest("sm_10"), nullptr);
  ASSERT_FALSE(ancient.ok());
  EXPECT_EQ(ancient.status().code(), absl::StatusCode::kUnimplemented);

  absl::StatusOr<CudaBinary> bad = CompileCuda(TemplateRequest("gfx942"), nullptr);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CompileCuda, ErrorCarriesLogAndSourcePath) {
  REQUIRE_NVRTC();
  CompileCache cache(CompileCache::Options{});
  CudaCompileRequest r = TemplateRequest("sm_90");
  r.source += "\nstatic_assert(kHeaderFactor == 4, \"hsap-test: factor must be four\");\n";
  absl::StatusOr<CudaBinary> b = CompileCuda(r, &cache);
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(IsCompileError(b.status())) << b.status();
  EXPECT_EQ(ResultFromStatus(b.status()), hsapCompileError);
  const std::string message(b.status().message());
  EXPECT_THAT(message, HasSubstr("hsap-test: factor must be four"));  // the log
  EXPECT_THAT(message, HasSubstr("scale.cu"));
  const std::string marker = "generated source kept at ";
  const size_t at = message.find(marker);
  ASSERT_NE(at, std::string::npos) << message;
  const std::string path =
      message.substr(at + marker.size(), message.find('\n', at) - at - marker.size());
  EXPECT_EQ(ReadFile(path), r.source) << path;
  std::remove(path.c_str());
  EXPECT_EQ(cache.stats().compile_failures, 1);

  // A bad name expression is an error too, never a crash.
  CudaCompileRequest bad_name = TemplateRequest("sm_90");
  bad_name.name_expressions = {"demo::no_such_kernel<1>"};
  absl::StatusOr<CudaBinary> unnamed = CompileCuda(bad_name, &cache);
  ASSERT_FALSE(unnamed.ok());
  const std::string unnamed_message(unnamed.status().message());
  if (const size_t p = unnamed_message.find(marker); p != std::string::npos) {
    std::remove(
        unnamed_message.substr(p + marker.size(), unnamed_message.find('\n', p) - p - marker.size())
            .c_str());
  }
}

TEST(CompileCuda, CacheServesRepeatsAndKeysOnHeadersAndOptions) {
  REQUIRE_NVRTC();
  CompileCache cache(CompileCache::Options{});
  const CudaCompileRequest r = TemplateRequest("sm_80");
  absl::StatusOr<CudaBinary> first = CompileCuda(r, &cache);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<CudaBinary> second = CompileCuda(r, &cache);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->from_cache);
  EXPECT_EQ(second->compile_seconds, 0.0);
  EXPECT_EQ(second->image, first->image);
  EXPECT_EQ(second->lowered_names, first->lowered_names);
  EXPECT_EQ(cache.stats().compiles, 1);

  CudaCompileRequest other_header = r;
  other_header.headers[0].second = "constexpr int kHeaderFactor = 4;\n";
  absl::StatusOr<CudaBinary> third = CompileCuda(other_header, &cache);
  ASSERT_TRUE(third.ok());
  EXPECT_FALSE(third->from_cache);
  CudaCompileRequest other_option = r;
  other_option.extra_options = {"-DHSAP_UNUSED_MACRO=1"};
  ASSERT_TRUE(CompileCuda(other_option, &cache).ok());
  EXPECT_EQ(cache.stats().compiles, 3);
}

TEST(ReadElfSymbols, RejectsMalformedImagesWithoutCrashing) {
  EXPECT_FALSE(ReadElfSymbols("").ok());
  EXPECT_FALSE(
      ReadElfSymbols("not an elf file at all, but long enough to hold a header......").ok());
  std::string header(64, '\0');
  header[0] = 0x7f;
  header[1] = 'E';
  header[2] = 'L';
  header[3] = 'F';
  header[4] = 2;
  header[5] = 1;
  // Section header table far out of bounds.
  header[0x28] = 0x7f;
  header[0x3a] = 64;
  header[0x3c] = 3;
  EXPECT_EQ(ReadElfSymbols(header).status().code(), absl::StatusCode::kInvalidArgument);

  if (!LoadNvrtc().ok()) return;
  absl::StatusOr<CudaBinary> b = CompileCuda(TemplateRequest("sm_90"), nullptr);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(ReadElfSymbols(b->image).ok());
  // Every truncation and a few corruptions: an error or a (partial) table, never a crash
  // (ASan checks the bounds).
  for (size_t len = 0; len < b->image.size(); len += 97) {
    (void)ReadElfSymbols(absl::string_view(b->image.data(), len));
  }
  for (size_t pos = 0; pos < std::min<size_t>(b->image.size(), 4096); pos += 13) {
    std::string corrupt = b->image;
    corrupt[pos] = static_cast<char>(corrupt[pos] ^ 0xa5);
    (void)ReadElfSymbols(corrupt);
  }
}

}  // namespace
}  // namespace hsap::jit
