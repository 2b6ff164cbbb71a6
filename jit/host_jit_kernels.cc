#include "jit/host_jit_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "attention/parallel.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "jit/host_abi.h"
#include "jit/host_compiler.h"

namespace hsap::jit {
namespace {

absl::string_view DTypeNameAbsl(DType t) {
  const std::string_view n = DTypeName(t);
  return absl::string_view(n.data(), n.size());
}

using InfoFn = void (*)(HsapHostKernelInfo*);
using PackFn = void (*)(const HsapHostPackTask*);
using ConvertFn = void (*)(const HsapHostConvertTask*);
using ForwardFn = void (*)(const HsapHostForwardTask*);
using BackwardFn = void (*)(const HsapHostBackwardTask*);
using MergeFn = void (*)(const HsapHostMergeTask*);

// Per-thread scratch of the generated kernels (grown on demand, reused across calls).
float* ThreadScratch(int64_t floats) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
  return scratch.data();
}

// A query block cut to at most block_q rows, with the segments of its block.
struct Chunk {
  int64_t q_begin, q_end;
  int64_t seg_begin, seg_end;
};

std::vector<Chunk> ChunksOf(const WorkList& work, int64_t block_q) {
  std::vector<Chunk> chunks;
  for (const QueryBlock& b : work.blocks) {
    for (int64_t q = b.q_begin; q < b.q_end; q += block_q) {
      chunks.push_back({q, std::min(q + block_q, b.q_end), b.seg_begin, b.seg_end});
    }
  }
  return chunks;
}

template <typename T>
T Sym(const HostModule& m, const char* name, absl::Status& status) {
  absl::StatusOr<void*> p = m.Symbol(name);
  if (!p.ok()) {
    if (status.ok()) status = p.status();
    return nullptr;
  }
  return reinterpret_cast<T>(*p);
}

// The backward's work by key tile: per tile, the items (a chunk's query rows against the
// tile's keys of one segment) in chunk order, the chunk of each item, and how many earlier
// tiles add to the dq of each item's chunk (its turn); the tiles with items, increasing.
struct KeyTileItems {
  std::vector<std::vector<HsapHostKvItem>> items;
  std::vector<std::vector<int64_t>> item_chunk;
  std::vector<std::vector<int64_t>> turn;
  std::vector<int64_t> busy_tiles;
};

KeyTileItems ItemsByKeyTile(const std::vector<Chunk>& chunks,
                            const std::vector<HsapHostSegment>& segments, int64_t tiles, int64_t bk,
                            bool band_masks) {
  KeyTileItems out;
  std::vector<std::vector<HsapHostKvItem>>& items = out.items;
  std::vector<std::vector<int64_t>>& item_chunk = out.item_chunk;
  items.resize(static_cast<size_t>(tiles));
  item_chunk.resize(static_cast<size_t>(tiles));
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci) {
    const Chunk& c = chunks[ci];
    for (int64_t s = c.seg_begin; s < c.seg_end; ++s) {
      const HsapHostSegment& g = segments[s];
      int64_t lo = g.k_begin, hi = g.k_end;
      if (band_masks) {
        lo = std::max(lo, c.q_begin + g.diag_lo);
        hi = std::min(hi, c.q_end - 1 + g.diag_hi + 1);
      }
      for (int64_t tile = lo / bk; tile * bk < hi; ++tile) {
        items[tile].push_back({c.q_begin, c.q_end, std::max(g.k_begin, tile * bk),
                               std::min(g.k_end, (tile + 1) * bk), g.diag_lo, g.diag_hi});
        item_chunk[tile].push_back(ci);
      }
    }
  }
  // turn[tile][i]: how many earlier tiles add to the dq of item i's chunk.
  std::vector<std::vector<int64_t>>& turn = out.turn;
  turn.resize(static_cast<size_t>(tiles));
  std::vector<int64_t> tiles_seen(chunks.size(), 0);
  for (int64_t t = 0; t < tiles; ++t) {
    if (items[t].empty()) continue;
    out.busy_tiles.push_back(t);
    const std::vector<int64_t>& ic = item_chunk[t];
    turn[t].resize(ic.size());
    for (size_t i = 0; i < ic.size(); ++i) {
      turn[t][i] = tiles_seen[ic[i]];
      if (i + 1 == ic.size() || ic[i + 1] != ic[i]) ++tiles_seen[ic[i]];
    }
  }
  return out;
}

