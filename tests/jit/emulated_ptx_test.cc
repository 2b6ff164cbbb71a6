// The emulator's tensor-core instructions (tests/support/emulated_ptx.h), each against a
// plain computation on the host: mma against the matrix product, ldmatrix element by element,
// cp.async against plain copies with its group semantics, plus the faults and a 16x16x16
// GEMM tile kernel (cp.async + ldmatrix + mma) against the fp64 product under the rule.
// The kernels below build their fragments from the layouts stated in hsap_mma.cuh's comment,
// so these tests also hold that comment to the emulator.
// The emulator must come before the device code.
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_device.cuh"
#include "jit/device/hsap_mma.cuh"
// clang-format on

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attention/dtype.h"
#include "attention/tolerance.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

constexpr int kWarp = 32;

// 16-bit storage of bf16 or f16, 16-byte aligned like a cudaMalloc'd buffer.
struct alignas(16) Tile {
  uint16_t v[256] = {};
};

float Decode(uint16_t bits, DType t) {
  return t == DType::kBF16 ? BF16ToFloat(BF16{bits}) : F16ToFloat(F16{bits});
}
uint16_t Encode(float x, DType t) {
  return t == DType::kBF16 ? FloatToBF16(x).bits : FloatToF16(x).bits;
}
float RoundTo(float x, DType t) { return Decode(Encode(x, t), t); }

void FillRandom(std::mt19937_64& rng, DType t, uint16_t* bits, int n, float range) {
  std::uniform_real_distribution<float> u(-range, range);
  for (int i = 0; i < n; ++i) bits[i] = Encode(u(rng), t);
}

uint32_t Pair(uint16_t lo, uint16_t hi) { return uint32_t{lo} | (uint32_t{hi} << 16); }

absl::Status LaunchWarps(int warps, size_t smem_bytes, const std::function<void()>& kernel) {
  return hsap_emu::Launch(1, 1, warps * kWarp, smem_bytes, /*all_concurrent=*/false, kernel);
}

// ---- mma.m16n8k16 ----

struct MmaCase {
  DType dtype;
  uint64_t seed;
};

class MmaTest : public ::testing::TestWithParam<MmaCase> {};

// D = A * B + C with A 16x16 row-major, B 16x8 ([k][n]), C non-trivial; each lane's
// fragments built from hsap_mma.cuh's table. Equal bit for bit to the host product in the
// emulator's documented order (c, then k ascending, fp32), and within the rule of the fp64
// product. The accumulator is passed as both c and d (the usual in-place use) on one warp.
TEST_P(MmaTest, EqualsThePlainMatrixProduct) {
  const MmaCase p = GetParam();
  std::mt19937_64 rng(p.seed);
  uint16_t a[16][16], b[16][8];
  float c[16][8];
  FillRandom(rng, p.dtype, &a[0][0], 256, 2.0f);
  FillRandom(rng, p.dtype, &b[0][0], 128, 2.0f);
  std::uniform_real_distribution<float> uc(-8.0f, 8.0f);
  for (auto& row : c) {
    for (float& x : row) x = uc(rng);
  }
  float d[2][16][8] = {};  // [warp]: warp 0 separate c and d, warp 1 in place
  const bool bf16 = p.dtype == DType::kBF16;
  absl::Status s = LaunchWarps(2, 0, [&] {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int g = lane / 4, t = lane % 4;
    const unsigned fa[4] = {
        Pair(a[g][2 * t], a[g][2 * t + 1]), Pair(a[g + 8][2 * t], a[g + 8][2 * t + 1]),
        Pair(a[g][2 * t + 8], a[g][2 * t + 9]), Pair(a[g + 8][2 * t + 8], a[g + 8][2 * t + 9])};
    const unsigned fb[2] = {Pair(b[2 * t][g], b[2 * t + 1][g]),
                            Pair(b[2 * t + 8][g], b[2 * t + 9][g])};
    float acc[4] = {c[g][2 * t], c[g][2 * t + 1], c[g + 8][2 * t], c[g + 8][2 * t + 1]};
    float out[4];
    if (warp == 0) {
      if (bf16) {
        hsap_dev::mma_m16n8k16_bf16(out, fa, fb, acc);
      } else {
        hsap_dev::mma_m16n8k16_f16(out, fa, fb, acc);
      }
    } else {
      if (bf16) {
        hsap_dev::mma_m16n8k16_bf16(acc, fa, fb, acc);
      } else {
        hsap_dev::mma_m16n8k16_f16(acc, fa, fb, acc);
      }
      std::memcpy(out, acc, sizeof(out));
    }
    d[warp][g][2 * t] = out[0];
    d[warp][g][2 * t + 1] = out[1];
    d[warp][g + 8][2 * t] = out[2];
    d[warp][g + 8][2 * t + 1] = out[3];
  });
  ASSERT_TRUE(s.ok()) << s;

  double err = 0, naive_err = 0, magnitude = 0;
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      float plain = c[i][j];
      double exact = c[i][j];
      float naive = RoundTo(c[i][j], p.dtype);
      for (int k = 0; k < 16; ++k) {
        const float x = Decode(a[i][k], p.dtype), y = Decode(b[k][j], p.dtype);
        plain = plain + x * y;
        exact += static_cast<double>(x) * y;
        naive = RoundTo(naive + RoundTo(x * y, p.dtype), p.dtype);
      }
      for (int w = 0; w < 2; ++w) {
        EXPECT_EQ(d[w][i][j], plain) << "warp " << w << " D[" << i << "][" << j << "]";
        err = std::max(err, std::abs(d[w][i][j] - exact));
      }
      naive_err = std::max(naive_err, std::abs(naive - exact));
      magnitude = std::max(magnitude, std::abs(exact));
    }
  }
  EXPECT_LE(err, ToleranceBound(naive_err, magnitude, kKernelFloor))
      << "naive error " << naive_err << ", magnitude " << magnitude;
  EXPECT_LT(err, 1e-5 * std::max(1.0, magnitude));  // fp32 sums of exact products
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MmaTest,
                         ::testing::Values(MmaCase{DType::kBF16, 1}, MmaCase{DType::kBF16, 2},
                                           MmaCase{DType::kF16, 3}, MmaCase{DType::kF16, 4}),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param.dtype)) + "_seed" +
                                  std::to_string(info.param.seed);
                         });

