#include "lib/comm/alltoallv.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/comm/host_transport.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

std::vector<std::unique_ptr<Transport>> MakeWorld(int n,
                                                  absl::Duration timeout = absl::Seconds(20)) {
  auto world = CreateHostTransports(n, timeout);
  EXPECT_TRUE(world.ok()) << world.status();
  return std::move(*world);
}

std::vector<absl::Status> RunRanks(int n, const std::function<absl::Status(int)>& body) {
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r]() { results[r] = body(r); });
  for (std::thread& t : threads) t.join();
  return results;
}

uint8_t SendByte(int rank, size_t offset) {
  return static_cast<uint8_t>(rank * 97 + offset * 31 + (offset >> 7) + 1);
}

constexpr uint8_t kSentinel = 0xA5;

// Random ragged exchange among `group` (world ranks, random order) with random chunk lists:
// each (src, dst) pair has a random total (zero included); the sender cuts it into pieces
// at random (possibly overlapping) places of its send buffer, the receiver into different
// pieces at disjoint places of its receive buffer, listed in shuffled address order.
struct RaggedCase {
  std::vector<int> group;
  std::vector<size_t> send_bytes, recv_bytes;  // per member
  std::vector<AllToAllVPlan> plans;            // per member
};

std::vector<size_t> RandomCuts(size_t total, std::mt19937& rng) {
  std::vector<size_t> cuts;
  const int pieces = 1 + static_cast<int>(rng() % 4);
  size_t left = total;
  for (int p = 0; p + 1 < pieces && left > 0; ++p) {
    const size_t c = rng() % (left + 1);
    cuts.push_back(c);  // zero-byte pieces included on purpose
    left -= c;
  }
  cuts.push_back(left);
  return cuts;
}

RaggedCase MakeRaggedCase(std::vector<int> group, std::mt19937& rng) {
  const size_t n = group.size();
  RaggedCase rc;
  rc.group = group;
  std::vector<std::vector<size_t>> totals(n, std::vector<size_t>(n));
  for (auto& row : totals) {
    for (size_t& t : row) t = rng() % 5 == 0 ? 0 : rng() % 700;
  }
  rc.plans.resize(n);
  rc.send_bytes.resize(n);
  rc.recv_bytes.resize(n);
  for (size_t i = 0; i < n; ++i) {
    AllToAllVPlan& plan = rc.plans[i];
    plan.group = group;
    plan.send_chunks.resize(n);
    plan.recv_chunks.resize(n);
    const size_t send_size = 1 + rng() % 900;
    rc.send_bytes[i] = send_size;
    for (size_t j = 0; j < n; ++j) {
      for (size_t cut : RandomCuts(totals[i][j], rng)) {
        if (cut > send_size) {  // keep it inside the buffer: split into pieces that fit
          size_t left = cut;
          while (left > 0) {
            const size_t piece = std::min(left, send_size);
            plan.send_chunks[j].push_back({rng() % (send_size - piece + 1), piece});
            left -= piece;
          }
        } else {
          plan.send_chunks[j].push_back({rng() % (send_size - cut + 1), cut});
        }
      }
    }
    // Receive pieces: cut each incoming total, shuffle all pieces, lay them out with gaps.
    struct Piece {
      size_t member, index, bytes;
    };
    std::vector<Piece> pieces;
    for (size_t j = 0; j < n; ++j) {
      std::vector<size_t> cuts = RandomCuts(totals[j][i], rng);
      for (size_t k = 0; k < cuts.size(); ++k) pieces.push_back({j, k, cuts[k]});
      plan.recv_chunks[j].resize(cuts.size());
    }
    std::shuffle(pieces.begin(), pieces.end(), rng);
    size_t cursor = rng() % 5;
    for (const Piece& p : pieces) {
      plan.recv_chunks[p.member][p.index] = {cursor, p.bytes};
      cursor += p.bytes + rng() % 5;
    }
    rc.recv_bytes[i] = cursor + rng() % 5;
  }
  return rc;
}

// The expected receive buffer of member i, built independently of AllToAllV: walk the
// sender's chunk bytes and the receiver's chunk slots byte by byte.
std::vector<uint8_t> ExpectedReceive(const RaggedCase& rc, size_t i) {
  std::vector<uint8_t> out(rc.recv_bytes[i], kSentinel);
  for (size_t j = 0; j < rc.group.size(); ++j) {
    std::vector<uint8_t> payload;
    for (const ByteChunk& c : rc.plans[j].send_chunks[i]) {
      for (size_t b = 0; b < c.bytes; ++b) payload.push_back(SendByte(rc.group[j], c.offset + b));
    }
    size_t k = 0;
    for (const ByteChunk& c : rc.plans[i].recv_chunks[j]) {
      for (size_t b = 0; b < c.bytes; ++b) out[c.offset + b] = payload.at(k++);
    }
    EXPECT_EQ(k, payload.size());
  }
  return out;
}

