// ExchangeBuilder (lib/cuda/exec/exchange_program.h): the staging offsets of messages, and
// the rule of the chunk kernels that one launch's chunks never overlap in the destination:
// copy programs that would write a byte twice are refused; add programs that receive into
// the same elements twice unpack in rounds, each round disjoint, in message order.
#include "lib/cuda/exec/exchange_program.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace hsap::cuda {
namespace {

constexpr uint64_t kTag = 7;

// The pieces of each launch, as (dst, bytes), in launch order.
std::vector<std::vector<std::pair<long long, long long>>> Launches(const ExchangeProgram& p) {
  hsap_dev::ChunksParams device{};
  device.chunks = p.unpack.data();  // a stand-in for the uploaded list
  device.num_chunks = static_cast<long long>(p.unpack.size());
  std::vector<std::vector<std::pair<long long, long long>>> out;
  for (const hsap_dev::ChunksParams& c : UnpackLaunches(p, device)) {
    out.emplace_back();
    for (long long i = 0; i < c.num_chunks; ++i) {
      out.back().push_back({c.chunks[i].dst, c.chunks[i].bytes});
    }
  }
  return out;
}

TEST(ExchangeBuilder, MessagesTakeAlignedStagingAndOneUnpackLaunch) {
  ExchangeBuilder b;
  b.Send(1, kTag, {{0, 64}, {128, 64}});
  b.Receive(2, kTag, {{0, 100}});
  b.Receive(3, kTag, {{256, 28}});
  absl::StatusOr<ExchangeProgram> p = std::move(b).Build();
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->sends.size(), 1u);
  EXPECT_EQ(p->sends[0].bytes, 128u);
  ASSERT_EQ(p->recvs.size(), 2u);
  EXPECT_EQ(p->recvs[0].offset, 0u);
  EXPECT_EQ(p->recvs[1].offset, 256u);  // messages start on 256-byte boundaries
  EXPECT_EQ(p->recv_staging, 512u);
  // The two source chunks of the send are packed back to back.
  ASSERT_EQ(p->pack.size(), 2u);
  EXPECT_EQ(p->pack[1].dst, 64);
  using Pieces = std::vector<std::pair<long long, long long>>;
  EXPECT_EQ(Launches(*p), (std::vector<Pieces>{{{0, 100}, {256, 28}}}));
}

TEST(ExchangeBuilder, CopyProgramWritingABytesTwiceIsRefused) {
  ExchangeBuilder b;
  b.Receive(1, kTag, {{0, 64}});
  b.Receive(2, kTag, {{32, 64}});
  absl::StatusOr<ExchangeProgram> p = std::move(b).Build();
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(p.status().message().find("unpack list writes destination bytes [32, 96) twice"),
            std::string::npos)
      << p.status();

  ExchangeBuilder self;
  ASSERT_TRUE(self.Self({{0, 64}, {64, 64}}, {{0, 64}, {60, 64}}).ok());
  EXPECT_FALSE(std::move(self).Build().ok());
}

// An owner adding the partials of three members into the same rows, with a fourth message
// into other rows: a round per repeat, the disjoint message joining the round it fits.
TEST(ExchangeBuilder, AddProgramUnpacksRepeatedElementsInRounds) {
  ExchangeBuilder b(/*add=*/true);
  b.Receive(1, kTag, {{0, 64}, {128, 64}});
  b.Receive(2, kTag, {{0, 64}, {128, 64}});
  b.Receive(3, kTag, {{64, 64}});
  b.Receive(4, kTag, {{128, 32}});
  absl::StatusOr<ExchangeProgram> p = std::move(b).Build();
  ASSERT_TRUE(p.ok()) << p.status();
  using Pieces = std::vector<std::pair<long long, long long>>;
  EXPECT_EQ(Launches(*p), (std::vector<Pieces>{{{0, 64}, {128, 64}},
                                               {{0, 64}, {128, 64}, {64, 64}},
                                               {{128, 32}}}));
  // Every element sums its messages in message order: replay the launches on the host.
  std::vector<float> dst(64, 0.0f);
  std::vector<float> staging(p->recv_staging / 4);
  for (size_t m = 0; m < p->recvs.size(); ++m) {
    for (size_t i = 0; i < p->recvs[m].bytes / 4; ++i) {
      staging[p->recvs[m].offset / 4 + i] = static_cast<float>(m + 1);
    }
  }
  for (const hsap_dev::CopyChunk& c : p->unpack) {
    for (long long i = 0; i < c.bytes / 4; ++i) dst[c.dst / 4 + i] += staging[c.src / 4 + i];
  }
  EXPECT_EQ(dst[0], 1.0f + 2.0f);
  EXPECT_EQ(dst[16], 3.0f);
  EXPECT_EQ(dst[32], 1.0f + 2.0f + 4.0f);
  EXPECT_EQ(dst[40], 1.0f + 2.0f);
}

TEST(ExchangeBuilder, EmptyProgramHasNoLaunch) {
  absl::StatusOr<ExchangeProgram> p = ExchangeBuilder(/*add=*/true).Build();
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(Launches(*p).empty());
}

}  // namespace
}  // namespace hsap::cuda
