// Runs distributed attention through the C API with one thread per rank, or one process
// per rank, for the distributed, traffic and faults tests.
//
// Ranks as processes: RunDistributed forks one child per rank (tests/support/
// process_ranks.h), each joining a host communicator through hsapGetUniqueId /
// hsapCommInitRank(hsapBackendHost) and running the same rank body as a thread would; the
// children send their outputs back to the test process. A case runs so when it sets
// `processes`, or when $HSAP_TEST_RANKS is "processes" (ctest runs the distributed suites
// once more that way: the "processes:" tests) and it uses the default host communicators.
#ifndef HSAP_TESTS_SUPPORT_DISTRIBUTED_HARNESS_H_
#define HSAP_TESTS_SUPPORT_DISTRIBUTED_HARNESS_H_

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/sched/partition.h"
#include "tests/support/process_ranks.h"
#include "tests/support/tolerance.h"

namespace hsap::testing {

inline hsapDataType_t ToC(DType t) {
  return t == DType::kF32 ? hsapFloat32 : t == DType::kBF16 ? hsapBFloat16 : hsapFloat16;
}

struct HostTensor {
  DType dtype = DType::kF32;
  int64_t tokens = 0;
  int heads = 0, head_dim = 0;
  std::vector<uint8_t> bytes;

  HostTensor() = default;
  HostTensor(DType t, int64_t n, int h, int d) : dtype(t), tokens(n), heads(h), head_dim(d) {
    bytes.assign(size() * DTypeSize(t), 0);
  }
  size_t size() const { return static_cast<size_t>(tokens) * heads * head_dim; }
  size_t bytes_per_token() const {
    return static_cast<size_t>(heads) * head_dim * DTypeSize(dtype);
  }
  void Randomize(std::mt19937_64& rng) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (size_t i = 0; i < size(); ++i) StoreFromFloat(dtype, bytes.data(), i, n(rng));
  }
  float At(size_t i) const { return LoadAsFloat(dtype, bytes.data(), i); }
  hsapTensor_t C() { return hsapTensor_t{bytes.data(), ToC(dtype), tokens, heads, head_dim}; }
};

// The same mask as a C layout handle: documents through hsapLayoutCreate, slices through
// hsapLayoutCreateFromSlices (full and causal-with-window slices only).
inline hsapLayout_t ToCLayout(const Layout& layout) {
  hsapLayout_t handle = nullptr;
  if (!layout.documents().empty()) {
    std::vector<int64_t> cu{0};
    std::vector<hsapMaskKind_t> kinds;
    std::vector<int64_t> params;
    for (const Document& d : layout.documents()) {
      cu.push_back(d.end);
      kinds.push_back(static_cast<hsapMaskKind_t>(d.kind));
      params.push_back(d.param);
    }
    EXPECT_EQ(hsapLayoutCreate(&handle, cu.data(), static_cast<int64_t>(kinds.size()), kinds.data(),
                               params.data()),
              hsapSuccess)
        << hsapGetLastError();
    return handle;
  }
  std::vector<hsapMaskSlice_t> slices;
  for (const MaskSlice& s : layout.slices()) {
    hsapMaskSlice_t c{s.q_begin, s.q_end, s.k_begin, s.k_end, hsapSliceFull, 0};
    if (!s.IsFull()) {
      c.kind = hsapSliceCausal;
      c.window = s.diag_lo <= -kNoDiagLimit ? 0 : 1 - s.diag_lo;
    }
    slices.push_back(c);
  }
  EXPECT_EQ(hsapLayoutCreateFromSlices(&handle, layout.num_tokens(), slices.data(),
                                       static_cast<int64_t>(slices.size())),
            hsapSuccess)
      << hsapGetLastError();
  return handle;
}

