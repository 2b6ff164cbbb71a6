// The emulator's sm_90a warpgroup instructions (tests/support/emulated_wgmma.h) through
// jit/device/hsap_wgmma.cuh, each against a plain computation on the host:
//   - wgmma.mma_async m64nNk16 for every swizzle mode of A and B, B K-major and N-major
//     (imm-trans-b), A from shared memory (SS) and from registers (RS), N = 16 .. 256, bf16
//     and f16, with and without scale-d: D equal bit for bit to the host product in the
//     emulator's documented order, and within the tolerance rule of the fp64 product. The
//     operands are placed in shared memory by the test from the PTX ISA's table of canonical
//     layouts (CuTe shapes and strides, "Asynchronous Warpgroup Level Matrix Shared Memory
//     Layout: Canonical Layouts") and the swizzle of emulated_swizzle.h, with padded
//     leading / stride byte offsets, junk around the operands, and K-major slices that start
//     inside a swizzled row (the descriptor start advanced by 32 bytes per k step);
//   - the asynchronous semantics: accumulators in flight (NaN) until the wait that covers
//     them, groups and wait_group counts, operations in flight on the same accumulators;
//   - the faults where the ISA leaves behaviour undefined or the hardware refuses.
// The kernels below read the accumulators through hsap_wgmma.cuh's stated layout, so these
// tests also hold that comment to the emulator.
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_device.cuh"
#include "jit/device/hsap_wgmma.cuh"
// clang-format on

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attention/dtype.h"
#include "attention/tolerance.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/emulated_swizzle.h"

namespace hsap {
namespace {

using hsap_emu::SwizzleMode;
using ::testing::HasSubstr;

uint16_t Encode(float x, bool bf16) { return bf16 ? FloatToBF16(x).bits : FloatToF16(x).bits; }
float Decode(uint16_t bits, bool bf16) {
  return bf16 ? BF16ToFloat(BF16{bits}) : F16ToFloat(F16{bits});
}
uint32_t Pair(uint16_t lo, uint16_t hi) { return uint32_t{lo} | (uint32_t{hi} << 16); }

int WgmmaField(SwizzleMode m) {
  switch (m) {
    case SwizzleMode::kNone:
      return hsap_dev::kSwizzleNone;
    case SwizzleMode::k32B:
      return hsap_dev::kSwizzle32B;
    case SwizzleMode::k64B:
      return hsap_dev::kSwizzle64B;
    case SwizzleMode::k128B:
      return hsap_dev::kSwizzle128B;
  }
  return -1;
}

// An operand of `rows` x 16 (rows along M or N, K = 16 columns) placed in shared memory by
// the ISA's canonical layout table, in elements (T = 8 16-bit elements = 16 bytes; x = S / 16
// for a swizzle of span S; LBO and SBO in elements):
//   K-major,  none:     ((8,m),(T,2k)) : ((1T,SBO),(1,LBO))
//   K-major,  swizzled: ((8,m),(T,2k)) : ((xT,SBO),(1,T))
//   MN-major, none:     ((T,1,m),(8,k)) : ((1,T,SBO),(1T,LBO))
//   MN-major, swizzled: ((T,x,m),(8,k)) : ((1,T,LBO),(xT,SBO))
// (a coordinate splits over a mode's shape first-index-fastest), then the swizzle on the byte
// address. K-major swizzled operands are column slice `k_slice` of a tile S bytes wide (the
// descriptor starts 32 * k_slice bytes in).
struct Placement {
  SwizzleMode mode = SwizzleMode::kNone;
  bool mn_major = false;
  int rows = 64;
  uint32_t base = 0;  // the tile's shared offset (a multiple of 1024)
  uint32_t lbo = 0, sbo = 0;  // bytes
  int k_slice = 0;

