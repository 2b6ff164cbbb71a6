// The loopback transport: several ranks share one GPU in one process (one thread and one
// CUDA stream per rank), so the whole CUDA executor can be tested on a single GPU.
//
// Matching is the host transport's (per (src, dst, tag), first posted first matched, sizes
// must agree: a mismatch fails both sides with FailedPrecondition). Data moves by
// cudaMemcpyAsync with cudaMemcpyDefault (buffers may be device memory or host memory, pinned
// or pageable: the AllGather of batch creation passes host records) on the receiver's
// stream, after an event recorded on the sender's stream at Start() (so the sender's earlier
// kernels have produced the data); the rank that completes a match enqueues the copy. A
// stage completes when all its operations are matched and their copies (both the ones into
// its buffers and those out of them) have finished; Wait() polls with the world's deadline
// (DeadlineExceeded naming the peer and tag still missing). Abort() on any rank releases
// every rank's waits.
//
// Peer windows. Several ranks share the GPU, so their batches move forward's K/V in transfer
// stages unless $HSAP_FUSED_FORWARD is set to 1 (then through peer windows and the fused
// kernel, as NCCL ranks of one node do): on an H200, with 4 loopback ranks at 8K tokens a
// rank's publish (device-to-device copies and a stream flag write) did not land while the other
// ranks' fused kernels ran ("a peer did not publish its K/V within 1m"; the kernels themselves
// no longer wait on CTAs that may not have started), and 8 ranks did not finish, while the
// staged forward ran 4 ranks at 16K-64K. One rank offers its (empty) windows.
//
// Devices. The ranks' streams and events belong to the device current at creation; Start()
// makes it current for its CUDA calls and then restores the caller's, so ranks may be driven
// from threads whose current device is another GPU.
#ifndef HSAP_LIB_CUDA_TRANSPORT_LOOPBACK_TRANSPORT_H_
#define HSAP_LIB_CUDA_TRANSPORT_LOOPBACK_TRANSPORT_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lib/comm/transport.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::cuda {

// Creates nranks loopback ranks on the current CUDA device. streams: one per rank (the
// caller's, of that device), or empty to create non-blocking streams owned by the
// transports. Errors: Unimplemented without a CUDA device; InvalidArgument for nranks < 1, a
// wrong number of streams, a stream of another device or a non-positive timeout.
absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateLoopbackTransports(
    int nranks, absl::Duration timeout, const std::vector<cudaStream>& streams = {});

// The same through the CUDA runtime `rt` (the one CreateLoopbackTransports loads, or a
// test's emulated one), on the calling thread's current device of `rt`. `rt` must outlive
// the transports.
absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateLoopbackTransports(
    const CudaRuntimeApi& rt, int nranks, absl::Duration timeout,
    const std::vector<cudaStream>& streams = {});

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_TRANSPORT_LOOPBACK_TRANSPORT_H_
