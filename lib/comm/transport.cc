#include "lib/comm/transport.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace hsap {

std::string TagName(uint64_t tag) {
  if ((tag & kCollectiveTagBit) == 0) return absl::StrCat("tag ", tag);
  const auto kind = static_cast<uint8_t>((tag & ~kCollectiveTagBit) >> kCollectiveKindShift);
  const uint64_t sequence = tag & kCollectiveSequenceMask;
  switch (static_cast<CollectiveKind>(kind)) {
    case CollectiveKind::kAllGather:
      return absl::StrCat("tag allgather#", sequence);
    case CollectiveKind::kAllToAllV:
      return absl::StrCat("tag alltoallv#", sequence);
  }
  return absl::StrCat("collective tag ", kind, "#", sequence);
}

namespace {

// Checks that no receive buffer overlaps another receive or a send buffer of the stage
// (a peer would write into memory that is being read or written concurrently).
absl::Status CheckBuffersDisjoint(int rank, absl::string_view stage, absl::Span<const SendOp> sends,
                                  absl::Span<const RecvOp> recvs) {
  struct Interval {
    uintptr_t begin, end;
    bool is_recv;
    size_t index;
  };
  std::vector<Interval> intervals;
  intervals.reserve(sends.size() + recvs.size());
  for (size_t i = 0; i < sends.size(); ++i) {
    if (sends[i].bytes == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(sends[i].data);
    intervals.push_back({begin, begin + sends[i].bytes, false, i});
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    if (recvs[i].bytes == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(recvs[i].data);
    intervals.push_back({begin, begin + recvs[i].bytes, true, i});
  }
  std::sort(intervals.begin(), intervals.end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  // Any earlier interval whose end lies past the current begin overlaps it.
  const Interval* furthest_any = nullptr;
  const Interval* furthest_recv = nullptr;
  auto name = [](const Interval& v) {
    return absl::StrCat(v.is_recv ? "recvs[" : "sends[", v.index, "]");
  };
  for (const Interval& v : intervals) {
    const Interval* clash = nullptr;
    if (furthest_recv != nullptr && v.begin < furthest_recv->end) clash = furthest_recv;
    if (clash == nullptr && v.is_recv && furthest_any != nullptr && v.begin < furthest_any->end) {
      clash = furthest_any;
    }
    if (clash != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, ": stage '", stage, "': buffer of ", name(v), " overlaps ", name(*clash),
          "; a receive buffer must not overlap any other buffer of the stage"));
    }
    if (furthest_any == nullptr || v.end > furthest_any->end) furthest_any = &v;
    if (v.is_recv && (furthest_recv == nullptr || v.end > furthest_recv->end)) {
      furthest_recv = &v;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckStageOps(int rank, int size, absl::string_view stage,
                           absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs) {
  auto check = [&](const char* what, size_t i, int peer, const void* data,
                   size_t bytes) -> absl::Status {
    if (peer < 0 || peer >= size) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": stage '", stage, "': ", what, "[", i, "].peer = ", peer,
                       " is not a rank of this world of ", size, " ranks"));
    }
    if (data == nullptr && bytes > 0) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": stage '", stage, "': ", what,
                                                     "[", i, "].data is null with ", bytes,
                                                     " bytes"));
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < sends.size(); ++i) {
    HSAP_RETURN_IF_ERROR(check("sends", i, sends[i].peer, sends[i].data, sends[i].bytes));
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    HSAP_RETURN_IF_ERROR(check("recvs", i, recvs[i].peer, recvs[i].data, recvs[i].bytes));
  }
  return CheckBuffersDisjoint(rank, stage, sends, recvs);
}

absl::Status Transport::Exchange(absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs,
                                 std::string stage) {
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<Pending> pending, Start(sends, recvs, std::move(stage)));
  return pending->Wait();
}

absl::Status Transport::AllGather(const void* in, void* out, size_t bytes, std::string stage) {
  const int n = size();
  const int me = rank();
  if (bytes > 0 && (in == nullptr || out == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("AllGather in stage '", stage,
                                                   "': ", in == nullptr ? "in" : "out",
                                                   " is null with bytes = ", bytes));
  }
  if (bytes > std::numeric_limits<size_t>::max() / static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(absl::StrCat("AllGather in stage '", stage, "': ", n, " x ",
                                                   bytes, " bytes overflows size_t"));
  }
  auto* out_bytes = static_cast<unsigned char*>(out);
  unsigned char* own_slot = bytes > 0 ? out_bytes + static_cast<size_t>(me) * bytes : nullptr;
  const auto* in_bytes = static_cast<const unsigned char*>(in);
  if (bytes > 0 && in_bytes != own_slot) {
    const bool overlap =
        in_bytes < out_bytes + static_cast<size_t>(n) * bytes && out_bytes < in_bytes + bytes;
    if (overlap) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AllGather in stage '", stage,
          "': in overlaps out without being this rank's slot (out + rank * bytes); pass "
          "disjoint buffers or in = out + rank * bytes"));
    }
  }

  const uint64_t tag = CollectiveTag(CollectiveKind::kAllGather, all_gather_calls_++);
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  sends.reserve(n > 0 ? n - 1 : 0);
  recvs.reserve(n > 0 ? n - 1 : 0);
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    sends.push_back(SendOp{peer, in, bytes, tag});
    recvs.push_back(
        RecvOp{peer, bytes > 0 ? out_bytes + static_cast<size_t>(peer) * bytes : out, bytes, tag});
  }
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<Pending> pending, Start(sends, recvs, std::move(stage)));
  // The own slot is copied while the peers' messages are in flight; the send reads `in`,
  // which the local copy only reads too.
  if (bytes > 0 && in_bytes != own_slot) std::memcpy(own_slot, in_bytes, bytes);
  return pending->Wait();
}

absl::Status CombineStageFailures(const std::vector<const absl::Status*>& failed) {
  constexpr size_t kMaxShown = 4;
  std::string message;
  for (size_t i = 0; i < failed.size() && i < kMaxShown; ++i) {
    absl::StrAppend(&message, i > 0 ? "; " : "", failed[i]->message());
  }
  if (failed.size() > kMaxShown) {
    absl::StrAppend(&message, "; and ", failed.size() - kMaxShown, " more failed operations");
  }
  return absl::Status(failed.front()->code(), message);
}

std::string StageTimeoutMessage(int rank, absl::Duration timeout, absl::string_view stage,
                                const std::map<int, std::vector<std::string>>& missing) {
  constexpr size_t kMaxPeersShown = 8;
  std::vector<std::string> parts;
  for (const auto& [peer, ops] : missing) {
    if (parts.size() == kMaxPeersShown) {
      parts.push_back(absl::StrCat("and ", missing.size() - kMaxPeersShown, " more ranks"));
      break;
    }
    parts.push_back(absl::StrCat("rank ", peer, " (", absl::StrJoin(ops, ", "), ")"));
  }
  return absl::StrCat("rank ", rank, ": timed out after ", absl::ToInt64Milliseconds(timeout),
                      " ms in stage '", stage, "' waiting for ", absl::StrJoin(parts, ", "));
}

}  // namespace hsap
