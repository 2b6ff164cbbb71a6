// The partition entry points of the C ABI: byte sizes the caller gives are checked before
// any copy.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"

namespace {

using ::testing::HasSubstr;

TEST(ApiPartitionTest, BytesPerTokenBeyondAnyRowIsRejectedBeforeCopying) {
  const int64_t cu[] = {0, 8, 16};
  hsapLayout_t layout = nullptr;
  ASSERT_EQ(hsapLayoutCreate(&layout, cu, 2, nullptr, nullptr), hsapSuccess);
  hsapPartition_t partition = nullptr;
  ASSERT_EQ(hsapPartitionCreate(&partition, layout, 2, nullptr), hsapSuccess);

  // Tiny buffers: a size that passed the check would copy far past their ends.
  std::vector<char> row(16), shard0(16), shard1(16);
  void* shards[] = {shard0.data(), shard1.data()};
  const void* const_shards[] = {shard0.data(), shard1.data()};
  for (const size_t bytes : {size_t{1} << 62, size_t{1} << 63, std::numeric_limits<size_t>::max(),
                             (size_t{1} << 56) / 16 + 1}) {
    EXPECT_EQ(hsapPartitionScatter(partition, row.data(), bytes, shards), hsapInvalidArgument)
        << bytes;
    EXPECT_THAT(hsapGetLastError(), HasSubstr("bytesPerToken = "));
    EXPECT_THAT(hsapGetLastError(), HasSubstr("2^56 bytes"));
    EXPECT_EQ(hsapPartitionGather(partition, const_shards, bytes, row.data()), hsapInvalidArgument)
        << bytes;
    EXPECT_THAT(hsapGetLastError(), HasSubstr("bytesPerToken = "));
  }
  // One byte per token still round-trips.
  for (int i = 0; i < 16; ++i) row[i] = static_cast<char>(i);
  ASSERT_EQ(hsapPartitionScatter(partition, row.data(), 1, shards), hsapSuccess);
  std::vector<char> back(16, -1);
  ASSERT_EQ(hsapPartitionGather(partition, const_shards, 1, back.data()), hsapSuccess);
  EXPECT_EQ(back, row);

  EXPECT_EQ(hsapPartitionDestroy(partition), hsapSuccess);
  EXPECT_EQ(hsapLayoutDestroy(layout), hsapSuccess);
}

}  // namespace
