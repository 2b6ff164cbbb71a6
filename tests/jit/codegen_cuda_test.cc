#include "jit/codegen_cuda.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "attention/worklist.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/cache.h"
#include "jit/compile_error.h"
#include "jit/cuda_kernels.h"
#include "jit/device/hsap_params.cuh"
#include "jit/nvrtc.h"
#include "lib/api/result.h"
#include "tests/support/cuobjdump.h"
#include "tests/support/scoped_env.h"
#include "tests/support/sweep.h"
#include "tests/support/test_files.h"

namespace hsap::jit {
namespace {

using ::hsap::testing::ReadFile;
using ::hsap::testing::WriteFile;

using ::testing::HasSubstr;
using ::testing::Not;

#define REQUIRE_NVRTC()                                                    \
  do {                                                                     \
    if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message(); \
  } while (0)

std::string TempDir() { return testing::MakeTestTempDir("codegen_cuda_test"); }

// One process-wide memory cache, so tests share compiles.
CompileCache& TestCache() {
  static auto* cache = new CompileCache(CompileCache::Options{});
  return *cache;
}

// The host's view of the Params must match the work-list structs it is filled from.
static_assert(sizeof(hsap_dev::QueryBlock) == sizeof(QueryBlock));
static_assert(offsetof(hsap_dev::QueryBlock, seg_end) == offsetof(QueryBlock, seg_end));
static_assert(offsetof(hsap_dev::QueryBlock, q_end) == offsetof(QueryBlock, q_end));
static_assert(sizeof(hsap_dev::KeySegment) == sizeof(KeySegment));
static_assert(offsetof(hsap_dev::KeySegment, diag_lo) == offsetof(KeySegment, diag_lo));
static_assert(offsetof(hsap_dev::KeySegment, diag_hi) == offsetof(KeySegment, diag_hi));
static_assert(sizeof(hsap_dev::FusedStep) == 64);
static_assert(sizeof(hsap_dev::FusedFwdParamsT<16>) < 4096, "kernel parameter limit");

TEST(CudaDeviceHeaders, EmbeddedTextIsTheFilesText) {
  const auto& headers = CudaDeviceHeaders();
  // Every device header of jit/device is embedded (NVRTC is given no include path).
  std::set<std::string> embedded, on_disk_names;
  for (const auto& [name, content] : headers) embedded.insert(name);
  for (const auto& entry :
       std::filesystem::directory_iterator(absl::StrCat(HSAP_SOURCE_DIR, "/jit/device"))) {
    if (entry.path().extension() == ".cuh") on_disk_names.insert(entry.path().filename().string());
  }
  // The reference kernels' header is their own program's (jit/reference_kernels.cc).
  on_disk_names.erase("hsap_reference.cuh");
  EXPECT_EQ(embedded, on_disk_names);
  ASSERT_EQ(headers.size(), embedded.size()) << "a header is embedded twice";
  for (const auto& [name, content] : headers) {
    const std::string on_disk = ReadFile(absl::StrCat(HSAP_SOURCE_DIR, "/jit/device/", name));
    ASSERT_FALSE(on_disk.empty()) << name;
    EXPECT_EQ(content, on_disk) << name << ": rebuild, the embedded copy is stale";
    EXPECT_THAT(content, Not(HasSubstr("#include <"))) << name << " must not need system headers";
  }
}

TEST(GenerateCudaKernels, SpecialisesOnTheConfiguration) {
  CudaKernelConfig c;
  c.arch = "sm_90";
  c.dtype = DType::kF16;
  c.head_dim = 96;
  c.gqa = 4;
  c.has_band = false;
  absl::StatusOr<CudaKernelSource> s = GenerateCudaKernels(c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->source, HasSubstr("using T = hsap_dev::f16;"));
  EXPECT_THAT(s->source, HasSubstr("kHeadDim = 96;"));
  EXPECT_THAT(s->source, HasSubstr("kGqa = 4;"));
  EXPECT_THAT(s->source, HasSubstr("kHasBand = false;"));
  EXPECT_THAT(s->source, HasSubstr("kMaxSteps = 0;"));
  EXPECT_EQ(s->program_name, "hsap_sm90_fp16_d96_g4_full_tc.cu");
  std::vector<std::string> roles;
  for (const CudaKernelEntry& k : s->kernels) {
    roles.push_back(k.role);
    EXPECT_GT(k.threads, 0);
    EXPECT_EQ(k.threads % 32, 0);
    EXPECT_THAT(s->source, HasSubstr(k.name_expression.substr(std::string("hsap_dev::").size())));
  }
  EXPECT_THAT(roles, ::testing::ElementsAre("fwd", "bwd", "delta", "merge", "init", "convert",
                                            "accumulate", "copy_chunks", "add_chunks",
                                            "merge_entries", "gather_stats", "add_entries"));

  c.role = {3};
  s = GenerateCudaKernels(c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->source, HasSubstr("kMaxSteps = 4;"));
  EXPECT_EQ(s->program_name, "hsap_sm90_fp16_d96_g4_full_p3_tc.cu");
  EXPECT_EQ(s->kernels.back().role, "fused_fwd");
  EXPECT_THAT(s->source, HasSubstr("FusedFwdParamsT<4>"));
}

// kAuto resolves to tensor cores for bf16/f16 at head dims 64..256 (multiples of 16) on
// sm_80+, and to the FMA kernels elsewhere (fp32, other head dims, older architectures).
TEST(ResolveCudaMath, TensorCoresWhereTheyApply) {
  CudaKernelConfig c;
  c.arch = "sm_80";
  c.dtype = DType::kBF16;
  c.head_dim = 128;
  EXPECT_EQ(ResolveCudaMath(c), CudaMath::kTensorCore);
  EXPECT_EQ(c.Name(), "sm80_bf16_d128_g1_band_tc");
  c.dtype = DType::kF16;
  for (int d : {64, 80, 96, 112, 128, 192, 256}) {
    c.head_dim = d;
    EXPECT_EQ(ResolveCudaMath(c), CudaMath::kTensorCore) << d;
  }
  for (int d : {32, 48, 72, 136, 200}) {  // below 64, or not a multiple of 16
    c.head_dim = d;
    EXPECT_EQ(ResolveCudaMath(c), CudaMath::kFma) << d;
    EXPECT_THAT(c.Name(), Not(HasSubstr("_tc")));
  }
  c.head_dim = 128;
  c.dtype = DType::kF32;  // no TF32 unless asked for
  EXPECT_EQ(ResolveCudaMath(c), CudaMath::kFma);
  c.dtype = DType::kBF16;
  c.arch = "sm_75";
  EXPECT_EQ(ResolveCudaMath(c), CudaMath::kFma);
  c.arch = "sm_90";
  c.math = CudaMath::kFma;  // forced: the plain kernels, named apart
  EXPECT_EQ(ResolveCudaMath(c), CudaMath::kFma);
  EXPECT_EQ(c.Name(), "sm90_bf16_d128_g1_band_fma");
  c.math = CudaMath::kTensorCore;
  EXPECT_EQ(ResolveCudaMath(c), CudaMath::kTensorCore);
  EXPECT_TRUE(ValidateCudaKernelConfig(c).ok());
  c.dtype = DType::kF32;  // asked for where it cannot apply
  EXPECT_EQ(ValidateCudaKernelConfig(c).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ValidateCudaKernelConfig(c).message(), HasSubstr("math"));
  c.math = CudaMath::kAuto;
  absl::StatusOr<CudaKernelSource> s = GenerateCudaKernels(c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->source, HasSubstr("kTensorCore = false;"));
  c.dtype = DType::kBF16;
  c.role = {3};
  s = GenerateCudaKernels(c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->source, HasSubstr("kTensorCore = true;"));
  EXPECT_THAT(s->source, HasSubstr("kFwdStages = 2;"));
  EXPECT_THAT(s->source, HasSubstr("kQInRegisters = false;"));  // D = 128
  // The forward, the fused forward and the backward run on tensor cores, the forwards sized
  // for two CTAs per SM on sm_90 (2 x 87264 B of shared memory: the tiles, three tile
  // descriptors and the walk), the backward's 32x64 tiles too; the other roles are FMA
  // kernels.
  for (const CudaKernelEntry& k : s->kernels) {
    const bool forward = k.role == "fwd" || k.role == "fused_fwd";
    const bool mma = forward || k.role == "bwd";
    EXPECT_EQ(k.tensor_core, mma) << k.role;
    EXPECT_EQ(k.min_ctas_per_sm, mma ? 2 : 1) << k.role;
    if (forward) {
      EXPECT_EQ(k.dynamic_smem_bytes, 2 * (64 + 2 * 2 * 64) * (128 + 8) + 3 * 32 + 128) << k.role;
    }
  }
  // On sm_80 two of them do not fit an SM's 164 KiB: one CTA is what the tiles promise.
  c.arch = "sm_80";
  s = GenerateCudaKernels(c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->kernels.front().min_ctas_per_sm, 1);
  // Head dim 256: 32-key tiles, Q re-read from shared memory.
  c.head_dim = 256;
  absl::StatusOr<CudaTiles> t = ChooseCudaTiles(c);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->block_m, 64);
  EXPECT_EQ(t->block_n, 32);
  EXPECT_FALSE(t->q_in_registers);
  // Head dim 64: 128 query rows on 4 warps, two m16 row blocks each.
  c.head_dim = 64;
  t = ChooseCudaTiles(c);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->block_m, 128);
  EXPECT_EQ(t->threads, 128);
  // Explicit tiles must keep one or two m16 row blocks per warp.
  c.head_dim = 128;
  c.block_m = 64;
  c.block_n = 64;
  c.threads = 64;  // two row blocks per warp
  EXPECT_TRUE(ChooseCudaTiles(c).ok());
  c.threads = 32;  // four
  EXPECT_EQ(ChooseCudaTiles(c).status().code(), absl::StatusCode::kInvalidArgument);
}

