#include "lib/comm/alltoallv.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

size_t Total(absl::Span<const ByteChunk> chunks) {
  size_t total = 0;
  for (const ByteChunk& c : chunks) total += c.bytes;
  return total;
}

// Checks that every chunk lies inside a buffer of `size` bytes (and that the buffer is
// non-null when it has chunks to move), and that the total fits size_t.
absl::Status CheckChunksInside(absl::string_view what, size_t member, int peer,
                               absl::Span<const ByteChunk> chunks, const void* buffer,
                               size_t size) {
  size_t total = 0;
  for (size_t k = 0; k < chunks.size(); ++k) {
    const ByteChunk& c = chunks[k];
    if (c.offset > size || c.bytes > size - c.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", member, "][", k, "] (for rank ", peer, ") = {offset ", c.offset,
                       ", bytes ", c.bytes, "} runs past the end of the ", size, "-byte buffer"));
    }
    if (c.bytes > 0 && buffer == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", member, "][", k, "] has bytes but its buffer is null"));
    }
    if (c.bytes > std::numeric_limits<size_t>::max() - total) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", member, "]: the total size overflows size_t"));
    }
    total += c.bytes;
  }
  return absl::OkStatus();
}

// Receive chunks must be pairwise disjoint and disjoint from every send chunk (in absolute
// addresses, since send and recv may be the same buffer).
absl::Status CheckReceiveRegionsDisjoint(const void* send, const void* recv,
                                         const AllToAllVPlan& plan) {
  struct Interval {
    uintptr_t begin, end;
    bool is_recv;
    size_t member, index;
  };
  std::vector<Interval> intervals;
  for (size_t j = 0; j < plan.group.size(); ++j) {
    for (size_t k = 0; k < plan.send_chunks[j].size(); ++k) {
      const ByteChunk& c = plan.send_chunks[j][k];
      if (c.bytes == 0) continue;
      const uintptr_t b = reinterpret_cast<uintptr_t>(send) + c.offset;
      intervals.push_back({b, b + c.bytes, false, j, k});
    }
    for (size_t k = 0; k < plan.recv_chunks[j].size(); ++k) {
      const ByteChunk& c = plan.recv_chunks[j][k];
      if (c.bytes == 0) continue;
      const uintptr_t b = reinterpret_cast<uintptr_t>(recv) + c.offset;
      intervals.push_back({b, b + c.bytes, true, j, k});
    }
  }
  std::sort(intervals.begin(), intervals.end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  const Interval* furthest_any = nullptr;
  const Interval* furthest_recv = nullptr;
  auto name = [](const Interval& v) {
    return absl::StrCat(v.is_recv ? "recv_chunks[" : "send_chunks[", v.member, "][", v.index, "]");
  };
  for (const Interval& v : intervals) {
    const Interval* clash = nullptr;
    if (furthest_recv != nullptr && v.begin < furthest_recv->end) clash = furthest_recv;
    if (clash == nullptr && v.is_recv && furthest_any != nullptr && v.begin < furthest_any->end) {
      clash = furthest_any;
    }
    if (clash != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(v), " overlaps ", name(*clash),
                       "; receive regions must not overlap each other or any send region"));
    }
    if (furthest_any == nullptr || v.end > furthest_any->end) furthest_any = &v;
    if (v.is_recv && (furthest_recv == nullptr || v.end > furthest_recv->end)) furthest_recv = &v;
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> CheckGroup(const Transport& transport, const AllToAllVPlan& plan) {
  const size_t n = plan.group.size();
  if (n == 0) return absl::InvalidArgumentError("group is empty; it must contain this rank");
  if (plan.send_chunks.size() != n || plan.recv_chunks.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("send_chunks has ", plan.send_chunks.size(), " entries and recv_chunks ",
                     plan.recv_chunks.size(), "; both need one per group member (", n, ")"));
  }
  absl::flat_hash_set<int> seen;
  size_t me = n;
  for (size_t j = 0; j < n; ++j) {
    const int r = plan.group[j];
    if (r < 0 || r >= transport.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group[", j, "] = ", r, " is not a rank of this world of ", transport.size(), " ranks"));
    }
    if (!seen.insert(r).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("group[", j, "] = ", r, " appears twice in the group"));
    }
    if (r == transport.rank()) me = j;
  }
  if (me == n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", transport.rank(), " is not in the group; only members may call AllToAllV"));
  }
  return me;
}

}  // namespace

