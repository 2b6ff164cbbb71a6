#include "lib/comm/transport.h"

#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {

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

}  // namespace hsap
