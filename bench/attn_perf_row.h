// One row of hsap_attn_perf (bench/hsap_attn_perf.cc): the setup every row shares (the
// options, the communicators, the plan), a row's documents, layout, inputs and partition with
// the ranks' shards, and the forward and backward every rank runs on it (a thread each),
// timed, with the traffic they report.
#ifndef HSAP_BENCH_ATTN_PERF_ROW_H_
#define HSAP_BENCH_ATTN_PERF_ROW_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/dtype.h"
#include "bench/attn_perf_options.h"
#include "hsap/hsap.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::bench::attn_perf {

// What every row runs with.
struct Setup {
  const Options* o = nullptr;
  DType dtype = DType::kBF16;
  size_t esize = 0;  // bytes per element of dtype
  int R = 0;         // ranks
  std::vector<hsapComm_t> comms;
  hsapPlan_t plan = nullptr;  // a rank arrangement, or null
  int plan_groups = 0;
  std::vector<int> rank_nodes;                    // --nodes: consecutive ranks share a node
  bool on_gpu = false;                            // --backend cuda-loopback
  const cuda::CudaRuntimeApi* cuda_rt = nullptr;  // on_gpu only
  const double* weights = nullptr;                // --weights, or null
};

// Host bytes, one spare so that an empty tensor has an address.
struct Bytes {
  std::vector<uint8_t> data;
  Bytes() = default;
  explicit Bytes(size_t n) : data(n + 1, 0) {}
  void* ptr() { return data.data(); }
};

// One tensor's shards, a buffer per rank.
struct Shards {
  std::vector<Bytes> b;
  std::vector<void*> p;
};

// One row: T tokens in documents of `lengths` (cumulative `cu`), its layout, the full-row
// inputs (q and dout [T, heads, D], k and v [T, kv_heads, D]), the partition and every
// tensor's shards.
struct Row {
  int64_t T = 0;
  std::vector<int64_t> lengths, cu;
  hsapLayout_t layout = nullptr;
  int64_t pairs = 0;  // visible (query, key) pairs
  size_t q_row = 0, kv_row = 0;
  Bytes q, k, v, dout;
  hsapPartition_t part = nullptr;
  std::vector<int64_t> local;  // tokens per rank
  Shards sq, sk, sv, sdout, sout, sdq, sdk, sdv;
  std::vector<std::vector<float>> lse;
};

// Row T: its documents and layout, inputs drawn from the seed, its partition (the plan's
// shards, or by the weights) and the inputs scattered to the ranks as a data loader would.
// False after printing why when the plan's shards cannot be computed.
bool MakeRow(const Setup& s, int64_t T, Row* row);

// What every rank measured in a row.
struct RankRuns {
  std::vector<double> fwd_s, bwd_s;  // seconds per call
  std::vector<hsapTraffic_t> traffic;
  std::vector<hsapTrafficDetail_t> detail;
  std::vector<hsapLinkTraffic_t> links;
  std::vector<hsapResult_t> result;
  std::vector<std::string> error;
  std::vector<size_t> pool_bytes;
  // CUDA backend: each rank's engine report (hsapBatchGetEngineReport: pieces per engine).
  std::vector<std::string> engines;
  // CUDA backend: [0] compute only, [1] transfers only (seconds per call, per rank).
  std::vector<double> part_fwd_s[2], part_bwd_s[2];
};

// Every rank's forward and backward on the row (a thread each): warmup and timed calls, the
// outputs fetched into the row's shards; on the GPU the same calls again without transfers
// and without kernels. False after printing the first rank that failed.
bool RunRanks(const Setup& s, Row& row, RankRuns* runs);

// Documents cut across ranks: those whose tokens are not all on one rank.
int64_t SplitDocuments(const Setup& s, const Row& row);

}  // namespace hsap::bench::attn_perf

#endif  // HSAP_BENCH_ATTN_PERF_ROW_H_