// The config struct is rendered by one function: the program NVRTC compiles holds it as
// `HsapCfg`, and the emulator's configurations (tests/support/gen_emulator_configs.cc) are
// the same text under another name.
TEST(CudaConfigStruct, IsTheGeneratedProgramsHsapCfg) {
  CudaKernelConfig c;
  c.arch = "sm_80";
  c.dtype = DType::kBF16;
  c.head_dim = 64;
  c.gqa = 8;
  c.role = {3};
  absl::StatusOr<CudaKernelSource> s = GenerateCudaKernels(c);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string hsap_cfg = CudaConfigStruct(c, s->tiles, "HsapCfg");
  EXPECT_THAT(s->source, HasSubstr(hsap_cfg));
  EXPECT_THAT(hsap_cfg, HasSubstr("struct HsapCfg {\n  using T = hsap_dev::bf16;\n"));
  EXPECT_THAT(hsap_cfg, HasSubstr(absl::StrCat("kBlockM = ", s->tiles.block_m,
                                               ", kBlockN = ", s->tiles.block_n,
                                               ", kThreads = ", s->tiles.threads, ";")));
  EXPECT_THAT(hsap_cfg, HasSubstr("kMaxSteps = 4;"));

  std::string renamed = CudaConfigStruct(c, s->tiles, "Cfg<float, 2>");
  ASSERT_EQ(renamed.rfind("struct Cfg<float, 2> {\n", 0), 0u) << renamed;
  renamed.replace(0, std::string("struct Cfg<float, 2>").size(), "struct HsapCfg");
  EXPECT_EQ(renamed, hsap_cfg);
}