absl::Status ForEachPiece(absl::Span<const ByteChunk> src_chunks,
                          absl::Span<const ByteChunk> dst_chunks,
                          const std::function<void(size_t, size_t, size_t)>& fn) {
  if (Total(src_chunks) != Total(dst_chunks)) {
    return absl::InvalidArgumentError(absl::StrCat("source chunks hold ", Total(src_chunks),
                                                   " bytes but destination chunks ",
                                                   Total(dst_chunks)));
  }
  size_t si = 0, di = 0, s_used = 0, d_used = 0;
  while (si < src_chunks.size() && di < dst_chunks.size()) {
    const size_t s_left = src_chunks[si].bytes - s_used;
    const size_t d_left = dst_chunks[di].bytes - d_used;
    const size_t n = std::min(s_left, d_left);
    if (n > 0) fn(src_chunks[si].offset + s_used, dst_chunks[di].offset + d_used, n);
    s_used += n;
    d_used += n;
    if (s_used == src_chunks[si].bytes) {
      ++si;
      s_used = 0;
    }
    if (d_used == dst_chunks[di].bytes) {
      ++di;
      d_used = 0;
    }
  }
  return absl::OkStatus();
}

absl::Status CopyChunks(const void* src, absl::Span<const ByteChunk> src_chunks, void* dst,
                        absl::Span<const ByteChunk> dst_chunks) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  return ForEachPiece(src_chunks, dst_chunks,
                      [&](size_t from, size_t to, size_t n) { std::memcpy(d + to, s + from, n); });
}

absl::StatusOr<AllToAllVStats> AllToAllV(Transport& transport, const void* send, size_t send_bytes,
                                         void* recv, size_t recv_bytes, const AllToAllVPlan& plan,
                                         uint64_t tag, std::string stage) {
  HSAP_ASSIGN_OR_RETURN(size_t me_or, CheckGroup(transport, plan));
  const size_t me = me_or;
  if (tag > kMaxAllToAllVTag) {
    return absl::InvalidArgumentError(
        absl::StrCat("tag = ", tag, " exceeds the largest AllToAllV tag ", kMaxAllToAllVTag));
  }
  const size_t n = plan.group.size();
  for (size_t j = 0; j < n; ++j) {
    HSAP_RETURN_IF_ERROR(
        CheckChunksInside("send_chunks", j, plan.group[j], plan.send_chunks[j], send, send_bytes));
    HSAP_RETURN_IF_ERROR(
        CheckChunksInside("recv_chunks", j, plan.group[j], plan.recv_chunks[j], recv, recv_bytes));
  }
  HSAP_RETURN_IF_ERROR(CheckReceiveRegionsDisjoint(send, recv, plan));
  const size_t own_send = Total(plan.send_chunks[me]);
  const size_t own_recv = Total(plan.recv_chunks[me]);
  if (own_send != own_recv) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this rank (group member ", me, ") sends ", own_send, " bytes to itself but receives ",
        own_recv, "; send_chunks[", me, "] and recv_chunks[", me, "] must hold equal totals"));
  }

  // Staging: one contiguous buffer per direction for members with several chunks.
  size_t send_staging_bytes = 0, recv_staging_bytes = 0;
  for (size_t j = 0; j < n; ++j) {
    if (j == me) continue;
    if (plan.send_chunks[j].size() > 1) send_staging_bytes += Total(plan.send_chunks[j]);
    if (plan.recv_chunks[j].size() > 1) recv_staging_bytes += Total(plan.recv_chunks[j]);
  }
  std::unique_ptr<unsigned char[]> send_staging(
      send_staging_bytes > 0 ? new unsigned char[send_staging_bytes] : nullptr);
  std::unique_ptr<unsigned char[]> recv_staging(
      recv_staging_bytes > 0 ? new unsigned char[recv_staging_bytes] : nullptr);

  AllToAllVStats stats;
  const uint64_t wire_tag = CollectiveTag(CollectiveKind::kAllToAllV, tag);
  const auto* send_base = static_cast<const unsigned char*>(send);
  auto* recv_base = static_cast<unsigned char*>(recv);
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  sends.reserve(n - 1);
  recvs.reserve(n - 1);
  struct Unpack {
    size_t member;
    size_t staging_offset;
    size_t bytes;
  };
  std::vector<Unpack> unpacks;
  size_t send_cursor = 0, recv_cursor = 0;
  for (size_t j = 0; j < n; ++j) {
    if (j == me) continue;
    const int peer = plan.group[j];
    const auto& sc = plan.send_chunks[j];
    const size_t s_total = Total(sc);
    const void* s_ptr = nullptr;
    if (s_total == 0) {
      // Nothing to point at; the zero-byte message still goes out.
    } else if (sc.size() == 1) {
      s_ptr = send_base + sc[0].offset;
    } else {
      unsigned char* dst = send_staging.get() + send_cursor;
      const ByteChunk whole{0, s_total};
      HSAP_RETURN_IF_ERROR(CopyChunks(send, sc, dst, absl::MakeConstSpan(&whole, 1)));
      s_ptr = dst;
      send_cursor += s_total;
      stats.bytes_staged += s_total;
    }
    sends.push_back(SendOp{peer, s_ptr, s_total, wire_tag});

    const auto& rc = plan.recv_chunks[j];
    const size_t r_total = Total(rc);
    void* r_ptr = nullptr;
    if (r_total == 0) {
    } else if (rc.size() == 1) {
      r_ptr = recv_base + rc[0].offset;
    } else {
      r_ptr = recv_staging.get() + recv_cursor;
      unpacks.push_back({j, recv_cursor, r_total});
      recv_cursor += r_total;
    }
    recvs.push_back(RecvOp{peer, r_ptr, r_total, wire_tag});
    stats.bytes_sent += s_total;
    stats.bytes_received += r_total;
  }
  stats.messages_sent = sends.size();
  stats.messages_received = recvs.size();

  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<Transport::Pending> pending,
                        transport.Start(sends, recvs, std::move(stage)));
  // The own share moves while the messages are in flight.
  if (absl::Status s = CopyChunks(send, plan.send_chunks[me], recv, plan.recv_chunks[me]);
      !s.ok()) {
    pending->Wait().IgnoreError();
    return s;
  }
  stats.bytes_local = own_send;
  HSAP_RETURN_IF_ERROR(pending->Wait());
  for (const Unpack& u : unpacks) {
    const ByteChunk whole{u.staging_offset, u.bytes};
    HSAP_RETURN_IF_ERROR(CopyChunks(recv_staging.get(), absl::MakeConstSpan(&whole, 1), recv,
                                    plan.recv_chunks[u.member]));
    stats.bytes_staged += u.bytes;
  }
  return stats;
}

