// Writes the kernel configurations the CUDA emulator runs (tests/support/emulated_device.h,
// tests/jit/cuda_emulation_test.cc) as a header of C++ structs, each rendered by
// jit/codegen_cuda's CudaConfigStruct: the very text NVRTC compiles as `struct HsapCfg`, so
// the emulated kernels cannot drift from what the generator emits.
//
//   hsap_gen_emulator_configs <output header>
//
// The build runs it into <build>/generated/tests/support/emulator_configs.h (included as
// "tests/support/emulator_configs.h"). A test that needs another configuration adds it to
// Families() below; using one that is not listed is a compile error (incomplete type).
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention/dtype.h"
#include "base/status_macros.h"
#include "jit/codegen_cuda.h"

namespace hsap {
namespace {

// One configuration: the generator's input and the template arguments that name it.
struct Instance {
  jit::CudaKernelConfig config;
  std::string template_args;
};

// A class template whose explicit specialisations are generated configurations.
struct Family {
  std::string doc;         // comment lines above the template
  std::string parameters;  // "typename StorageT, int kG, ..."
  std::string name;
  std::vector<Instance> instances;
};

// The architecture the emulated configurations are generated for: it only bounds the
// shared memory a tile may use, and sm_90 is the shipped architecture with the most.
constexpr char kArch[] = "sm_90";

const char* StorageTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float";
    case DType::kBF16:
      return "hsap_dev::bf16";
    case DType::kF16:
      return "hsap_dev::f16";
  }
  return "float";
}

// Head dim 32 with explicit small tiles (forward 32x16 on 64 threads, backward 16x16 on 32),
// so that short rows still span several tiles, chunks and segments. kSteps > 0: with the
// fused forward of kSteps steps per launch (kSteps - 1 peers).
Instance SmallTile(DType dtype, int gqa, bool band, int steps) {
  Instance i;
  jit::CudaKernelConfig& c = i.config;
  c.arch = kArch;
  c.dtype = dtype;
  c.head_dim = 32;
  c.gqa = gqa;
  c.has_band = band;
  c.role.num_peers = steps > 0 ? steps - 1 : 0;
  c.block_m = 32;
  c.block_n = 16;
  c.threads = 64;
  c.bwd_block_m = 16;
  c.bwd_block_n = 16;
  c.bwd_threads = 32;
  i.template_args =
      absl::StrCat(StorageTypeName(dtype), ", ", gqa, ", ", band ? "true" : "false", ", ", steps);
  return i;
}

// The tiles ChooseCudaTiles picks for the architecture, as a GPU run would use them.
Instance ChosenTile(DType dtype, int head_dim, int gqa, bool band) {
  Instance i;
  jit::CudaKernelConfig& c = i.config;
  c.arch = kArch;
  c.dtype = dtype;
  c.head_dim = head_dim;
  c.gqa = gqa;
  c.has_band = band;
  // The FMA kernels (the tensor-core ones: MmaBwdCfg below).
  c.math = jit::CudaMath::kFma;
  i.template_args = absl::StrCat(StorageTypeName(dtype), ", ", head_dim, ", ", gqa, ", ",
                                 band ? "true" : "false");
  return i;
}

// A tensor-core configuration (bf16/f16, head dim 64..256) with the tiles ChooseCudaTiles
// picks (64 query rows on 4 warps, one m16 row block each); kSteps as in SmallTile.
Instance MmaTile(DType dtype, int head_dim, int gqa, bool band, int steps) {
  Instance i = ChosenTile(dtype, head_dim, gqa, band);
  i.config.math = jit::CudaMath::kTensorCore;
  i.config.role.num_peers = steps > 0 ? steps - 1 : 0;
  absl::StrAppend(&i.template_args, ", ", steps);
  return i;
}

// The tensor-core backward at its shipped tiles, deterministic or atomic dq.
Instance MmaBackward(DType dtype, int head_dim, int gqa, bool deterministic_dq) {
  Instance i;
  jit::CudaKernelConfig& c = i.config;
  c.arch = kArch;
  c.dtype = dtype;
  c.head_dim = head_dim;
  c.gqa = gqa;
  c.has_band = true;
  c.math = jit::CudaMath::kTensorCore;
  c.deterministic_dq = deterministic_dq;
  // The shipped tiles (MmaBwdTileFor): 32x64 up to head dim 128, 32x32 above (two warps
  // splitting D), 4 warps.
  i.template_args = absl::StrCat(StorageTypeName(dtype), ", ", head_dim, ", ", gqa, ", ",
                                 deterministic_dq ? "true" : "false");
  return i;
}

