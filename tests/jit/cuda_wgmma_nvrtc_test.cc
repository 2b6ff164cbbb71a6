// The sm_90a forward's variant selection and its compile check without a GPU:
//   - the generator picks it for arch sm_90a (tensor-core math, head dims 64/128/256), the JIT
//     picks sm_90a on compute capability 9.0 only (JitCudaArch), and the arch is in the
//     variant's name, the NVRTC target and so the cache key;
//   - NVRTC compiles the forward, and the fused forward of a rank with peers (the same CTAs
//     plus copy CTAs), for sm_90a (bf16 and f16; d 64, 128, 256; banded and full-only),
//     ptxas' report shows no spill, at most the 168 registers per thread that 384
//     threads leave at one CTA per SM (the consumers then raise theirs to 240 by setmaxnreg),
//     one CTA per SM fitting the shared memory the generator computed, no wgmma serialized by
//     ptxas (warning C7514); and the SASS holds
//     HGMMA (wgmma), UTMALDG (TMA) and SYNCS (mbarrier) instructions and no HMMA.
// The compiles take a few seconds each: the sanitizer pass (HSAP_TEST_SWEEP=subset) compiles
// the first and the last of the configurations.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/codegen_cuda.h"
#include "jit/cuda_kernels.h"
#include "jit/nvrtc.h"
#include "tests/support/cuobjdump.h"
#include "tests/support/sweep.h"
#include "tests/support/test_files.h"

