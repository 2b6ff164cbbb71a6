// EncodeTiledTensorMap (lib/cuda/runtime/tensor_map.h): every documented requirement of
// cuTensorMapEncodeTiled refused with a message naming the field, valid specs encoded through
// the emulated driver (tests/support/emulated_cuda_runtime.h) into the fields they describe,
// the library's checks and the emulated driver's (written separately from the same
// documentation) agreeing on every case, and the box size that a copy completes.
#include "lib/cuda/runtime/tensor_map.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/emulated_cuda_runtime.h"
#include "tests/support/emulated_tensor_map.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::EmulatedCudaRuntime;
using ::testing::HasSubstr;

alignas(256) uint16_t g_tensor[64 * 1024];

// A 3d bf16 tensor [heads 4][rows 100][d 128] seen as (d, rows, heads), one 64 x 32 box.
TiledTensorMapSpec Valid() {
  TiledTensorMapSpec s;
  s.dtype = TensorMapDataType::kBfloat16;
  s.global_address = g_tensor;
  s.global_dims = {128, 100, 4};
  s.global_strides = {256, 256 * 100};
  s.box_dims = {64, 32, 1};
  s.swizzle = TensorMapSwizzle::k128B;
  return s;
}

struct Broken {
  const char* what;
  std::function<void(TiledTensorMapSpec&)> change;
  const char* field;  // named in the message
};

std::vector<Broken> BrokenSpecs() {
  return {
      {"rank 0", [](auto& s) { s.global_dims.clear(); }, "global_dims"},
      {"rank 6",
       [](auto& s) {
         s.global_dims = {8, 2, 2, 2, 2, 2};
         s.global_strides = {16, 32, 64, 128, 256};
         s.box_dims = {8, 1, 1, 1, 1, 1};
       },
       "global_dims"},
      {"missing stride", [](auto& s) { s.global_strides.pop_back(); }, "global_strides"},
      {"missing box", [](auto& s) { s.box_dims.pop_back(); }, "box_dims"},
      {"steps for another rank",
       [](auto& s) {
         s.element_strides = {1, 1};
       },
       "element_strides"},
      {"null address", [](auto& s) { s.global_address = nullptr; }, "global_address"},
      {"misaligned address", [](auto& s) { s.global_address = g_tensor + 4; }, "global_address"},
      {"empty dimension", [](auto& s) { s.global_dims[1] = 0; }, "global_dims[1]"},
      {"dimension past 2^32", [](auto& s) { s.global_dims[2] = (uint64_t{1} << 32) + 1; },
       "global_dims[2]"},
      {"stride not a multiple of 16", [](auto& s) { s.global_strides[0] = 250; },
       "global_strides[0]"},
      {"stride 2^40", [](auto& s) { s.global_strides[1] = uint64_t{1} << 40; },
       "global_strides[1]"},
      {"empty box", [](auto& s) { s.box_dims[1] = 0; }, "box_dims[1]"},
      {"box 257", [](auto& s) { s.box_dims[1] = 257; }, "box_dims[1]"},
      {"inner box of 20 bytes",
       [](auto& s) {
         s.box_dims[0] = 10;
         s.swizzle = TensorMapSwizzle::kNone;
       },
       "box_dims[0]"},
      {"step 0",
       [](auto& s) {
         s.element_strides = {1, 0, 1};
       },
       "element_strides[1]"},
      {"step 9",
       [](auto& s) {
         s.element_strides = {1, 1, 9};
       },
       "element_strides[2]"},
      {"128B swizzle, 256-byte rows", [](auto& s) { s.box_dims[0] = 128; }, "box_dims[0]"},
      {"64B swizzle, 128-byte rows", [](auto& s) { s.swizzle = TensorMapSwizzle::k64B; },
       "box_dims[0]"},
      {"32B swizzle, 64-byte rows",
       [](auto& s) {
         s.swizzle = TensorMapSwizzle::k32B;
         s.box_dims[0] = 32;
       },
       "box_dims[0]"},
      {"swizzle value 4", [](auto& s) { s.swizzle = static_cast<TensorMapSwizzle>(4); }, "swizzle"},
      {"L2 promotion value 4",
       [](auto& s) { s.l2_promotion = static_cast<TensorMapL2Promotion>(4); }, "l2_promotion"},
      {"NaN fill of integers",
       [](auto& s) {
         s.dtype = TensorMapDataType::kUint16;
         s.oob_fill = TensorMapOobFill::kNanRequestZeroFma;
       },
       "oob_fill"},
      {"element type 13", [](auto& s) { s.dtype = static_cast<TensorMapDataType>(13); }, "dtype"},
  };
}

TEST(ValidateTiledTensorMapSpec, RefusesEachDocumentedRuleWithTheField) {
  ASSERT_TRUE(ValidateTiledTensorMapSpec(Valid()).ok());
  for (const Broken& b : BrokenSpecs()) {
    TiledTensorMapSpec s = Valid();
    b.change(s);
    const absl::Status st = ValidateTiledTensorMapSpec(s);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b.what;
    EXPECT_THAT(st.message(), HasSubstr(absl::StrCat("TiledTensorMapSpec.", b.field, ":")))
        << b.what;
    EXPECT_THAT(st.message(), HasSubstr("(cuTensorMapEncodeTiled); ")) << b.what;
  }
}