// Many collectives back to back (ldmatrix then mma, 64 times, no other barrier between) on
// four warps: each instruction sees its own operands, never a later one's. The accumulator
// runs through every mma, so the result is checked bit for bit against the host's sums.
TEST(MmaSequenceTest, BackToBackInstructionsKeepTheirOperands) {
  constexpr int kSteps = 64, kWarps = 4;
  std::mt19937_64 rng(7);
  std::vector<Tile> a(kSteps);
  for (Tile& t : a) FillRandom(rng, DType::kBF16, t.v, 256, 1.0f);
  uint16_t b[16][8];
  FillRandom(rng, DType::kBF16, &b[0][0], 128, 1.0f);
  float d[kWarps][16][8] = {};
  absl::Status s = LaunchWarps(kWarps, kSteps * sizeof(Tile), [&] {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int g = lane / 4, t = lane % 4;
    auto* smem = reinterpret_cast<Tile*>(hsap_dev::dynamic_smem());
    for (int i = threadIdx.x; i < kSteps; i += kWarps * kWarp) smem[i] = a[i];
    __syncthreads();
    const unsigned fb[2] = {Pair(b[2 * t][g], b[2 * t + 1][g]),
                            Pair(b[2 * t + 8][g], b[2 * t + 9][g])};
    float acc[4] = {0, 0, 0, 0};
    for (int step = 0; step < kSteps; ++step) {
      // Warp w starts at a different tile, so neighbouring warps load different data.
      const Tile& tile = smem[(step + warp * 5) % kSteps];
      unsigned fa[4];
      hsap_dev::ldmatrix_x4(fa, tile.v + (lane % 16) * 16 + (lane / 16) * 8);
      hsap_dev::mma_m16n8k16_bf16(acc, fa, fb, acc);
    }
    d[warp][g][2 * t] = acc[0];
    d[warp][g][2 * t + 1] = acc[1];
    d[warp][g + 8][2 * t] = acc[2];
    d[warp][g + 8][2 * t + 1] = acc[3];
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int w = 0; w < kWarps; ++w) {
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 8; ++j) {
        float plain = 0;
        for (int step = 0; step < kSteps; ++step) {
          const Tile& tile = a[(step + w * 5) % kSteps];
          for (int k = 0; k < 16; ++k) {
            plain =
                plain + Decode(tile.v[i * 16 + k], DType::kBF16) * Decode(b[k][j], DType::kBF16);
          }
        }
        ASSERT_EQ(d[w][i][j], plain) << "warp " << w << " D[" << i << "][" << j << "]";
      }
    }
  }
}