namespace hsap::jit {
namespace {

using ::testing::HasSubstr;

#define REQUIRE_NVRTC()                                                    \
  do {                                                                     \
    if (!LoadNvrtc().ok()) GTEST_SKIP() << LoadNvrtc().status().message(); \
  } while (0)

CudaKernelConfig Config(const std::string& arch, DType dtype, int head_dim, bool band) {
  CudaKernelConfig c;
  c.arch = arch;
  c.dtype = dtype;
  c.head_dim = head_dim;
  c.gqa = 2;
  c.has_band = band;
  return c;
}

TEST(WgmmaForwardSelection, ArchSm90aWithTensorCoresOnly) {
  EXPECT_TRUE(CudaWgmmaForwardApplies(Config("sm_90a", DType::kBF16, 128, true)));
  EXPECT_TRUE(CudaWgmmaForwardApplies(Config("sm_90a", DType::kF16, 64, false)));
  EXPECT_TRUE(CudaWgmmaForwardApplies(Config("sm_90a", DType::kBF16, 256, true)));
  // sm_90 without `a`, other architectures, fp32, head dims that are not 64-element panels,
  // and FMA math keep the other forwards.
  EXPECT_FALSE(CudaWgmmaForwardApplies(Config("sm_90", DType::kBF16, 128, true)));
  EXPECT_FALSE(CudaWgmmaForwardApplies(Config("sm_80", DType::kBF16, 128, true)));
  EXPECT_FALSE(CudaWgmmaForwardApplies(Config("sm_90a", DType::kF32, 128, true)));
  EXPECT_FALSE(CudaWgmmaForwardApplies(Config("sm_90a", DType::kBF16, 96, true)));
  CudaKernelConfig fma = Config("sm_90a", DType::kBF16, 128, true);
  fma.math = CudaMath::kFma;
  EXPECT_FALSE(CudaWgmmaForwardApplies(fma));

  EXPECT_EQ(JitCudaArch("sm_90", Config("", DType::kBF16, 128, true)), "sm_90a");
  EXPECT_EQ(JitCudaArch("sm_90", Config("", DType::kF32, 128, true)), "sm_90");
  EXPECT_EQ(JitCudaArch("sm_90", Config("", DType::kBF16, 96, true)), "sm_90");
  EXPECT_EQ(JitCudaArch("sm_80", Config("", DType::kBF16, 128, true)), "sm_80");
  EXPECT_EQ(JitCudaArch("sm_89", Config("", DType::kF16, 64, true)), "sm_89");
  EXPECT_EQ(JitCudaArch("sm_100", Config("", DType::kBF16, 128, true)), "sm_100");
}

TEST(WgmmaForwardSelection, GeneratorEmitsTheWgmmaForward) {
  absl::StatusOr<CudaKernelSource> s = GenerateCudaKernels(Config("sm_90a", DType::kBF16, 128, true));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->config.Name(), "sm90a_bf16_d128_g2_band_tc");
  EXPECT_THAT(s->source, HasSubstr("#include \"hsap_attention_wgmma_fwd.cuh\""));
  EXPECT_THAT(s->source, HasSubstr("kWgmmaFwd = true"));
  const CudaKernelEntry& fwd = s->kernels.front();
  EXPECT_EQ(fwd.role, "fwd");
  EXPECT_EQ(fwd.name_expression, "hsap_dev::attn_fwd_wgmma_kernel<HsapCfg>");
  EXPECT_TRUE(fwd.wgmma);
  EXPECT_TRUE(fwd.tensor_core);
  EXPECT_EQ(fwd.threads, 384);
  EXPECT_EQ(fwd.min_ctas_per_sm, 1);
  // 1 KiB alignment slack + Q (128 x 128) + 2 stages of K and V (128 x 128) + 7 mbarriers +
  // 2 tile descriptors + the chunk's tile count.
  EXPECT_EQ(fwd.dynamic_smem_bytes, 1024 + 2 * (128 + 2 * 2 * 128) * 128 + 8 * 7 + 2 * 32 + 16);
  EXPECT_EQ(s->tiles.wgmma_block_n, 128);
  EXPECT_EQ(s->tiles.wgmma_stages, 2);
  // The fused forward runs the same CTAs (plus copy CTAs), one launch per step.
  CudaKernelConfig fused = Config("sm_90a", DType::kBF16, 128, true);
  fused.role = {3};
  absl::StatusOr<CudaKernelSource> f = GenerateCudaKernels(fused);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kernels.back().role, "fused_fwd");
  EXPECT_EQ(f->kernels.back().name_expression, "hsap_dev::fused_fwd_wgmma_kernel<HsapCfg>");
  EXPECT_TRUE(f->kernels.back().wgmma);
  EXPECT_EQ(f->kernels.back().threads, 384);
  EXPECT_EQ(f->kernels.back().dynamic_smem_bytes, fwd.dynamic_smem_bytes);
  EXPECT_EQ(f->kernels.back().min_ctas_per_sm, 1);
  // Every shared-memory size fits sm_90's 227 KiB.
  for (int d : {64, 128, 256}) {
    absl::StatusOr<CudaTiles> t = ChooseCudaTiles(Config("sm_90a", DType::kF16, d, true));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(t->wgmma_fwd);
    EXPECT_LE(t->wgmma_smem_bytes, CudaMaxSharedMemory(90)) << d;
  }
  // sm_90 keeps the mma.sync forward.
  absl::StatusOr<CudaKernelSource> plain = GenerateCudaKernels(Config("sm_90", DType::kBF16, 128, true));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->kernels.front().name_expression, "hsap_dev::attn_fwd_kernel<HsapCfg>");
  EXPECT_FALSE(plain->kernels.front().wgmma);
}

TEST(WgmmaForwardSelection, ArchSuffixParses) {
  EXPECT_EQ(*ParseCudaArch("sm_90a"), 90);
  EXPECT_EQ(*ParseCudaArch("compute_90a"), 90);
  EXPECT_TRUE(IsArchSpecificTarget("sm_90a"));
  EXPECT_FALSE(IsArchSpecificTarget("sm_90"));
  EXPECT_FALSE(ParseCudaArch("sm_90b").ok());
  EXPECT_FALSE(ParseCudaArch("sm_a").ok());
  EXPECT_FALSE(ParseCudaArch("sm_90aa").ok());
}

