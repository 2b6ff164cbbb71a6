// tests/support/emulated_swizzle.h: the shared-memory swizzle of TMA and wgmma against the
// PTX ISA's "Tensor Swizzling Modes" tables written out literally (the chunk each 16-byte
// chunk of the first 128-byte lines lands in), plus the properties the ISA states: a
// permutation of each repeat (S * 8 bytes) that keeps the byte within a chunk, keeps a chunk
// within its S-byte segment, repeats with the period, and is its own inverse; and the two
// numberings of the modes (wgmma descriptor field, CUtensorMapSwizzle).
#include "tests/support/emulated_swizzle.h"

#include <cstdint>
#include <set>

#include "gtest/gtest.h"

namespace hsap_emu {
namespace {

// The ISA's tables: kTable[mode][line][chunk] = the chunk (0..7 within the 128-byte line)
// where the 16-byte chunk `chunk` of 128-byte line `line` is stored. Lines 0..7.
constexpr int kTable128[8][8] = {
    {0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6}, {2, 3, 0, 1, 6, 7, 4, 5},
    {3, 2, 1, 0, 7, 6, 5, 4}, {4, 5, 6, 7, 0, 1, 2, 3}, {5, 4, 7, 6, 1, 0, 3, 2},
    {6, 7, 4, 5, 2, 3, 0, 1}, {7, 6, 5, 4, 3, 2, 1, 0}};
constexpr int kTable64[8][8] = {
    {0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6}, {2, 3, 0, 1, 6, 7, 4, 5},
    {3, 2, 1, 0, 7, 6, 5, 4}, {0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6},
    {2, 3, 0, 1, 6, 7, 4, 5}, {3, 2, 1, 0, 7, 6, 5, 4}};
constexpr int kTable32[8][8] = {
    {0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6}, {0, 1, 2, 3, 4, 5, 6, 7},
    {1, 0, 3, 2, 5, 4, 7, 6}, {0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6},
    {0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6}};

constexpr SwizzleMode kModes[] = {SwizzleMode::kNone, SwizzleMode::k32B, SwizzleMode::k64B,
                                  SwizzleMode::k128B};

TEST(SwizzleTest, MatchesTheIsaTables) {
  const struct {
    SwizzleMode mode;
    const int (*table)[8];
  } cases[] = {{SwizzleMode::k128B, kTable128},
               {SwizzleMode::k64B, kTable64},
               {SwizzleMode::k32B, kTable32}};
  for (const auto& c : cases) {
    for (uint32_t base : {0u, 1024u, 7u * 1024u, 228u * 1024u - 1024u}) {
      for (int line = 0; line < 8; ++line) {
        for (int chunk = 0; chunk < 8; ++chunk) {
          for (uint32_t byte : {0u, 5u, 15u}) {
            const uint32_t in = base + line * 128 + chunk * 16 + byte;
            const uint32_t want = base + line * 128 + c.table[line][chunk] * 16 + byte;
            EXPECT_EQ(SwizzleSharedOffset(in, c.mode), want)
                << SwizzleName(c.mode) << " line " << line << " chunk " << chunk;
          }
        }
      }
    }
  }
}

TEST(SwizzleTest, NoneIsTheIdentity) {
  for (uint32_t x = 0; x < 4096; x += 3) EXPECT_EQ(SwizzleSharedOffset(x, SwizzleMode::kNone), x);
}

TEST(SwizzleTest, PermutesEachRepeatKeepingBytesAndSegments) {
  for (SwizzleMode mode : kModes) {
    const uint32_t repeat = SwizzleRepeatBytes(mode);
    const uint32_t span = mode == SwizzleMode::kNone ? 16 : SwizzleSpanBytes(mode);
    for (uint32_t base : {0u, repeat, 37u * repeat}) {
      std::set<uint32_t> seen;
      for (uint32_t x = base; x < base + repeat; ++x) {
        const uint32_t y = SwizzleSharedOffset(x, mode);
        EXPECT_EQ(y / repeat, x / repeat) << SwizzleName(mode) << " leaves its repeat at " << x;
        EXPECT_EQ(y / span, x / span) << SwizzleName(mode) << " leaves its segment at " << x;
        EXPECT_EQ(y % 16, x % 16) << SwizzleName(mode) << " moves a byte within its chunk";
        EXPECT_EQ(SwizzleSharedOffset(y, mode), x) << SwizzleName(mode) << " not an involution";
        EXPECT_EQ(SwizzleSharedOffset(x + repeat, mode), y + repeat)
            << SwizzleName(mode) << " does not repeat every " << repeat << " bytes";
        seen.insert(y);
      }
      EXPECT_EQ(seen.size(), repeat) << SwizzleName(mode) << " is not a permutation";
    }
  }
}

// Each of the S / 16 chunks of a column position lands in a different 16-byte bank group
// across the atom's lines: what the swizzle is for (8 lines reading chunk 0 of a 128B-swizzled
// tile hit 8 different bank groups).
TEST(SwizzleTest, SpreadsAColumnOverTheBanks) {
  for (SwizzleMode mode : {SwizzleMode::k32B, SwizzleMode::k64B, SwizzleMode::k128B}) {
    const uint32_t chunks = SwizzleSpanBytes(mode) / 16;
    for (uint32_t chunk = 0; chunk < chunks; ++chunk) {
      std::set<uint32_t> groups;
      for (uint32_t line = 0; line < chunks; ++line) {
        groups.insert((SwizzleSharedOffset(line * 128 + chunk * 16, mode) % 128) / 16);
      }
      EXPECT_EQ(groups.size(), chunks) << SwizzleName(mode);
    }
  }
}

TEST(SwizzleTest, SizesAndEncodings) {
  EXPECT_EQ(SwizzleRepeatBytes(SwizzleMode::k128B), 1024u);
  EXPECT_EQ(SwizzleRepeatBytes(SwizzleMode::k64B), 512u);
  EXPECT_EQ(SwizzleRepeatBytes(SwizzleMode::k32B), 256u);
  EXPECT_EQ(SwizzleRepeatBytes(SwizzleMode::kNone), 16u);
  EXPECT_EQ(SwizzleFromWgmmaField(0), SwizzleMode::kNone);
  EXPECT_EQ(SwizzleFromWgmmaField(1), SwizzleMode::k128B);
  EXPECT_EQ(SwizzleFromWgmmaField(2), SwizzleMode::k64B);
  EXPECT_EQ(SwizzleFromWgmmaField(3), SwizzleMode::k32B);
  EXPECT_EQ(SwizzleFromWgmmaField(4), std::nullopt);
  EXPECT_EQ(SwizzleFromTensorMap(0), SwizzleMode::kNone);
  EXPECT_EQ(SwizzleFromTensorMap(1), SwizzleMode::k32B);
  EXPECT_EQ(SwizzleFromTensorMap(2), SwizzleMode::k64B);
  EXPECT_EQ(SwizzleFromTensorMap(3), SwizzleMode::k128B);
  EXPECT_EQ(SwizzleFromTensorMap(4), std::nullopt);
  EXPECT_EQ(SwizzleFromTensorMap(-1), std::nullopt);
}

}  // namespace
}  // namespace hsap_emu