// One backward task's place in the dq order of the chunks it adds to: before an item of a
// new chunk it waits until the tiles before it are done with that chunk (BeforeItem, the
// kernel's callback), and it marks its turn done when it leaves the chunk (Finish).
struct ChunkTurn {
  const std::vector<int64_t>* chunk_of;
  const std::vector<int64_t>* turn;
  std::atomic<int64_t>* done;  // this kv head's row
  int64_t current = -1;        // item whose chunk this task is adding to

  void Finish() {
    if (current < 0) return;
    std::atomic<int64_t>& d = done[(*chunk_of)[current]];
    d.store((*turn)[current] + 1, std::memory_order_release);
    d.notify_all();
  }
  static void BeforeItem(void* ctx, int64_t item) {
    auto* self = static_cast<ChunkTurn*>(ctx);
    if (self->current >= 0 && (*self->chunk_of)[self->current] == (*self->chunk_of)[item]) {
      return;  // same chunk: already its turn
    }
    self->Finish();
    self->current = item;
    std::atomic<int64_t>& d = self->done[(*self->chunk_of)[item]];
    const int64_t mine = (*self->turn)[item];
    for (int64_t v = d.load(std::memory_order_acquire); v != mine;
         v = d.load(std::memory_order_acquire)) {
      d.wait(v, std::memory_order_acquire);
    }
  }
};

class LoadedKernels final : public HostJitKernelSet {
 public:
  static absl::StatusOr<std::shared_ptr<const HostJitKernelSet>> Create(
      const HostKernelSpec& spec, std::shared_ptr<HostModule> module) {
    auto k = std::shared_ptr<LoadedKernels>(new LoadedKernels(spec, std::move(module)));
    absl::Status status;
    const HostModule& m = *k->module_;
    auto info = Sym<InfoFn>(m, "hsap_kernel_info", status);
    k->pack_ = Sym<PackFn>(m, "hsap_pack", status);
    k->convert_ = Sym<ConvertFn>(m, "hsap_convert", status);
    k->forward_ = Sym<ForwardFn>(m, "hsap_forward", status);
    k->backward_ = Sym<BackwardFn>(m, "hsap_backward", status);
    k->merge_ = Sym<MergeFn>(m, "hsap_merge", status);
    if (!status.ok()) return status;
    info(&k->info_);
    const HsapHostKernelInfo& i = k->info_;
    if (i.abi_version != HSAP_HOST_ABI_VERSION || i.head_dim != spec.head_dim ||
        i.block_q != spec.block_q || i.block_k != spec.block_k || i.gqa != spec.gqa_ratio ||
        i.dtype != static_cast<int>(spec.dtype) || i.masked != (spec.band_masks ? 1 : 0)) {
      return absl::InternalError(absl::StrCat(
          "JIT module ", m.cache_entry_name(), " (abi ", i.abi_version, ", d ", i.head_dim,
          ", tiles ", i.block_q, "x", i.block_k, ", gqa ", i.gqa, ", dtype ", i.dtype, ", band ",
          i.masked, ") vs spec (d ", spec.head_dim, ", tiles ", spec.block_q, "x", spec.block_k,
          ", gqa ", spec.gqa_ratio, ", dtype ", static_cast<int>(spec.dtype), ", band ",
          spec.band_masks, ")", " does not match the spec it was built for"));
    }
    k->name_ =
        absl::StrCat("host-jit/", HostIsaName(spec.isa), "/", DTypeNameAbsl(spec.dtype), "/d",
                     spec.head_dim, "/g", spec.gqa_ratio, spec.band_masks ? "/band" : "/full", "/",
                     spec.block_q, "x", spec.block_k);
    return std::shared_ptr<const HostJitKernelSet>(std::move(k));
  }