TEST(AllToAllVTest, RandomRaggedTablesOnRandomSubgroups) {
  constexpr int kWorld = 7;
  std::mt19937 rng(20261129);
  for (int trial = 0; trial < 12; ++trial) {
    auto world = MakeWorld(kWorld);
    // Two disjoint groups of random membership and order run at the same time.
    std::vector<int> ranks(kWorld);
    std::iota(ranks.begin(), ranks.end(), 0);
    std::shuffle(ranks.begin(), ranks.end(), rng);
    const size_t first = 1 + rng() % (kWorld - 1);
    std::vector<RaggedCase> cases = {MakeRaggedCase({ranks.begin(), ranks.begin() + first}, rng),
                                     MakeRaggedCase({ranks.begin() + first, ranks.end()}, rng)};
    std::vector<std::vector<uint8_t>> received(kWorld);
    std::vector<AllToAllVStats> stats(kWorld);
    auto results = RunRanks(kWorld, [&](int rank) -> absl::Status {
      for (const RaggedCase& rc : cases) {
        auto it = std::find(rc.group.begin(), rc.group.end(), rank);
        if (it == rc.group.end()) continue;
        const size_t i = it - rc.group.begin();
        std::vector<uint8_t> send(rc.send_bytes[i]);
        for (size_t b = 0; b < send.size(); ++b) send[b] = SendByte(rank, b);
        received[rank].assign(rc.recv_bytes[i], kSentinel);
        auto s = AllToAllV(*world[rank], send.data(), send.size(), received[rank].data(),
                           received[rank].size(), rc.plans[i], 5, "ragged");
        if (!s.ok()) return s.status();
        stats[rank] = *s;
      }
      return absl::OkStatus();
    });
    for (const auto& s : results) ASSERT_TRUE(s.ok()) << s;
    for (const RaggedCase& rc : cases) {
      for (size_t i = 0; i < rc.group.size(); ++i) {
        const int rank = rc.group[i];
        EXPECT_EQ(received[rank], ExpectedReceive(rc, i)) << "trial " << trial << " rank " << rank;
        // Accounting: bytes to/from others, own share local, transport counters agree.
        uint64_t sent = 0, got = 0, staged = 0;
        for (size_t j = 0; j < rc.group.size(); ++j) {
          if (j == i) continue;
          uint64_t s_total = 0, r_total = 0;
          for (const ByteChunk& c : rc.plans[i].send_chunks[j]) s_total += c.bytes;
          for (const ByteChunk& c : rc.plans[i].recv_chunks[j]) r_total += c.bytes;
          sent += s_total;
          got += r_total;
          if (rc.plans[i].send_chunks[j].size() > 1) staged += s_total;
          if (rc.plans[i].recv_chunks[j].size() > 1) staged += r_total;
        }
        uint64_t own = 0;
        for (const ByteChunk& c : rc.plans[i].send_chunks[i]) own += c.bytes;
        EXPECT_EQ(stats[rank].bytes_sent, sent);
        EXPECT_EQ(stats[rank].bytes_received, got);
        EXPECT_EQ(stats[rank].bytes_local, own);
        EXPECT_EQ(stats[rank].bytes_staged, staged);
        EXPECT_EQ(stats[rank].messages_sent, rc.group.size() - 1);
        EXPECT_EQ(world[rank]->counters().bytes_sent, sent);
        EXPECT_EQ(world[rank]->counters().bytes_received, got);
      }
    }
  }
}