  uint32_t Start() const { return base + (mn_major ? 0 : 32u * k_slice); }
  // The swizzled byte offset of operand element (mn, k).
  uint32_t Offset(int mn, int k) const {
    constexpr uint32_t T = 8;
    const uint32_t x = hsap_emu::SwizzleSpanBytes(mode) / 16, L = lbo / 2, S = sbo / 2;
    const uint32_t m = static_cast<uint32_t>(mn);
    uint32_t elems;
    if (!mn_major) {
      const uint32_t c = static_cast<uint32_t>(k + 16 * k_slice);  // column in the tile
      elems = mode == SwizzleMode::kNone ? (m % 8) * T + (m / 8) * S + (c % T) + (c / T) * L
                                         : (m % 8) * x * T + (m / 8) * S + (c % T) + (c / T) * T;
    } else {
      const uint32_t kk = static_cast<uint32_t>(k);
      elems = mode == SwizzleMode::kNone
                  ? (m % T) + (m / T) * S + (kk % 8) * T + (kk / 8) * L
                  : (m % T) + ((m / T) % x) * T + (m / (T * x)) * L + (kk % 8) * x * T +
                        (kk / 8) * S;
    }
    return hsap_emu::SwizzleSharedOffset(base + 2 * elems, mode);
  }
  // The bytes the layout spans from `base` (for the junk fill and the shared memory size).
  uint32_t Extent() const {
    uint32_t last = 0;
    for (int mn = 0; mn < rows; ++mn) {
      for (int k = 0; k < 16; ++k) last = std::max(last, Offset(mn, k));
    }
    const uint32_t repeat = hsap_emu::SwizzleRepeatBytes(mode);
    return (last - base + 2 + repeat - 1) / repeat * repeat;
  }
};

// A placement for each mode, with padded offsets (the descriptor's fields must carry them).
Placement MakePlacement(SwizzleMode mode, bool mn_major, int rows, uint32_t base, bool padded) {
  Placement p;
  p.mode = mode, p.mn_major = mn_major, p.rows = rows, p.base = base;
  const uint32_t span = hsap_emu::SwizzleSpanBytes(mode), atom = 8 * span;
  const uint32_t groups = static_cast<uint32_t>(rows) / 8;
  if (!mn_major) {
    if (mode == SwizzleMode::kNone) {  // core matrices of 8 rows x 16 bytes
      p.sbo = 128;
      p.lbo = groups * 128 + (padded ? 48 : 0);
    } else {
      p.sbo = padded ? 2 * atom : atom;
      p.lbo = 16;  // unused by the layout
      p.k_slice = static_cast<int>(span / 32) - 1;
    }
  } else if (mode == SwizzleMode::kNone) {
    p.sbo = 128;
    p.lbo = groups * 128 + (padded ? 32 : 0);
  } else {
    p.sbo = atom;                              // the second 8 rows of K
    p.lbo = (padded ? 3 : 2) * atom;           // the next S bytes of N
  }
  return p;
}

struct Operands {
  bool bf16 = true;
  int n = 64;
  std::vector<uint16_t> a;  // [64][16]
  std::vector<uint16_t> b;  // [16][n]
  std::vector<float> c;     // [64][n]
};

Operands RandomOperands(std::mt19937_64& rng, bool bf16, int n) {
  Operands o;
  o.bf16 = bf16, o.n = n;
  std::uniform_real_distribution<float> u(-2.0f, 2.0f), uc(-8.0f, 8.0f);
  for (int i = 0; i < 64 * 16; ++i) o.a.push_back(Encode(u(rng), bf16));
  for (int i = 0; i < 16 * n; ++i) o.b.push_back(Encode(u(rng), bf16));
  for (int i = 0; i < 64 * n; ++i) o.c.push_back(uc(rng));
  return o;
}

// Writes the (offset, bits) list into the CTA's shared memory (thread 0) and meets the CTA.
void WriteShared(const std::vector<std::pair<uint32_t, uint16_t>>& bytes) {
  if (threadIdx.x == 0) {
    unsigned char* smem = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
    for (const auto& [at, bits] : bytes) std::memcpy(smem + at, &bits, 2);
  }
  __syncthreads();
}

// (row, col) of accumulator register i of warpgroup thread t, from hsap_wgmma.cuh's comment.
void DPosition(int t, int i, int& row, int& col) {
  const int w = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
  row = 16 * w + g + 8 * ((i % 4) / 2);
  col = 8 * (i / 4) + 2 * q + (i % 2);
}

// The A fragment of warpgroup thread t (hsap_wgmma.cuh's comment: mma.m16n8k16's A per warp).
void AFragment(const std::vector<uint16_t>& a, int t, unsigned (&frag)[4]) {
  const int w = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
  auto at = [&](int r, int c) { return a[static_cast<size_t>(16 * w + r) * 16 + c]; };
  frag[0] = Pair(at(g, 2 * q), at(g, 2 * q + 1));
  frag[1] = Pair(at(g + 8, 2 * q), at(g + 8, 2 * q + 1));
  frag[2] = Pair(at(g, 2 * q + 8), at(g, 2 * q + 9));
  frag[3] = Pair(at(g + 8, 2 * q + 8), at(g + 8, 2 * q + 9));
}

template <int N>
void IssueMma(bool bf16, bool trans_b, bool rs, float (&d)[N / 2], const unsigned (&a)[4],
              uint64_t a_desc, uint64_t b_desc, bool accumulate) {
  using namespace hsap_dev;
  if (rs) {
    if (bf16 && trans_b) wgmma_m64k16_rs<N, true, true>(d, a, b_desc, accumulate);
    if (bf16 && !trans_b) wgmma_m64k16_rs<N, true, false>(d, a, b_desc, accumulate);
    if (!bf16 && trans_b) wgmma_m64k16_rs<N, false, true>(d, a, b_desc, accumulate);
    if (!bf16 && !trans_b) wgmma_m64k16_rs<N, false, false>(d, a, b_desc, accumulate);
  } else {
    if (bf16 && trans_b) wgmma_m64k16_ss<N, true, true>(d, a_desc, b_desc, accumulate);
    if (bf16 && !trans_b) wgmma_m64k16_ss<N, true, false>(d, a_desc, b_desc, accumulate);
    if (!bf16 && trans_b) wgmma_m64k16_ss<N, false, true>(d, a_desc, b_desc, accumulate);
    if (!bf16 && !trans_b) wgmma_m64k16_ss<N, false, false>(d, a_desc, b_desc, accumulate);
  }
}

struct MmaCase {
  int n;
  bool bf16, trans_b, rs, accumulate;
  SwizzleMode a_mode, b_mode;
  bool padded;
};

std::string CaseName(const MmaCase& c) {
  return absl::StrCat("n", c.n, c.bf16 ? "_bf16" : "_f16", c.trans_b ? "_transB" : "",
                      c.rs ? "_RS" : "_SS", c.accumulate ? "_acc" : "",
                      "_A", hsap_emu::SwizzleName(c.a_mode), "_B",
                      hsap_emu::SwizzleName(c.b_mode), c.padded ? "_padded" : "");
}

// Runs one wgmma of case `c` on one warpgroup and returns D [64][n].
template <int N>
absl::Status RunMma(const MmaCase& c, const Operands& o, std::mt19937_64& rng,
                    std::vector<float>& d_out) {
  constexpr uint32_t kBBase = 32 * 1024;
  const Placement pa = MakePlacement(c.a_mode, false, 64, 0, c.padded);
  const Placement pb = MakePlacement(c.b_mode, c.trans_b, N, kBBase, !c.padded);
  EXPECT_LE(pa.Extent(), kBBase);
  const size_t smem = kBBase + pb.Extent();
  // Junk everywhere, then the operands.
  std::vector<std::pair<uint32_t, uint16_t>> bytes;
  std::uniform_int_distribution<int> junk(0, 0xffff);
  for (uint32_t at = 0; at < smem; at += 2) {
    bytes.push_back({at, Encode(static_cast<float>(junk(rng) % 977) - 488.0f, c.bf16)});
  }
  if (!c.rs) {
    for (int m = 0; m < 64; ++m) {
      for (int k = 0; k < 16; ++k) bytes.push_back({pa.Offset(m, k), o.a[m * 16 + k]});
    }
  }
  for (int n = 0; n < N; ++n) {
    for (int k = 0; k < 16; ++k) bytes.push_back({pb.Offset(n, k), o.b[k * N + n]});
  }
  d_out.assign(64 * N, 0.0f);
  return hsap_emu::Launch(1, 1, 128, smem, false, [&] {
    using namespace hsap_dev;
    WriteShared(bytes);
    unsigned char* s = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
    const uint64_t a_desc = wgmma_desc(s + pa.Start(), pa.lbo, pa.sbo, WgmmaField(pa.mode));
    const uint64_t b_desc = wgmma_desc(s + pb.Start(), pb.lbo, pb.sbo, WgmmaField(pb.mode));
    const int t = threadIdx.x;
    float d[N / 2];
    for (int i = 0; i < N / 2; ++i) {
      int row, col;
      DPosition(t, i, row, col);
      d[i] = c.accumulate ? o.c[row * N + col] : 1e30f;  // ignored without scale-d
    }
    unsigned a[4] = {};
    if (c.rs) AFragment(o.a, t, a);
    wgmma_fence();
    IssueMma<N>(c.bf16, c.trans_b, c.rs, d, a, a_desc, b_desc, c.accumulate);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operand(d);
    for (int i = 0; i < N / 2; ++i) {
      int row, col;
      DPosition(t, i, row, col);
      d_out[row * N + col] = d[i];
    }
  });
}

// D against the host: equal to the fp32 sum in the emulator's documented order (input, then
// k ascending), within the rule of the fp64 product.
void CheckProduct(const MmaCase& c, const Operands& o, const std::vector<float>& d) {
  const int n_cols = c.n;
  const DType t = c.bf16 ? DType::kBF16 : DType::kF16;
  double err = 0, naive_err = 0, magnitude = 0;
  int mismatches = 0;
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      const float c0 = c.accumulate ? o.c[m * n_cols + n] : 0.0f;
      float plain = c0;
      double exact = c0;
      float naive = RoundTo(t, c0);
      for (int k = 0; k < 16; ++k) {
        const float x = Decode(o.a[m * 16 + k], c.bf16), y = Decode(o.b[k * n_cols + n], c.bf16);
        plain = plain + x * y;
        exact += static_cast<double>(x) * y;
        naive = RoundTo(t, naive + RoundTo(t, x * y));
      }
      const float got = d[m * n_cols + n];
      if (got != plain && ++mismatches <= 5) {
        ADD_FAILURE() << CaseName(c) << ": D[" << m << "][" << n << "] = " << got << ", want "
                      << plain;
      }
      err = std::max(err, std::abs(got - exact));
      naive_err = std::max(naive_err, std::abs(naive - exact));
      magnitude = std::max(magnitude, std::abs(exact));
    }
  }
  EXPECT_EQ(mismatches, 0) << CaseName(c);
  EXPECT_LE(err, ToleranceBound(naive_err, magnitude, kKernelFloor)) << CaseName(c);
}

