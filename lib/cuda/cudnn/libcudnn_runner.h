// The CudnnPieceRunner that calls libcudnn (piece_runner.h says what a runner computes): per
// call, cuDNN's fused attention graph of sdpa_graph.h for the call's shape and mask, built
// once and kept in an LRU cache, executed on the call's stream with the call's device arrays
// bound in the variant pack.
//
// Cache key (SdpaGraphKey): dtype, head dim, heads q/kv, mask kind, the call's entries and
// max lengths (exact: cuDNN's Stats layout [entries, heads_q, max_q_len] is the caller's, so
// a graph padded to a larger bucket would write another layout), forward or backward, and in
// backward whether O is given. Not in the key, because they are by-value scalars of the
// variant pack: the scale and the window's left bound. The buffers' row counts (which size
// the backward's scratch) are not in the key either: scratch and workspace are kept per
// stream, grown to the largest call seen and reused call after call (stream order makes that
// safe); a runner serves one device (the one current at Create) and is thread-safe.
//
// Backward without O (the plan executor gathers no O): SdpaBackwardArgs::softmax_sum, the
// delta gathered into the Stats layout, is bound in place of cuDNN's own sum_row(dO * O).
//
// Errors are Statuses with cuDNN's message (cudnn_descriptors.h): Unimplemented without
// cudnn_graph.h at build time, libcudnn or a GPU; NotFound when no cuDNN engine takes a graph;
// InvalidArgument for a call no graph takes. Nothing throws.
#ifndef HSAP_LIB_CUDA_CUDNN_LIBCUDNN_RUNNER_H_
#define HSAP_LIB_CUDA_CUDNN_LIBCUDNN_RUNNER_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "attention/dtype.h"
#include "lib/cuda/cudnn/piece_runner.h"
#include "lib/cuda/cudnn/sdpa_graph.h"

namespace hsap::cuda {

struct SdpaGraphKey {
  DType dtype = DType::kBF16;
  int head_dim = 0, heads_q = 0, heads_kv = 0;
  CudnnMaskKind mask = CudnnMaskKind::kNone;
  int64_t batch = 0, max_q_len = 0, max_k_len = 0;
  bool backward = false;
  bool with_o = true;  // backward: O bound (else softmax_sum)

  friend bool operator==(const SdpaGraphKey&, const SdpaGraphKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const SdpaGraphKey& k) {
    return H::combine(std::move(h), static_cast<int>(k.dtype), k.head_dim, k.heads_q, k.heads_kv,
                      static_cast<int>(k.mask), k.batch, k.max_q_len, k.max_k_len, k.backward,
                      k.with_o);
  }
};

// The key of one call (with_o from args.o in backward).
SdpaGraphKey KeyOfCall(const SdpaShape& shape, const SdpaCall& call, bool backward, bool with_o);

// The graph spec of `key` for buffers of q_rows / k_rows rows and cuDNN `version` (a banded
// mask gets left bound 1: the graph does not depend on it, the variant pack binds it).
SdpaGraphSpec SpecOfKey(const SdpaGraphKey& key, int64_t q_rows, int64_t k_rows, int version);

// A least-recently-used map of at most `capacity` (>= 1) entries: Find refreshes, Insert
// evicts the oldest.
template <typename V>
class SdpaGraphCache {
 public:
  explicit SdpaGraphCache(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}
  V* Find(const SdpaGraphKey& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return it->second->second.get();
  }
  V* Insert(const SdpaGraphKey& key, std::unique_ptr<V> value) {
    if (auto it = index_.find(key); it != index_.end()) {
      order_.erase(it->second);
      index_.erase(it);
    }
    order_.emplace_front(key, std::move(value));
    index_[key] = order_.begin();
    while (order_.size() > capacity_) {
      index_.erase(order_.back().first);
      order_.pop_back();
      ++evictions_;
    }
    return order_.front().second.get();
  }
  size_t size() const { return order_.size(); }
  int64_t evictions() const { return evictions_; }

 private:
  using Entry = std::pair<SdpaGraphKey, std::unique_ptr<V>>;
  size_t capacity_;
  std::list<Entry> order_;  // most recent first
  absl::flat_hash_map<SdpaGraphKey, typename std::list<Entry>::iterator> index_;
  int64_t evictions_ = 0;
};

// libcudnn's runner on the current device: Unimplemented (saying what is missing) without
// cudnn_graph.h at build time, without libcudnn.so.9, or without a GPU of sm_80 or newer;
// cuDNN's error when cudnnCreate fails. `cache_capacity`: graphs kept.
absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> NewLibCudnnPieceRunner(
    size_t cache_capacity = 64);

// The runner of the current device shared by the batches alive on it (NewLibCudnnPieceRunner
// on first use; made again once the last holder released it): one handle and one graph cache
// per device, not one per batch.
absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> SharedLibCudnnPieceRunner();

// The runner over given function tables, without loading libcudnn or looking for a device:
// what NewLibCudnnPieceRunner calls once it has them, and how the tests drive it with a fake
// cuDNN (tests/lib/cuda/cudnn/libcudnn_runner_test.cc). cudnnCreate through `api`;
// Unimplemented without cudnn_graph.h at build time.
class CudnnApi;  // cudnn_descriptors.h
absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> NewLibCudnnPieceRunnerWith(
    const CudnnApi* api, const CudaRuntimeApi* rt, int version, size_t cache_capacity = 64);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_CUDNN_LIBCUDNN_RUNNER_H_