TEST(AllToAllVTest, SplitTables) {
  // MPI-style counts and displacements (elements of 4 bytes) among world ranks {3, 0, 2}.
  const std::vector<int> group = {3, 0, 2};
  auto world = MakeWorld(4);
  std::mt19937 rng(7);
  const size_t n = group.size();
  std::vector<std::vector<int64_t>> counts(n, std::vector<int64_t>(n));
  for (auto& row : counts) {
    for (int64_t& c : row) c = rng() % 6;
  }
  std::vector<SplitTable> tables(n);
  std::vector<int64_t> send_total(n, 0), recv_total(n, 0);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      tables[i].send_counts.push_back(counts[i][j]);
      tables[i].send_displs.push_back(send_total[i]);
      send_total[i] += counts[i][j];
      // Receive in reverse member order to show displacements are honoured.
    }
    int64_t displ = 0;
    tables[i].recv_counts.resize(n);
    tables[i].recv_displs.resize(n);
    for (size_t j = n; j-- > 0;) {
      tables[i].recv_counts[j] = counts[j][i];
      tables[i].recv_displs[j] = displ;
      displ += counts[j][i];
    }
    recv_total[i] = displ;
  }
  std::vector<std::vector<int32_t>> out(n);
  auto results = RunRanks(4, [&](int rank) -> absl::Status {
    auto it = std::find(group.begin(), group.end(), rank);
    if (it == group.end()) return absl::OkStatus();
    const size_t i = it - group.begin();
    std::vector<int32_t> in(send_total[i]);
    for (size_t e = 0; e < in.size(); ++e) in[e] = static_cast<int32_t>(rank * 1000 + e);
    out[i].assign(recv_total[i], -1);
    auto plan = PlanFromSplits(group, tables[i], sizeof(int32_t));
    if (!plan.ok()) return plan.status();
    return AllToAllV(*world[rank], in.data(), in.size() * 4, out[i].data(), out[i].size() * 4,
                     *plan, 0, "splits")
        .status();
  });
  for (const auto& s : results) ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      for (int64_t e = 0; e < counts[j][i]; ++e) {
        EXPECT_EQ(out[i][tables[i].recv_displs[j] + e],
                  group[j] * 1000 + tables[j].send_displs[i] + e)
            << "member " << i << " from member " << j;
      }
    }
  }
  SplitTable bad = tables[0];
  bad.recv_counts[1] = -1;
  EXPECT_EQ(PlanFromSplits(group, bad, 4).status().code(), absl::StatusCode::kInvalidArgument);
  bad = tables[0];
  bad.send_displs.pop_back();
  EXPECT_EQ(PlanFromSplits(group, bad, 4).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ThdTest, ChunksCoalesce) {
  const ThdShape shape{10, 6, 4, 2};  // 8-byte heads, 48-byte tokens
  // Whole tokens 2..5: one chunk.
  auto c = ThdChunks(shape, {{{2, 5}}}, {{0, 1, 2, 3, 4, 5}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<ByteChunk>{{96, 144}}));
  // Heads {1, 2, 4} of tokens 0..1 and 7: runs {1,2} and {4} per token.
  c = ThdChunks(shape, {{{0, 2}, {7, 8}}}, {{1, 2, 4}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<ByteChunk>{{8, 16}, {32, 8}, {56, 16}, {80, 8}, {344, 16}, {368, 8}}));
  // Head 5 of token 0 and head 0 of token 1 touch in memory but not in list order: kept apart.
  c = ThdChunks(shape, {{{0, 2}}}, {{5, 0}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<ByteChunk>{{40, 8}, {0, 8}, {88, 8}, {48, 8}}));
  c = ThdChunks(shape, {{{3, 3}}}, {{1}});
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->empty());
}