template <int N>
void RunAndCheck(const MmaCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Operands o = RandomOperands(rng, c.bf16, N);
  std::vector<float> d;
  const absl::Status s = RunMma<N>(c, o, rng, d);
  ASSERT_TRUE(s.ok()) << CaseName(c) << ": " << s;
  CheckProduct(c, o, d);
}

constexpr SwizzleMode kModes[] = {SwizzleMode::kNone, SwizzleMode::k32B, SwizzleMode::k64B,
                                  SwizzleMode::k128B};

// Every swizzle mode of B, both majors, SS and RS, both types; A's mode cycles against B's.
TEST(WgmmaTest, EveryLayoutEqualsTheProduct) {
  uint64_t seed = 1;
  for (int mi = 0; mi < 4; ++mi) {
    for (bool trans_b : {false, true}) {
      for (bool rs : {false, true}) {
        for (bool bf16 : {true, false}) {
          MmaCase c{64, bf16, trans_b, rs, /*accumulate=*/(mi + rs) % 2 == 0,
                    kModes[(mi + 1 + bf16) % 4], kModes[mi], /*padded=*/trans_b != bf16};
          RunAndCheck<64>(c, ++seed);
        }
      }
    }
  }
}

// Other N: the accumulator layout over N / 8 column blocks, B's layouts over more atoms.
TEST(WgmmaTest, EveryShapeEqualsTheProduct) {
  uint64_t seed = 100;
  for (SwizzleMode mode : kModes) {
    const bool t = mode == SwizzleMode::k64B || mode == SwizzleMode::kNone;
    RunAndCheck<16>({16, true, t, false, true, SwizzleMode::k128B, mode, false}, ++seed);
    RunAndCheck<48>({48, false, !t, true, true, mode, mode, true}, ++seed);
    RunAndCheck<128>({128, true, !t, false, false, mode, mode, true}, ++seed);
    RunAndCheck<256>({256, false, t, true, true, SwizzleMode::k64B, mode, false}, ++seed);
  }
}