  std::string_view name() const override { return name_; }

  absl::Status Forward(const ForwardArgs& args, const WorkList& work,
                       int num_threads) const override {
    HSAP_RETURN_IF_ERROR(
        CheckCommon(args.dims, args.dtype, args.q_rows, args.k_rows, work, "ForwardArgs"));
    if (args.q == nullptr || args.k == nullptr || args.v == nullptr || args.out == nullptr ||
        args.lse == nullptr) {
      return absl::InvalidArgumentError("ForwardArgs: q, k, v, out and lse must be non-null");
    }
    if (work.empty()) return absl::OkStatus();
    const AttentionDims& dims = args.dims;
    const int64_t dp = info_.padded_head_dim, bk = info_.block_k;
    const int64_t tiles = (args.k_rows + bk - 1) / bk;
    const int64_t tile_floats = bk * dp;
    const int64_t per_head = tiles * tile_floats;
    std::vector<float> kt(static_cast<size_t>(per_head * dims.heads_kv));
    std::vector<float> v(kt.size());
    PackAll(args.k, args.k_rows, dims, /*transposed=*/true, kt.data(), num_threads);
    PackAll(args.v, args.k_rows, dims, /*transposed=*/false, v.data(), num_threads);

    const std::vector<HsapHostSegment> segments = Segments(work);
    const std::vector<Chunk> chunks = ChunksOf(work, info_.block_q);
    const int64_t n = static_cast<int64_t>(chunks.size()) * dims.heads_q;
    ParallelFor(n, num_threads, [&](int64_t i) {
      const Chunk& c = chunks[i / dims.heads_q];
      const int h = static_cast<int>(i % dims.heads_q);
      const int kvh = dims.KvHead(h);
      HsapHostForwardTask t{};
      t.q = args.q;
      t.q_row_stride = int64_t{dims.heads_q} * dims.head_dim;
      t.kt = kt.data() + kvh * per_head;
      t.v = v.data() + kvh * per_head;
      t.out = args.out;
      t.out_row_stride = int64_t{dims.heads_q} * dims.head_dim;
      t.lse = args.lse + h * args.q_rows;
      t.q_head = h;
      t.scale = dims.scale;
      t.q_begin = c.q_begin;
      t.q_end = c.q_end;
      t.segments = segments.data() + c.seg_begin;
      t.num_segments = c.seg_end - c.seg_begin;
      t.scratch = ThreadScratch(info_.scratch_floats);
      forward_(&t);
    });
    return absl::OkStatus();
  }

