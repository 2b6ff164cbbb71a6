// Ragged all-to-all-v among a group of ranks, built only on Transport::Start/Wait (so any
// transport, host or NCCL, runs it).
//
// A "group" is a list of world ranks (a head-parallel group of HexiSeq: any subset, in any
// order). Every member calls AllToAllV with the same group and tag; member i sends to every
// member j the bytes described by its send_chunks[j] and receives from j into the regions
// of its recv_chunks[j]. The payload from i to j is the concatenation of i's chunks for j,
// in list order; the receiver may cut it differently, only the totals must agree (a
// disagreement is a size-mismatch error on both ranks, reported by the transport). Every
// pair of members exchanges a message, zero-byte ones included, so a disagreement never
// shows up as a hang.
//
// Data movement: a peer whose region is one chunk is sent from / received into the user
// buffer directly; several chunks are packed into (unpacked from) one contiguous staging
// buffer per direction. The rank's own share is copied locally while the messages are in
// flight. One call is one transport stage named `stage`.
//
// Tags: the call uses CollectiveTag(kAllToAllV, tag) for every message, so it never matches
// point-to-point traffic. Concurrent calls (or calls left pending) of groups that share a
// pair of ranks must use distinct tags.
#ifndef HSAP_LIB_COMM_ALLTOALLV_H_
#define HSAP_LIB_COMM_ALLTOALLV_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/layout.h"
#include "lib/comm/transport.h"

namespace hsap {

// `bytes` bytes at byte `offset` of a buffer.
struct ByteChunk {
  size_t offset = 0;
  size_t bytes = 0;
  friend bool operator==(const ByteChunk&, const ByteChunk&) = default;
};

struct AllToAllVPlan {
  std::vector<int> group;                           // world ranks, distinct, contains me
  std::vector<std::vector<ByteChunk>> send_chunks;  // [group.size()]: regions of `send`
  std::vector<std::vector<ByteChunk>> recv_chunks;  // [group.size()]: regions of `recv`
};

// What one call moved on this rank.
struct AllToAllVStats {
  uint64_t bytes_sent = 0;      // to other members (the transport's payload)
  uint64_t bytes_received = 0;  // from other members
  uint64_t bytes_local = 0;     // this rank's share to itself, copied locally
  uint64_t bytes_staged = 0;    // bytes packed into or unpacked from staging buffers
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
};

// The largest caller tag (it must fit below the collective kind bits).
inline constexpr uint64_t kMaxAllToAllVTag = kCollectiveSequenceMask;

// Runs one ragged all-to-all-v. `send` has send_bytes bytes, `recv` recv_bytes; every chunk
// must lie inside its buffer; receive chunks must not overlap each other or any send chunk.
// On error nothing is guaranteed about `recv`'s chunk regions (bytes outside them are never
// written).
absl::StatusOr<AllToAllVStats> AllToAllV(Transport& transport, const void* send, size_t send_bytes,
                                         void* recv, size_t recv_bytes, const AllToAllVPlan& plan,
                                         uint64_t tag, std::string stage);

// MPI_Alltoallv-style split table, in elements of `element_bytes`, indexed like the group:
// to member j go send_counts[j] elements starting at element send_displs[j] of `send`; from
// member j come recv_counts[j] elements placed at element recv_displs[j] of `recv`.
struct SplitTable {
  std::vector<int64_t> send_counts, send_displs;
  std::vector<int64_t> recv_counts, recv_displs;
};

// The plan of a split table (one chunk per member and direction). Errors: sizes that do not
// match the group, negative counts or displacements, byte offsets overflowing size_t.
absl::StatusOr<AllToAllVPlan> PlanFromSplits(std::vector<int> group, const SplitTable& splits,
                                             size_t element_bytes);

// ---- [tokens, heads, head_dim] tensors -----------------------------------------------

// A contiguous THD tensor: element (t, h, d) is at byte ((t * heads + h) * head_dim + d) *
// element_bytes.
struct ThdShape {
  int64_t tokens = 0;
  int heads = 0;
  int head_dim = 0;
  size_t element_bytes = 0;
};

// Token ranges are hsap::TokenRange of lib/sched/partition.h (half-open [begin, end)), so that the
// all-to-all and the partition/schedule can be used together.

// The selection (for each token of `ranges` in order, the heads of `heads` in list order)
// as byte chunks of the tensor, adjacent regions merged: consecutive heads become one chunk,
// and whole-token selections of consecutive tokens one chunk. Errors: a range outside
// [0, tokens) or reversed, a head outside [0, heads), a repeated head, a bad shape.
absl::StatusOr<std::vector<ByteChunk>> ThdChunks(const ThdShape& shape,
                                                 absl::Span<const TokenRange> ranges,
                                                 absl::Span<const int> heads);

// Bytes of the selection: sum of range lengths * heads.size() * head_dim * element_bytes.
absl::StatusOr<size_t> ThdSelectionBytes(const ThdShape& shape, absl::Span<const TokenRange> ranges,
                                         absl::Span<const int> heads);

// Copies the selection of `tensor` into contiguous `staging` laid out as
// [selected tokens, heads.size(), head_dim] (staging_bytes must equal the selection size),
// and back.
absl::Status PackThd(const void* tensor, const ThdShape& shape, absl::Span<const TokenRange> ranges,
                     absl::Span<const int> heads, void* staging, size_t staging_bytes);
absl::Status UnpackThd(const void* staging, size_t staging_bytes, const ThdShape& shape,
                       absl::Span<const TokenRange> ranges, absl::Span<const int> heads,
                       void* tensor);

// Calls fn(src_offset, dst_offset, bytes) for each piece of copying the concatenation of
// `src_chunks` into the concatenation of `dst_chunks` (pieces split where either list's
// chunks end), in order; the totals must be equal (InvalidArgument otherwise).
absl::Status ForEachPiece(absl::Span<const ByteChunk> src_chunks,
                          absl::Span<const ByteChunk> dst_chunks,
                          const std::function<void(size_t, size_t, size_t)>& fn);

// Copies the concatenation of `src_chunks` of `src` into the concatenation of
// `dst_chunks` of `dst`; the totals must be equal (checked). Bounds are the caller's.
absl::Status CopyChunks(const void* src, absl::Span<const ByteChunk> src_chunks, void* dst,
                        absl::Span<const ByteChunk> dst_chunks);

}  // namespace hsap

#endif  // HSAP_LIB_COMM_ALLTOALLV_H_