// ---- asynchrony ----

absl::Status RunWarpgroups(int threads, size_t smem, const std::function<void()>& kernel) {
  return hsap_emu::Launch(1, 1, threads, smem, false, kernel);
}

// A 64x16 K-major 128B-swizzled A at 0 (8 atoms of 1024 bytes, 32 bytes of each row used)
// and a 16x16 N-major unswizzled B at kSmallB, from `o`, in kSmallSmem bytes.
constexpr uint32_t kSmallB = 8192, kSmallSmem = 9216;
std::vector<std::pair<uint32_t, uint16_t>> SmallTiles(const Operands& o, Placement& pa,
                                                     Placement& pb) {
  pa = MakePlacement(SwizzleMode::k128B, false, 64, 0, false);
  pa.k_slice = 0;
  pb = MakePlacement(SwizzleMode::kNone, true, 16, kSmallB, false);
  std::vector<std::pair<uint32_t, uint16_t>> bytes;
  for (int m = 0; m < 64; ++m) {
    for (int k = 0; k < 16; ++k) bytes.push_back({pa.Offset(m, k), o.a[m * 16 + k]});
  }
  for (int n = 0; n < 16; ++n) {
    for (int k = 0; k < 16; ++k) bytes.push_back({pb.Offset(n, k), o.b[k * 16 + n]});
  }
  return bytes;
}

