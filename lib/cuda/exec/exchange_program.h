// One transport stage of the hierarchical runtime on a device, as data: what a rank sends
// to and receives from each peer, and the copy lists (hsap_dev::CopyChunk) that move the
// selected rows and heads between its tensors and contiguous staging buffers.
//
// A message to a peer is the concatenation of byte chunks of a source tensor (in list
// order); a message from a peer lands in chunks of a destination tensor. On the device the
// rank packs every outgoing message into the send staging (one copy_chunks launch), posts
// the stage, and after it completed unpacks every incoming message from the receive
// staging (copy_chunks, or add_chunks for fp32 partial sums); its own share goes straight
// from source to destination (the `self` list). The lists are built once per batch and
// uploaded with the batch; offsets are bytes from the base pointers given at run time.
//
// The kernels run a list's chunks on many CTAs at once, so the chunks of one launch must not
// overlap in the destination. A copy program never writes a byte twice (Build refuses it).
// An add program may receive several messages into the same elements (an owner summing
// the partials of every group member): its unpack runs in rounds, one launch each, a round
// being consecutive pieces with disjoint destinations, so that no element is added by two
// CTAs at once and each element's sum is taken in message order (bitwise reproducible).
#ifndef HSAP_LIB_CUDA_EXEC_EXCHANGE_PROGRAM_H_
#define HSAP_LIB_CUDA_EXEC_EXCHANGE_PROGRAM_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "jit/device/hsap_params.cuh"
#include "lib/comm/alltoallv.h"

namespace hsap::cuda {

struct ExchangeMessage {
  int peer = -1;
  size_t offset = 0;  // in the staging buffer
  size_t bytes = 0;
  uint64_t tag = 0;
};

struct ExchangeProgram {
  std::vector<ExchangeMessage> sends, recvs;
  std::vector<hsap_dev::CopyChunk> pack;      // source tensor -> send staging
  std::vector<hsap_dev::CopyChunk> unpack;    // receive staging -> destination tensor
  std::vector<hsap_dev::CopyChunk> self;      // source tensor -> destination tensor
  size_t send_staging = 0, recv_staging = 0;  // bytes (each message aligned to 256)
  bool add = false;  // unpack and self add fp32 elements instead of copying
  // Where each launch of `unpack` begins (round k: [unpack_rounds[k], unpack_rounds[k + 1])
  // or to the end); one round unless an add program receives into the same elements twice.
  std::vector<size_t> unpack_rounds;

  uint64_t bytes_sent() const;
  uint64_t bytes_received() const;
};

// Builds an ExchangeProgram message by message.
class ExchangeBuilder {
 public:
  explicit ExchangeBuilder(bool add = false) { program_.add = add; }
  // A message to `peer` made of `source` chunks (zero-byte messages are kept: the peer
  // posts the matching receive).
  void Send(int peer, uint64_t tag, const std::vector<ByteChunk>& source);
  // A message from `peer` landing in `destination` chunks.
  void Receive(int peer, uint64_t tag, const std::vector<ByteChunk>& destination);
  // This rank's own share.
  absl::Status Self(const std::vector<ByteChunk>& source,
                    const std::vector<ByteChunk>& destination);
  absl::StatusOr<ExchangeProgram> Build() &&;

 private:
  ExchangeProgram program_;
  absl::Status error_;
};

// The launches of `unpack` (the device copy of `program.unpack`, src and dst set), one per
// round, in order.
std::vector<hsap_dev::ChunksParams> UnpackLaunches(const ExchangeProgram& program,
                                                   const hsap_dev::ChunksParams& unpack);

// The pieces copying the concatenation of `from` into the concatenation of `to`.
absl::StatusOr<std::vector<hsap_dev::CopyChunk>> CopyPieces(absl::Span<const ByteChunk> from,
                                                            absl::Span<const ByteChunk> to);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_EXCHANGE_PROGRAM_H_