// The "bwd" role is the tensor-core backward where the math resolves to kTensorCore and its
// tiles fit; the FMA backward otherwise.
TEST(GenerateCudaKernels, TensorCoreBackwardWhereItApplies) {
  auto bwd_of = [](const CudaKernelSource& s) {
    for (const CudaKernelEntry& k : s.kernels) {
      if (k.role == "bwd") return k;
    }
    return CudaKernelEntry{};
  };
  CudaKernelConfig c;
  c.arch = "sm_90";
  c.dtype = DType::kBF16;
  c.head_dim = 128;
  absl::StatusOr<CudaKernelSource> tc = GenerateCudaKernels(c);
  ASSERT_TRUE(tc.ok()) << tc.status();
  EXPECT_TRUE(tc->tiles.bwd_tensor_core);
  EXPECT_EQ(bwd_of(*tc).name_expression, "hsap_dev::attn_bwd_mma_kernel<HsapCfg>");
  EXPECT_EQ(bwd_of(*tc).threads, 128);
  EXPECT_EQ(bwd_of(*tc).dynamic_smem_bytes, tc->tiles.bwd_smem_bytes);
  EXPECT_THAT(tc->source, HasSubstr("#include \"hsap_attention_mma_bwd.cuh\""));
  EXPECT_THAT(tc->source, HasSubstr("kDeterministicDq = true;"));
  EXPECT_THAT(c.Name(), Not(HasSubstr("_adq")));

  // Atomic dq: its own variant, with room for dS^T in the key pass.
  c.deterministic_dq = false;
  absl::StatusOr<CudaKernelSource> atomic = GenerateCudaKernels(c);
  ASSERT_TRUE(atomic.ok()) << atomic.status();
  EXPECT_THAT(c.Name(), HasSubstr("_tc_adq"));
  EXPECT_THAT(atomic->source, HasSubstr("kDeterministicDq = false;"));
  EXPECT_EQ(bwd_of(*atomic).name_expression, "hsap_dev::attn_bwd_mma_kernel<HsapCfg>");

  // The FMA kernel: asked for, fp32, or tiles that do not fit (head dim 256 on sm_86).
  for (auto change : std::vector<std::function<void(CudaKernelConfig&)>>{
           [](CudaKernelConfig& k) { k.math = CudaMath::kFma; },
           [](CudaKernelConfig& k) { k.dtype = DType::kF32; },
           [](CudaKernelConfig& k) {
             k.arch = "sm_86";
             k.head_dim = 256;
           }}) {
    CudaKernelConfig f;
    f.arch = "sm_90";
    f.dtype = DType::kBF16;
    f.head_dim = 128;
    change(f);
    absl::StatusOr<CudaKernelSource> fma = GenerateCudaKernels(f);
    ASSERT_TRUE(fma.ok()) << fma.status();
    EXPECT_FALSE(fma->tiles.bwd_tensor_core) << f.Name();
    EXPECT_EQ(bwd_of(*fma).name_expression, "hsap_dev::attn_bwd_kernel<HsapCfg>") << f.Name();
    EXPECT_THAT(fma->source, Not(HasSubstr("hsap_attention_mma_bwd.cuh"))) << f.Name();
  }
}