// The accumulators read as the in-flight NaN until the wait that covers their group; a
// wait_group 1 completes only the older group; two operations in flight on the same
// accumulators chain (the second accumulates onto the first's result).
TEST(WgmmaTest, AccumulatorsAreWrittenAtTheWait) {
  std::mt19937_64 rng(7);
  Operands o = RandomOperands(rng, true, 16);
  Placement pa, pb;
  const auto bytes = SmallTiles(o, pa, pb);
  std::vector<float> first(64 * 16), second(64 * 16);
  int early_nan = 0, after_one_nan = 0, after_one_done = 0;
  absl::Status s = RunWarpgroups(128, kSmallSmem, [&] {
    using namespace hsap_dev;
    WriteShared(bytes);
    unsigned char* sm = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
    const uint64_t a = wgmma_desc(sm + pa.Start(), pa.lbo, pa.sbo, kSwizzle128B);
    const uint64_t b = wgmma_desc(sm + pb.Start(), pb.lbo, pb.sbo, kSwizzleNone);
    float d1[8] = {}, d2[8] = {};
    wgmma_fence();
    wgmma_m64k16_ss<16, true, true>(d1, a, b, false);
    wgmma_commit_group();
    wgmma_m64k16_ss<16, true, true>(d2, a, b, false);
    wgmma_m64k16_ss<16, true, true>(d2, a, b, true);  // in flight on d2: chains
    wgmma_commit_group();
    if (std::isnan(d1[0]) && std::isnan(d2[7])) ++early_nan;
    wgmma_wait_group<1>();
    if (!std::isnan(d1[3])) ++after_one_done;
    if (std::isnan(d2[0])) ++after_one_nan;
    wgmma_wait_group<0>();
    for (int i = 0; i < 8; ++i) {
      int row, col;
      DPosition(threadIdx.x, i, row, col);
      first[row * 16 + col] = d1[i];
      second[row * 16 + col] = d2[i];
    }
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(early_nan, 128);
  EXPECT_EQ(after_one_done, 128);
  EXPECT_EQ(after_one_nan, 128);
  MmaCase c{16, true, true, false, false, SwizzleMode::k128B, SwizzleMode::kNone, false};
  CheckProduct(c, o, first);
  // The second operation on d2 accumulated onto the first's result P: P + A * B in order.
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < 16; ++n) {
      float want = first[m * 16 + n];
      for (int k = 0; k < 16; ++k) want = want + Decode(o.a[m * 16 + k], true) * Decode(o.b[k * 16 + n], true);
      ASSERT_EQ(second[m * 16 + n], want) << m << ", " << n;
    }
  }
}