  absl::Status Backward(const BackwardArgs& args, const WorkList& work,
                        int num_threads) const override {
    HSAP_RETURN_IF_ERROR(
        CheckCommon(args.dims, args.dtype, args.q_rows, args.k_rows, work, "BackwardArgs"));
    if (args.q == nullptr || args.dout == nullptr || args.lse == nullptr || args.delta == nullptr ||
        args.k == nullptr || args.v == nullptr || args.dq == nullptr || args.dk == nullptr ||
        args.dv == nullptr) {
      return absl::InvalidArgumentError(
          "BackwardArgs: q, dout, lse, delta, k, v, dq, dk and dv must be non-null");
    }
    if (work.empty()) return absl::OkStatus();
    const AttentionDims& dims = args.dims;
    const int64_t dp = info_.padded_head_dim, bk = info_.block_k, bq = info_.block_q;
    const int64_t tiles = (args.k_rows + bk - 1) / bk;
    const int64_t tile_floats = bk * dp;
    const int64_t per_head = tiles * tile_floats;
    std::vector<float> kt(static_cast<size_t>(per_head * dims.heads_kv));
    std::vector<float> vt(kt.size()), krow(kt.size());
    PackAll(args.k, args.k_rows, dims, /*transposed=*/true, kt.data(), num_threads);
    PackAll(args.v, args.k_rows, dims, /*transposed=*/true, vt.data(), num_threads);
    PackAll(args.k, args.k_rows, dims, /*transposed=*/false, krow.data(), num_threads);
    // fp32 copies of q and dout, with spare zero rows for whole register blocks.
    const int64_t qd_stride = int64_t{dims.heads_q} * dp;
    const int64_t q32_rows = args.q_rows + info_.spare_rows;
    std::vector<float> q32(static_cast<size_t>(q32_rows * qd_stride), 0.0f);
    std::vector<float> do32(q32.size(), 0.0f);
    ConvertAll(args.q, args.q_rows, dims, q32.data(), num_threads);
    ConvertAll(args.dout, args.q_rows, dims, do32.data(), num_threads);

    const std::vector<HsapHostSegment> segments = Segments(work);
    const std::vector<Chunk> chunks = ChunksOf(work, bq);

    // Fused backward: one task per (busy key tile, kv head), as the FlashAttention-2 order
    // (dk, dv of the tile in registers and scratch across its chunks), each also adding
    // dS.K into dq. The tiles that see a chunk add to its dq in increasing tile order:
    // a task waits (ChunkTurn) until the tiles before it are done with the chunk. So every
    // dq, dk and dv element sums its contributions in one order whatever the number of
    // threads; tasks are handed out in increasing order, so the lowest unfinished one
    // never waits.
    const KeyTileItems by_tile = ItemsByKeyTile(chunks, segments, tiles, bk, spec_.band_masks);
    const std::vector<std::vector<HsapHostKvItem>>& items = by_tile.items;
    const std::vector<std::vector<int64_t>>& item_chunk = by_tile.item_chunk;
    const std::vector<std::vector<int64_t>>& turn = by_tile.turn;
    const std::vector<int64_t>& busy_tiles = by_tile.busy_tiles;
    std::vector<std::vector<int32_t>> q_heads(dims.heads_kv);
    for (int h = 0; h < dims.heads_q; ++h) q_heads[dims.KvHead(h)].push_back(h);
    // done[kv head][chunk]: tiles (in order) that finished adding to the chunk's dq.
    std::vector<std::atomic<int64_t>> done(chunks.size() * dims.heads_kv);
    const int64_t nkv = static_cast<int64_t>(busy_tiles.size()) * dims.heads_kv;
    ParallelFor(nkv, num_threads, [&](int64_t i) {
      const int64_t tile = busy_tiles[i / dims.heads_kv];
      const int kvh = static_cast<int>(i % dims.heads_kv);
      if (q_heads[kvh].empty()) return;
      const int64_t tile_offset = kvh * per_head + tile * tile_floats;
      ChunkTurn order{&item_chunk[tile], &turn[tile],
                      done.data() + static_cast<int64_t>(chunks.size()) * kvh};
      HsapHostBackwardTask t{};
      t.q32 = q32.data();
      t.do32 = do32.data();
      t.qd_row_stride = qd_stride;
      t.lse = args.lse;
      t.delta = args.delta;
      t.lse_stride = args.q_rows;
      t.kt_tile = kt.data() + tile_offset;
      t.vt_tile = vt.data() + tile_offset;
      t.krow_tile = krow.data() + tile_offset;
      t.dq = args.dq;
      t.dq_row_stride = int64_t{dims.heads_q} * dims.head_dim;
      t.dk = args.dk;
      t.dv = args.dv;
      t.kv_row_stride = int64_t{dims.heads_kv} * dims.head_dim;
      t.k_rows = args.k_rows;
      t.tile = tile;
      t.kv_head = kvh;
      t.num_q_heads = static_cast<int32_t>(q_heads[kvh].size());
      t.q_heads = q_heads[kvh].data();
      t.scale = dims.scale;
      t.items = items[tile].data();
      t.num_items = static_cast<int64_t>(items[tile].size());
      t.before_item = &ChunkTurn::BeforeItem;
      t.ctx = &order;
      t.scratch = ThreadScratch(info_.scratch_floats);
      backward_(&t);
      order.Finish();
    });
    return absl::OkStatus();
  }