TEST(ThdTest, RejectsBadSelections) {
  const ThdShape shape{10, 6, 4, 2};
  EXPECT_THAT(ThdChunks(shape, {{{0, 11}}}, {{0}}).status().message(), HasSubstr("ranges[0]"));
  EXPECT_THAT(ThdChunks(shape, {{{5, 4}}}, {{0}}).status().message(), HasSubstr("ranges[0]"));
  EXPECT_THAT(ThdChunks(shape, {{{0, 1}}}, {{6}}).status().message(), HasSubstr("heads[0]"));
  EXPECT_THAT(ThdChunks(shape, {{{0, 1}}}, {{2, 2}}).status().message(), HasSubstr("twice"));
  EXPECT_EQ(ThdChunks(ThdShape{10, 0, 4, 2}, {}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> tensor(10 * 6 * 4 * 2), staging(16);
  EXPECT_THAT(
      PackThd(tensor.data(), shape, {{{0, 1}}}, {{0}}, staging.data(), staging.size()).message(),
      HasSubstr("staging has 16 bytes but the selection holds 8"));
}

TEST(ThdTest, PackUnpackRoundTrip) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 20; ++trial) {
    const ThdShape shape{static_cast<int64_t>(1 + rng() % 20), static_cast<int>(1 + rng() % 8),
                         static_cast<int>(1 + rng() % 5), size_t{1} << (rng() % 3)};
    std::vector<int> heads(shape.heads);
    std::iota(heads.begin(), heads.end(), 0);
    std::shuffle(heads.begin(), heads.end(), rng);
    heads.resize(1 + rng() % shape.heads);
    std::vector<TokenRange> ranges;
    for (int k = 0; k < 3; ++k) {
      const int64_t a = rng() % (shape.tokens + 1), b = rng() % (shape.tokens + 1);
      ranges.push_back({std::min(a, b), std::max(a, b)});
    }
    const size_t elem = shape.element_bytes, hd = shape.head_dim;
    std::vector<uint8_t> tensor(shape.tokens * shape.heads * hd * elem);
    for (size_t b = 0; b < tensor.size(); ++b) tensor[b] = static_cast<uint8_t>(b * 7 + 3);
    auto bytes = ThdSelectionBytes(shape, ranges, heads);
    ASSERT_TRUE(bytes.ok());
    std::vector<uint8_t> staging(*bytes);
    ASSERT_TRUE(PackThd(tensor.data(), shape, ranges, heads, staging.data(), staging.size()).ok());
    // Reference: element (t, h, d) of the selection in (token, listed head, dim) order.
    size_t k = 0;
    for (const TokenRange& r : ranges) {
      for (int64_t t = r.begin; t < r.end; ++t) {
        for (int h : heads) {
          for (size_t b = 0; b < hd * elem; ++b, ++k) {
            ASSERT_EQ(staging[k], tensor[(t * shape.heads + h) * hd * elem + b]);
          }
        }
      }
    }
    ASSERT_EQ(k, staging.size());
    // Unpack into a blank tensor: exactly the selected elements come back.
    std::vector<uint8_t> back(tensor.size(), 0);
    ASSERT_TRUE(UnpackThd(staging.data(), staging.size(), shape, ranges, heads, back.data()).ok());
    for (int64_t t = 0; t < shape.tokens; ++t) {
      bool token_selected = false;
      for (const TokenRange& r : ranges) token_selected |= (t >= r.begin && t < r.end);
      for (int h = 0; h < shape.heads; ++h) {
        const bool selected =
            token_selected && std::find(heads.begin(), heads.end(), h) != heads.end();
        for (size_t b = 0; b < hd * elem; ++b) {
          const size_t at = (t * shape.heads + h) * hd * elem + b;
          ASSERT_EQ(back[at], selected ? tensor[at] : 0) << "t " << t << " h " << h;
        }
      }
    }
  }
}

// Ulysses-style head-parallel exchange with uneven shards and non-contiguous head subsets:
// member i holds tokens shard[i] of all H heads; afterwards member j holds all tokens of
// its heads heads[j] (a random, non-contiguous subset), as [T, |heads[j]|, D].
TEST(AllToAllVTest, HeadSubsetExchangeMatchesDirectGather) {
  constexpr int kWorld = 5;
  const std::vector<int> group = {4, 1, 3, 0};  // rank 2 sits out
  const size_t n = group.size();
  const int H = 7, D = 3;
  const size_t elem = 2;
  std::mt19937 rng(5);
  // Uneven token shards (one of them empty).
  const std::vector<int64_t> shard_tokens = {5, 0, 9, 3};
  std::vector<int64_t> shard_begin(n + 1, 0);
  for (size_t i = 0; i < n; ++i) shard_begin[i + 1] = shard_begin[i] + shard_tokens[i];
  const int64_t T = shard_begin[n];
  // A random partition of the heads into members, each list shuffled.
  std::vector<int> all_heads(H);
  std::iota(all_heads.begin(), all_heads.end(), 0);
  std::shuffle(all_heads.begin(), all_heads.end(), rng);
  std::vector<std::vector<int>> heads(n);
  for (int h = 0; h < H; ++h) heads[h % n].push_back(all_heads[h]);
  auto global_byte = [&](int64_t t, int h, size_t b) {
    return static_cast<uint8_t>(t * 53 + h * 11 + b * 3 + 1);
  };
  auto world = MakeWorld(kWorld);
  std::vector<std::vector<uint8_t>> outputs(n);
  auto results = RunRanks(kWorld, [&](int rank) -> absl::Status {
    auto it = std::find(group.begin(), group.end(), rank);
    if (it == group.end()) return absl::OkStatus();
    const size_t i = it - group.begin();
    const ThdShape local{shard_tokens[i], H, D, elem};
    std::vector<uint8_t> tensor(shard_tokens[i] * H * D * elem);
    for (int64_t t = 0; t < shard_tokens[i]; ++t) {
      for (int h = 0; h < H; ++h) {
        for (size_t b = 0; b < D * elem; ++b) {
          tensor[(t * H + h) * D * elem + b] = global_byte(shard_begin[i] + t, h, b);
        }
      }
    }
    const int my_heads = static_cast<int>(heads[i].size());
    const ThdShape gathered{T, my_heads, D, elem};
    outputs[i].assign(T * my_heads * D * elem, kSentinel);
    std::vector<int> positions(my_heads);
    std::iota(positions.begin(), positions.end(), 0);
    AllToAllVPlan plan;
    plan.group = group;
    for (size_t j = 0; j < n; ++j) {
      auto send = ThdChunks(local, {{{0, shard_tokens[i]}}}, heads[j]);
      if (!send.ok()) return send.status();
      plan.send_chunks.push_back(*send);
      auto recv = ThdChunks(gathered, {{{shard_begin[j], shard_begin[j + 1]}}}, positions);
      if (!recv.ok()) return recv.status();
      plan.recv_chunks.push_back(*recv);
    }
    return AllToAllV(*world[rank], tensor.data(), tensor.size(), outputs[i].data(),
                     outputs[i].size(), plan, 11, "ulysses q")
        .status();
  });
  for (const auto& s : results) ASSERT_TRUE(s.ok()) << s;
  for (size_t j = 0; j < n; ++j) {
    const int my_heads = static_cast<int>(heads[j].size());
    for (int64_t t = 0; t < T; ++t) {
      for (int p = 0; p < my_heads; ++p) {
        for (size_t b = 0; b < D * elem; ++b) {
          ASSERT_EQ(outputs[j][(t * my_heads + p) * D * elem + b], global_byte(t, heads[j][p], b))
              << "member " << j << " token " << t << " head " << heads[j][p];
        }
      }
    }
  }
}