absl::StatusOr<AllToAllVPlan> PlanFromSplits(std::vector<int> group, const SplitTable& splits,
                                             size_t element_bytes) {
  const size_t n = group.size();
  if (splits.send_counts.size() != n || splits.send_displs.size() != n ||
      splits.recv_counts.size() != n || splits.recv_displs.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split table sizes (send_counts ", splits.send_counts.size(), ", send_displs ",
        splits.send_displs.size(), ", recv_counts ", splits.recv_counts.size(), ", recv_displs ",
        splits.recv_displs.size(), ") must all equal the group size ", n));
  }
  if (element_bytes == 0) return absl::InvalidArgumentError("element_bytes must be positive");
  AllToAllVPlan plan;
  plan.group = std::move(group);
  plan.send_chunks.resize(n);
  plan.recv_chunks.resize(n);
  constexpr size_t kMax = std::numeric_limits<size_t>::max();
  auto to_chunk = [&](const char* table, size_t j, int64_t count,
                      int64_t displ) -> absl::StatusOr<ByteChunk> {
    if (count < 0 || displ < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          table, "[", j, "]: count ", count, " and displacement ", displ, " must be non-negative"));
    }
    const auto c = static_cast<uint64_t>(count), d = static_cast<uint64_t>(displ);
    if (c > kMax / element_bytes || d > kMax / element_bytes ||
        d * element_bytes > kMax - c * element_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(table, "[", j, "]: byte offsets overflow size_t"));
    }
    return ByteChunk{d * element_bytes, c * element_bytes};
  };
  for (size_t j = 0; j < n; ++j) {
    auto s = to_chunk("send", j, splits.send_counts[j], splits.send_displs[j]);
    if (!s.ok()) return s.status();
    auto r = to_chunk("recv", j, splits.recv_counts[j], splits.recv_displs[j]);
    if (!r.ok()) return r.status();
    plan.send_chunks[j].push_back(*s);
    plan.recv_chunks[j].push_back(*r);
  }
  return plan;
}