// Two k steps of a K = 32 product accumulate in place, as a kernel's loop does.
TEST(WgmmaTest, ChainedKStepsEqualTheLongProduct) {
  std::mt19937_64 rng(11);
  const Operands lo = RandomOperands(rng, false, 64), hi = RandomOperands(rng, false, 64);
  // A 64x32 = [lo.a | hi.a] as one 128B-swizzled K-major tile of 64 columns (slices 0 and 1);
  // B 32x64 N-major 128B-swizzled, its two 16-row halves SBO apart... as two descriptors.
  Placement pa = MakePlacement(SwizzleMode::k128B, false, 64, 0, false);
  Placement pb0 = MakePlacement(SwizzleMode::k128B, true, 64, 8192, false);
  Placement pb1 = pb0;
  pb1.base = 8192 + 4096;
  std::vector<std::pair<uint32_t, uint16_t>> bytes;
  for (int half = 0; half < 2; ++half) {
    pa.k_slice = half;
    const Operands& o = half == 0 ? lo : hi;
    for (int m = 0; m < 64; ++m) {
      for (int k = 0; k < 16; ++k) bytes.push_back({pa.Offset(m, k), o.a[m * 16 + k]});
    }
    const Placement& pb = half == 0 ? pb0 : pb1;
    for (int n = 0; n < 64; ++n) {
      for (int k = 0; k < 16; ++k) bytes.push_back({pb.Offset(n, k), o.b[k * 64 + n]});
    }
  }
  std::vector<float> d_out(64 * 64);
  absl::Status s = RunWarpgroups(128, 16384, [&] {
    using namespace hsap_dev;
    WriteShared(bytes);
    unsigned char* sm = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
    float d[32];
    for (int i = 0; i < 32; ++i) {
      int row, col;
      DPosition(threadIdx.x, i, row, col);
      d[i] = lo.c[row * 64 + col];
    }
    wgmma_fence();
    for (int step = 0; step < 2; ++step) {
      const uint64_t a = wgmma_desc(sm + 32 * step, 16, 1024, kSwizzle128B);
      const uint64_t b = wgmma_desc(sm + (step == 0 ? pb0 : pb1).base, pb0.lbo, pb0.sbo,
                                    kSwizzle128B);
      wgmma_m64k16_ss<64, false, true>(d, a, b, true);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
    for (int i = 0; i < 32; ++i) {
      int row, col;
      DPosition(threadIdx.x, i, row, col);
      d_out[row * 64 + col] = d[i];
    }
  });
  ASSERT_TRUE(s.ok()) << s;
  double err = 0, magnitude = 0;
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < 64; ++n) {
      float plain = lo.c[m * 64 + n];
      double exact = plain;
      for (const Operands* o : {&lo, &hi}) {
        for (int k = 0; k < 16; ++k) {
          const float x = Decode(o->a[m * 16 + k], false), y = Decode(o->b[k * 64 + n], false);
          plain = plain + x * y;
          exact += static_cast<double>(x) * y;
        }
      }
      ASSERT_EQ(d_out[m * 64 + n], plain) << m << ", " << n;
      err = std::max(err, std::abs(d_out[m * 64 + n] - exact));
      magnitude = std::max(magnitude, std::abs(exact));
    }
  }
  EXPECT_LT(err, 1e-5 * std::max(1.0, magnitude));
}

// ---- faults ----

// Runs a one-warpgroup kernel over SmallTiles and returns its status.
absl::Status RunSmall(const std::function<void(uint64_t a, uint64_t b)>& body, int threads = 128) {
  std::mt19937_64 rng(3);
  Operands o = RandomOperands(rng, true, 16);
  Placement pa, pb;
  const auto bytes = SmallTiles(o, pa, pb);
  return RunWarpgroups(threads, kSmallSmem, [&] {
    using namespace hsap_dev;
    WriteShared(bytes);
    unsigned char* sm = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
    body(wgmma_desc(sm + pa.Start(), pa.lbo, pa.sbo, kSwizzle128B),
         wgmma_desc(sm + pb.Start(), pb.lbo, pb.sbo, kSwizzleNone));
  });
}

TEST(WgmmaFaultTest, ReadsFromTheSmallTilesSucceedWhenUsedCorrectly) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t b) {
    float d[8] = {};
    hsap_dev::wgmma_fence();
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, true);
    hsap_dev::wgmma_commit_group();
    hsap_dev::wgmma_wait_group<0>();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(WgmmaFaultTest, MmaWithoutFence) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t b) {
    float d[8] = {};
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, true);
  });
  EXPECT_THAT(s.message(), HasSubstr("without a wgmma.fence"));
}

TEST(WgmmaFaultTest, MmaAfterAWaitWithoutANewFence) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t b) {
    float d[8] = {};
    hsap_dev::wgmma_fence();
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, false);
    hsap_dev::wgmma_commit_group();
    hsap_dev::wgmma_wait_group<0>();
    d[0] *= 2.0f;  // the thread's own access: a fence must follow
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, true);
  });
  EXPECT_THAT(s.message(), HasSubstr("since the thread last had these accumulator registers"));
}

TEST(WgmmaFaultTest, RegisterFragmentWithoutFenceAfterTheWait) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t b) {
    float d[8] = {}, e[8] = {};
    hsap_dev::wgmma_fence();
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, false);
    hsap_dev::wgmma_commit_group();
    hsap_dev::wgmma_wait_group<0>();
    const unsigned frag[4] = {Pair(Encode(d[0], true), Encode(d[1], true)), 0, 0, 0};
    hsap_dev::wgmma_m64k16_rs<16, true, true>(e, frag, b, false);
  });
  EXPECT_THAT(s.message(), HasSubstr("A in registers without a wgmma.fence"));
}

TEST(WgmmaFaultTest, AccumulatorWrittenWhileInFlight) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t b) {
    float d[8] = {};
    hsap_dev::wgmma_fence();
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, false);
    hsap_dev::wgmma_commit_group();
    d[5] = 1.0f;
    hsap_dev::wgmma_wait_group<0>();
  });
  EXPECT_THAT(s.message(), HasSubstr("accumulator register d[5] was written while"));
}