TEST(ValidateTiledTensorMapSpec, AcceptsTheLimits) {
  TiledTensorMapSpec s = Valid();
  s.global_dims = {uint64_t{1} << 32, 1, 1};
  s.global_strides = {(uint64_t{1} << 40) - 16, 16};
  s.box_dims = {64, 256, 1};
  s.element_strides = {1, 8, 1};
  s.oob_fill = TensorMapOobFill::kNanRequestZeroFma;
  s.l2_promotion = TensorMapL2Promotion::k256B;
  EXPECT_TRUE(ValidateTiledTensorMapSpec(s).ok()) << ValidateTiledTensorMapSpec(s);
  TiledTensorMapSpec one = Valid();  // rank 1: no strides
  one.global_dims = {1000};
  one.global_strides = {};
  one.box_dims = {256};
  one.swizzle = TensorMapSwizzle::kNone;
  EXPECT_TRUE(ValidateTiledTensorMapSpec(one).ok()) << ValidateTiledTensorMapSpec(one);
}

TEST(TensorMapBoxBytes, IsTheBoxesElementsTimesTheirSize) {
  EXPECT_EQ(TensorMapBoxBytes(Valid()), 64u * 32u * 2u);
  TiledTensorMapSpec s = Valid();
  s.dtype = TensorMapDataType::kFloat32;
  s.box_dims = {32, 30, 3};
  s.element_strides = {4, 4, 2};  // dimension 0's step is ignored; ceil(30/4) = 8, ceil(3/2) = 2
  EXPECT_EQ(TensorMapBoxBytes(s), 32u * 8u * 2u * 4u);
}

// Through the emulated driver: the map holds the spec's fields (the emulator's layout), and
// every spec the library refuses, the driver's own checks refuse too.
TEST(EncodeTiledTensorMap, EncodesThroughTheDriverAndAgreesWithItsRefusals) {
  EmulatedCudaRuntime emu;
  absl::StatusOr<TensorMapBytes> m = EncodeTiledTensorMap(emu.driver(), Valid());
  ASSERT_TRUE(m.ok()) << m.status();
  hsap_emu::EmuTensorMap f;
  ASSERT_TRUE(hsap_emu::EmuDecodeTensorMap(&*m, f));
  EXPECT_EQ(f.dtype, 9);
  EXPECT_EQ(f.rank, 3);
  EXPECT_EQ(f.swizzle, 3);
  EXPECT_EQ(f.address, reinterpret_cast<uint64_t>(g_tensor));
  EXPECT_EQ(f.dims[0], 128u);
  EXPECT_EQ(f.dims[2], 4u);
  EXPECT_EQ(f.strides[1], 256u);
  EXPECT_EQ(f.strides[2], 25600u);
  EXPECT_EQ(f.box[0], 64);
  EXPECT_EQ(f.box[1], 32);
  for (const Broken& b : BrokenSpecs()) {
    TiledTensorMapSpec s = Valid();
    b.change(s);
    if (s.global_dims.size() != s.box_dims.size() ||
        s.global_strides.size() + 1 != s.global_dims.size() ||
        (!s.element_strides.empty() && s.element_strides.size() != s.box_dims.size())) {
      continue;  // array lengths: the C call cannot express the mismatch
    }
    // A null address is aligned: the documentation gives no rule the driver would refuse it
    // by; the library refuses it as a missing tensor.
    if (s.global_address == nullptr) continue;
    std::vector<unsigned long long> dims(s.global_dims.begin(), s.global_dims.end());
    std::vector<unsigned long long> strides(s.global_strides.begin(), s.global_strides.end());
    std::vector<unsigned> box(s.box_dims.begin(), s.box_dims.end());
    std::vector<unsigned> steps(s.global_dims.size(), 1);
    if (!s.element_strides.empty())
      steps.assign(s.element_strides.begin(), s.element_strides.end());
    TensorMapBytes raw;
    const CUresult r = emu.driver().TensorMapEncodeTiled(
        &raw, static_cast<int>(s.dtype), static_cast<unsigned>(dims.size()),
        const_cast<void*>(s.global_address), dims.data(), strides.data(), box.data(), steps.data(),
        0, static_cast<int>(s.swizzle), static_cast<int>(s.l2_promotion),
        static_cast<int>(s.oob_fill));
    EXPECT_NE(r, 0) << b.what << ": the emulated driver accepts what the library refuses";
    EXPECT_FALSE(EncodeTiledTensorMap(emu.driver(), s).ok()) << b.what;
  }
}

TEST(EncodeTiledTensorMap, ADriverWithoutTheEntryPointIsUnimplemented) {
  EmulatedCudaRuntime emu;
  CudaDriverApi old = emu.driver();
  old.TensorMapEncodeTiled = nullptr;
  absl::StatusOr<TensorMapBytes> m = EncodeTiledTensorMap(old, Valid());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(m.status().message(), HasSubstr("CUDA 12.0 or newer driver"));
  // A bad spec is still named before the driver is needed.
  TiledTensorMapSpec bad = Valid();
  bad.box_dims[1] = 0;
  EXPECT_EQ(EncodeTiledTensorMap(old, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorMapDataTypeOf, MapsTheStorageTypes) {
  EXPECT_EQ(TensorMapDataTypeOf(DType::kBF16), TensorMapDataType::kBfloat16);
  EXPECT_EQ(TensorMapDataTypeOf(DType::kF16), TensorMapDataType::kFloat16);
  EXPECT_EQ(TensorMapDataTypeOf(DType::kF32), TensorMapDataType::kFloat32);
  EXPECT_EQ(TensorMapElementBytes(TensorMapDataType::kFloat64), 8);
  EXPECT_EQ(TensorMapElementBytes(TensorMapDataType::kUint8), 1);
}

}  // namespace
}  // namespace hsap::cuda