// Arch sm_90a and tensor-core math with the tiles ChooseCudaTiles picks: the sm_90a forward
// (hsap_attention_wgmma_fwd.cuh: 128 query rows on a producer and two consumer warpgroups)
// and, at head dims 64 and 128, the sm_90a backward (hsap_attention_wgmma_bwd.cuh).
Instance WgmmaTile(DType dtype, int head_dim, int gqa, bool band) {
  Instance i = ChosenTile(dtype, head_dim, gqa, band);
  i.config.arch = "sm_90a";
  i.config.math = jit::CudaMath::kTensorCore;
  return i;
}

// The sm_90a forward; kSteps as in SmallTile (its fused forward: fused_fwd_wgmma_kernel).
Instance WgmmaForward(DType dtype, int head_dim, int gqa, bool band, int steps = 0) {
  Instance i = WgmmaTile(dtype, head_dim, gqa, band);
  i.config.role.num_peers = steps > 0 ? steps - 1 : 0;
  absl::StrAppend(&i.template_args, ", ", steps);
  return i;
}

// The sm_90a backward (deterministic dq).
Instance WgmmaBackward(DType dtype, int head_dim, int gqa, bool band) {
  return WgmmaTile(dtype, head_dim, gqa, band);
}

std::vector<Family> Families() {
  constexpr DType kF32 = DType::kF32, kBF16 = DType::kBF16, kF16 = DType::kF16;
  return {
      {"// Head dim 32, explicit small tiles (forward 32x16 on 64 threads, backward 16x16 on\n"
       "// 32), so that short rows span several tiles, chunks and segments; kSteps > 0: with the\n"
       "// fused forward of kSteps steps per launch.\n",
       "typename StorageT, int kG, bool kBand, int kSteps = 0",
       "SmallTileCfg",
       {SmallTile(kF32, 2, true, 0), SmallTile(kBF16, 2, true, 0), SmallTile(kF16, 2, true, 0),
        SmallTile(kF32, 2, false, 0), SmallTile(kF32, 1, true, 0), SmallTile(kF32, 2, true, 2),
        SmallTile(kBF16, 2, true, 2), SmallTile(kBF16, 2, true, 3), SmallTile(kBF16, 2, true, 5)}},
      {"// The tiles ChooseCudaTiles picks on sm_90 for the FMA kernels (e.g. 64x64 forward\n"
       "// tiles at head dim 128), as the GPU runs them.\n",
       "typename StorageT, int kHeadDim, int kG, bool kBand",
       "ChosenTileCfg",
       {ChosenTile(kBF16, 128, 1, true)}},
      {"// Tensor-core variants (math kTensorCore) with the tiles ChooseCudaTiles picks on sm_90,\n"
       "// as the GPU runs them; kSteps > 0: with the fused forward of kSteps steps per launch.\n",
       "typename StorageT, int kHeadDim, int kG, bool kBand, int kSteps = 0",
       "MmaTileCfg",
       {MmaTile(kBF16, 64, 2, true, 0), MmaTile(kF16, 64, 2, true, 0),
        MmaTile(kBF16, 128, 2, true, 0), MmaTile(kF16, 128, 2, true, 0),
        MmaTile(kBF16, 64, 2, false, 0), MmaTile(kBF16, 64, 2, true, 3),
        MmaTile(kBF16, 144, 2, true, 0), MmaTile(kF16, 240, 2, true, 0)}},
      {"// The tensor-core backward (hsap_attention_mma_bwd.cuh) with the tiles ChooseCudaTiles\n"
       "// picks on sm_90; kDeterministicDq: dq in a fixed order, else fp32 atomics.\n",
       "typename StorageT, int kHeadDim, int kG, bool kDeterministicDq",
       "MmaBwdCfg",
       {MmaBackward(kBF16, 64, 2, true), MmaBackward(kF16, 64, 2, true),
        MmaBackward(kF16, 128, 2, true), MmaBackward(kBF16, 128, 2, false),
        MmaBackward(kBF16, 64, 2, false), MmaBackward(kBF16, 256, 2, true),
        MmaBackward(kF16, 256, 2, false), MmaBackward(kBF16, 144, 2, true),
        MmaBackward(kBF16, 144, 2, false), MmaBackward(kF16, 240, 2, true)}},
      {"// The sm_90a forward (hsap_attention_wgmma_fwd.cuh, arch sm_90a) with the tiles\n"
       "// ChooseCudaTiles picks: 128 query rows per CTA, K/V tiles of kWgmmaBlockN keys;\n"
       "// kSteps > 0: with the fused forward of kSteps steps per launch.\n",
       "typename StorageT, int kHeadDim, int kG, bool kBand, int kSteps = 0",
       "WgmmaFwdCfg",
       {WgmmaForward(kBF16, 64, 2, true), WgmmaForward(kF16, 64, 2, true),
        WgmmaForward(kBF16, 128, 2, true), WgmmaForward(kF16, 128, 2, true),
        WgmmaForward(kBF16, 64, 2, false), WgmmaForward(kBF16, 256, 2, true),
        WgmmaForward(kBF16, 64, 2, true, 3)}},
      {"// The sm_90a backward (hsap_attention_wgmma_bwd.cuh, arch sm_90a, deterministic dq) with\n"
       "// the tiles ChooseCudaTiles picks: key items of 64 keys, query tiles of "
       "kWgmmaBwdBlockM.\n",
       "typename StorageT, int kHeadDim, int kG, bool kBand",
       "WgmmaBwdCfg",
       {WgmmaBackward(kBF16, 64, 2, true), WgmmaBackward(kF16, 64, 2, true),
        WgmmaBackward(kBF16, 128, 2, true), WgmmaBackward(kF16, 128, 2, true),
        WgmmaBackward(kBF16, 64, 2, false)}},
  };
}