// One kernel of the generated program (`role`: "fwd", "bwd", or "fused_fwd" for a
// configuration with peers) alone, compiled with ptxas' report: the program's includes and
// configuration, and its explicit instantiation of that kernel (the program the runtime
// compiles also holds the other kernels and the helpers, unchanged from sm_90).
absl::StatusOr<CudaBinary> CompileWgmmaKernel(const CudaKernelConfig& c, absl::string_view role,
                                              CudaKernelEntry* entry) {
  HSAP_ASSIGN_OR_RETURN(CudaKernelSource s, GenerateCudaKernels(c));
  const auto it = std::find_if(s.kernels.begin(), s.kernels.end(),
                               [&](const CudaKernelEntry& k) { return k.role == role; });
  if (it == s.kernels.end()) return absl::NotFoundError(absl::StrCat("no ", role, " kernel"));
  *entry = *it;
  std::string includes, instantiation;
  const std::string prefix = absl::StrCat("template __global__ void ", entry->name_expression, "(");
  for (absl::string_view line : absl::StrSplit(s.source, '\n')) {
    if (absl::StartsWith(line, "#include ")) absl::StrAppend(&includes, line, "\n");
    if (absl::StartsWith(line, prefix)) instantiation = absl::StrCat(line, "\n");
  }
  if (instantiation.empty()) return absl::NotFoundError(absl::StrCat("no ", prefix));
  CudaCompileRequest r;
  r.program_name = absl::StrCat("hsap_", c.Name(), "_", role, ".cu");
  r.source = absl::StrCat(includes, CudaConfigStruct(c, s.tiles, "HsapCfg"), instantiation);
  r.headers = s.headers;
  r.arch = c.arch;
  r.extra_options = {"--ptxas-options=-v"};
  r.name_expressions = {entry->name_expression};
  return CompileCuda(r, nullptr);
}

// What every sm_90a kernel must show once compiled (`role` of `c`, entry `e`, binary `b`): no
// spill, `max_registers` exactly, no wgmma serialized by ptxas (its C7514, "wgmma.mma_async
// instructions are serialized due to ...", would mean a wait after every wgmma: the
// pipelining lost), at least one CTA per SM; and, where cuobjdump is found, HGMMA (wgmma),
// UTMALDG (TMA) and SYNCS (mbarrier) in the SASS and no HMMA, and BAR.ARV (a named
// barrier's arrive: the forward's consumers passing the turn) exactly when `turns`. Prints the
// resources.
void ExpectWgmmaKernel(const CudaKernelConfig& c, absl::string_view role, const CudaKernelEntry& e,
                       const CudaBinary& b, int max_registers, bool turns,
                       const std::string& cuobjdump, const std::string& dir) {
  EXPECT_EQ(b.target, "sm_90a");
  absl::StatusOr<std::vector<CudaKernelResources>> res = ParsePtxasResources(b.log);
  ASSERT_TRUE(res.ok()) << res.status();
  ASSERT_EQ(res->size(), 1u) << b.log;
  const CudaKernelResources& r = res->front();
  EXPECT_EQ(r.spill_store_bytes, 0) << b.log;
  EXPECT_EQ(r.spill_load_bytes, 0);
  // Exactly the launch bounds' count: setmaxnreg's pool is the launch's registers, which the
  // kernels' register splits and the emulator (emulated_wgmma.h LaunchRegisters) assume.
  EXPECT_EQ(r.registers, max_registers);
  EXPECT_THAT(b.log, ::testing::Not(HasSubstr("serialized")));
  std::string limiter;
  const int ctas = CudaCtasPerSm(90, e.threads, r.registers,
                                 e.dynamic_smem_bytes + r.static_smem_bytes, &limiter);
  EXPECT_GE(ctas, 1) << limiter;
  std::printf(
      "[ resources ] %-34s %-9s %3d regs, spill %d/%d B, stack %d B, smem %6d B, %d CTA/SM (%s)\n",
      c.Name().c_str(), std::string(role).c_str(), r.registers, r.spill_store_bytes,
      r.spill_load_bytes, r.stack_frame_bytes, e.dynamic_smem_bytes + r.static_smem_bytes, ctas,
      limiter.c_str());
  if (cuobjdump.empty()) return;
  const std::map<std::string, std::string> sass = testing::SassByFunction(cuobjdump, b.image, dir);
  ASSERT_EQ(sass.size(), 1u);
  const std::string& code = sass.begin()->second;
  EXPECT_THAT(code, HasSubstr("HGMMA"));
  EXPECT_THAT(code, HasSubstr("UTMALDG"));
  EXPECT_THAT(code, HasSubstr("SYNCS"));
  EXPECT_THAT(code, ::testing::Not(HasSubstr("HMMA")));  // the backward's dq items too
  EXPECT_EQ(code.find("BAR.ARV") != std::string::npos, turns);
}