// A rank's rows (global token ranges, in local order) of a full-row tensor, and back.
inline std::vector<uint8_t> SliceRows(const HostTensor& row, const std::vector<TokenRange>& shard) {
  std::vector<uint8_t> out(1);  // one spare byte: empty shards still have a data pointer
  for (const TokenRange& r : shard) {
    out.insert(out.end() - 1, row.bytes.begin() + r.begin * row.bytes_per_token(),
               row.bytes.begin() + r.end * row.bytes_per_token());
  }
  return out;
}
inline void UnsliceRows(const std::vector<uint8_t>& part, const std::vector<TokenRange>& shard,
                        HostTensor& row) {
  size_t at = 0;
  for (const TokenRange& r : shard) {
    const size_t bytes = r.size() * row.bytes_per_token();
    std::memcpy(row.bytes.data() + r.begin * row.bytes_per_token(), part.data() + at, bytes);
    at += bytes;
  }
}
// A shard's lse [heads, rows of the shard] into the row's lse [heads, row.size() / heads].
inline void UnsliceLse(const std::vector<float>& part, const std::vector<TokenRange>& shard,
                       int heads, std::vector<float>& row) {
  const int64_t T = static_cast<int64_t>(row.size()) / heads;
  int64_t n = 0;
  for (const TokenRange& r : shard) n += r.size();
  int64_t at = 0;
  for (const TokenRange& r : shard) {
    for (int64_t t = r.begin; t < r.end; ++t, ++at) {
      for (int h = 0; h < heads; ++h) row[h * T + t] = part[h * n + at];
    }
  }
}

