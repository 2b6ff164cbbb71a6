#include "lib/cuda/exec/exchange_program.h"

#include <utility>

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

}  // namespace

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
  return std::move(program_);
}

}  // namespace hsap::cuda