TEST(WgmmaForwardCompile, Sm90aResourcesAndSass) {
  REQUIRE_NVRTC();
  const std::vector<CudaKernelConfig> configs = testing::Sweep(
      std::vector<CudaKernelConfig>{Config("sm_90a", DType::kBF16, 128, true),
                                    Config("sm_90a", DType::kF16, 64, false),
                                    Config("sm_90a", DType::kF16, 256, true)},
      2);
  const std::string cuobjdump = testing::FindCuobjdump();
  const std::string dir = testing::MakeTestTempDir("cuda_wgmma_nvrtc_test");
  for (CudaKernelConfig c : configs) {
    // The forward, and the fused forward of a rank with three peers.
    for (const char* role : {"fwd", "fused_fwd"}) {
      c.role = {std::string(role) == "fwd" ? 0 : 3};
      SCOPED_TRACE(absl::StrCat(c.Name(), " ", role));
      CudaKernelEntry e;
      absl::StatusOr<CudaBinary> b = CompileWgmmaKernel(c, role, &e);
      ASSERT_TRUE(b.ok()) << b.status();
      // 65536 / 384, rounded down to a multiple of 8 (the consumers then take 240). The
      // consumers take turns (ping-pong) at head dims up to 128.
      ExpectWgmmaKernel(c, role, e, *b, 168, /*turns=*/c.head_dim <= 128, cuobjdump, dir);
    }
  }
  std::filesystem::remove_all(dir);
  if (cuobjdump.empty()) {
    std::printf("[ sass ] no cuobjdump: the SASS was not checked (tests/support/cuobjdump.h)\n");
  }
}