TEST(WgmmaFaultTest, SharedOperandWrittenBeforeTheWait) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t b) {
    float d[8] = {};
    hsap_dev::wgmma_fence();
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, false);
    hsap_dev::wgmma_commit_group();
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned char* sm = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
      sm[kSmallB + 6] ^= 0x40;  // an element of B
    }
    __syncthreads();
    hsap_dev::wgmma_wait_group<0>();
  });
  EXPECT_THAT(s.message(), HasSubstr("was written before the wgmma.wait_group"));
}

TEST(WgmmaFaultTest, AThreadOfTheWarpgroupMissing) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t b) {
    float d[8] = {};
    hsap_dev::wgmma_fence();
    if (threadIdx.x == 77) return;
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, false);
  });
  EXPECT_THAT(s.message(), HasSubstr("thread 77 of the warpgroup did not take part"));
}

TEST(WgmmaFaultTest, DifferentOperandsAcrossTheWarpgroup) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t b) {
    float d[8] = {};
    hsap_dev::wgmma_fence();
    hsap_dev::wgmma_m64k16_ss<16, true, true>(d, a, b, threadIdx.x != 40);
  });
  EXPECT_THAT(s.message(), HasSubstr("executed another instruction or operands"));
}

TEST(WgmmaFaultTest, CtaNotMadeOfWarpgroups) {
  absl::Status s = RunSmall([](uint64_t, uint64_t) { hsap_dev::wgmma_fence(); }, 96);
  EXPECT_THAT(s.message(), HasSubstr("not a multiple of 128"));
}

TEST(WgmmaFaultTest, OperandOutsideSharedMemory) {
  absl::Status s = RunSmall([](uint64_t a, uint64_t) {
    float d[8] = {};
    unsigned char* sm = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
    const uint64_t far = hsap_dev::wgmma_desc(sm + kSmallB, 128, 4096, hsap_dev::kSwizzleNone);
    hsap_dev::wgmma_fence();
    hsap_dev::wgmma_m64k16_ss<16, true, false>(d, a, far, false);
  });
  EXPECT_THAT(s.message(), HasSubstr("outside the CTA's 9216 bytes of shared memory"));
}

TEST(WgmmaFaultTest, DescriptorArguments) {
  absl::Status s = RunSmall([](uint64_t, uint64_t) {
    unsigned char* sm = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
    hsap_dev::wgmma_desc(sm + 8, 16, 1024, hsap_dev::kSwizzle128B);
  });
  EXPECT_THAT(s.message(), HasSubstr("wgmma_desc: start offset 8 is not 16-byte aligned"));
  s = RunSmall([](uint64_t, uint64_t) {
    unsigned char* sm = reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem());
    hsap_dev::wgmma_desc(sm, 24, 1024, hsap_dev::kSwizzle128B);
  });
  EXPECT_THAT(s.message(), HasSubstr("leading byte offset 24"));
  s = RunSmall([](uint64_t, uint64_t) {
    static float outside[4] = {};
    hsap_dev::wgmma_desc(outside, 16, 1024, hsap_dev::kSwizzle128B);
  });
  EXPECT_THAT(s.message(), HasSubstr("is not in the CTA's shared memory"));
}

// The descriptor's bits, against the ISA's field table.
TEST(WgmmaDescTest, FieldsAsTheIsaTableStates) {
  const uint64_t d = hsap_dev::wgmma_desc_bits(0x2a0f0, 0x230, 0x4560, hsap_dev::kSwizzle64B);
  EXPECT_EQ(d & 0x3fff, 0x2a0f0u >> 4);
  EXPECT_EQ((d >> 16) & 0x3fff, 0x23u);
  EXPECT_EQ((d >> 32) & 0x3fff, 0x456u);
  EXPECT_EQ((d >> 49) & 7, 0u);
  EXPECT_EQ(d >> 62, 2u);
  EXPECT_EQ(d & 0x3ffe0000c000c000ull, 0u);  // the reserved bits
}