// Runs fn(rank) on one thread per rank and joins them.
inline void OnEveryRank(int ranks, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

// Where the ranks' tensors live: host memory (this default) or a device (tests of the
// CUDA backend override it).
class TensorPlacement {
 public:
  virtual ~TensorPlacement() = default;
  // The address the library is given for `bytes` bytes holding a copy of `host`.
  virtual void* Place(void* host, size_t bytes) { return host; }
  // Copies a placed buffer back into `host`.
  virtual void Fetch(const void* placed, void* host, size_t bytes) {}
};

struct DistCase {
  int ranks = 1;
  std::vector<double> weights;  // empty: equal
  DType dtype = DType::kF32;
  int heads_q = 2, heads_kv = 1, head_dim = 32;
  bool backward = true;
  int timeout_ms = 60000;
  // The node of every rank (hsapCommConfig_t::rankNodes); empty: NULL (one node).
  std::vector<int> rank_nodes;
  // The communicators (hsapCommInitAll: the host backend), where tensors live (null: host
  // memory), and what each rank's thread does first (e.g. select its GPU).
  std::function<hsapResult_t(hsapComm_t*, int, const hsapCommConfig_t*)> init_comms =
      hsapCommInitAll;
  TensorPlacement* placement = nullptr;
  std::function<void(int)> enter_rank;
  // What each rank's thread does once its batch exists, before forward (e.g. destroy the
  // layout).
  std::function<void(int)> after_create;
  // Non-null: the batches are made by hsapBatchCreateWithPlan with this plan (weights are
  // not used), and each rank's tensors are its rows of the batch's own partition.
  hsapPlan_t plan = nullptr;
  // Non-null: the batches are made by hsapBatchCreateWithPartition over this partition
  // (weights are not used), which is also the data loader's.
  hsapPartition_t partition = nullptr;
  // Ranks as processes on the host backend (see the top of this file).
  bool processes = false;
};

using InitCommsFn = hsapResult_t (*)(hsapComm_t*, int, const hsapCommConfig_t*);

// Whether RunDistributed runs the ranks of `c` as processes.
inline bool RanksAsProcesses(const DistCase& c) {
  if (c.processes) return true;
  const char* env = std::getenv("HSAP_TEST_RANKS");
  if (env == nullptr || std::string(env) != "processes") return false;
  const InitCommsFn* init = c.init_comms.target<InitCommsFn>();
  return init != nullptr && *init == &hsapCommInitAll && c.placement == nullptr && !c.enter_rank;
}

// Full-row inputs.
struct RowInputs {
  HostTensor q, k, v, dout;
  RowInputs(const DistCase& c, int64_t tokens, uint64_t seed)
      : q(c.dtype, tokens, c.heads_q, c.head_dim),
        k(c.dtype, tokens, c.heads_kv, c.head_dim),
        v(c.dtype, tokens, c.heads_kv, c.head_dim),
        dout(c.dtype, tokens, c.heads_q, c.head_dim) {
    std::mt19937_64 rng(seed);
    q.Randomize(rng);
    k.Randomize(rng);
    v.Randomize(rng);
    dout.Randomize(rng);
  }
  // The reference's view of q, k, v (the row's tensors, pointing into this object).
  ReferenceInputs Reference(const AttentionDims& dims, DType dtype) const {
    ReferenceInputs ri;
    ri.dims = dims;
    ri.dtype = dtype;
    ri.q = q.bytes.data();
    ri.k = k.bytes.data();
    ri.v = v.bytes.data();
    return ri;
  }
};

// Full-row outputs gathered from the ranks.
struct RowOutputs {
  HostTensor out, dq, dk, dv;
  std::vector<float> lse;  // [heads_q, tokens]
  std::vector<hsapTraffic_t> traffic;
  std::vector<hsapLinkTraffic_t> link_traffic;  // zero where hsapBatchGetLinkTraffic failed
  std::vector<int64_t> local_tokens;
  std::vector<std::vector<int64_t>> ranges;  // per rank, begin/end pairs
  std::vector<hsapResult_t> results;         // per rank: the first failing call's result
  std::vector<std::string> errors;
  bool ok() const {
    for (hsapResult_t r : results) {
      if (r != hsapSuccess) return false;
    }
    return true;
  }
};

// One rank's slices of a row's inputs and outputs: the buffers its calls read and write
// (lse: [heads_q, rows of the shard], one spare element), and back into the row's outputs.
struct ShardTensors {
  ShardTensors(const RowInputs& in, const RowOutputs& row, std::vector<TokenRange> rows, int heads)
      : shard(std::move(rows)),
        heads_q(heads),
        q(SliceRows(in.q, shard)),
        k(SliceRows(in.k, shard)),
        v(SliceRows(in.v, shard)),
        dout(SliceRows(in.dout, shard)),
        out(SliceRows(row.out, shard)),
        dq(SliceRows(row.dq, shard)),
        dk(SliceRows(row.dk, shard)),
        dv(SliceRows(row.dv, shard)) {
    int64_t n = 0;
    for (const TokenRange& r : shard) n += r.size();
    lse.assign(static_cast<size_t>(n) * heads_q + 1, 0.0f);
  }
  void Unslice(RowOutputs& row) const {
    UnsliceRows(out, shard, row.out);
    UnsliceRows(dq, shard, row.dq);
    UnsliceRows(dk, shard, row.dk);
    UnsliceRows(dv, shard, row.dv);
    UnsliceLse(lse, shard, heads_q, row.lse);
  }

  std::vector<TokenRange> shard;
  int heads_q;
  std::vector<uint8_t> q, k, v, dout, out, dq, dk, dv;
  std::vector<float> lse;
};

inline std::vector<std::vector<uint8_t>> ScatterRow(hsapPartition_t part, int ranks,
                                                    HostTensor& row) {
  std::vector<std::vector<uint8_t>> shards(ranks);
  std::vector<void*> ptrs(ranks);
  for (int r = 0; r < ranks; ++r) {
    int64_t n = 0, num_ranges = 0;
    EXPECT_EQ(hsapPartitionGetRanges(part, r, nullptr, &num_ranges, &n), hsapSuccess);
    shards[r].assign(n * row.bytes_per_token() + 1, 0);
    ptrs[r] = shards[r].data();
  }
  EXPECT_EQ(hsapPartitionScatter(part, row.bytes.data(), row.bytes_per_token(), ptrs.data()),
            hsapSuccess)
      << hsapGetLastError();
  return shards;
}

inline void GatherRow(hsapPartition_t part, std::vector<std::vector<uint8_t>>& shards,
                      HostTensor& row) {
  std::vector<const void*> ptrs;
  for (auto& s : shards) ptrs.push_back(s.data());
  EXPECT_EQ(hsapPartitionGather(part, ptrs.data(), row.bytes_per_token(), row.bytes.data()),
            hsapSuccess)
      << hsapGetLastError();
}

// Forward (and backward) of `in` over `layout` on c.ranks host ranks via the C API.
inline RowOutputs RunDistributed(hsapLayout_t layout, const DistCase& c, RowInputs& in) {
  const int R = c.ranks;
  const int64_t T = in.q.tokens;
  const double* weights = c.weights.empty() ? nullptr : c.weights.data();
  RowOutputs res;
  res.out = HostTensor(c.dtype, T, c.heads_q, c.head_dim);
  res.dq = HostTensor(c.dtype, T, c.heads_q, c.head_dim);
  res.dk = HostTensor(c.dtype, T, c.heads_kv, c.head_dim);
  res.dv = HostTensor(c.dtype, T, c.heads_kv, c.head_dim);
  res.lse.assign(static_cast<size_t>(T) * c.heads_q, 0.0f);
  res.traffic.assign(R, hsapTraffic_t{});
  res.link_traffic.assign(R, hsapLinkTraffic_t{});
  res.local_tokens.assign(R, -1);
  res.ranges.assign(R, {});
  res.results.assign(R, hsapSuccess);
  res.errors.assign(R, "");

  // The data loader's view: a partition made from the same inputs, used to scatter.
  hsapPartition_t part = c.partition;
  if (part == nullptr) {
    EXPECT_EQ(hsapPartitionCreate(&part, layout, R, weights), hsapSuccess) << hsapGetLastError();
  }
  if (part == nullptr) return res;
  // The partition of the case is the caller's to destroy.
  auto destroy_part = [&] {
    if (part != c.partition) hsapPartitionDestroy(part);
  };
  auto q = ScatterRow(part, R, in.q), k = ScatterRow(part, R, in.k), v = ScatterRow(part, R, in.v),
       dout = ScatterRow(part, R, in.dout);
  auto out = ScatterRow(part, R, res.out), dq = ScatterRow(part, R, res.dq),
       dk = ScatterRow(part, R, res.dk), dv = ScatterRow(part, R, res.dv);
  std::vector<std::vector<float>> lse(R);  // per rank [heads_q, local]

  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  config.timeoutMs = c.timeout_ms;
  config.numThreads = 1;
  config.rankNodes = c.rank_nodes.empty() ? nullptr : c.rank_nodes.data();
  TensorPlacement host_memory;
  TensorPlacement& place = c.placement != nullptr ? *c.placement : host_memory;
  std::vector<std::vector<TokenRange>> plan_shards(R);  // with a plan: each rank's rows

  auto run_rank = [&](int r, hsapComm_t comm) {
    if (c.enter_rank) c.enter_rank(r);
    auto fail = [&](hsapResult_t result) {
      res.results[r] = result;
      res.errors[r] = hsapGetLastError();
    };
    hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
    bc.dtype = ToC(c.dtype);
    bc.numHeadsQ = c.heads_q;
    bc.numHeadsKV = c.heads_kv;
    bc.headDim = c.head_dim;
    hsapBatch_t batch = nullptr;
    if (hsapResult_t e =
            c.plan != nullptr        ? hsapBatchCreateWithPlan(&batch, comm, layout, c.plan, &bc)
            : c.partition != nullptr ? hsapBatchCreateWithPartition(&batch, comm, layout,
                                                                    c.partition, &bc)
                                     : hsapBatchCreate(&batch, comm, layout, weights, &bc);
        e) {
      return fail(e);
    }
    if (c.after_create) c.after_create(r);
    int64_t n = -1;
    hsapBatchGetLocalTokens(batch, &n);
    res.local_tokens[r] = n;
    hsapPartition_t own = nullptr;
    int64_t num_ranges = 0;
    hsapBatchGetPartition(batch, &own);
    hsapPartitionGetRanges(own, r, nullptr, &num_ranges, nullptr);
    res.ranges[r].resize(2 * num_ranges);
    hsapPartitionGetRanges(own, r, res.ranges[r].data(), &num_ranges, nullptr);
    if (c.plan != nullptr) {
      std::vector<TokenRange>& shard = plan_shards[r];
      shard.clear();
      for (int64_t i = 0; i < num_ranges; ++i) {
        shard.push_back({res.ranges[r][2 * i], res.ranges[r][2 * i + 1]});
      }
      q[r] = SliceRows(in.q, shard);
      k[r] = SliceRows(in.k, shard);
      v[r] = SliceRows(in.v, shard);
      dout[r] = SliceRows(in.dout, shard);
      out[r] = SliceRows(res.out, shard);
      dq[r] = SliceRows(res.dq, shard);
      dk[r] = SliceRows(res.dk, shard);
      dv[r] = SliceRows(res.dv, shard);
    }

    auto placed = [&](std::vector<uint8_t>& shard) {
      return place.Place(shard.data(), shard.size());
    };
    hsapTensor_t tq{placed(q[r]), ToC(c.dtype), n, c.heads_q, c.head_dim};
    hsapTensor_t tk{placed(k[r]), ToC(c.dtype), n, c.heads_kv, c.head_dim};
    hsapTensor_t tv{placed(v[r]), ToC(c.dtype), n, c.heads_kv, c.head_dim};
    hsapTensor_t tout{placed(out[r]), ToC(c.dtype), n, c.heads_q, c.head_dim};
    hsapTensor_t tdout{placed(dout[r]), ToC(c.dtype), n, c.heads_q, c.head_dim};
    hsapTensor_t tdq{placed(dq[r]), ToC(c.dtype), n, c.heads_q, c.head_dim};
    hsapTensor_t tdk{placed(dk[r]), ToC(c.dtype), n, c.heads_kv, c.head_dim};
    hsapTensor_t tdv{placed(dv[r]), ToC(c.dtype), n, c.heads_kv, c.head_dim};
    lse[r].assign(static_cast<size_t>(n) * c.heads_q + 1, 0.0f);
    const size_t lse_bytes = lse[r].size() * sizeof(float);
    float* tlse = static_cast<float*>(place.Place(lse[r].data(), lse_bytes));
    if (hsapResult_t e = hsapAttentionForward(batch, &tq, &tk, &tv, &tout, tlse); e) {
      fail(e);
    } else if (c.backward) {
      if (hsapResult_t e2 =
              hsapAttentionBackward(batch, &tdout, &tq, &tk, &tv, &tout, tlse, &tdq, &tdk, &tdv);
          e2) {
        fail(e2);
      }
    }
    place.Fetch(tout.data, out[r].data(), out[r].size());
    place.Fetch(tlse, lse[r].data(), lse_bytes);
    place.Fetch(tdq.data, dq[r].data(), dq[r].size());
    place.Fetch(tdk.data, dk[r].data(), dk[r].size());
    place.Fetch(tdv.data, dv[r].data(), dv[r].size());
    hsapBatchGetTraffic(batch, &res.traffic[r]);
    hsapBatchGetLinkTraffic(batch, &res.link_traffic[r]);
    hsapBatchDestroy(batch);
  };

  if (RanksAsProcesses(c)) {
    hsapUniqueId_t id;
    EXPECT_EQ(hsapGetUniqueId(&id), hsapSuccess) << hsapGetLastError();
    std::vector<ProcessRank> children = RunRanksAsProcesses(R, [&](int r) -> std::string {
      hsapCommConfig_t own = config;
      own.backend = hsapBackendHost;
      hsapComm_t comm = nullptr;
      if (hsapResult_t e = hsapCommInitRank(&comm, R, id, r, &own); e) {
        res.results[r] = e;
        res.errors[r] = hsapGetLastError();
      } else {
        run_rank(r, comm);
        hsapCommDestroy(comm);
      }
      ReportWriter w;
      w.Value(res.results[r]);
      w.String(res.errors[r]);
      w.Value(res.traffic[r]);
      w.Value(res.link_traffic[r]);
      w.Value(res.local_tokens[r]);
      w.Bytes(res.ranges[r].data(), res.ranges[r].size() * sizeof(int64_t));
      for (const auto* t : {&out[r], &dq[r], &dk[r], &dv[r]}) {
        w.Bytes(t->data(), t->size());
      }
      w.Bytes(lse[r].data(), lse[r].size() * sizeof(float));
      return w.Take();
    });
    for (const std::string& e : HsapShmEntries()) {
      EXPECT_NE(e, HsapSegmentOf(id)) << "the ranks left their segment in /dev/shm";
    }
    for (int r = 0; r < R; ++r) {
      ReportReader reader(children[r].report);
      std::string field;
      bool ok = children[r].exited_normally() && reader.Value(res.results[r]) &&
                reader.String(res.errors[r]) && reader.Value(res.traffic[r]) &&
                reader.Value(res.link_traffic[r]) && reader.Value(res.local_tokens[r]) &&
                reader.Next(field);
      if (ok) {
        res.ranges[r].resize(field.size() / sizeof(int64_t));
        std::memcpy(res.ranges[r].data(), field.data(), field.size());
        for (auto* t : {&out[r], &dq[r], &dk[r], &dv[r]}) {
          ok = ok && reader.Next(field);
          t->assign(field.begin(), field.end());
        }
        ok = ok && reader.Next(field);
        lse[r].resize(field.size() / sizeof(float));
        std::memcpy(lse[r].data(), field.data(), field.size());
        if (c.plan != nullptr) {
          for (size_t i = 0; i + 1 < res.ranges[r].size(); i += 2) {
            plan_shards[r].push_back({res.ranges[r][i], res.ranges[r][i + 1]});
          }
        }
      }
      if (!ok) {
        res.results[r] = hsapInternalError;
        res.errors[r] = "the rank's process did not report (status " +
                        std::to_string(children[r].wait_status) + ")";
      }
    }
  } else {
    std::vector<hsapComm_t> comms(R, nullptr);
    EXPECT_EQ(c.init_comms(comms.data(), R, &config), hsapSuccess) << hsapGetLastError();
    OnEveryRank(R, [&](int r) { run_rank(r, comms[r]); });
    for (hsapComm_t comm : comms) hsapCommDestroy(comm);
  }

  if (c.plan != nullptr) {  // the batch's partition, not the data loader's
    for (int r = 0; r < R; ++r) {
      if (res.local_tokens[r] < 0) continue;
      UnsliceRows(out[r], plan_shards[r], res.out);
      UnsliceRows(dq[r], plan_shards[r], res.dq);
      UnsliceRows(dk[r], plan_shards[r], res.dk);
      UnsliceRows(dv[r], plan_shards[r], res.dv);
      UnsliceLse(lse[r], plan_shards[r], c.heads_q, res.lse);
    }
    destroy_part();
    return res;
  }
  GatherRow(part, out, res.out);
  GatherRow(part, dq, res.dq);
  GatherRow(part, dk, res.dk);
  GatherRow(part, dv, res.dv);
  // lse is [heads, local]: transpose to token-major rows to gather, then back.
  std::vector<std::vector<uint8_t>> lse_rows(R);
  for (int r = 0; r < R; ++r) {
    const int64_t n = std::max<int64_t>(res.local_tokens[r], 0);
    lse_rows[r].assign(n * c.heads_q * sizeof(float) + 1, 0);
    float* rows = reinterpret_cast<float*>(lse_rows[r].data());
    for (int h = 0; h < c.heads_q; ++h) {
      for (int64_t t = 0; t < n; ++t) rows[t * c.heads_q + h] = lse[r][h * n + t];
    }
  }
  std::vector<float> token_major(static_cast<size_t>(T) * c.heads_q);
  std::vector<const void*> ptrs;
  for (auto& s : lse_rows) ptrs.push_back(s.data());
  EXPECT_EQ(hsapPartitionGather(part, ptrs.data(), c.heads_q * sizeof(float), token_major.data()),
            hsapSuccess);
  for (int h = 0; h < c.heads_q; ++h) {
    for (int64_t t = 0; t < T; ++t) res.lse[h * T + t] = token_major[t * c.heads_q + h];
  }
  destroy_part();
  return res;
}

// Runs the case and checks every output against the fp64 reference (tests/tolerance.h).
inline RowOutputs CheckAgainstReference(const Layout& layout, const DistCase& c, uint64_t seed,
                                        double min_floor = 0.0) {
  hsapLayout_t handle = ToCLayout(layout);
  RowInputs in(c, layout.num_tokens(), seed);
  RowOutputs got = RunDistributed(handle, c, in);
  hsapLayoutDestroy(handle);
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_EQ(got.results[r], hsapSuccess) << "rank " << r << ": " << got.errors[r];
  }
  if (!got.ok()) return got;

  AttentionDims dims;
  dims.heads_q = c.heads_q;
  dims.heads_kv = c.heads_kv;
  dims.head_dim = c.head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  ExpectMatchesReference(layout, in.Reference(dims, c.dtype), in.dout.bytes.data(), got, c.backward,
                         min_floor);
  return got;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_DISTRIBUTED_HARNESS_H_