  absl::Status Merge(float* o1, float* lse1, const float* o2, const float* lse2, int64_t rows,
                     int heads, int head_dim, int64_t lse_stride1, int64_t lse_stride2,
                     int num_threads) const override {
    if (head_dim != spec_.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Merge: head_dim ", head_dim, " does not match the compiled ", spec_.head_dim));
    }
    if (rows < 0 || heads <= 0 || lse_stride1 < rows || lse_stride2 < rows) {
      return absl::InvalidArgumentError("Merge: need rows >= 0, heads > 0 and lse strides >= rows");
    }
    if (rows == 0) return absl::OkStatus();
    if (o1 == nullptr || lse1 == nullptr || o2 == nullptr || lse2 == nullptr) {
      return absl::InvalidArgumentError("Merge: o1, lse1, o2 and lse2 must be non-null");
    }
    constexpr int64_t kRowsPerTask = 64;
    const int64_t n = (rows + kRowsPerTask - 1) / kRowsPerTask;
    ParallelFor(n, num_threads, [&](int64_t i) {
      HsapHostMergeTask t{};
      t.o1 = o1;
      t.lse1 = lse1;
      t.o2 = o2;
      t.lse2 = lse2;
      t.row_begin = i * kRowsPerTask;
      t.row_end = std::min(rows, t.row_begin + kRowsPerTask);
      t.lse_stride1 = lse_stride1;
      t.lse_stride2 = lse_stride2;
      t.heads = heads;
      merge_(&t);
    });
    return absl::OkStatus();
  }

 private:
  LoadedKernels(const HostKernelSpec& spec, std::shared_ptr<HostModule> module)
      : HostJitKernelSet(spec), module_(std::move(module)) {}