// A descriptor advanced by a byte offset, or given another leading byte offset, equals the one
// formed from the moved address or the other offset: the other fields are kept, and no carry
// leaves the start-address field anywhere in the 228 KiB window.
TEST(WgmmaDescTest, AdvanceAndLeadingOffsetKeepTheOtherFields) {
  for (unsigned address = 0; address < 228 * 1024; address += 4096 + 16) {
    for (unsigned bytes : {0u, 16u, 32u, 96u, 1024u, 8192u, 40960u}) {
      if (address + bytes >= 228 * 1024) continue;
      for (int swizzle : {hsap_dev::kSwizzleNone, hsap_dev::kSwizzle128B}) {
        const uint64_t d = hsap_dev::wgmma_desc_bits(address, 16, 1024, swizzle);
        EXPECT_EQ(hsap_dev::wgmma_desc_advance(d, bytes),
                  hsap_dev::wgmma_desc_bits(address + bytes, 16, 1024, swizzle))
            << address << " + " << bytes;
        EXPECT_EQ(hsap_dev::wgmma_desc_with_lbo(d, 48 * 128),
                  hsap_dev::wgmma_desc_bits(address, 48 * 128, 1024, swizzle));
      }
    }
  }
}

// 384 threads start at 168 registers each (65536 / 384, rounded down to 8): a producer at 24
// releases what two consumers at 240 take, the sm_90a forward's split; in two steps too.
TEST(SetmaxnregTest, UniformIncAndDecPass) {
  absl::Status s = RunWarpgroups(384, 0, [] {
    if (threadIdx.x < 128) {
      hsap_dev::setmaxnreg_dec<40>();
      hsap_dev::setmaxnreg_dec<24>();
    } else {
      hsap_dev::setmaxnreg_inc<232>();
      hsap_dev::setmaxnreg_inc<240>();
    }
  });
  EXPECT_TRUE(s.ok()) << s;
  // An .inc waits for the .dec that covers it: here the producer would release only after a
  // __syncthreads the waiting consumers never reach (a GPU hangs).
  s = RunWarpgroups(384, 0, [] {
    if (threadIdx.x >= 128) hsap_dev::setmaxnreg_inc<232>();
    __syncthreads();
    if (threadIdx.x < 128) hsap_dev::setmaxnreg_dec<40>();
  });
  EXPECT_THAT(s.message(), HasSubstr("no warpgroup releases more"));
}

// Counts that sum past the launch's: a producer at 32 and two consumers at 240 would take
// 512 registers per thread of three warpgroups that have 3 x 168 (the sm_90a backward's
// first split, which would have hung on a GPU).
TEST(SetmaxnregTest, IncBeyondTheCtaPoolFaults) {
  absl::Status s = RunWarpgroups(384, 0, [] {
    if (threadIdx.x < 128) {
      hsap_dev::setmaxnreg_dec<32>();
    } else {
      hsap_dev::setmaxnreg_inc<240>();
    }
  });
  EXPECT_THAT(s.message(), HasSubstr("no warpgroup releases more"));
  EXPECT_THAT(s.message(), HasSubstr("3 warpgroups x 168 registers per thread"));
  s = RunWarpgroups(384, 0, [] {
    if (threadIdx.x < 128) {
      hsap_dev::setmaxnreg_dec<40>();
    } else {
      hsap_dev::setmaxnreg_inc<232>();
    }
  });
  EXPECT_TRUE(s.ok()) << s;  // the sm_90a backward's split: 40 + 2 x 232 = 3 x 168
}

TEST(SetmaxnregTest, Faults) {
  absl::Status s = RunWarpgroups(128, 0, [] {
    if (threadIdx.x / 32 == 2) {
      hsap_dev::setmaxnreg_inc<240>();
    } else {
      hsap_dev::setmaxnreg_inc<232>();
    }
  });
  EXPECT_THAT(s.message(), HasSubstr("executed another instruction or operands"));
  s = RunWarpgroups(128, 0, [] {
    hsap_dev::setmaxnreg_inc<232>();
    hsap_dev::setmaxnreg_inc<200>();
  });
  EXPECT_THAT(s.message(), HasSubstr(".inc must not lower the count"));
  s = RunWarpgroups(128, 0, [] {
    hsap_dev::setmaxnreg_dec<40>();
    hsap_dev::setmaxnreg_dec<48>();
  });
  EXPECT_THAT(s.message(), HasSubstr(".dec must not raise it"));
  // Counts the header refuses at compile time, through the emulator's entry point.
  for (int bad : {20, 100, 264}) {
    s = RunWarpgroups(128, 0, [bad] { hsap_emu_setmaxnreg(true, bad); });
    EXPECT_THAT(s.message(), HasSubstr("multiple of 8 in [24, 256]")) << bad;
  }
  s = RunWarpgroups(64, 0, [] { hsap_dev::setmaxnreg_dec<40>(); });
  EXPECT_THAT(s.message(), HasSubstr("not a multiple of 128"));
}

}  // namespace
}  // namespace hsap
