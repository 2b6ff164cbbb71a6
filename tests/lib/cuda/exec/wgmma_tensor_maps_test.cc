// The sm_90a forward's and backward's host side: their tensor maps
// (lib/cuda/exec/wgmma_tensor_maps.h) through the emulated driver's cuTensorMapEncodeTiled (the
// geometry the kernel assumes, hsap_attention_wgmma_fwd.cuh, and the refusals, each naming the
// argument), the arch the runtime compiles for (JitArchForDevice, HSAP_JIT_SM90A), and the
// work-list block rows the GPU runners ask for (the forward's CTA tile).
#include "lib/cuda/exec/wgmma_tensor_maps.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/cuda/exec/jit_device_kernels.h"
#include "tests/support/emulated_cuda_runtime.h"
#include "tests/support/emulated_tensor_map.h"
#include "tests/support/scoped_env.h"

namespace hsap::cuda {
namespace {

using ::testing::HasSubstr;

struct Tensors {
  alignas(16) uint16_t q[300 * 4 * 128];
  alignas(16) uint16_t k[200 * 2 * 128];
  alignas(16) uint16_t v[200 * 2 * 128];
  hsap_dev::FwdParams Params() {
    hsap_dev::FwdParams p{};
    p.q = q;
    p.k = k;
    p.v = v;
    p.q_rows = 300;
    p.k_rows = 200;
    p.heads_q = 4;
    p.heads_kv = 2;
    return p;
  }
};

TEST(WgmmaTensorMaps, GeometryIsTheKernels) {
  testing::EmulatedCudaRuntime emu;
  auto t = std::make_unique<Tensors>();
  absl::StatusOr<WgmmaForwardMaps> maps =
      EncodeWgmmaForwardMaps(emu.driver(), t->Params(), DType::kBF16, 128, 128);
  ASSERT_TRUE(maps.ok()) << maps.status();
  struct Want {
    const TensorMapBytes* map;
    const void* base;
    uint64_t heads, rows, box_rows;
  };
  for (const Want& w : {Want{&maps->q, t->q, 4, 300, 128}, Want{&maps->k, t->k, 2, 200, 128},
                        Want{&maps->v, t->v, 2, 200, 128}}) {
    hsap_emu::EmuTensorMap m;
    ASSERT_TRUE(hsap_emu::EmuDecodeTensorMap(w.map, m));
    EXPECT_EQ(m.rank, 3);
    EXPECT_EQ(m.dtype, static_cast<int>(TensorMapDataType::kBfloat16));
    EXPECT_EQ(m.swizzle, static_cast<int>(TensorMapSwizzle::k128B));
    EXPECT_EQ(m.oob_fill, static_cast<int>(TensorMapOobFill::kZero));
    EXPECT_EQ(m.address, reinterpret_cast<uint64_t>(w.base));
    EXPECT_EQ(m.dims[0], 128u);
    EXPECT_EQ(m.dims[1], w.heads);
    EXPECT_EQ(m.dims[2], w.rows);
    EXPECT_EQ(m.strides[1], 256u);               // one head: 128 elements
    EXPECT_EQ(m.strides[2], w.heads * 256u);     // one row: every head
    EXPECT_EQ(m.box[0], 64);                     // 128 bytes: the swizzle's span
    EXPECT_EQ(m.box[1], 1);
    EXPECT_EQ(m.box[2], w.box_rows);
  }
  // f16, and a key tile of 64 rows (head dim 256).
  absl::StatusOr<WgmmaForwardMaps> f16 =
      EncodeWgmmaForwardMaps(emu.driver(), t->Params(), DType::kF16, 64, 64);
  ASSERT_TRUE(f16.ok()) << f16.status();
  hsap_emu::EmuTensorMap m;
  ASSERT_TRUE(hsap_emu::EmuDecodeTensorMap(&f16->k, m));
  EXPECT_EQ(m.dtype, static_cast<int>(TensorMapDataType::kFloat16));
  EXPECT_EQ(m.box[2], 64);
}

TEST(WgmmaTensorMaps, RefusalsNameTheArgument) {
  testing::EmulatedCudaRuntime emu;
  auto t = std::make_unique<Tensors>();
  auto encode = [&](hsap_dev::FwdParams p, DType dtype, int d, int bn) {
    return EncodeWgmmaForwardMaps(emu.driver(), p, dtype, d, bn).status();
  };
  const hsap_dev::FwdParams good = t->Params();
  EXPECT_THAT(encode(good, DType::kF32, 128, 128).message(), HasSubstr("dtype"));
  EXPECT_THAT(encode(good, DType::kBF16, 96, 128).message(), HasSubstr("head dim 96"));
  EXPECT_THAT(encode(good, DType::kBF16, 128, 512).message(), HasSubstr("key tile"));
  hsap_dev::FwdParams p = good;
  p.k = reinterpret_cast<const char*>(t->k) + 2;  // not 16-byte aligned
  absl::Status s = encode(p, DType::kBF16, 128, 128);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor map of k"));
  p = good;
  p.q_rows = 1LL << 31;
  s = encode(p, DType::kBF16, 128, 128);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("q has 2147483648 rows"));
}

// The sm_90a backward's maps (hsap_attention_wgmma_bwd.cuh): all four in boxes of the rows
// given (the kernel's WgmmaBwdBoxRows: 16 for its 48-row tiles at head dim 128); its refusals
// name the argument too.
TEST(WgmmaTensorMaps, BackwardGeometryIsTheKernels) {
  testing::EmulatedCudaRuntime emu;
  auto t = std::make_unique<Tensors>();
  auto dout = std::make_unique<Tensors>();
  const hsap_dev::FwdParams f = t->Params();
  hsap_dev::BwdParams p{};
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.dout = dout->q;
  p.q_rows = f.q_rows;
  p.k_rows = f.k_rows;
  p.heads_q = f.heads_q;
  p.heads_kv = f.heads_kv;
  absl::StatusOr<WgmmaBackwardMaps> maps =
      EncodeWgmmaBackwardMaps(emu.driver(), p, DType::kF16, 128, 16);
  ASSERT_TRUE(maps.ok()) << maps.status();
  struct Want {
    const TensorMapBytes* map;
    const void* base;
    uint64_t heads, rows, box_rows;
  };
  for (const Want& w : {Want{&maps->q, t->q, 4, 300, 16}, Want{&maps->k, t->k, 2, 200, 16},
                        Want{&maps->v, t->v, 2, 200, 16}, Want{&maps->dout, dout->q, 4, 300, 16}}) {
    hsap_emu::EmuTensorMap m;
    ASSERT_TRUE(hsap_emu::EmuDecodeTensorMap(w.map, m));
    EXPECT_EQ(m.dtype, static_cast<int>(TensorMapDataType::kFloat16));
    EXPECT_EQ(m.swizzle, static_cast<int>(TensorMapSwizzle::k128B));
    EXPECT_EQ(m.address, reinterpret_cast<uint64_t>(w.base));
    EXPECT_EQ(m.dims[1], w.heads);
    EXPECT_EQ(m.dims[2], w.rows);
    EXPECT_EQ(m.box[0], 64);
    EXPECT_EQ(m.box[2], w.box_rows);
  }
  auto encode = [&](hsap_dev::BwdParams bp, DType dtype, int d, int bm) {
    return EncodeWgmmaBackwardMaps(emu.driver(), bp, dtype, d, bm).status();
  };
  EXPECT_THAT(encode(p, DType::kF32, 128, 64).message(), HasSubstr("dtype"));
  EXPECT_THAT(encode(p, DType::kBF16, 256, 64).message(), HasSubstr("head dim 256"));
  EXPECT_THAT(encode(p, DType::kBF16, 128, 8).message(), HasSubstr("TMA box tile of 8 rows"));
  hsap_dev::BwdParams bad = p;
  bad.dout = reinterpret_cast<const char*>(dout->q) + 2;
  const absl::Status s = encode(bad, DType::kBF16, 128, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("sm_90a backward, tensor map of dout"));
}

TEST(JitArchForDevice, Sm90aOnComputeCapability90WhenHsapJitSm90aIsOn) {
  jit::CudaKernelConfig c;
  c.dtype = DType::kBF16;
  c.head_dim = 128;
  {
    testing::ScopedEnv on("HSAP_JIT_SM90A", "1");
    EXPECT_EQ(*JitArchForDevice("sm_90", c), "sm_90a");
    EXPECT_EQ(*JitArchForDevice("sm_80", c), "sm_80");
  }
  {
    testing::ScopedEnv unset("HSAP_JIT_SM90A", nullptr);  // opt-in until it has run on a GPU
    EXPECT_EQ(*JitArchForDevice("sm_90", c), "sm_90");
  }
  {
    testing::ScopedEnv off("HSAP_JIT_SM90A", "0");
    EXPECT_EQ(*JitArchForDevice("sm_90", c), "sm_90");
  }
  {
    testing::ScopedEnv bad("HSAP_JIT_SM90A", "maybe");
    absl::StatusOr<std::string> arch = JitArchForDevice("sm_90", c);
    EXPECT_EQ(arch.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(arch.status().message(), HasSubstr("HSAP_JIT_SM90A"));
  }
}

// Kernels that launch nothing and say which work-list blocks their forward was built for.
class TileKernels : public DeviceKernels {
 public:
  explicit TileKernels(int64_t rows) : rows_(rows) {}
  int64_t forward_block_rows() const override { return rows_; }
  absl::Status Forward(const hsap_dev::FwdParams&, cudaStream) const override { return No(); }
  absl::Status Backward(const hsap_dev::BwdParams&, cudaStream) const override { return No(); }
  absl::Status Delta(const hsap_dev::DeltaParams&, cudaStream) const override { return No(); }
  absl::Status Init(const hsap_dev::InitParams&, cudaStream) const override { return No(); }
  absl::Status Convert(const hsap_dev::ConvertParams&, cudaStream) const override { return No(); }
  absl::Status Accumulate(const hsap_dev::AccumulateParams&, cudaStream) const override {
    return No();
  }
  absl::Status CopyChunks(const hsap_dev::ChunksParams&, cudaStream) const override {
    return No();
  }
  absl::Status AddChunks(const hsap_dev::ChunksParams&, cudaStream) const override {
    return No();
  }

 private:
  static absl::Status No() { return absl::UnimplementedError("no launches here"); }
  int64_t rows_;
};

TEST(GpuRunners, WorkListBlocksFollowTheForwardsTile) {
  EXPECT_EQ(NewGpuRunners(nullptr, std::make_shared<const TileKernels>(128))->WorkBlockRows(),
            128);
  EXPECT_EQ(NewGpuRunners(nullptr, std::make_shared<const TileKernels>(0))->WorkBlockRows(),
            kKernelBlockQ);
}

}  // namespace
}  // namespace hsap::cuda