  absl::Status CheckCommon(const AttentionDims& dims, DType dtype, int64_t q_rows, int64_t k_rows,
                           const WorkList& work, const char* what) const {
    HSAP_RETURN_IF_ERROR(ValidateDims(dims));
    if (dtype != spec_.dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dtype ", DTypeNameAbsl(dtype), " but the kernels ", name_,
                       " were compiled for ", DTypeNameAbsl(spec_.dtype)));
    }
    if (dims.head_dim != spec_.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": head_dim ", dims.head_dim,
                                                     " but the kernels ", name_,
                                                     " were compiled for ", spec_.head_dim));
    }
    // An explicit kv-head table (a rank holding an arbitrary subset of heads) maps each query
    // head itself; the compiled ratio only describes the default mapping.
    if (dims.kv_head_of_q.empty() && dims.heads_q != dims.heads_kv * spec_.gqa_ratio) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": heads_q / heads_kv = ", dims.heads_q, " / ", dims.heads_kv, " but the kernels ",
          name_, " were compiled for a GQA ratio of ", spec_.gqa_ratio));
    }
    if (q_rows < 0 || k_rows < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": negative q_rows or k_rows"));
    }
    for (const QueryBlock& b : work.blocks) {
      if (b.q_begin < 0 || b.q_end > q_rows || b.q_begin >= b.q_end || b.seg_begin < 0 ||
          b.seg_end > static_cast<int64_t>(work.segments.size()) || b.seg_begin > b.seg_end) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": work-list block [", b.q_begin, ", ",
                                                       b.q_end, ") is outside the ", q_rows,
                                                       " query rows or its segments"));
      }
    }
    for (const KeySegment& s : work.segments) {
      if (s.k_begin < 0 || s.k_end > k_rows || s.k_begin > s.k_end || s.diag_lo > s.diag_hi) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": work-list segment [", s.k_begin,
                                                       ", ", s.k_end, ") is outside the ", k_rows,
                                                       " key rows or has an empty band"));
      }
      if (!spec_.band_masks && !s.IsFull()) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": the work list has banded (causal/window) segments but the kernels ", name_,
            " were compiled for full segments only; compile with band_masks=true"));
      }
    }
    return absl::OkStatus();
  }

  static std::vector<HsapHostSegment> Segments(const WorkList& work) {
    std::vector<HsapHostSegment> out;
    out.reserve(work.segments.size());
    for (const KeySegment& s : work.segments) {
      out.push_back({s.k_begin, s.k_end, s.diag_lo, s.diag_hi});
    }
    return out;
  }

  void PackAll(const void* src, int64_t rows, const AttentionDims& dims, bool transposed,
               float* dst, int num_threads) const {
    const int64_t bk = info_.block_k;
    const int64_t tiles = (rows + bk - 1) / bk;
    const int64_t tile_floats = bk * info_.padded_head_dim;
    ParallelFor(tiles * dims.heads_kv, num_threads, [&](int64_t i) {
      const int h = static_cast<int>(i / tiles);
      const int64_t tile = i % tiles;
      HsapHostPackTask t{};
      t.src = src;
      t.row_stride = int64_t{dims.heads_kv} * dims.head_dim;
      t.rows = rows;
      t.tile = tile;
      t.head = h;
      t.transposed = transposed ? 1 : 0;
      t.dst = dst + (h * tiles + tile) * tile_floats;
      pack_(&t);
    });
  }

  void ConvertAll(const void* src, int64_t rows, const AttentionDims& dims, float* dst,
                  int num_threads) const {
    constexpr int64_t kRowsPerTask = 64;
    ParallelFor((rows + kRowsPerTask - 1) / kRowsPerTask, num_threads, [&](int64_t i) {
      HsapHostConvertTask t{};
      t.src = src;
      t.row_stride = int64_t{dims.heads_q} * dims.head_dim;
      t.row_begin = i * kRowsPerTask;
      t.row_end = std::min(rows, t.row_begin + kRowsPerTask);
      t.heads = dims.heads_q;
      t.dst = dst;
      convert_(&t);
    });
  }

  std::shared_ptr<HostModule> module_;
  HsapHostKernelInfo info_{};
  std::string name_;
  PackFn pack_ = nullptr;
  ConvertFn convert_ = nullptr;
  ForwardFn forward_ = nullptr;
  BackwardFn backward_ = nullptr;
  MergeFn merge_ = nullptr;
};

HostSource SourceFor(const HostKernelSpec& spec) {
  HostSource src;
  src.code = GenerateHostKernelSource(spec);
  src.headers = {{"hsap_host_abi.h", HostAbiHeaderText()}};
  return src;
}

}  // namespace

HostKernelSpec HostKernelSpecFor(const AttentionDims& dims, DType dtype, bool band_masks) {
  HostKernelSpec spec;
  spec.dtype = dtype;
  spec.head_dim = dims.head_dim;
  spec.gqa_ratio = dims.heads_kv > 0 ? dims.heads_q / dims.heads_kv : 0;
  spec.band_masks = band_masks;
  spec.block_q = static_cast<int>(kKernelBlockQ);
  return spec;
}

bool HasBandMasks(const WorkList& work) {
  return std::any_of(work.segments.begin(), work.segments.end(),
                     [](const KeySegment& s) { return !s.IsFull(); });
}

absl::StatusOr<std::shared_ptr<const HostJitKernelSet>> CompileHostJitKernelsUnchecked(
    const HostKernelSpec& spec_in, CompileCache& cache) {
  const HostKernelSpec spec = ResolveHostKernelSpec(spec_in);
  HSAP_ASSIGN_OR_RETURN(std::shared_ptr<HostModule> module,
                        CompileHostModule(SourceFor(spec), cache));
  return LoadedKernels::Create(spec, std::move(module));
}

