// The emulator's mbarrier and TMA instructions (tests/support/emulated_tma.h) through the
// device functions of jit/device/hsap_tma.cuh: the mbarrier's phases, parity waits, expect-tx
// and complete-tx against the ISA's state machine; cp.async.bulk.tensor 2d / 3d / 4d with
// every swizzle mode and boxes crossing the tensor's edges against direct reads of the tensor
// and the swizzle tables written here from the ISA; the asynchrony (stale shared memory
// without a wait); the faults; and the emulated cuTensorMapEncodeTiled's refusals.
// The emulator must come before the device code.
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_device.cuh"
#include "jit/device/hsap_tma.cuh"
// clang-format on

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/cuda/runtime/tensor_map.h"
#include "tests/support/emulated_cuda_runtime.h"
#include "tests/support/emulated_tensor_map.h"

namespace hsap {
namespace {

using hsap_dev::TensorMap;
using ::testing::HasSubstr;

constexpr int kSwizzleNone = 0, kSwizzle32B = 1, kSwizzle64B = 2,
              kSwizzle128B = 3;           // CUtensorMapSwizzle
constexpr int kUint16 = 1, kFloat32 = 7;  // CUtensorMapDataType

absl::Status Launch(int threads, size_t smem_bytes, const std::function<void()>& kernel) {
  return hsap_emu::Launch(1, 1, threads, smem_bytes, /*all_concurrent=*/false, kernel);
}
unsigned char* Smem() { return reinterpret_cast<unsigned char*>(hsap_emu_dynamic_smem()); }
unsigned long long* BarAt(size_t offset) {
  return reinterpret_cast<unsigned long long*>(Smem() + offset);
}

// ---- mbarrier ----

// Three phases of a 64-thread barrier: nobody passes phase k before all 64 arrived in it;
// try_wait.parity answers for the current phase (false) and the one before it (true).
TEST(EmulatedMbarrier, PhasesCompleteWhenAllArrived) {
  std::vector<int> arrived_before_pass(64 * 3, -1);
  int arrivals = 0;
  bool early[3] = {true, true, true}, previous[3] = {false, false, false};
  absl::Status s = Launch(64, 1024, [&] {
    unsigned long long* bar = BarAt(0);
    if (threadIdx.x == 0) {
      hsap_dev::mbarrier_init(bar, 64);
      hsap_dev::fence_barrier_init();
    }
    __syncthreads();
    for (int phase = 0; phase < 3; ++phase) {
      if (threadIdx.x == 0) {
        early[phase] = hsap_dev::mbarrier_try_wait_parity(bar, phase % 2);  // not arrived yet
        previous[phase] = hsap_dev::mbarrier_try_wait_parity(bar, (phase + 1) % 2);
      }
      ++arrivals;
      hsap_dev::mbarrier_arrive(bar);
      hsap_dev::mbarrier_wait_parity(bar, phase % 2);
      arrived_before_pass[phase * 64 + threadIdx.x] = arrivals;
    }
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int phase = 0; phase < 3; ++phase) {
    EXPECT_FALSE(early[phase]) << phase;
    // The phase before phase 0 is "phase -1", which never completed: parity 1 reads as the
    // current phase's neighbour and is reported complete by the ISA's rule too.
    EXPECT_TRUE(previous[phase]) << phase;
    for (int t = 0; t < 64; ++t) {
      EXPECT_GE(arrived_before_pass[phase * 64 + t], 64 * (phase + 1)) << phase << " " << t;
    }
  }
}

// An arrive-on after the phase completed counts toward the next phase.
TEST(EmulatedMbarrier, ArrivalAfterCompletionCountsForTheNextPhase) {
  bool r[5] = {};
  absl::Status s = Launch(32, 1024, [&] {
    if (threadIdx.x != 0) return;
    unsigned long long* bar = BarAt(8);
    hsap_dev::mbarrier_init(bar, 2);
    hsap_dev::mbarrier_arrive(bar);
    r[0] = hsap_dev::mbarrier_try_wait_parity(bar, 0);  // 1 of 2
    hsap_dev::mbarrier_arrive(bar);                     // phase 0 completes
    r[1] = hsap_dev::mbarrier_try_wait_parity(bar, 0);
    hsap_dev::mbarrier_arrive(bar);  // 1 of 2 in phase 1
    r[2] = hsap_dev::mbarrier_try_wait_parity(bar, 1);
    hsap_dev::mbarrier_arrive(bar);  // phase 1 completes
    r[3] = hsap_dev::mbarrier_try_wait_parity(bar, 1);
    r[4] = hsap_dev::mbarrier_try_wait_parity(bar, 0);  // phase 2 is current: incomplete
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_FALSE(r[0]);
  EXPECT_TRUE(r[1]);
  EXPECT_FALSE(r[2]);
  EXPECT_TRUE(r[3]);
  EXPECT_FALSE(r[4]);
}

// expect-tx holds the phase until complete-tx brought the tx-count back to zero, whichever
// comes first: here the copy lands (tx-count negative) before the arrive.expect_tx.
TEST(EmulatedMbarrier, TxCountMayGoNegativeBeforeTheExpectTx) {
  alignas(16) static uint16_t tensor[16 * 8];
  for (int i = 0; i < 16 * 8; ++i) tensor[i] = static_cast<uint16_t>(i + 1);
  alignas(64) TensorMap map;
  const uint64_t dims[2] = {16, 8}, strides[1] = {32};
  const uint32_t box[2] = {16, 8}, estr[2] = {1, 1};
  ASSERT_EQ(hsap_emu::EmuEncodeTiledTensorMap(&map, kUint16, 2, tensor, dims, strides, box, estr, 0,
                                              0, 0, 0),
            0);
  bool before = true, after = false;
  uint16_t first = 0;
  absl::Status s = Launch(32, 2048, [&] {
    if (threadIdx.x != 0) return;
    unsigned long long* bar = BarAt(0);
    hsap_dev::mbarrier_init(bar, 1);
    hsap_dev::tma_load_2d(Smem() + 1024, &map, 0, 0, bar);
    before = hsap_dev::mbarrier_try_wait_parity(bar, 0);  // the copy lands: tx -256, 1 pending
    hsap_dev::mbarrier_arrive_expect_tx(bar, 256);
    after = hsap_dev::mbarrier_try_wait_parity(bar, 0);
    std::memcpy(&first, Smem() + 1024, 2);
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_FALSE(before);
  EXPECT_TRUE(after);
  EXPECT_EQ(first, 1);
}

struct FaultCase {
  const char* name;
  std::function<void()> body;  // run by thread 0 of a 32-thread CTA with 4 KB of smem
  const char* message;
};

TEST(EmulatedMbarrier, MisuseFaults) {
  const std::vector<FaultCase> cases = {
      {"uninitialised", [] { hsap_dev::mbarrier_arrive(BarAt(16)); }, "before its mbarrier.init"},
      {"overwritten",
       [] {
         hsap_dev::mbarrier_init(BarAt(16), 4);
         *BarAt(16) = 0;  // an ordinary store
         hsap_dev::mbarrier_arrive(BarAt(16));
       },
       "overwritten by an ordinary store"},
      {"too many arrivals",
       [] {
         hsap_dev::mbarrier_init(BarAt(16), 1);
         hsap_dev::mbarrier_arrive_expect_tx(BarAt(16), 64);  // pending 0, waits for 64 bytes
         hsap_dev::mbarrier_arrive(BarAt(16));
       },
       "more arrivals than the count 1"},
      {"tx overflow",
       [] {
         hsap_dev::mbarrier_init(BarAt(16), 2);
         hsap_dev::mbarrier_arrive_expect_tx(BarAt(16), (1u << 20) - 1);
         hsap_dev::mbarrier_arrive_expect_tx(BarAt(16), 1);
       },
       "outside the ISA's range"},
      {"count 0", [] { hsap_dev::mbarrier_init(BarAt(16), 0); }, "with count 0"},
      {"count 2^20", [] { hsap_dev::mbarrier_init(BarAt(16), 1u << 20); }, "with count 1048576"},
      {"parity 2",
       [] {
         hsap_dev::mbarrier_init(BarAt(16), 1);
         hsap_dev::mbarrier_try_wait_parity(BarAt(16), 2);
       },
       "valid values are 0 and 1"},
      {"misaligned", [] { hsap_dev::mbarrier_init(BarAt(12), 1); }, "8-byte aligned"},
      {"not shared",
       [] {
         static unsigned long long global_word;
         hsap_dev::mbarrier_init(&global_word, 1);
       },
       "not in shared memory"},
  };
  for (const FaultCase& c : cases) {
    absl::Status s = Launch(32, 4096, [&] {
      if (threadIdx.x == 0) c.body();
    });
    EXPECT_FALSE(s.ok()) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.name;
  }
}

// A wait that nothing can complete stops the launch (where a GPU would hang).
TEST(EmulatedMbarrier, AWaitNothingCompletesStopsTheLaunch) {
  const int64_t saved = hsap_emu::WaitWatchdogMs().exchange(100);
  absl::Status s = Launch(64, 1024, [&] {
    unsigned long long* bar = BarAt(0);
    if (threadIdx.x == 0) hsap_dev::mbarrier_init(bar, 65);  // one arrival too many expected
    __syncthreads();
    hsap_dev::mbarrier_arrive(bar);
    hsap_dev::mbarrier_wait_parity(bar, 0);
  });
  hsap_emu::WaitWatchdogMs().store(saved);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("never completed: phase 0 waits for 1 of 65 arrivals"));
}

// ---- cp.async.bulk.tensor ----

// Where the ISA's swizzle puts byte `byte` of a box whose rows are `span` bytes (the swizzle
// span), for a box that starts `shift` bytes past an address aligned to the pattern's repeat
// (8 * span): the 16-byte chunk j of a row that lies in 128-byte line L (of the absolute
// address) moves to chunk j ^ (L mod (span / 16)) of its row. The CUDA programming guide's
// TMA swizzle tables: for 128B, row r's chunks are XORed with r mod 8; for 64B, rows 2i and
// 2i + 1 share line i and XOR with i mod 4; for 32B, rows 4i .. 4i + 3 XOR with i mod 2.
uint32_t SwizzledByte(uint32_t byte, uint32_t span, uint32_t shift) {
  if (span == 0) return byte;
  const uint32_t at = shift + byte;
  const uint32_t line = at / 128, row_start = at / span * span, chunk = at % span / 16;
  return row_start + ((chunk ^ (line % (span / 16))) * 16) + at % 16 - shift;
}

struct BoxCase {
  std::string name;
  int rank;
  std::vector<uint64_t> dims;  // elements, dimension 0 innermost
  uint32_t row_pad;            // elements of padding per dimension-0 row in the tensor
  std::vector<uint32_t> box;
  std::vector<int> coords;
  int swizzle;  // CUtensorMapSwizzle
  uint32_t dst_offset;
};

void PrintTo(const BoxCase& c, std::ostream* os) { *os << c.name; }

class EmulatedTmaBoxTest : public ::testing::TestWithParam<BoxCase> {};

// The box lands in shared memory at the swizzled place of each element; elements outside the
// tensor are zeros; the barrier completes with the box's bytes.
TEST_P(EmulatedTmaBoxTest, LandsSwizzledWithZerosOutsideTheTensor) {
  const BoxCase& c = GetParam();
  // A 16-bit tensor, each element its own value (index + 1, never 0).
  std::vector<uint64_t> strides;  // bytes, for dimensions 1..rank-1
  uint64_t stride = (c.dims[0] + c.row_pad) * 2, elements = c.dims[0] + c.row_pad;
  for (int i = 1; i < c.rank; ++i) {
    strides.push_back(stride);
    stride *= c.dims[i];
    elements *= c.dims[i];
  }
  std::vector<uint16_t> storage(elements + 8);
  uint16_t* tensor =
      storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) % 16) % 16 / 2;
  for (uint64_t i = 0; i < elements; ++i) tensor[i] = static_cast<uint16_t>(i % 65521 + 1);
  alignas(64) TensorMap map;
  const std::vector<uint32_t> estr(c.rank, 1);
  ASSERT_EQ(hsap_emu::EmuEncodeTiledTensorMap(&map, kUint16, c.rank, tensor, c.dims.data(),
                                              strides.data(), c.box.data(), estr.data(), 0,
                                              c.swizzle, 0, 0),
            0);
  uint32_t box_elements = 1;
  for (uint32_t b : c.box) box_elements *= b;
  const uint32_t bytes = box_elements * 2;
  std::vector<uint16_t> smem(box_elements);
  bool done = false;
  absl::Status s = Launch(64, 16384, [&] {
    unsigned long long* bar = BarAt(0);
    unsigned char* dst = Smem() + c.dst_offset;
    if (threadIdx.x == 0) {
      hsap_dev::mbarrier_init(bar, 1);
      hsap_dev::fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      hsap_dev::prefetch_tensormap(&map);
      hsap_dev::mbarrier_arrive_expect_tx(bar, bytes);
      const int* k = c.coords.data();
      if (c.rank == 2) hsap_dev::tma_load_2d(dst, &map, k[0], k[1], bar);
      if (c.rank == 3) hsap_dev::tma_load_3d(dst, &map, k[0], k[1], k[2], bar);
      if (c.rank == 4) hsap_dev::tma_load_4d(dst, &map, k[0], k[1], k[2], k[3], bar);
    }
    hsap_dev::mbarrier_wait_parity(bar, 0);
    if (threadIdx.x == 1) {
      std::memcpy(smem.data(), dst, bytes);
      done = true;
    }
  });
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(done);
  const uint32_t span = c.swizzle == 0 ? 0 : 16u << c.swizzle;
  const uint32_t shift = span == 0 ? 0 : c.dst_offset % (8 * span);
  int wrong = 0;
  for (uint32_t e = 0; e < box_elements; ++e) {
    // The element's coordinates in the tensor, and its value or 0 outside.
    uint32_t rest = e;
    bool inside = true;
    uint64_t index = 0, pitch = 1;
    for (int i = 0; i < c.rank; ++i) {
      const int64_t x = c.coords[i] + static_cast<int64_t>(rest % c.box[i]);
      rest /= c.box[i];
      inside = inside && x >= 0 && x < static_cast<int64_t>(c.dims[i]);
      index += static_cast<uint64_t>(x) * pitch;
      pitch *= i == 0 ? c.dims[0] + c.row_pad : c.dims[i];
    }
    const uint16_t want = inside ? tensor[index] : 0;
    const uint16_t got = smem[SwizzledByte(e * 2, span, shift) / 2];
    if (got != want && ++wrong <= 5) {
      ADD_FAILURE() << c.name << ": box element " << e << " holds " << got << ", want " << want;
    }
  }
  EXPECT_EQ(wrong, 0);
}

std::vector<BoxCase> BoxCases() {
  std::vector<BoxCase> cases;
  // 2d: 100 x 37 (rows padded to 104 elements), every swizzle, boxes inside and crossing
  // every edge; the 128B box once at a 1024-aligned address and once 128 bytes past one.
  for (int sw : {kSwizzleNone, kSwizzle32B, kSwizzle64B, kSwizzle128B}) {
    const uint32_t inner = sw == kSwizzleNone ? 24 : (16u << sw) / 2;
    const std::string n = absl::StrCat("sw", sw);
    cases.push_back({n + "_2d_inside", 2, {100, 37}, 4, {inner, 16}, {8, 3}, sw, 1024});
    cases.push_back({n + "_2d_top_left", 2, {100, 37}, 4, {inner, 16}, {-5, -9}, sw, 2048});
    cases.push_back({n + "_2d_bottom_right", 2, {100, 37}, 4, {inner, 16}, {90, 30}, sw, 1024});
    cases.push_back({n + "_2d_shifted", 2, {100, 37}, 4, {inner, 8}, {0, 0}, sw, 1024 + 128});
    cases.push_back({n + "_3d_edges", 3, {40, 6, 5}, 8, {inner, 4, 3}, {-2, 4, 3}, sw, 4096});
  }
  cases.push_back(
      {"sw3_4d_edges", 4, {64, 3, 4, 2}, 0, {64, 2, 3, 2}, {0, 2, -1, 1}, kSwizzle128B, 1024});
  cases.push_back({"sw0_4d_inside", 4, {16, 3, 4, 2}, 8, {8, 3, 2, 1}, {8, 0, 1, 1}, 0, 128});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Boxes, EmulatedTmaBoxTest, ::testing::ValuesIn(BoxCases()),
                         [](const auto& info) { return info.param.name; });

// The copy is asynchronous: before the barrier is waited on, the box is not in shared memory.
TEST(EmulatedTma, SharedMemoryIsStaleUntilTheWait) {
  alignas(16) static float tensor[8 * 8];
  for (int i = 0; i < 64; ++i) tensor[i] = 1.0f + static_cast<float>(i);
  alignas(64) TensorMap map;
  const uint64_t dims[2] = {8, 8}, strides[1] = {32};
  const uint32_t box[2] = {8, 8}, estr[2] = {1, 1};
  ASSERT_EQ(hsap_emu::EmuEncodeTiledTensorMap(&map, kFloat32, 2, tensor, dims, strides, box, estr,
                                              0, 0, 0, 0),
            0);
  // Two copies on two barriers: waiting on the first lands only the first.
  float before = -1, after = -1, other_before = -1, other_after = -1;
  absl::Status s = Launch(32, 4096, [&] {
    if (threadIdx.x != 0) return;
    unsigned long long* bar = BarAt(0);
    unsigned long long* other_bar = BarAt(8);
    float* dst = reinterpret_cast<float*>(Smem() + 1024);
    float* other = reinterpret_cast<float*>(Smem() + 2048);
    dst[9] = -7.0f;
    other[9] = -8.0f;
    hsap_dev::mbarrier_init(bar, 1);
    hsap_dev::mbarrier_init(other_bar, 1);
    hsap_dev::mbarrier_arrive_expect_tx(bar, 256);
    hsap_dev::mbarrier_arrive_expect_tx(other_bar, 256);
    hsap_dev::tma_load_2d(dst, &map, 0, 0, bar);
    hsap_dev::tma_load_2d(other, &map, 0, 0, other_bar);
    hsap_dev::fence_proxy_async_shared();
    before = dst[9];
    hsap_dev::mbarrier_wait_parity(bar, 0);
    after = dst[9];
    other_before = other[9];
    hsap_dev::mbarrier_wait_parity(other_bar, 0);
    other_after = other[9];
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(before, -7.0f);
  EXPECT_EQ(after, 10.0f);
  EXPECT_EQ(other_before, -8.0f);
  EXPECT_EQ(other_after, 10.0f);
}

// The pipeline the sm_90a kernels run: a producer thread fills a ring of 3 stages by TMA
// (full barriers: its arrive.expect_tx plus the copy's bytes), 64 consumer threads read each
// tile through the 128B swizzle and free the stage (empty barriers: 64 arrivals). 13 tiles
// (the last crossing the tensor's end) take every barrier through 4 or 5 phases, with the
// parities the kernels use (the producer's first wait on each empty stage passes at once).
TEST(EmulatedTma, ProducerConsumerRingOverManyPhases) {
  constexpr int kRows = 200, kCols = 32, kBox = 16, kStages = 3, kTiles = (kRows + kBox - 1) / kBox;
  static float tensor[kRows * kCols];
  for (int i = 0; i < kRows * kCols; ++i) tensor[i] = static_cast<float>(i % 997);
  alignas(64) TensorMap map;
  const uint64_t dims[2] = {kCols, kRows}, strides[1] = {kCols * 4};
  const uint32_t box[2] = {kCols, kBox}, estr[2] = {1, 1};
  ASSERT_EQ(hsap_emu::EmuEncodeTiledTensorMap(&map, kFloat32, 2, tensor, dims, strides, box, estr,
                                              0, kSwizzle128B, 0, 0),
            0);
  double sums[64] = {};  // per consumer thread: column (t % 32), rows of parity t / 32
  absl::Status s = Launch(96, 8192, [&] {
    unsigned long long* full = BarAt(0);
    unsigned long long* empty = BarAt(64);
    auto stage_tile = [](int stage) { return Smem() + 1024 + stage * 2048; };
    if (threadIdx.x == 0) {
      for (int i = 0; i < kStages; ++i) {
        hsap_dev::mbarrier_init(&full[i], 1);
        hsap_dev::mbarrier_init(&empty[i], 64);
      }
      hsap_dev::fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the producer warp: one thread issues
      if (threadIdx.x != 0) return;
      for (int t = 0; t < kTiles; ++t) {
        const int stage = t % kStages;
        hsap_dev::mbarrier_wait_parity(&empty[stage], ((t / kStages) & 1) ^ 1);
        hsap_dev::mbarrier_arrive_expect_tx(&full[stage], kBox * kCols * 4);
        hsap_dev::tma_load_2d(stage_tile(stage), &map, 0, t * kBox, &full[stage]);
      }
      return;
    }
    const int c = static_cast<int>(threadIdx.x - 32);
    for (int t = 0; t < kTiles; ++t) {
      const int stage = t % kStages;
      hsap_dev::mbarrier_wait_parity(&full[stage], (t / kStages) & 1);
      const unsigned char* tile = stage_tile(stage);
      for (int r = c / 32; r < kBox; r += 2) {
        float v;
        std::memcpy(&v, tile + SwizzledByte(r * 128 + (c % 32) * 4, 128, 0), 4);
        sums[c] += v;
      }
      hsap_dev::mbarrier_arrive(&empty[stage]);
    }
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int c = 0; c < 64; ++c) {
    double want = 0;
    for (int r = c / 32; r < kRows; r += 2) want += tensor[r * kCols + c % 32];
    EXPECT_EQ(sums[c], want) << c;
  }
}

// CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA: elements outside the tensor are NaN.
TEST(EmulatedTma, NanRequestFillsOutsideWithNan) {
  alignas(16) static float tensor[4 * 8];
  for (int i = 0; i < 32; ++i) tensor[i] = static_cast<float>(i);
  alignas(64) TensorMap map;
  const uint64_t dims[2] = {8, 4}, strides[1] = {32};
  const uint32_t box[2] = {8, 4}, estr[2] = {1, 1};
  ASSERT_EQ(hsap_emu::EmuEncodeTiledTensorMap(&map, kFloat32, 2, tensor, dims, strides, box, estr,
                                              0, 0, 0, /*oob_fill=*/1),
            0);
  float got[32];
  absl::Status s = Launch(32, 2048, [&] {
    if (threadIdx.x != 0) return;
    hsap_dev::mbarrier_init(BarAt(0), 1);
    hsap_dev::mbarrier_arrive_expect_tx(BarAt(0), 128);
    hsap_dev::tma_load_2d(Smem() + 1024, &map, -2, 1, BarAt(0));
    hsap_dev::mbarrier_wait_parity(BarAt(0), 0);
    std::memcpy(got, Smem() + 1024, sizeof(got));
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 8; ++c) {
      const int x = c - 2, y = r + 1;
      if (x >= 0 && y < 4) {
        EXPECT_EQ(got[r * 8 + c], tensor[y * 8 + x]) << r << " " << c;
      } else {
        EXPECT_TRUE(std::isnan(got[r * 8 + c])) << r << " " << c;
      }
    }
  }
}

TEST(EmulatedTma, MisuseFaults) {
  alignas(16) static uint16_t tensor[64 * 64];
  alignas(64) static TensorMap map2d, map3d, narrow;
  const uint64_t dims[3] = {64, 16, 4}, strides[2] = {128, 128 * 16};
  const uint32_t box[3] = {64, 16, 1}, estr[3] = {1, 1, 1};
  ASSERT_EQ(hsap_emu::EmuEncodeTiledTensorMap(&map2d, kUint16, 2, tensor, dims, strides, box, estr,
                                              0, kSwizzle128B, 0, 0),
            0);
  ASSERT_EQ(hsap_emu::EmuEncodeTiledTensorMap(&map3d, kUint16, 3, tensor, dims, strides, box, estr,
                                              0, 0, 0, 0),
            0);
  const uint32_t narrow_box[2] = {32, 16};  // 64-byte rows under the 128B swizzle
  ASSERT_EQ(hsap_emu::EmuEncodeTiledTensorMap(&narrow, kUint16, 2, tensor, dims, strides,
                                              narrow_box, estr, 0, kSwizzle128B, 0, 0),
            0);
  const std::vector<FaultCase> cases = {
      {"not a map",
       [] {
         alignas(64) TensorMap zero = {};
         hsap_dev::mbarrier_init(BarAt(0), 1);
         hsap_dev::tma_load_2d(Smem() + 1024, &zero, 0, 0, BarAt(0));
       },
       "not a tensor map made by cuTensorMapEncodeTiled"},
      {"rank",
       [] {
         hsap_dev::mbarrier_init(BarAt(0), 1);
         hsap_dev::tma_load_2d(Smem() + 1024, &map3d, 0, 0, BarAt(0));
       },
       "cp.async.bulk.tensor.2d with a tensor map of rank 3"},
      {"misaligned destination",
       [] {
         hsap_dev::mbarrier_init(BarAt(0), 1);
         hsap_dev::tma_load_2d(Smem() + 1024 + 64, &map2d, 0, 0, BarAt(0));
       },
       "is not 128-byte aligned"},
      {"box past shared memory",
       [] {
         hsap_dev::mbarrier_init(BarAt(0), 1);
         hsap_dev::tma_load_2d(Smem() + 3072, &map2d, 0, 0, BarAt(0));
       },
       "do not fit in shared memory"},
      {"uninitialised barrier",
       [] { hsap_dev::tma_load_2d(Smem() + 1024, &map2d, 0, 0, BarAt(0)); },
       "before its mbarrier.init"},
      {"narrow swizzled box",
       [] {
         hsap_dev::mbarrier_init(BarAt(0), 1);
         hsap_dev::tma_load_2d(Smem() + 1024, &narrow, 0, 0, BarAt(0));
       },
       "64-byte rows"},
      {"re-init in flight",
       [] {
         hsap_dev::mbarrier_init(BarAt(0), 1);
         hsap_dev::tma_load_2d(Smem() + 1024, &map2d, 0, 0, BarAt(0));
         hsap_dev::mbarrier_init(BarAt(0), 1);
       },
       "in flight"},
  };
  for (const FaultCase& c : cases) {
    absl::Status s = Launch(32, 4096, [&] {
      if (threadIdx.x == 0) c.body();
    });
    EXPECT_FALSE(s.ok()) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.name;
  }
}

// The host path the sm_90a kernels take: the library's EncodeTiledTensorMap through the
// (emulated) driver, the map passed by value as a kernel parameter, a [tokens][heads][d] bf16
// tensor seen as (d, tokens, heads) with the 128B swizzle, one 64 x 16 box per load.
TEST(EmulatedTma, LoadsThroughAMapTheLibraryEncoded) {
  constexpr int kTokens = 40, kHeads = 3, kD = 128;
  std::vector<uint16_t> storage(kTokens * kHeads * kD + 64);
  uint16_t* qkv = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64 / 2;
  for (int i = 0; i < kTokens * kHeads * kD; ++i) qkv[i] = static_cast<uint16_t>(i + 1);
  testing::EmulatedCudaRuntime emu;
  cuda::TiledTensorMapSpec spec;
  spec.dtype = cuda::TensorMapDataTypeOf(DType::kBF16);
  spec.global_address = qkv;
  spec.global_dims = {kD, kTokens, kHeads};
  spec.global_strides = {kHeads * kD * 2, kD * 2};
  spec.box_dims = {64, 16, 1};
  spec.swizzle = cuda::TensorMapSwizzle::k128B;
  absl::StatusOr<cuda::TensorMapBytes> bytes = cuda::EncodeTiledTensorMap(emu.driver(), spec);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  TensorMap param;
  static_assert(sizeof(param) == sizeof(*bytes));
  std::memcpy(&param, &*bytes, sizeof(param));
  const uint32_t box_bytes = cuda::TensorMapBoxBytes(spec);
  ASSERT_EQ(box_bytes, 2048u);
  std::vector<uint16_t> got(1024);
  absl::Status s = Launch(32, 4096, [&, param]() {  // the map captured by value, as a parameter
    if (threadIdx.x != 0) return;
    unsigned long long* bar = BarAt(0);
    hsap_dev::mbarrier_init(bar, 1);
    hsap_dev::mbarrier_arrive_expect_tx(bar, box_bytes);
    hsap_dev::tma_load_3d(Smem() + 1024, &param, 64, 32, 2, bar);  // d 64.., tokens 32..47, head 2
    hsap_dev::mbarrier_wait_parity(bar, 0);
    std::memcpy(got.data(), Smem() + 1024, 2048);
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int row = 0; row < 16; ++row) {
    for (int col = 0; col < 64; ++col) {
      const int token = 32 + row, d = 64 + col;
      const uint16_t want = token < kTokens ? qkv[(token * kHeads + 2) * kD + d] : 0;
      const uint32_t byte = SwizzledByte(static_cast<uint32_t>(row * 128 + col * 2), 128, 0);
      ASSERT_EQ(got[byte / 2], want) << row << " " << col;
    }
  }
}

// ---- the emulated cuTensorMapEncodeTiled ----

// Each of the driver's documented requirements, broken alone, from a valid 2d bf16 map.
TEST(EmulatedTensorMapEncode, RefusesWhatTheDriverRefuses) {
  alignas(64) static unsigned char map[128 + 64];
  alignas(256) static uint16_t tensor[256 * 256];
  struct Args {
    void* map = nullptr;
    int dtype = 9;
    uint32_t rank = 2;
    void* address = nullptr;
    uint64_t dims[5] = {256, 256, 1, 1, 1};
    uint64_t strides[4] = {512, 512 * 256, 512 * 256, 512 * 256};
    uint32_t box[5] = {64, 64, 1, 1, 1};
    uint32_t estr[5] = {1, 1, 1, 1, 1};
    int interleave = 0, swizzle = 3, l2 = 0, oob = 0;
  };
  auto encode = [&](const Args& a) {
    return hsap_emu::EmuEncodeTiledTensorMap(a.map, a.dtype, a.rank, a.address, a.dims, a.strides,
                                             a.box, a.estr, a.interleave, a.swizzle, a.l2, a.oob);
  };
  Args ok;
  ok.map = map;
  ok.address = tensor;
  ASSERT_EQ(encode(ok), 0);
  struct Broken {
    const char* what;
    std::function<void(Args&)> change;
    int error;
  };
  const int kInvalid = hsap_emu::kEmuCuErrorInvalidValue;
  const std::vector<Broken> broken = {
      {"map not 64-byte aligned", [](Args& a) { a.map = static_cast<char*>(a.map) + 32; },
       kInvalid},
      {"dtype", [](Args& a) { a.dtype = 16; }, kInvalid},
      {"packed dtype", [](Args& a) { a.dtype = 13; }, hsap_emu::kEmuCuErrorNotSupported},
      {"rank 0", [](Args& a) { a.rank = 0; }, kInvalid},
      {"rank 6", [](Args& a) { a.rank = 6; }, kInvalid},
      {"interleave with rank 2",
       [](Args& a) {
         a.interleave = 1;
         a.swizzle = 0;
       },
       kInvalid},
      {"address", [&](Args& a) { a.address = tensor + 1; }, kInvalid},
      {"dim 0", [](Args& a) { a.dims[1] = 0; }, kInvalid},
      {"dim 2^32 + 1", [](Args& a) { a.dims[0] = (uint64_t{1} << 32) + 1; }, kInvalid},
      {"stride not a multiple of 16", [](Args& a) { a.strides[0] = 520; }, kInvalid},
      {"stride 2^40", [](Args& a) { a.strides[0] = uint64_t{1} << 40; }, kInvalid},
      {"box 0", [](Args& a) { a.box[1] = 0; }, kInvalid},
      {"box 257",
       [](Args& a) {
         a.box[1] = 257;
         a.swizzle = 0;
       },
       kInvalid},
      {"inner box bytes not a multiple of 16",
       [](Args& a) {
         a.box[0] = 12;
         a.swizzle = 0;
       },
       kInvalid},
      {"element stride 9", [](Args& a) { a.estr[1] = 9; }, kInvalid},
      {"128B swizzle, 256-byte rows", [](Args& a) { a.box[0] = 128; }, kInvalid},
      {"64B swizzle, 128-byte rows", [](Args& a) { a.swizzle = 2; }, kInvalid},
      {"32B swizzle, 64-byte rows",
       [](Args& a) {
         a.swizzle = 1;
         a.box[0] = 32;
       },
       kInvalid},
      {"swizzle 7", [](Args& a) { a.swizzle = 7; }, kInvalid},
      {"l2 promotion 4", [](Args& a) { a.l2 = 4; }, kInvalid},
      {"NaN fill of an integer type",
       [](Args& a) {
         a.dtype = 1;
         a.oob = 1;
       },
       kInvalid},
  };
  for (const Broken& b : broken) {
    Args a = ok;
    b.change(a);
    EXPECT_EQ(encode(a), b.error) << b.what;
  }
  // The limits themselves are accepted.
  Args edge = ok;
  edge.dims[0] = uint64_t{1} << 32;
  edge.strides[0] = (uint64_t{1} << 40) - 16;
  edge.box[1] = 256;
  edge.estr[1] = 8;
  edge.oob = 1;
  EXPECT_EQ(encode(edge), 0);
}

}  // namespace
}  // namespace hsap