absl::StatusOr<size_t> ThdSelectionBytes(const ThdShape& shape, absl::Span<const TokenRange> ranges,
                                         absl::Span<const int> heads) {
  if (shape.tokens < 0 || shape.heads <= 0 || shape.head_dim <= 0 || shape.element_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("THD shape [tokens ", shape.tokens, ", heads ", shape.heads, ", head_dim ",
                     shape.head_dim, "] x ", shape.element_bytes,
                     " bytes: tokens must be >= 0, heads, head_dim and element size positive"));
  }
  const uint64_t tensor_bytes_per_token =
      static_cast<uint64_t>(shape.heads) * shape.head_dim * shape.element_bytes;
  if (tensor_bytes_per_token != 0 &&
      static_cast<uint64_t>(shape.tokens) >
          std::numeric_limits<size_t>::max() / tensor_bytes_per_token) {
    return absl::InvalidArgumentError("THD tensor size overflows size_t");
  }
  std::vector<bool> seen(shape.heads, false);
  for (size_t i = 0; i < heads.size(); ++i) {
    const int h = heads[i];
    if (h < 0 || h >= shape.heads) {
      return absl::InvalidArgumentError(
          absl::StrCat("heads[", i, "] = ", h, " is outside [0, ", shape.heads, ")"));
    }
    if (seen[h]) {
      return absl::InvalidArgumentError(
          absl::StrCat("heads[", i, "] = ", h, " appears twice in the head list"));
    }
    seen[h] = true;
  }
  uint64_t tokens = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const TokenRange& r = ranges[i];
    if (r.begin < 0 || r.end < r.begin || r.end > shape.tokens) {
      return absl::InvalidArgumentError(absl::StrCat("ranges[", i, "] = [", r.begin, ", ", r.end,
                                                     ") is not inside [0, ", shape.tokens, ")"));
    }
    tokens += static_cast<uint64_t>(r.end - r.begin);
  }
  // tokens x heads.size() x ... cannot exceed the ranges' tokens times a whole token, but
  // ranges may repeat tokens, so check the product.
  const uint64_t per_token =
      heads.size() * static_cast<uint64_t>(shape.head_dim) * shape.element_bytes;
  if (per_token != 0 && tokens > std::numeric_limits<size_t>::max() / per_token) {
    return absl::InvalidArgumentError("THD selection size overflows size_t");
  }
  return static_cast<size_t>(tokens * per_token);
}

absl::StatusOr<std::vector<ByteChunk>> ThdChunks(const ThdShape& shape,
                                                 absl::Span<const TokenRange> ranges,
                                                 absl::Span<const int> heads) {
  HSAP_ASSIGN_OR_RETURN(size_t total, ThdSelectionBytes(shape, ranges, heads));
  std::vector<ByteChunk> chunks;
  if (total == 0) return chunks;
  const size_t head_bytes = static_cast<size_t>(shape.head_dim) * shape.element_bytes;
  const size_t token_bytes = head_bytes * static_cast<size_t>(shape.heads);
  // Runs of consecutive heads within a token (same for every token).
  std::vector<ByteChunk> runs;
  for (const int h : heads) {
    const size_t offset = static_cast<size_t>(h) * head_bytes;
    if (!runs.empty() && runs.back().offset + runs.back().bytes == offset) {
      runs.back().bytes += head_bytes;
    } else {
      runs.push_back({offset, head_bytes});
    }
  }
  for (const TokenRange& r : ranges) {
    for (int64_t t = r.begin; t < r.end; ++t) {
      const size_t base = static_cast<size_t>(t) * token_bytes;
      for (const ByteChunk& run : runs) {
        const size_t offset = base + run.offset;
        if (!chunks.empty() && chunks.back().offset + chunks.back().bytes == offset) {
          chunks.back().bytes += run.bytes;  // e.g. whole tokens, one after the other
        } else {
          chunks.push_back({offset, run.bytes});
        }
      }
    }
  }
  return chunks;
}

absl::Status PackThd(const void* tensor, const ThdShape& shape, absl::Span<const TokenRange> ranges,
                     absl::Span<const int> heads, void* staging, size_t staging_bytes) {
  HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> chunks, ThdChunks(shape, ranges, heads));
  const size_t total = Total(chunks);
  if (staging_bytes != total) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging has ", staging_bytes, " bytes but the selection holds ", total));
  }
  if (total > 0 && (tensor == nullptr || staging == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensor == nullptr ? "tensor" : "staging", " is null"));
  }
  const ByteChunk whole{0, total};
  return CopyChunks(tensor, chunks, staging, absl::MakeConstSpan(&whole, 1));
}

absl::Status UnpackThd(const void* staging, size_t staging_bytes, const ThdShape& shape,
                       absl::Span<const TokenRange> ranges, absl::Span<const int> heads,
                       void* tensor) {
  HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> chunks, ThdChunks(shape, ranges, heads));
  const size_t total = Total(chunks);
  if (staging_bytes != total) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging has ", staging_bytes, " bytes but the selection holds ", total));
  }
  if (total > 0 && (tensor == nullptr || staging == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensor == nullptr ? "tensor" : "staging", " is null"));
  }
  const ByteChunk whole{0, total};
  return CopyChunks(staging, absl::MakeConstSpan(&whole, 1), tensor, chunks);
}

}  // namespace hsap