// ---- ldmatrix ----

struct LdmatrixCase {
  int num;
  bool trans;
};

class LdmatrixTest : public ::testing::TestWithParam<LdmatrixCase> {};

// Rows of the matrices lie scattered in shared memory (matrices in reverse order, rows with
// a 48-byte stride and a gap), each given by its lane; lanes the instruction does not read
// give misaligned addresses, which must be ignored. Every element checked against the table.
TEST_P(LdmatrixTest, EveryLaneGetsItsElements) {
  const LdmatrixCase p = GetParam();
  constexpr int kRowStride = 24;  // elements: 48 bytes
  constexpr int kMatrixStride = 8 * kRowStride + 8;
  auto row_offset = [&](int m, int r) { return (3 - m) * kMatrixStride + r * kRowStride; };
  auto value = [](int m, int r, int c) {
    return static_cast<uint16_t>(0x1000 * (m + 1) + 16 * r + c);
  };
  unsigned got[kWarp][4] = {};
  absl::Status s = LaunchWarps(1, 4 * kMatrixStride * 2, [&] {
    const int lane = threadIdx.x;
    auto* smem = reinterpret_cast<uint16_t*>(hsap_dev::dynamic_smem());
    if (lane < 4) {
      for (int r = 0; r < 8; ++r) {
        for (int c = 0; c < 8; ++c) smem[row_offset(lane, r) + c] = value(lane, r, c);
      }
    }
    __syncthreads();
    const uint16_t* row =
        lane < 8 * p.num ? smem + row_offset(lane / 8, lane % 8) : smem + 1;  // misaligned, unused
    unsigned r1[1] = {}, r2[2] = {}, r4[4] = {};
    const unsigned* r = p.num == 1 ? r1 : p.num == 2 ? r2 : r4;
    if (p.num == 1) p.trans ? hsap_dev::ldmatrix_x1_trans(r1, row) : hsap_dev::ldmatrix_x1(r1, row);
    if (p.num == 2) p.trans ? hsap_dev::ldmatrix_x2_trans(r2, row) : hsap_dev::ldmatrix_x2(r2, row);
    if (p.num == 4) p.trans ? hsap_dev::ldmatrix_x4_trans(r4, row) : hsap_dev::ldmatrix_x4(r4, row);
    for (int m = 0; m < p.num; ++m) got[lane][m] = r[m];
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int lane = 0; lane < kWarp; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int m = 0; m < p.num; ++m) {
      const unsigned want = p.trans ? Pair(value(m, 2 * t, g), value(m, 2 * t + 1, g))
                                    : Pair(value(m, g, 2 * t), value(m, g, 2 * t + 1));
      EXPECT_EQ(got[lane][m], want) << "lane " << lane << " matrix " << m << std::hex << " got 0x"
                                    << got[lane][m] << " want 0x" << want;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LdmatrixTest,
                         ::testing::Values(LdmatrixCase{1, false}, LdmatrixCase{1, true},
                                           LdmatrixCase{2, false}, LdmatrixCase{2, true},
                                           LdmatrixCase{4, false}, LdmatrixCase{4, true}),
                         [](const auto& info) {
                           return "x" + std::to_string(info.param.num) +
                                  (info.param.trans ? "_trans" : "");
                         });

// ---- cp.async ----

// Each thread issues three groups of one 16-byte copy each (and one more it never commits)
// into slots preset to a sentinel, and looks at its slots after each step: nothing is
// visible before a wait (not even across __syncthreads), wait_group<N> completes all but the
// N most recent groups, uncommitted copies stay pending, and the copied bytes are the source's.
TEST(CpAsyncTest, GroupsCompleteOnlyAtTheWaitThatRequiresThem) {
  constexpr int kThreads = 64, kCopies = 4;
  std::vector<Tile> src(kCopies);
  for (int c = 0; c < kCopies; ++c) {
    for (int i = 0; i < 256; ++i) src[c].v[i] = static_cast<uint16_t>(0x100 * (c + 1) + i);
  }
  constexpr int kSteps = 5;  // issued+syncthreads, wait<2>, wait<1>, wait<0>, again wait<0>
  // seen[step][thread][copy]: the slot equals the source (1), is the sentinel (0), other (-1)
  std::vector<int> seen(kSteps * kThreads * kCopies, -2);
  absl::Status s = LaunchWarps(kThreads / kWarp, kThreads * kCopies * 16, [&] {
    const int tid = threadIdx.x;
    auto* smem = reinterpret_cast<unsigned char*>(hsap_dev::dynamic_smem());
    auto slot = [&](int c) { return smem + (tid * kCopies + c) * 16; };
    auto source = [&](int c) { return src[c].v + (tid % 32) * 8; };
    for (int c = 0; c < kCopies; ++c) std::memset(slot(c), 0xAB, 16);
    auto look = [&](int step) {
      for (int c = 0; c < kCopies; ++c) {
        unsigned char sentinel[16];
        std::memset(sentinel, 0xAB, 16);
        int v = -1;
        if (std::memcmp(slot(c), source(c), 16) == 0) v = 1;
        if (std::memcmp(slot(c), sentinel, 16) == 0) v = 0;
        seen[(step * kThreads + tid) * kCopies + c] = v;
      }
    };
    for (int c = 0; c < 3; ++c) {
      hsap_dev::cp_async_16(slot(c), source(c));
      hsap_dev::cp_async_commit();
    }
    hsap_dev::cp_async_16(slot(3), source(3));  // never committed
    __syncthreads();
    look(0);
    hsap_dev::cp_async_wait<2>();
    look(1);
    hsap_dev::cp_async_wait<1>();
    look(2);
    hsap_dev::cp_async_wait<0>();
    look(3);
    __syncthreads();
    hsap_dev::cp_async_wait<0>();
    look(4);
  });
  ASSERT_TRUE(s.ok()) << s;
  const int want[kSteps][kCopies] = {
      {0, 0, 0, 0}, {1, 0, 0, 0}, {1, 1, 0, 0}, {1, 1, 1, 0}, {1, 1, 1, 0}};
  for (int step = 0; step < kSteps; ++step) {
    for (int tid = 0; tid < kThreads; ++tid) {
      for (int c = 0; c < kCopies; ++c) {
        EXPECT_EQ(seen[(step * kThreads + tid) * kCopies + c], want[step][c])
            << "step " << step << " thread " << tid << " copy " << c;
      }
    }
  }
}

// An empty group counts as a group (pipelines commit one per stage even past the end), and
// a commit after the last copy makes a later wait<0> complete it.
TEST(CpAsyncTest, EmptyGroupsCountAndCommitPublishesPendingCopies) {
  Tile src;
  for (int i = 0; i < 256; ++i) src.v[i] = static_cast<uint16_t>(i * 7 + 1);
  std::vector<int> ok(kWarp * 3, -1);
  absl::Status s = LaunchWarps(1, kWarp * 16, [&] {
    const int lane = threadIdx.x;
    auto* slot = reinterpret_cast<unsigned char*>(hsap_dev::dynamic_smem()) + lane * 16;
    const uint16_t* from = src.v + lane * 8;
    hsap_dev::cp_async_16(slot, from);
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_commit();   // empty
    hsap_dev::cp_async_wait<1>();  // the copy's group is the older one: complete
    ok[lane * 3] = std::memcmp(slot, from, 16) == 0;
    std::memset(slot, 0, 16);
    hsap_dev::cp_async_16(slot, from);
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_wait<2>();  // two empty groups may stay pending: the copy is done
    ok[lane * 3 + 1] = std::memcmp(slot, from, 16) == 0;
    std::memset(slot, 0, 16);
    hsap_dev::cp_async_16(slot, from);
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_wait<1>();  // the empty group is the most recent: copy complete
    ok[lane * 3 + 2] = std::memcmp(slot, from, 16) == 0;
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int i = 0; i < kWarp * 3; ++i) EXPECT_EQ(ok[i], 1) << "lane " << i / 3 << " case " << i % 3;
}

// zfill with valid = false writes zeros and reads nothing (the source is a null pointer).
TEST(CpAsyncTest, ZfillWritesZerosWithoutReading) {
  Tile src;
  for (int i = 0; i < 256; ++i) src.v[i] = static_cast<uint16_t>(0x8000 | i);
  std::vector<uint16_t> got(kWarp * 8, 0xffff);
  absl::Status s = LaunchWarps(1, kWarp * 16, [&] {
    const int lane = threadIdx.x;
    auto* slot = reinterpret_cast<uint16_t*>(hsap_dev::dynamic_smem()) + lane * 8;
    for (int i = 0; i < 8; ++i) slot[i] = 0x5555;
    const bool valid = lane % 3 != 0;
    hsap_dev::cp_async_16_zfill(slot, valid ? src.v + lane * 8 : nullptr, valid);
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_wait<0>();
    for (int i = 0; i < 8; ++i) got[lane * 8 + i] = slot[i];
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int lane = 0; lane < kWarp; ++lane) {
    for (int i = 0; i < 8; ++i) {
      const uint16_t want = lane % 3 != 0 ? src.v[lane * 8 + i] : 0;
      EXPECT_EQ(got[lane * 8 + i], want) << "lane " << lane << " element " << i;
    }
  }
}

// The 4-byte form (cp.async.ca, cp-size 4): a word per copy, or zeros without reading.
TEST(CpAsyncTest, FourByteCopiesAndZfill) {
  float src[kWarp];
  for (int i = 0; i < kWarp; ++i) src[i] = 0.5f + static_cast<float>(i);
  std::vector<float> got(kWarp, -1.0f);
  absl::Status s = LaunchWarps(1, kWarp * 4, [&] {
    const int lane = threadIdx.x;
    float* slot = reinterpret_cast<float*>(hsap_dev::dynamic_smem()) + lane;
    *slot = 99.0f;
    const bool valid = lane % 4 != 1;
    hsap_dev::cp_async_4_zfill(slot, valid ? src + lane : nullptr, valid);
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_wait<0>();
    got[lane] = *slot;
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int lane = 0; lane < kWarp; ++lane) {
    EXPECT_EQ(got[lane], lane % 4 != 1 ? src[lane] : 0.0f) << "lane " << lane;
  }
}

// ---- faults ----

absl::Status RunWithBadAddress(const std::function<void(unsigned char* smem, int lane)>& body) {
  return LaunchWarps(1, 4096, [&] {
    body(reinterpret_cast<unsigned char*>(hsap_dev::dynamic_smem()), threadIdx.x);
  });
}

TEST(EmulatedPtxFaults, MisalignedOrNonSharedAddressesStopTheLaunch) {
  Tile global;
  struct Case {
    const char* name;
    std::function<void(unsigned char*, int)> body;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"ldmatrix misaligned row",
       [](unsigned char* smem, int lane) {
         unsigned r[4];
         hsap_dev::ldmatrix_x4(r, smem + lane * 16 + (lane == 13 ? 8 : 0));
       },
       "misaligned address: ldmatrix row address of lane 13"},
      {"ldmatrix trans misaligned row",
       [](unsigned char* smem, int lane) {
         unsigned r[2];
         hsap_dev::ldmatrix_x2_trans(r, smem + lane * 16 + (lane == 9 ? 2 : 0));
       },
       "misaligned address: ldmatrix row address of lane 9"},
      {"ldmatrix from global memory",
       [&](unsigned char* smem, int lane) {
         unsigned r[1];
         hsap_dev::ldmatrix_x1(r, global.v + (lane % 8) * 8);
       },
       "is not in shared memory"},
      {"cp.async misaligned destination",
       [&](unsigned char* smem, int lane) {
         hsap_dev::cp_async_16(smem + lane * 32 + (lane == 4 ? 4 : 0), global.v);
       },
       "misaligned address: cp.async"},
      {"cp.async misaligned source",
       [&](unsigned char* smem, int lane) {
         hsap_dev::cp_async_16(smem + lane * 16, global.v + (lane == 7 ? 1 : 0));
       },
       "misaligned address: cp.async"},
      {"cp.async zfill misaligned destination",
       [&](unsigned char* smem, int lane) {
         hsap_dev::cp_async_16_zfill(smem + lane * 16 + (lane == 2 ? 8 : 0), global.v, false);
       },
       "misaligned address: cp.async"},
      {"cp.async 4 bytes misaligned source",
       [&](unsigned char* smem, int lane) {
         hsap_dev::cp_async_4_zfill(
             smem + lane * 4, reinterpret_cast<unsigned char*>(global.v) + (lane == 3 ? 2 : 0),
             true);
       },
       "misaligned address: cp.async 4 bytes"},
      {"cp.async of 12 bytes",
       [&](unsigned char* smem, int lane) {
         hsap_emu_cp_async(smem + lane * 16, global.v, 12, true);
       },
       "the copy size is 4, 8 or 16"},
      {"cp.async into global memory",
       [&](unsigned char* smem, int lane) { hsap_dev::cp_async_16(global.v, global.v + 8); },
       "is not in shared memory"},
  };
  for (const Case& c : cases) {
    absl::Status s = RunWithBadAddress(c.body);
    ASSERT_FALSE(s.ok()) << c.name;
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.name;
  }
  // The same instructions with aligned shared addresses run.
  absl::Status fine = RunWithBadAddress([&](unsigned char* smem, int lane) {
    unsigned r[4];
    hsap_dev::ldmatrix_x4(r, smem + lane * 16);
    hsap_dev::cp_async_16(smem + 1024 + lane * 16, global.v + (lane % 16) * 8);
    hsap_dev::cp_async_commit();
    hsap_dev::cp_async_wait<0>();
  });
  EXPECT_TRUE(fine.ok()) << fine;
}

// .sync.aligned needs the whole warp: an exited lane or a lane at another instruction is a
// fault, never a hang.
TEST(EmulatedPtxFaults, MissingOrDivergedLanesFaultInsteadOfHanging) {
  const unsigned zero4[4] = {0, 0, 0, 0}, zero2[2] = {0, 0};
  const float c[4] = {0, 0, 0, 0};
  absl::Status exited = LaunchWarps(2, 1024, [&] {
    if (threadIdx.x == 37) return;  // lane 5 of warp 1
    float d[4];
    hsap_dev::mma_m16n8k16_bf16(d, zero4, zero2, c);
  });
  ASSERT_FALSE(exited.ok());
  EXPECT_THAT(exited.message(), HasSubstr("mma.m16n8k16.bf16.sync.aligned: lane 5 did not"));

  absl::Status exited_ld = LaunchWarps(1, 1024, [&] {
    if (threadIdx.x == 31) return;
    unsigned r[1];
    hsap_dev::ldmatrix_x1(
        r, reinterpret_cast<unsigned char*>(hsap_dev::dynamic_smem()) + (threadIdx.x % 8) * 16);
  });
  ASSERT_FALSE(exited_ld.ok());
  EXPECT_THAT(exited_ld.message(), HasSubstr("ldmatrix.x1.sync.aligned: lane 31 did not"));

  absl::Status diverged = LaunchWarps(1, 1024, [&] {
    float d[4];
    if (threadIdx.x == 3) {
      hsap_dev::mma_m16n8k16_f16(d, zero4, zero2, c);
    } else {
      hsap_dev::mma_m16n8k16_bf16(d, zero4, zero2, c);
    }
  });
  ASSERT_FALSE(diverged.ok());
  EXPECT_THAT(diverged.message(), HasSubstr("executed a different instruction"));
}

// ---- packing ----

TEST(PackTest, RoundsToNearestEvenWithLoInTheLowHalf) {
  const float values[] = {1.0f,           -2.5f,       3.14159f,    1e-30f,        65504.0f,
                          70000.0f,       1.00390625f, 1.01171875f, 1.0009765625f, -0.0f,
                          1.00048828125f, 3.0e-8f,     INFINITY,    -INFINITY};
  for (float lo : values) {
    for (float hi : values) {
      EXPECT_EQ(hsap_dev::pack_bf16x2(lo, hi), Pair(FloatToBF16(lo).bits, FloatToBF16(hi).bits))
          << lo << " " << hi;
      EXPECT_EQ(hsap_dev::pack_f16x2(lo, hi), Pair(FloatToF16(lo).bits, FloatToF16(hi).bits))
          << lo << " " << hi;
    }
  }
}

// ---- ex2.approx.ftz.f32 ----

// The ISA's table of special values, the flush of subnormal inputs and results, and 2^a
// within the instruction's 2 ulp of the fp64 value over the range the softmax uses.
TEST(Ex2ApproxTest, FollowsTheIsaOnSpecialValuesAndIsWithinTwoUlp) {
  const float kDenormMin = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(hsap_dev::ex2_approx(-INFINITY), 0.0f);
  EXPECT_FALSE(std::signbit(hsap_dev::ex2_approx(-INFINITY)));
  EXPECT_EQ(hsap_dev::ex2_approx(INFINITY), INFINITY);
  EXPECT_TRUE(std::isnan(hsap_dev::ex2_approx(NAN)));
  for (float one : {-kDenormMin, -0.0f, 0.0f, kDenormMin, 1e-39f}) {
    EXPECT_EQ(hsap_dev::ex2_approx(one), 1.0f) << one;
  }
  EXPECT_EQ(hsap_dev::ex2_approx(-127.5f), 0.0f);  // 2^-127.5 is subnormal: flushed
  EXPECT_EQ(hsap_dev::ex2_approx(-126.0f), std::numeric_limits<float>::min());
  EXPECT_EQ(hsap_dev::ex2_approx(128.0f), INFINITY);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> a(-126.0f, 127.0f);
  for (int i = 0; i < 10000; ++i) {
    const float x = a(rng);
    const double want = std::exp2(static_cast<double>(x));
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    EXPECT_LE(std::abs(hsap_dev::ex2_approx(x) - want), 2 * ulp) << x;
  }
}

// ---- a GEMM tile: cp.async + ldmatrix + mma ----

// D (16x16) = A (16x16, row-major) * B (16x16, row-major K x N) by one warp: both tiles
// staged through cp.async, A's fragment by ldmatrix.x4, B's two 8-column halves by
// ldmatrix.x2.trans, two mma. Within the rule of the fp64 product.
class GemmTileTest : public ::testing::TestWithParam<DType> {};

TEST_P(GemmTileTest, MatchesTheFp64Product) {
  const DType dtype = GetParam();
  const bool bf16 = dtype == DType::kBF16;
  for (uint64_t seed : {11u, 12u, 13u}) {
    std::mt19937_64 rng(seed);
    Tile a, b;
    FillRandom(rng, dtype, a.v, 256, 1.0f);
    FillRandom(rng, dtype, b.v, 256, 1.0f);
    float d[16][16] = {};
    absl::Status s = LaunchWarps(1, 1024, [&] {
      const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
      auto* smem = reinterpret_cast<uint16_t*>(hsap_dev::dynamic_smem());
      uint16_t* sa = smem;        // 16 rows of 16 elements
      uint16_t* sb = smem + 256;  // 16 rows (k) of 16 elements (n)
      hsap_dev::cp_async_16(sa + lane * 8, a.v + lane * 8);
      hsap_dev::cp_async_16(sb + lane * 8, b.v + lane * 8);
      hsap_dev::cp_async_commit();
      hsap_dev::cp_async_wait<0>();
      __syncwarp();
      unsigned fa[4];
      hsap_dev::ldmatrix_x4(fa, sa + (lane % 16) * 16 + (lane / 16) * 8);
      for (int nb = 0; nb < 2; ++nb) {
        unsigned fb[2];
        hsap_dev::ldmatrix_x2_trans(fb, sb + (lane % 16) * 16 + nb * 8);
        float acc[4] = {0, 0, 0, 0};
        if (bf16) {
          hsap_dev::mma_m16n8k16_bf16(acc, fa, fb, acc);
        } else {
          hsap_dev::mma_m16n8k16_f16(acc, fa, fb, acc);
        }
        d[g][nb * 8 + 2 * t] = acc[0];
        d[g][nb * 8 + 2 * t + 1] = acc[1];
        d[g + 8][nb * 8 + 2 * t] = acc[2];
        d[g + 8][nb * 8 + 2 * t + 1] = acc[3];
      }
    });
    ASSERT_TRUE(s.ok()) << s;
    double err = 0, naive_err = 0, magnitude = 0;
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 16; ++j) {
        double exact = 0;
        float naive = 0;
        for (int k = 0; k < 16; ++k) {
          const float x = Decode(a.v[i * 16 + k], dtype), y = Decode(b.v[k * 16 + j], dtype);
          exact += static_cast<double>(x) * y;
          naive = RoundTo(naive + RoundTo(x * y, dtype), dtype);
        }
        err = std::max(err, std::abs(d[i][j] - exact));
        naive_err = std::max(naive_err, std::abs(naive - exact));
        magnitude = std::max(magnitude, std::abs(exact));
      }
    }
    EXPECT_LE(err, ToleranceBound(naive_err, magnitude, kKernelFloor))
        << "seed " << seed << ": error " << err << ", naive error " << naive_err;
    EXPECT_GT(naive_err, 0.0) << "the rule's naive error must not be trivially zero";
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GemmTileTest, ::testing::Values(DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace hsap