absl::StatusOr<std::shared_ptr<const HostJitKernelSet>> GetHostJitKernels(
    const HostKernelSpec& spec_in, CompileCache* cache) {
  HSAP_RETURN_IF_ERROR(ValidateHostKernelSpec(spec_in));
  const HostKernelSpec spec = ResolveHostKernelSpec(spec_in);
  CompileCache& c = cache != nullptr ? *cache : CompileCache::Global();
  using Key = std::tuple<const CompileCache*, int, int, int, bool, int, int, int>;
  static absl::Mutex mu(absl::kConstInit);
  static auto* loaded = new std::map<Key, std::shared_ptr<const HostJitKernelSet>>();
  const Key key{&c,
                static_cast<int>(spec.dtype),
                spec.head_dim,
                spec.gqa_ratio,
                spec.band_masks,
                spec.block_q,
                spec.block_k,
                static_cast<int>(spec.isa)};
  // A set this process could not build for a reason of the environment (no compiler, a
  // compile past its time limit) is not tried again: every batch would stall as long.
  static auto* unavailable = new std::map<Key, absl::Status>();
  {
    absl::MutexLock lock(&mu);
    auto it = unavailable->find(key);
    if (it != unavailable->end()) return it->second;
  }
  auto remember_if_unavailable = [&](const absl::Status& status) {
    if (status.code() != absl::StatusCode::kUnavailable) return;
    absl::MutexLock lock(&mu);
    if (unavailable->emplace(key, status).second) {
      std::fprintf(stderr,
                   "hsap: host JIT kernels unavailable, batches run the hand-written "
                   "kernels: %s\n",
                   std::string(status.message()).c_str());
    }
  };
  // With the cache disabled (HSAP_JIT_DISABLE_CACHE) every request compiles.
  if (!c.options().enabled) {
    absl::StatusOr<std::shared_ptr<const HostJitKernelSet>> kernels =
        CompileHostJitKernelsUnchecked(spec, c);
    if (!kernels.ok()) remember_if_unavailable(kernels.status());
    return kernels;
  }
  {
    absl::MutexLock lock(&mu);
    auto it = loaded->find(key);
    if (it != loaded->end()) return it->second;
  }
  // Compiled outside the lock (the cache serialises compiles of one key).
  absl::StatusOr<std::shared_ptr<const HostJitKernelSet>> kernels =
      CompileHostJitKernelsUnchecked(spec, c);
  if (!kernels.ok()) {
    remember_if_unavailable(kernels.status());
    return kernels.status();
  }
  absl::MutexLock lock(&mu);
  auto [it, inserted] = loaded->emplace(key, *std::move(kernels));
  return it->second;
}

absl::StatusOr<std::shared_ptr<const KernelSet>> HostKernelsForBatch(const AttentionDims& dims,
                                                                     DType dtype,
                                                                     const Layout& layout) {
  HSAP_RETURN_IF_ERROR(ValidateDims(dims));
  const std::shared_ptr<const KernelSet> hand_written(&HandWrittenKernels(),
                                                      [](const KernelSet*) {});
  const std::string choice = GetStringParam(Param::kHostKernels);
  if (choice == "handwritten") return hand_written;
  if (choice != "jit") {
    return absl::InvalidArgumentError(absl::StrCat(
        "HSAP_HOST_KERNELS is '", choice, "'; set it to 'jit' (default) or 'handwritten'"));
  }
  const bool band = std::any_of(layout.slices().begin(), layout.slices().end(),
                                [](const MaskSlice& s) { return !s.IsFull(); });
  absl::StatusOr<std::shared_ptr<const HostJitKernelSet>> jit =
      GetHostJitKernels(HostKernelSpecFor(dims, dtype, band));
  if (jit.ok()) return std::shared_ptr<const KernelSet>(*std::move(jit));
  if (jit.status().code() == absl::StatusCode::kUnavailable ||
      jit.status().code() == absl::StatusCode::kUnimplemented) {
    // Not an error of the caller's: run the hand-written kernels.
    return hand_written;
  }
  return jit.status();
}

}  // namespace hsap::jit