// The tensor-core backward's tiles per head dim (MmaBwdTileFor): 32x64 up to 128, 32x32
// above (two warps split D), on 4 warps; the FMA backward where the tiles exceed the shared
// memory.
TEST(ChooseCudaTiles, TensorCoreBackwardTilesPerHeadDim) {
  struct Expected {
    int head_dim, bm, bn;
  };
  for (const Expected& e : {Expected{64, 32, 64}, Expected{96, 32, 64}, Expected{112, 32, 64},
                            Expected{128, 32, 64}, Expected{144, 32, 32}, Expected{192, 32, 32},
                            Expected{224, 32, 32}, Expected{240, 32, 32}, Expected{256, 32, 32}}) {
    for (const char* arch : {"sm_80", "sm_90"}) {
      for (bool deterministic_dq : {true, false}) {
        CudaKernelConfig c;
        c.arch = arch;
        c.dtype = DType::kF16;
        c.head_dim = e.head_dim;
        c.deterministic_dq = deterministic_dq;
        absl::StatusOr<CudaTiles> t = ChooseCudaTiles(c);
        ASSERT_TRUE(t.ok()) << t.status();
        EXPECT_TRUE(t->bwd_tensor_core) << c.Name();
        EXPECT_EQ(t->bwd_block_m, e.bm) << c.Name();
        EXPECT_EQ(t->bwd_block_n, e.bn) << c.Name();
        EXPECT_EQ(t->bwd_threads, 128) << c.Name();
      }
    }
  }
  // 99 KB (sm_86): up to head dim 240 the tensor-core backward fits, 256 does not.
  CudaKernelConfig c;
  c.arch = "sm_86";
  c.head_dim = 240;
  absl::StatusOr<CudaTiles> t = ChooseCudaTiles(c);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->bwd_tensor_core);
  EXPECT_LE(t->bwd_smem_bytes, CudaMaxSharedMemory(86));
  c.head_dim = 256;
  t = ChooseCudaTiles(c);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->bwd_tensor_core);
}

TEST(GenerateCudaKernels, RejectsUnsupportedConfigurations) {
  auto expect_invalid = [](CudaKernelConfig c, const char* field) {
    absl::StatusOr<CudaKernelSource> s = GenerateCudaKernels(c);
    ASSERT_FALSE(s.ok()) << field;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_THAT(s.status().message(), HasSubstr(field));
  };
  CudaKernelConfig c;
  for (int d : {0, 24, 36, 264, -8}) {
    c.head_dim = d;
    expect_invalid(c, "head_dim");
  }
  c = {};
  c.arch = "sm_60";
  expect_invalid(c, "arch");
  c.arch = "compute_90";
  expect_invalid(c, "arch");
  c.arch = "hopper";
  expect_invalid(c, "sm_XX");
  c = {};
  c.gqa = 0;
  expect_invalid(c, "gqa");
  c = {};
  c.role = {-1};
  expect_invalid(c, "num_peers");
  c.role = {16};
  expect_invalid(c, "num_peers");
  c = {};
  c.block_m = 64;
  expect_invalid(c, "set together");
}