TEST(AllToAllVTest, RejectsBadPlans) {
  auto world = MakeWorld(3);
  std::vector<uint8_t> send(64), recv(64);
  AllToAllVPlan plan;
  plan.group = {0, 1};
  plan.send_chunks = {{{0, 8}}, {{8, 8}}};
  plan.recv_chunks = {{{0, 8}}, {{8, 8}}};
  auto run = [&](const AllToAllVPlan& p, uint64_t tag = 0) {
    return AllToAllV(*world[0], send.data(), send.size(), recv.data(), recv.size(), p, tag, "bad")
        .status();
  };
  AllToAllVPlan p = plan;
  p.group = {1, 2};
  p.send_chunks.resize(2);
  EXPECT_THAT(run(p).message(), HasSubstr("rank 0 is not in the group"));
  p = plan;
  p.group = {0, 0};
  EXPECT_THAT(run(p).message(), HasSubstr("appears twice"));
  p = plan;
  p.group = {0, 3};
  EXPECT_THAT(run(p).message(), HasSubstr("group[1] = 3"));
  p = plan;
  p.recv_chunks.pop_back();
  EXPECT_THAT(run(p).message(), HasSubstr("one per group member"));
  p = plan;
  p.send_chunks[1] = {{60, 8}};
  EXPECT_THAT(run(p).message(), HasSubstr("send_chunks[1][0]"));
  p = plan;
  p.recv_chunks[1] = {{4, 8}};
  EXPECT_THAT(run(p).message(), HasSubstr("overlaps"));
  p = plan;
  p.recv_chunks[0] = {{0, 4}};
  EXPECT_THAT(run(p).message(), HasSubstr("equal totals"));
  EXPECT_THAT(run(plan, kMaxAllToAllVTag + 1).message(), HasSubstr("tag"));
  p.group.clear();
  EXPECT_THAT(run(p).message(), HasSubstr("group is empty"));
  // In place with overlapping send and receive regions.
  p = plan;
  EXPECT_THAT(AllToAllV(*world[0], send.data(), 64, send.data(), 64, p, 0, "x").status().message(),
              HasSubstr("overlaps"));
  EXPECT_EQ(world[0]->counters().messages_sent, 0u) << "a rejected call posts nothing";
}

TEST(AllToAllVTest, DisagreeingTablesFailOnBothRanks) {
  auto world = MakeWorld(2, absl::Seconds(10));
  auto results = RunRanks(2, [&](int rank) -> absl::Status {
    std::vector<uint8_t> send(32, 1), recv(32, 0);
    AllToAllVPlan plan;
    plan.group = {0, 1};
    plan.send_chunks = {{{0, 4}}, {{4, 4}}};
    plan.recv_chunks = {{{0, 4}}, {{4, 4}}};
    if (rank == 1) plan.recv_chunks = {{{0, 6}}, {{8, 4}}};  // expects 6 from rank 0
    return AllToAllV(*world[rank], send.data(), send.size(), recv.data(), recv.size(), plan, 2,
                     "moe dispatch")
        .status();
  });
  for (const auto& s : results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("size mismatch in stage 'moe dispatch'"));
    EXPECT_THAT(s.message(), HasSubstr("tag alltoallv#2"));
  }
}

}  // namespace
}  // namespace hsap