TEST(WgmmaBackwardSelection, Sm90aDeterministicDqHeadDims64And128) {
  EXPECT_TRUE(CudaWgmmaBackwardApplies(Config("sm_90a", DType::kBF16, 128, true)));
  EXPECT_TRUE(CudaWgmmaBackwardApplies(Config("sm_90a", DType::kF16, 64, false)));
  // Head dim 256 (dK + dV would not fit one warpgroup's registers), atomic dq, explicit tiles,
  // sm_90 and fp32 keep the mma.sync / FMA backward.
  EXPECT_FALSE(CudaWgmmaBackwardApplies(Config("sm_90a", DType::kBF16, 256, true)));
  EXPECT_FALSE(CudaWgmmaBackwardApplies(Config("sm_90", DType::kBF16, 128, true)));
  EXPECT_FALSE(CudaWgmmaBackwardApplies(Config("sm_90a", DType::kF32, 128, true)));
  CudaKernelConfig atomic = Config("sm_90a", DType::kBF16, 128, true);
  atomic.deterministic_dq = false;
  EXPECT_FALSE(CudaWgmmaBackwardApplies(atomic));
  CudaKernelConfig tiles = Config("sm_90a", DType::kBF16, 128, true);
  tiles.bwd_block_m = 16;
  tiles.bwd_block_n = 64;
  tiles.bwd_threads = 128;
  EXPECT_FALSE(CudaWgmmaBackwardApplies(tiles));

  absl::StatusOr<CudaKernelSource> s =
      GenerateCudaKernels(Config("sm_90a", DType::kBF16, 128, true));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->source, HasSubstr("#include \"hsap_attention_wgmma_bwd.cuh\""));
  EXPECT_THAT(s->source, HasSubstr("kWgmmaBwd = true"));
  const CudaKernelEntry& bwd = s->kernels[1];
  EXPECT_EQ(bwd.role, "bwd");
  EXPECT_EQ(bwd.name_expression, "hsap_dev::attn_bwd_wgmma_kernel<HsapCfg>");
  EXPECT_TRUE(bwd.wgmma);
  EXPECT_EQ(bwd.threads, 384);  // a producer and two consumer warpgroups
  // 48-row stage tiles at head dim 128 (in 16-row TMA boxes), 64 at 64.
  EXPECT_EQ(s->tiles.wgmma_bwd_block_m, 48);
  EXPECT_EQ(s->tiles.wgmma_bwd_box_rows, 16);
  // 1 KiB slack + K, V (128 x 128) + 2 stages of Q, dO (48 x 128) + P^T, dS^T (64 rows of
  // 128 bytes) of both consumer warpgroups + lse/delta + walk state and stage slots, then 6
  // mbarriers.
  EXPECT_EQ(bwd.dynamic_smem_bytes,
            1024 + 2 * 128 * 128 * 2 + 4 * 48 * 128 * 2 + 4 * 64 * 128 + 16 * 48 + 256 + 6 * 8);
  absl::StatusOr<CudaKernelSource> d64 =
      GenerateCudaKernels(Config("sm_90a", DType::kF16, 64, false));
  ASSERT_TRUE(d64.ok()) << d64.status();
  EXPECT_EQ(d64->tiles.wgmma_bwd_block_m, 64);
  EXPECT_EQ(d64->tiles.wgmma_bwd_box_rows, 64);
  // The atomic-dq configuration keeps the mma.sync backward.
  CudaKernelConfig atomic_c = Config("sm_90a", DType::kBF16, 128, true);
  atomic_c.deterministic_dq = false;
  absl::StatusOr<CudaKernelSource> a = GenerateCudaKernels(atomic_c);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->kernels[1].name_expression, "hsap_dev::attn_bwd_mma_kernel<HsapCfg>");
  EXPECT_FALSE(a->kernels[1].wgmma);
}

// The backward alone, compiled with ptxas' report: no spill (the consumers' code within the
// 232 registers setmaxnreg gives them, the producer's within 40), 168 registers at launch
// (65536 / 384), the generator's shared memory fits, and the SASS holds HGMMA (key and dq
// items), UTMALDG and SYNCS (TMA and mbarriers) and no HMMA.
TEST(WgmmaBackwardCompile, Sm90aResourcesAndSass) {
  REQUIRE_NVRTC();
  const std::vector<CudaKernelConfig> configs = testing::Sweep(
      std::vector<CudaKernelConfig>{
          Config("sm_90a", DType::kBF16, 128, true), Config("sm_90a", DType::kF16, 128, false),
          Config("sm_90a", DType::kBF16, 64, true), Config("sm_90a", DType::kF16, 64, false)},
      2);
  const std::string cuobjdump = testing::FindCuobjdump();
  const std::string dir = testing::MakeTestTempDir("cuda_wgmma_bwd_nvrtc_test");
  for (const CudaKernelConfig& c : configs) {
    SCOPED_TRACE(c.Name());
    CudaKernelEntry e;
    absl::StatusOr<CudaBinary> b = CompileWgmmaKernel(c, "bwd", &e);
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE(e.wgmma);
    ExpectWgmmaKernel(c, "bwd", e, *b, 168, /*turns=*/false, cuobjdump, dir);
  }
  std::filesystem::remove_all(dir);
  if (cuobjdump.empty()) {
    std::printf("[ sass ] no cuobjdump: the SASS was not checked (tests/support/cuobjdump.h)\n");
  }
}

}  // namespace
}  // namespace hsap::jit