TEST(ChooseCudaTiles, FitSharedMemoryOfEachArchitecture) {
  for (const char* arch : {"sm_75", "sm_80", "sm_86", "sm_90"}) {
    const int limit = CudaMaxSharedMemory(*ParseCudaArch(arch));
    for (DType t : {DType::kF32, DType::kBF16}) {
      for (int d = 32; d <= 256; d += 8) {
        CudaKernelConfig c;
        c.arch = arch;
        c.dtype = t;
        c.head_dim = d;
        absl::StatusOr<CudaTiles> tiles = ChooseCudaTiles(c);
        ASSERT_TRUE(tiles.ok()) << arch << " d=" << d << ": " << tiles.status();
        EXPECT_LE(tiles->fwd_smem_bytes, limit);
        EXPECT_LE(tiles->bwd_smem_bytes, limit);
        EXPECT_EQ(tiles->threads % 32, 0);
        EXPECT_LE(tiles->threads, 1024);
        if (ResolveCudaMath(c) == CudaMath::kTensorCore) {
          // Two m16 row blocks per warp at D = 64, one above; the O fragment is D/2 floats per
          // thread and row block, and Q is held in registers only at D = 64
          // (ChooseMmaForwardTiles).
          EXPECT_EQ(tiles->block_m, (d <= 64 ? 32 : 16) * (tiles->threads / 32)) << d;
          EXPECT_EQ(tiles->block_n % 16, 0) << d;
          EXPECT_GE(tiles->fwd_stages, 2) << d;
          EXPECT_EQ(tiles->q_in_registers, d <= 64) << d;
        } else {
          // Per-thread accumulator of at most 64 floats.
          EXPECT_LE(d / (tiles->threads / tiles->block_m), 64);
        }
        EXPECT_LE(d / (tiles->bwd_threads / tiles->bwd_block_m), 64);
      }
    }
  }
  CudaKernelConfig h100;
  h100.arch = "sm_90";
  h100.head_dim = 128;
  EXPECT_EQ(ChooseCudaTiles(h100)->block_m, 64);
  EXPECT_EQ(ChooseCudaTiles(h100)->block_n, 64);
}

TEST(ShippedCudaConfigs, AreValidDistinctAndCoverTheMatrix) {
  for (const std::string& arch : ShippedCudaArchs()) {
    const std::vector<CudaKernelConfig> configs = ShippedCudaConfigs(arch);
    EXPECT_GE(configs.size(), 12u);
    EXPECT_LE(configs.size(), 24u);
    std::set<std::string> names;
    bool fused = false, full_only = false, gqa8 = false;
    std::set<int> dims;
    std::set<DType> dtypes;
    for (const CudaKernelConfig& c : configs) {
      EXPECT_TRUE(ValidateCudaKernelConfig(c).ok()) << c.Name();
      EXPECT_TRUE(names.insert(c.Name()).second) << "duplicate " << c.Name();
      fused |= c.role.num_peers > 0;
      full_only |= !c.has_band;
      gqa8 |= c.gqa == 8;
      dims.insert(c.head_dim);
      dtypes.insert(c.dtype);
    }
    EXPECT_TRUE(fused && full_only && gqa8);
    EXPECT_EQ(dims, (std::set<int>{64, 128, 256}));
    EXPECT_EQ(dtypes.size(), 3u);
  }
}

