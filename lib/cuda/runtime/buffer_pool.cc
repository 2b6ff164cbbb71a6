#include "lib/cuda/runtime/buffer_pool.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap::cuda {

std::string PoolLayout::DebugString() const {
  return absl::StrCat("kv_recv ", kv_recv, " B, kv_send ", kv_send, " B, fwd_accum ", fwd_accum,
                      " B, bwd_accum ", bwd_accum, " B, grad_partial ", grad_partial,
                      " B, grad_returned ", grad_returned, " B, relay_kv ", relay_kv,
                      " B, relay_grad ", relay_grad, " B, relay_returned ", relay_returned,
                      " B; forward ", forward_bytes(), " B, backward ", backward_bytes(),
                      " B, pool ", total_bytes(), " B");
}

absl::StatusOr<PoolLayout> ComputePoolLayout(const Schedule& schedule, const AttentionDims& dims,
                                             DType dtype) {
  if (dims.heads_q <= 0 || dims.heads_kv <= 0 || dims.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool sizing needs positive heads_q, heads_kv and head_dim (got ",
                     dims.heads_q, ", ", dims.heads_kv, ", ", dims.head_dim, ")"));
  }
  // Slots hold what is not kept in the relay store; partials of deferred sends come back
  // in the return phase, each into a region of its own.
  int64_t max_recv = 0, max_send = 0, max_returned = 0;
  std::vector<int64_t> deferred;
  for (const Stage& st : schedule.stages) {
    if (st.recv_from >= 0 && st.store_begin < 0) max_recv = std::max(max_recv, st.recv_rows);
    if (st.send_to >= 0) max_send = std::max(max_send, st.send_rows);
    if (st.send_to >= 0 && !st.send_grads_deferred) {
      max_returned = std::max(max_returned, st.send_rows);
    }
    if (st.send_to >= 0 && st.send_grads_deferred) deferred.push_back(st.send_rows);
  }
  const size_t rows = static_cast<size_t>(schedule.local_rows);
  const size_t kv_row = static_cast<size_t>(dims.heads_kv) * dims.head_dim * DTypeSize(dtype);
  const size_t kv_row32 = static_cast<size_t>(dims.heads_kv) * dims.head_dim * sizeof(float);
  const size_t q_elems = rows * dims.heads_q * dims.head_dim;
  const size_t lse_elems = rows * dims.heads_q;
  PoolLayout p;
  // Each slot's K and V are separate aligned sub-regions.
  p.kv_recv = 2 * 2 * AlignPool(max_recv * kv_row);
  p.kv_send = 2 * 2 * AlignPool(max_send * kv_row);
  p.fwd_accum = AlignPool(q_elems * sizeof(float)) + AlignPool(lse_elems * sizeof(float));
  p.bwd_accum = AlignPool(q_elems * sizeof(float)) + 2 * AlignPool(rows * kv_row32) +
                AlignPool(lse_elems * sizeof(float));
  p.grad_partial = 2 * 2 * AlignPool(max_recv * kv_row32);
  p.grad_returned = 2 * 2 * AlignPool(max_returned * kv_row32);
  const size_t store_rows = static_cast<size_t>(schedule.store_rows);
  p.relay_kv = 2 * AlignPool(store_rows * kv_row);
  p.relay_grad = 2 * AlignPool(store_rows * kv_row32);
  for (int64_t rows_back : deferred) p.relay_returned += 2 * AlignPool(rows_back * kv_row32);
  return p;
}

DeviceBufferPool::~DeviceBufferPool() { device_.Free(base_); }

absl::Status DeviceBufferPool::Reserve(size_t bytes, absl::string_view need) {
  if (bytes <= size_) return absl::OkStatus();
  device_.Free(base_);
  base_ = nullptr;
  size_ = 0;
  absl::StatusOr<void*> p = device_.Allocate(bytes);
  if (!p.ok()) {
    if (need.empty()) return p.status();
    return absl::Status(p.status().code(),
                        absl::StrCat("reserving the communicator's device pool (", need,
                                     "): ", p.status().message()));
  }
  base_ = *p;
  size_ = bytes;
  return absl::OkStatus();
}

}  // namespace hsap::cuda
