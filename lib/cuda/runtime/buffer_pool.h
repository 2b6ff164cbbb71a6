// The device memory of a communicator: one pool, sized from the batches' schedules, so that
// no allocation happens inside forward/backward (the fixed global buffer of the HSAP design).
//
// PoolLayout says how a forward and a backward of one schedule use the pool. All regions are
// aligned to kPoolAlignment bytes. With kv_row = heads_kv * head_dim * dtype size bytes and
// the maxima taken over the schedule's stages (a kept buffer of a relay, schedule.h, is
// received into the relay store, not a slot, and its partials are summed there):
//   kv_recv     2 slots x 2 (K, V) x max recv_rows x kv_row     (double-buffered K/V)
//   kv_send     2 slots x 2 (K, V) x max send_rows x kv_row     (packed rows to send)
//   relay_kv    2 (K, V) x store_rows x kv_row                  (the relay store)
//   forward:    out fp32 [rows, hq, d] + lse fp32 [hq, rows]  (the kernels merge every
//               stage's partial into them by LSE)
//   backward:   dq fp32 [rows, hq, d] + dk, dv fp32 [rows, hkv, d] + delta fp32 [hq, rows]
//               + 2 slots x 2 (dK, dV) x max recv_rows x hkv x d x 4   (partials to return)
//               + 2 slots x 2 (dK, dV) x max send_rows x hkv x d x 4   (partials coming back)
//               + 2 (dK, dV) x store_rows x hkv x d x 4   (the relay store's summed partials)
//               + per stage whose partials come back in the return phase, 2 (dK, dV) x its
//                 send_rows x hkv x d x 4 (all received at once)
// A schedule without relays has no relay regions.
// The pool holds max(forward, backward) bytes: the two never run at once on one rank.
#ifndef HSAP_LIB_CUDA_RUNTIME_BUFFER_POOL_H_
#define HSAP_LIB_CUDA_RUNTIME_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "lib/cuda/runtime/device.h"
#include "lib/sched/schedule.h"

namespace hsap::cuda {

inline constexpr size_t kPoolAlignment = 256;

// Bytes rounded up to kPoolAlignment.
constexpr size_t AlignPool(size_t bytes) {
  return (bytes + kPoolAlignment - 1) / kPoolAlignment * kPoolAlignment;
}

struct PoolLayout {
  // Regions, each an aligned size; offsets follow in this order from 0.
  size_t kv_recv = 0;  // both slots; slot s, K at s * kv_recv / 2, V after K
  size_t kv_send = 0;
  size_t fwd_accum = 0;      // out32 + lse32
  size_t bwd_accum = 0;      // dq32 + dk32 + dv32 + delta32
  size_t grad_partial = 0;   // partials sent back (both slots)
  size_t grad_returned = 0;  // partials received (both slots)
  // Relays only (after kv_send, before the accumulators; the gradient regions last).
  size_t relay_kv = 0;        // the relay store's K, V
  size_t relay_grad = 0;      // its summed dK, dV partials
  size_t relay_returned = 0;  // the return phase's received partials

  size_t forward_bytes() const { return kv_recv + kv_send + relay_kv + fwd_accum; }
  size_t backward_bytes() const {
    return kv_recv + kv_send + relay_kv + bwd_accum + grad_partial + grad_returned + relay_grad +
           relay_returned;
  }
  size_t total_bytes() const {
    return forward_bytes() > backward_bytes() ? forward_bytes() : backward_bytes();
  }
  std::string DebugString() const;
};

// The pool use of one schedule; InvalidArgument for non-positive dims.
absl::StatusOr<PoolLayout> ComputePoolLayout(const Schedule& schedule, const AttentionDims& dims,
                                             DType dtype);

// Device memory of one communicator, grown only by Reserve (at batch creation) and freed
// at destruction.
class DeviceBufferPool {
 public:
  explicit DeviceBufferPool(Device& device) : device_(device) {}
  ~DeviceBufferPool();
  DeviceBufferPool(const DeviceBufferPool&) = delete;
  DeviceBufferPool& operator=(const DeviceBufferPool&) = delete;

  // Makes the pool at least `bytes` bytes (one allocation; the old block is freed first,
  // which waits for the device, so call it only between calls). A failure names `need`
  // (what the bytes are for) when given.
  absl::Status Reserve(size_t bytes, absl::string_view need = {});
  size_t size() const { return size_; }
  // The pool's base pointer (device memory), null before the first Reserve.
  void* base() const { return base_; }

 private:
  Device& device_;
  void* base_ = nullptr;
  size_t size_ = 0;
};

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_RUNTIME_BUFFER_POOL_H_