// The main check of the CUDA half of the JIT: every shipped variant compiles with NVRTC for
// sm_80 and sm_90, and each cubin defines every kernel under the lowered name the runtime
// will look up. Two compile threads; the timings are printed. Then, for every kernel of every
// role of every variant, ptxas' report (CompiledCudaKernels::Resources): no spill, and the
// registers, threads and shared memory allow at least the CTAs per SM its tiles were chosen
// for (min_ctas_per_sm); and with cuobjdump (tests/support/cuobjdump.h; where there is none,
// Cuobjdump.FindsHmmaInATensorCoreKernel skips and says so) its SASS holds HMMA exactly when
// the generator marked it tensor_core.
// One test per architecture (sm_80, sm_90), so that each stays well inside a minute.
class ShippedCudaKernelsOf : public ::testing::TestWithParam<std::string> {};
TEST_P(ShippedCudaKernelsOf, AllVariantsCompile) {
  REQUIRE_NVRTC();
  const std::string& arch = GetParam();
  // A sweep over the shipped variants: the sanitizer pass checks 4 of the 13 per architecture
  // (bf16 d64 and d256, f16 d64, f32 d128; testing::Sweep), compiled one by one below.
  const std::vector<CudaKernelConfig> configs = testing::Sweep(ShippedCudaConfigs(arch), 4);
  const bool all = configs.size() == ShippedCudaConfigs(arch).size();
  absl::StatusOr<std::vector<CudaVariantTiming>> timings =
      all ? CompileShippedCudaKernels({arch}, &TestCache(), 2)
          : absl::StatusOr<std::vector<CudaVariantTiming>>(std::vector<CudaVariantTiming>{});
  ASSERT_TRUE(timings.ok()) << timings.status();
  if (all) {
    ASSERT_EQ(timings->size(), ShippedCudaConfigs(arch).size());
  }
  double total = 0, worst = 0, cpu = 0, worst_cpu = 0;
  for (const CudaVariantTiming& t : *timings) {
    EXPECT_EQ(t.target.substr(0, 3), "sm_") << t.name;
    EXPECT_GT(t.image_bytes, 1000u) << t.name;
    total += t.seconds;
    worst = std::max(worst, t.seconds);
    cpu += t.cpu_seconds;
    worst_cpu = std::max(worst_cpu, t.cpu_seconds);
  }
  std::printf(
      "[ timing ] %zu CUDA variants: NVRTC wall %.2f s total (mean %.3f, max %.3f), CPU %.2f s "
      "(mean %.3f, max %.3f)\n",
      timings->size(), total, total / std::max<size_t>(1, timings->size()), worst, cpu,
      cpu / std::max<size_t>(1, timings->size()), worst_cpu);

  const std::string cuobjdump = testing::FindCuobjdump();
  const std::string dir = TempDir();
  int kernels = 0, tensor_core = 0, sass_checked = 0;
  for (const CudaKernelConfig& c : configs) {
    absl::StatusOr<CompiledCudaKernels> k = CompileCudaKernels(c, &TestCache());  // cached
    ASSERT_TRUE(k.ok()) << k.status();
    const std::string& name = k->source.program_name;
    absl::StatusOr<std::vector<CudaKernelResources>> res = k->Resources();
    ASSERT_TRUE(res.ok()) << name << ": " << res.status();
    std::map<std::string, std::string> sass;
    if (!cuobjdump.empty()) sass = testing::SassByFunction(cuobjdump, k->binary.image, dir);
    for (size_t i = 0; i < k->source.kernels.size(); ++i) {
      const CudaKernelEntry& e = k->source.kernels[i];
      const CudaKernelResources& r = (*res)[i];
      ++kernels;
      tensor_core += e.tensor_core;
      EXPECT_EQ(r.spill_store_bytes, 0) << name << " " << e.role;
      EXPECT_EQ(r.spill_load_bytes, 0) << name << " " << e.role;
      std::string limiter;
      const int ctas = CudaCtasPerSm(*ParseCudaArch(arch), e.threads, r.registers,
                                     e.dynamic_smem_bytes + r.static_smem_bytes, &limiter);
      EXPECT_GE(ctas, e.min_ctas_per_sm)
          << name << " " << e.role << ": " << r.registers << " registers, " << limiter;
      if (e.role == "fwd" || e.role == "bwd" || e.role == "fused_fwd") {
        std::printf(
            "[ resources ] %-40s %-9s %3d regs, spill %d/%d B, stack %d B, smem %6d "
            "B, %d CTA/SM (%s)%s\n",
            name.c_str(), e.role.c_str(), r.registers, r.spill_store_bytes, r.spill_load_bytes,
            r.stack_frame_bytes, e.dynamic_smem_bytes + r.static_smem_bytes, ctas,
            limiter.c_str(), e.tensor_core ? " [tensor cores]" : "");
      }
      if (cuobjdump.empty()) continue;
      const auto it = sass.find(*k->binary.LoweredName(e.name_expression));
      ASSERT_NE(it, sass.end()) << name << ": no SASS for " << e.role;
      EXPECT_EQ(it->second.find("HMMA") != std::string::npos, e.tensor_core)
          << name << " " << e.role
          << (e.tensor_core ? ": a tensor-core kernel without HMMA"
                            : ": HMMA in a kernel not marked tensor_core");
      ++sass_checked;
    }
  }
  std::filesystem::remove_all(dir);
  // Forward and fused forward of the bf16/f16 variants at least (20 over both architectures);
  // the sanitizer pass's subset holds three bf16/f16 variants.
  EXPECT_GE(tensor_core, all ? 10 : 3) << arch;
  std::printf("[ resources ] %d kernels, %d on tensor cores; SASS checked: %d (%s)\n", kernels,
              tensor_core, sass_checked, cuobjdump.empty() ? "no cuobjdump" : cuobjdump.c_str());
}
INSTANTIATE_TEST_SUITE_P(Archs, ShippedCudaKernelsOf, ::testing::ValuesIn(ShippedCudaArchs()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

TEST(ShippedCudaKernels, PtxFallbackMentionsEveryEntry) {
  REQUIRE_NVRTC();
  CudaKernelConfig c = ShippedCudaConfigs("sm_90").front();
  c.role = {1};
  absl::StatusOr<CompiledCudaKernels> k = CompileCudaKernels(c, &TestCache(), /*force_ptx=*/true);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->binary.kind, CudaBinary::Kind::kPtx);
  EXPECT_EQ(k->binary.target, "compute_90");
  for (const CudaKernelEntry& e : k->source.kernels) {
    EXPECT_THAT(k->binary.image, HasSubstr(".entry " + *k->binary.LoweredName(e.name_expression)))
        << e.role;
  }
  EXPECT_EQ(VerifyCubinSymbols(*k).code(), absl::StatusCode::kFailedPrecondition);
  // The PTX uses the acquire/release flags of hsap_sync.cuh in the fused kernel.
  EXPECT_THAT(k->binary.image, HasSubstr("ld.acquire.gpu"));
  EXPECT_THAT(k->binary.image, HasSubstr("atom.release.gpu"));
  EXPECT_THAT(k->binary.image, HasSubstr("ld.acquire.sys"));
  // A copy CTA's wait for a peer is bounded by the global timer.
  EXPECT_THAT(k->binary.image, HasSubstr("%globaltimer"));
}

// Loopback batches compile their configuration with the role {7 peers} (the
// fused forward, 8 steps per launch, gpu_batch.cc) for whatever dtype the batch has; the
// shipped list only has bf16 roles, so fp32 and fp16 are compiled here.
TEST(ShippedCudaKernels, FusedRoleOfLoopbackBatchesCompilesForFp32AndFp16) {
  REQUIRE_NVRTC();
  for (DType dtype : {DType::kF32, DType::kF16}) {
    CudaKernelConfig c;
    c.arch = "sm_90";
    c.dtype = dtype;
    c.head_dim = 64;
    c.gqa = 2;
    c.has_band = true;
    c.role = {7};
    absl::StatusOr<CompiledCudaKernels> k = CompileCudaKernels(c, &TestCache());
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_TRUE(k->LoweredName("fused_fwd").ok()) << c.Name();
    EXPECT_TRUE(VerifyCubinSymbols(*k).ok()) << c.Name();
  }
}

// The cuDNN engine's helpers compile with NVRTC into every configuration, for sm_80 and
// sm_90, in the storage dtypes cuDNN takes (bf16 on one, fp16 on the other: two compiles),
// without spills. (AllVariantsCompile compiles them in every shipped variant too.)
TEST(ShippedCudaKernels, CudnnEngineHelpersCompileForSm80AndSm90) {
  REQUIRE_NVRTC();
  for (const auto& [arch, dtype] : {std::pair{"sm_80", DType::kBF16}, {"sm_90", DType::kF16}}) {
    {
      CudaKernelConfig c;
      c.arch = arch;
      c.dtype = dtype;
      c.head_dim = 128;
      c.gqa = 4;
      c.has_band = true;
      absl::StatusOr<CompiledCudaKernels> k = CompileCudaKernels(c, &TestCache());
      ASSERT_TRUE(k.ok()) << k.status();
      EXPECT_TRUE(VerifyCubinSymbols(*k).ok()) << c.Name();
      absl::StatusOr<std::vector<CudaKernelResources>> res = k->Resources();
      ASSERT_TRUE(res.ok()) << c.Name() << ": " << res.status();
      int found = 0;
      for (size_t i = 0; i < k->source.kernels.size(); ++i) {
        const std::string& role = k->source.kernels[i].role;
        if (role != "merge_entries" && role != "gather_stats" && role != "add_entries") continue;
        ++found;
        EXPECT_TRUE(k->LoweredName(role).ok()) << c.Name() << " " << role;
        EXPECT_EQ((*res)[i].spill_store_bytes, 0) << c.Name() << " " << role;
        EXPECT_EQ((*res)[i].spill_load_bytes, 0) << c.Name() << " " << role;
      }
      EXPECT_EQ(found, 3) << c.Name();
    }
  }
}

TEST(ShippedCudaKernels, LookupOfAnUnknownRoleIsNotFound) {
  REQUIRE_NVRTC();
  absl::StatusOr<CompiledCudaKernels> k =
      CompileCudaKernels(ShippedCudaConfigs("sm_90").front(), &TestCache());
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_TRUE(k->LoweredName("fwd").ok());
  EXPECT_EQ(k->LoweredName("fused_fwd").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(VerifyCubinSymbols(*k).ok());
}

TEST(ShippedCudaKernels, ForcedUnsupportedHeadDimIsACompileErrorWithLogAndSource) {
  REQUIRE_NVRTC();
  CudaKernelConfig c;
  c.arch = "sm_90";
  c.head_dim = 36;  // not a multiple of 8
  c.skip_validation = true;
  absl::StatusOr<CompiledCudaKernels> k = CompileCudaKernels(c, &TestCache());
  ASSERT_FALSE(k.ok());
  EXPECT_TRUE(IsCompileError(k.status())) << k.status();
  EXPECT_EQ(ResultFromStatus(k.status()), hsapCompileError);
  const std::string message(k.status().message());
  EXPECT_THAT(message, HasSubstr("unsupported head dim"));
  const std::string marker = "generated source kept at ";
  const size_t at = message.find(marker);
  ASSERT_NE(at, std::string::npos) << message;
  const std::string path =
      message.substr(at + marker.size(), message.find('\n', at) - at - marker.size());
  EXPECT_THAT(ReadFile(path), HasSubstr("kHeadDim = 36;")) << path;
  std::remove(path.c_str());
}

TEST(ShippedCudaKernels, MissingNvrtcIsUnsupported) {
  const std::string empty_dir = TempDir();
  absl::StatusOr<CompiledCudaKernels> k = absl::UnknownError("not compiled");
  {
    testing::ScopedEnv nvrtc_path("HSAP_NVRTC_PATH", empty_dir.c_str());
    CudaKernelConfig c;
    c.dtype = DType::kF32;
    c.head_dim = 40;  // a configuration no other test compiles, so the cache cannot serve it
    k = CompileCudaKernels(c, nullptr);
  }
  std::filesystem::remove_all(empty_dir);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(ResultFromStatus(k.status()), hsapUnsupported);
  EXPECT_THAT(k.status().message(), HasSubstr("NVRTC not found"));
}

// nvcc-clean: one generated program with its headers compiles with nvcc too (host and
// device passes). Skipped where the toolkit has no nvcc.
TEST(CudaDeviceHeaders, CompileWithNvcc) {
  const char* cuda_home = std::getenv("CUDA_HOME");
  const std::string nvcc =
      std::string(cuda_home != nullptr ? cuda_home : "/usr/local/cuda") + "/bin/nvcc";
  if (::access(nvcc.c_str(), X_OK) != 0) GTEST_SKIP() << "no nvcc at " << nvcc;
  CudaKernelConfig c;
  c.arch = "sm_80";
  c.dtype = DType::kBF16;
  c.head_dim = 64;
  c.role = {1};
  absl::StatusOr<CudaKernelSource> s = GenerateCudaKernels(c);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string dir = TempDir();
  for (const auto& [name, content] : s->headers) WriteFile(dir + "/" + name, content);
  WriteFile(dir + "/kernels.cu", s->source);
  const std::string cmd = absl::StrCat(nvcc, " -std=c++17 -arch=sm_80 -c ", dir, "/kernels.cu -o ",
                                       dir, "/kernels.o > ", dir, "/nvcc.log 2>&1");
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << ReadFile(dir + "/nvcc.log");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hsap::jit