absl::Status WriteHeader(const std::string& path) {
  std::ostringstream out;
  out << "// Generated by tests/support/gen_emulator_configs.cc from jit/codegen_cuda; do not "
         "edit.\n"
         "// Each struct is the `HsapCfg` text the generator emits for the configuration named\n"
         "// above it. Include after the device headers (tests/support/emulated_device.h).\n"
         "#ifndef HSAP_TESTS_SUPPORT_EMULATOR_CONFIGS_H_\n"
         "#define HSAP_TESTS_SUPPORT_EMULATOR_CONFIGS_H_\n\n"
         "#ifndef HSAP_DEVICE_EMULATION\n"
         "#error \"include tests/support/cuda_emulator.h and the device headers first\"\n"
         "#endif\n\n"
         "namespace hsap::testing {\n";
  for (const Family& family : Families()) {
    out << "\n"
        << family.doc << "template <" << family.parameters << ">\nstruct " << family.name << ";\n";
    for (const Instance& instance : family.instances) {
      HSAP_ASSIGN_OR_RETURN(const jit::CudaKernelSource source,
                            jit::GenerateCudaKernels(instance.config));
      out << "\n// " << instance.config.Name() << "\ntemplate <>\n"
          << jit::CudaConfigStruct(instance.config, source.tiles,
                                   absl::StrCat(family.name, "<", instance.template_args, ">"));
    }
  }
  out << "\n}  // namespace hsap::testing\n\n#endif  // HSAP_TESTS_SUPPORT_EMULATOR_CONFIGS_H_\n";

  // Rewrite only on change, so that the tests including it are not rebuilt for nothing.
  const std::string text = out.str();
  {
    std::ifstream old(path, std::ios::binary);
    std::ostringstream existing;
    existing << old.rdbuf();
    if (old && existing.str() == text) return absl::OkStatus();
  }
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << text;
  file.close();
  if (!file) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace
}  // namespace hsap

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <output header>\n", argv[0]);
    return 2;
  }
  if (absl::Status s = hsap::WriteHeader(argv[1]); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], s.ToString().c_str());
    return 1;
  }
  return 0;
}
