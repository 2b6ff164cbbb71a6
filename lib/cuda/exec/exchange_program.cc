#include "lib/cuda/exec/exchange_program.h"

#include <iterator>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/cuda/runtime/buffer_pool.h"

namespace hsap::cuda {

uint64_t ExchangeProgram::bytes_sent() const {
  uint64_t n = 0;
  for (const ExchangeMessage& m : sends) n += m.bytes;
  return n;
}

uint64_t ExchangeProgram::bytes_received() const {
  uint64_t n = 0;
  for (const ExchangeMessage& m : recvs) n += m.bytes;
  return n;
}

absl::StatusOr<std::vector<hsap_dev::CopyChunk>> CopyPieces(absl::Span<const ByteChunk> from,
                                                            absl::Span<const ByteChunk> to) {
  std::vector<hsap_dev::CopyChunk> pieces;
  absl::Status s = ForEachPiece(from, to, [&](size_t src, size_t dst, size_t bytes) {
    // Extend the previous piece when both sides continue it.
    if (!pieces.empty()) {
      hsap_dev::CopyChunk& last = pieces.back();
      if (last.src + last.bytes == static_cast<long long>(src) &&
          last.dst + last.bytes == static_cast<long long>(dst)) {
        last.bytes += static_cast<long long>(bytes);
        return;
      }
    }
    pieces.push_back(
        {static_cast<long long>(src), static_cast<long long>(dst), static_cast<long long>(bytes)});
  });
  if (!s.ok()) return s;
  return pieces;
}

namespace {

size_t Total(const std::vector<ByteChunk>& chunks) {
  size_t n = 0;
  for (const ByteChunk& c : chunks) n += c.bytes;
  return n;
}

// Appends the pieces of from -> to, shifting the staging side by `offset`.
absl::Status Append(std::vector<hsap_dev::CopyChunk>& into, const std::vector<ByteChunk>& from,
                    const std::vector<ByteChunk>& to) {
  HSAP_ASSIGN_OR_RETURN(std::vector<hsap_dev::CopyChunk> pieces, CopyPieces(from, to));
  into.insert(into.end(), pieces.begin(), pieces.end());
  return absl::OkStatus();
}

// Destination ranges [begin, end) of chunks, by begin.
using Taken = std::map<long long, long long>;

// Whether `c`'s destination meets one in `taken`.
bool Overlaps(const Taken& taken, const hsap_dev::CopyChunk& c) {
  auto next = taken.upper_bound(c.dst);
  if (next != taken.end() && next->first < c.dst + c.bytes) return true;
  return next != taken.begin() && std::prev(next)->second > c.dst;
}

// An error naming the first piece of `pieces` whose destination meets an earlier one's.
absl::Status CheckDisjoint(const std::vector<hsap_dev::CopyChunk>& pieces, const char* list) {
  Taken taken;
  for (const hsap_dev::CopyChunk& c : pieces) {
    if (Overlaps(taken, c)) {
      return absl::InternalError(absl::StrCat("an exchange program's ", list,
                                              " list writes destination bytes [", c.dst, ", ",
                                              c.dst + c.bytes, ") twice"));
    }
    taken[c.dst] = c.dst + c.bytes;
  }
  return absl::OkStatus();
}

// The rounds of an add program's unpack: a new round wherever a piece meets the current one.
std::vector<size_t> AddRounds(const std::vector<hsap_dev::CopyChunk>& pieces) {
  std::vector<size_t> starts;
  Taken taken;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (starts.empty() || Overlaps(taken, pieces[i])) {
      starts.push_back(i);
      taken.clear();
    }
    taken[pieces[i].dst] = pieces[i].dst + pieces[i].bytes;
  }
  return starts;
}

}  // namespace

std::vector<hsap_dev::ChunksParams> UnpackLaunches(const ExchangeProgram& program,
                                                   const hsap_dev::ChunksParams& unpack) {
  std::vector<hsap_dev::ChunksParams> launches;
  const std::vector<size_t>& starts = program.unpack_rounds;
  for (size_t k = 0; k < starts.size(); ++k) {
    const size_t end = k + 1 < starts.size() ? starts[k + 1] : program.unpack.size();
    hsap_dev::ChunksParams c = unpack;
    c.chunks = unpack.chunks + starts[k];
    c.num_chunks = static_cast<long long>(end - starts[k]);
    launches.push_back(c);
  }
  return launches;
}

void ExchangeBuilder::Send(int peer, uint64_t tag, const std::vector<ByteChunk>& source) {
  const size_t bytes = Total(source);
  const size_t offset = program_.send_staging;
  program_.sends.push_back({peer, offset, bytes, tag});
  program_.send_staging += AlignPool(bytes);
  if (error_.ok()) error_ = Append(program_.pack, source, {ByteChunk{offset, bytes}});
}

void ExchangeBuilder::Receive(int peer, uint64_t tag, const std::vector<ByteChunk>& destination) {
  const size_t bytes = Total(destination);
  const size_t offset = program_.recv_staging;
  program_.recvs.push_back({peer, offset, bytes, tag});
  program_.recv_staging += AlignPool(bytes);
  if (error_.ok()) error_ = Append(program_.unpack, {ByteChunk{offset, bytes}}, destination);
}

absl::Status ExchangeBuilder::Self(const std::vector<ByteChunk>& source,
                                   const std::vector<ByteChunk>& destination) {
  return Append(program_.self, source, destination);
}

absl::StatusOr<ExchangeProgram> ExchangeBuilder::Build() && {
  if (!error_.ok()) return error_;
  HSAP_RETURN_IF_ERROR(CheckDisjoint(program_.pack, "pack"));
  HSAP_RETURN_IF_ERROR(CheckDisjoint(program_.self, "self"));
  if (program_.add) {
    program_.unpack_rounds = AddRounds(program_.unpack);
  } else {
    HSAP_RETURN_IF_ERROR(CheckDisjoint(program_.unpack, "unpack"));
    if (!program_.unpack.empty()) program_.unpack_rounds = {0};
  }
  return std::move(program_);
}

}  // namespace hsap::cuda
