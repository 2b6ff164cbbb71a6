// The CUDA emulator's sm_90 asynchronous-copy instructions (jit/device/hsap_tma.cuh under
// HSAP_DEVICE_EMULATION): mbarrier, cp.async.bulk.tensor (tiled mode, global -> shared) with
// its complete-tx on an mbarrier, prefetch.tensormap and the two fences. Written from NVIDIA's
// PTX ISA (the sections are cited in hsap_tma.cuh, whose comment states the same rules),
// separately from any kernel.
//
// mbarrier. The state of each barrier (phase, expected and pending arrival counts, tx-count)
// is kept per CTA, by shared-memory address, and mirrored into the barrier's 64-bit word
// (phase parity, pending and expected counts, tx-count: the emulator's encoding; the
// hardware's is opaque). Faults, for what the ISA leaves undefined and the emulator can see:
//   - any mbarrier operation but init on an address where no mbarrier.init took place;
//   - a barrier word that changed since the last mbarrier operation (an ordinary store to the
//     object: "performing any other operation than mbarrier instructions ... is undefined");
//   - init with a count outside 1 .. 2^20 - 1, or while TMA copies on the barrier are in
//     flight;
//   - an arrive-on when the pending count is already zero (more arrivals than the count: the
//     phase waits only for its tx-count);
//   - a tx-count leaving -(2^20 - 1) .. 2^20 - 1 (expect-tx or complete-tx);
//   - try_wait.parity with a parity other than 0 or 1;
//   - addresses outside shared memory or not 8-byte aligned.
// try_wait.parity answers true when the current phase's parity differs from the operand.
// When it would answer false it first lets the CTA's other threads run (the ISA's suspended
// wait), so a spin on it never starves the thread that will arrive. A barrier whose waiters
// see no mbarrier operation or copy in their CTA for the watchdog's time (WaitWatchdog, 30 s
// by default) stops the launch with a description of the barrier, where a GPU would hang.
//
// TMA. cp.async.bulk.tensor is asynchronous here too: the copy is checked and recorded at
// issue (the tensor map's fields are read then, as the map may be a kernel parameter), and
// carried out (global reads, zero fill outside the tensor, swizzled shared writes, then a
// complete-tx of the box's bytes on its barrier) when a thread of the CTA runs try_wait on
// that barrier -- never at issue. A kernel that reads the box without waiting on the barrier
// sees stale shared memory, as it may on the GPU. Copies still in flight when the CTA ends
// are dropped. Faults: a map that is not 64-byte aligned or not made by the emulated
// cuTensorMapEncodeTiled (tests/support/emulated_tensor_map.h), an instruction rank that is
// not the map's, a destination that is not 128-byte aligned or whose box does not fit in
// shared memory, an uninitialised barrier; and, as not modelled: interleaved maps, element
// strides other than 1, and swizzled maps whose inner box is narrower than the swizzle span
// (the box rows are then not the pattern's rows, a layout the ISA text does not spell out).
//
// Fences: the emulator runs a CTA's threads one at a time on sequentially consistent memory,
// so fence.proxy.async and fence.mbarrier_init have nothing to order; they are counted
// (TmaCounters) so that tests can see them executed.
//
// Included by tests/support/cuda_emulator.h (before its per-CTA state, which holds one
// TmaCtaState); the hooks declared below are defined there.
#ifndef HSAP_TESTS_SUPPORT_EMULATED_TMA_H_
#define HSAP_TESTS_SUPPORT_EMULATED_TMA_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/support/emulated_swizzle.h"
#include "tests/support/emulated_tensor_map.h"

namespace hsap_emu {

// ---- hooks (tests/support/cuda_emulator.h) ----
struct TmaCtaState;
[[noreturn]] inline void Fault(const std::string& what);
inline bool InSharedMemory(const void* p, std::size_t bytes);  // [p, p + bytes) in CTA smem
inline TmaCtaState& ThisCtaTma();                              // the calling thread's CTA's
inline std::uintptr_t SharedWindowBase();                      // the CTA's shared window
inline void YieldThread();  // lets the CTA's other threads run (a spin's pause)

namespace tma {

inline constexpr std::int64_t kMaxCount = (1 << 20) - 1;  // "Contents of the mbarrier object"

struct Mbarrier {
  std::uint32_t expected = 0, pending = 0;
  std::int64_t tx = 0;
  std::uint64_t phase = 0;  // completed phases so far
  std::uint64_t word = 0;   // the encoding last written to the object
};

struct PendingLoad {
  EmuTensorMap map;
  unsigned char* dst;
  int coords[5];
  std::uint64_t* bar;
};

}  // namespace tma

// Counters of the fences and prefetches a launch executed (all CTAs), for tests.
struct TmaCounters {
  std::atomic<std::uint64_t> fence_barrier_init{0}, fence_proxy_async{0}, prefetch_tensormap{0};
  std::atomic<std::uint64_t> loads_issued{0}, loads_done{0};
};
inline TmaCounters& GlobalTmaCounters() {
  static TmaCounters counters;
  return counters;
}

// The longest an mbarrier wait may see nothing happen in its CTA before the launch stops.
inline std::atomic<std::int64_t>& WaitWatchdogMs() {
  static std::atomic<std::int64_t> ms{30000};
  return ms;
}

struct TmaCtaState {
  std::map<std::uintptr_t, tma::Mbarrier> barriers;  // by address
  std::deque<tma::PendingLoad> loads;                // in flight, oldest first
  std::uint64_t epoch = 0;                           // bumped by every operation
  std::uint64_t waited_epoch = ~std::uint64_t{0};    // what the failing waits last saw
  std::chrono::steady_clock::time_point waiting_since;
};

namespace tma {

inline std::string Where(const void* p) {
  return absl::StrCat("0x", absl::Hex(reinterpret_cast<std::uintptr_t>(p)), " (shared offset ",
                      reinterpret_cast<std::uintptr_t>(p) - SharedWindowBase(), ")");
}

// The emulator's own layout of the word: phase parity in bit 63, 1 in bit 62 (initialised),
// the expected count in bits [60:41], the pending count in [40:21], the tx-count (21-bit
// two's complement) in [20:0].
inline std::uint64_t Encode(const Mbarrier& b) {
  const std::uint64_t tx = static_cast<std::uint64_t>(b.tx) & ((std::uint64_t{1} << 21) - 1);
  return ((b.phase & 1) << 63) | (std::uint64_t{1} << 62) |
         (static_cast<std::uint64_t>(b.expected) << 41) |
         (static_cast<std::uint64_t>(b.pending) << 21) | tx;
}

inline void CheckAddress(const void* bar, const char* op) {
  if ((reinterpret_cast<std::uintptr_t>(bar) - SharedWindowBase()) % 8 != 0) {
    Fault(absl::StrCat("misaligned address: ", op, " on an mbarrier at ", Where(bar),
                       " (mbarrier objects are 8-byte aligned)"));
  }
  if (!InSharedMemory(bar, 8)) {
    Fault(absl::StrCat(op, ": the mbarrier at 0x", absl::Hex(reinterpret_cast<std::uintptr_t>(bar)),
                       " is not in shared memory"));
  }
}

// The barrier at `bar`, initialised and untouched by ordinary stores (faults otherwise).
inline Mbarrier& Find(std::uint64_t* bar, const char* op) {
  CheckAddress(bar, op);
  TmaCtaState& cta = ThisCtaTma();
  auto it = cta.barriers.find(reinterpret_cast<std::uintptr_t>(bar));
  if (it == cta.barriers.end()) {
    Fault(absl::StrCat(op, " on the mbarrier at ", Where(bar),
                       " before its mbarrier.init (undefined in the PTX ISA)"));
  }
  std::uint64_t word;
  std::memcpy(&word, bar, 8);
  if (word != it->second.word) {
    Fault(absl::StrCat(op, ": the mbarrier object at ", Where(bar),
                       " was overwritten by an ordinary store (only mbarrier instructions may "
                       "access it)"));
  }
  return it->second;
}

inline void Store(std::uint64_t* bar, Mbarrier& b) {
  b.word = Encode(b);
  std::memcpy(bar, &b.word, 8);
  ++ThisCtaTma().epoch;
}

inline void CheckTx(const Mbarrier& b, const void* bar, const char* op) {
  if (b.tx > kMaxCount || b.tx < -kMaxCount) {
    Fault(absl::StrCat(op, ": the tx-count of the mbarrier at ", Where(bar), " would be ", b.tx,
                       ", outside the ISA's range -(2^20 - 1) .. 2^20 - 1"));
  }
}

// Completes the current phase when nothing is pending ("Phase Completion").
inline void MaybeComplete(Mbarrier& b) {
  if (b.pending == 0 && b.tx == 0) {
    ++b.phase;
    b.pending = b.expected;
  }
}

inline void Init(std::uint64_t* bar, std::uint32_t count) {
  CheckAddress(bar, "mbarrier.init");
  if (count < 1 || count > kMaxCount) {
    Fault(absl::StrCat("mbarrier.init of the mbarrier at ", Where(bar), " with count ", count,
                       ", outside 1 .. 2^20 - 1"));
  }
  TmaCtaState& cta = ThisCtaTma();
  for (const PendingLoad& l : cta.loads) {
    if (l.bar == bar) {
      Fault(absl::StrCat("mbarrier.init of the mbarrier at ", Where(bar),
                         " while a cp.async.bulk.tensor completing on it is in flight"));
    }
  }
  Mbarrier& b = cta.barriers[reinterpret_cast<std::uintptr_t>(bar)];
  b = Mbarrier{};
  b.expected = b.pending = count;
  Store(bar, b);
}

inline void Arrive(std::uint64_t* bar, bool expect_tx, std::uint32_t bytes) {
  const char* op = expect_tx ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive";
  Mbarrier& b = Find(bar, op);
  if (expect_tx) {
    if (bytes > kMaxCount) {
      Fault(absl::StrCat(op, ": ", bytes, " bytes on the mbarrier at ", Where(bar),
                         ", more than the tx-count's 2^20 - 1"));
    }
    b.tx += bytes;  // the expect-tx operation comes before the arrive-on
    CheckTx(b, bar, op);
  }
  if (b.pending == 0) {
    Fault(absl::StrCat(op, ": more arrivals than the count ", b.expected, " in phase ", b.phase,
                       " of the mbarrier at ", Where(bar),
                       " (the phase waits only for its tx-count, ", b.tx, " bytes)"));
  }
  --b.pending;
  MaybeComplete(b);
  Store(bar, b);
}

inline void CompleteTx(std::uint64_t* bar, std::uint32_t bytes) {
  Mbarrier& b = Find(bar, "cp.async.bulk.tensor complete-tx");
  b.tx -= bytes;
  CheckTx(b, bar, "cp.async.bulk.tensor complete-tx");
  MaybeComplete(b);
  Store(bar, b);
}

// ---- cp.async.bulk.tensor ----

inline std::uint32_t BoxBytes(const EmuTensorMap& m) {
  std::uint32_t n = m.element_bytes;
  for (int i = 0; i < m.rank; ++i) n *= m.box[i];
  return n;
}

inline void Load(void* dst, const void* map, int rank, const int* coords, std::uint64_t* bar) {
  const std::string op = absl::StrCat("cp.async.bulk.tensor.", rank, "d");
  const auto map_address = reinterpret_cast<std::uintptr_t>(map);
  if (map_address % 64 != 0) {
    Fault(absl::StrCat(op, ": the tensor map at 0x", absl::Hex(map_address),
                       " is not 64-byte aligned"));
  }
  PendingLoad l;
  if (!EmuDecodeTensorMap(map, l.map)) {
    Fault(absl::StrCat(op, ": the 128 bytes at 0x", absl::Hex(map_address),
                       " are not a tensor map made by cuTensorMapEncodeTiled"));
  }
  const EmuTensorMap& m = l.map;
  if (m.rank != rank) {
    Fault(absl::StrCat(op, " with a tensor map of rank ", static_cast<int>(m.rank)));
  }
  if (m.interleave != 0) Fault(absl::StrCat(op, ": interleaved tensor maps are not emulated"));
  for (int i = 1; i < rank; ++i) {
    if (m.element_strides[i] != 1) {
      Fault(absl::StrCat(op, ": element strides other than 1 are not emulated"));
    }
  }
  const std::optional<SwizzleMode> swizzle = SwizzleFromTensorMap(m.swizzle);
  if (!swizzle) Fault(absl::StrCat(op, ": swizzle mode ", static_cast<int>(m.swizzle)));
  const std::uint32_t inner = std::uint32_t{m.box[0]} * m.element_bytes;
  if (*swizzle != SwizzleMode::kNone && inner != SwizzleSpanBytes(*swizzle)) {
    Fault(absl::StrCat(op, ": a swizzle-", SwizzleName(*swizzle), " box of ", inner,
                       "-byte rows (the emulator models boxes whose rows are the span)"));
  }
  const auto dst_address = reinterpret_cast<std::uintptr_t>(dst);
  if ((dst_address - SharedWindowBase()) % 128 != 0) {
    Fault(absl::StrCat("misaligned address: ", op, " destination ", Where(dst),
                       " is not 128-byte aligned"));
  }
  if (!InSharedMemory(dst, BoxBytes(m))) {
    Fault(absl::StrCat(op, ": the box's ", BoxBytes(m), " bytes at 0x", absl::Hex(dst_address),
                       " do not fit in shared memory"));
  }
  Find(bar, op.c_str());
  l.dst = static_cast<unsigned char*>(dst);
  for (int i = 0; i < 5; ++i) l.coords[i] = i < rank ? coords[i] : 0;
  l.bar = bar;
  TmaCtaState& cta = ThisCtaTma();
  cta.loads.push_back(l);
  ++cta.epoch;
  GlobalTmaCounters().loads_issued.fetch_add(1, std::memory_order_relaxed);
}

// The element pattern written outside the tensor: zeros, or for
// CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA a quiet NaN of the type (the driver's
// documentation names "a special NaN constant" without its bits).
inline void FillOutOfBounds(const EmuTensorMap& m, unsigned char* out) {
  std::memset(out, 0, m.element_bytes);
  if (m.oob_fill != 1) return;
  const std::uint64_t nan = m.element_bytes == 2   ? (m.dtype == 9 ? 0x7fc0u : 0x7e00u)
                            : m.element_bytes == 4 ? 0x7fc00000u
                                                   : 0x7ff8000000000000ull;
  std::memcpy(out, &nan, m.element_bytes);
}

// Carries out one recorded copy: every box element, in box order, to the swizzled shared
// address of its packed position; then complete-tx of the box's bytes.
inline void Perform(const PendingLoad& l) {
  const EmuTensorMap& m = l.map;
  const SwizzleMode swizzle = *SwizzleFromTensorMap(m.swizzle);
  const std::uintptr_t window = SharedWindowBase();
  const std::uint32_t base =
      static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(l.dst) - window);
  const std::uint32_t elements = BoxBytes(m) / m.element_bytes;
  int k[5] = {0, 0, 0, 0, 0};  // the element's index in the box, dimension 0 fastest
  for (std::uint32_t e = 0; e < elements; ++e) {
    bool inside = true;
    std::uint64_t offset = 0;
    for (int i = 0; i < m.rank; ++i) {
      const std::int64_t c = static_cast<std::int64_t>(l.coords[i]) + k[i];
      inside = inside && c >= 0 && static_cast<std::uint64_t>(c) < m.dims[i];
      offset += static_cast<std::uint64_t>(c) * m.strides[i];
    }
    unsigned char value[8];
    if (inside) {
      std::memcpy(value, reinterpret_cast<const unsigned char*>(m.address + offset),
                  m.element_bytes);
    } else {
      FillOutOfBounds(m, value);
    }
    const std::uint32_t at = SwizzleSharedOffset(base + e * m.element_bytes, swizzle);
    std::memcpy(reinterpret_cast<unsigned char*>(window + at), value, m.element_bytes);
    for (int i = 0; i < m.rank && ++k[i] == m.box[i]; ++i) k[i] = 0;
  }
  CompleteTx(l.bar, BoxBytes(m));
  GlobalTmaCounters().loads_done.fetch_add(1, std::memory_order_relaxed);
}

inline bool TryWaitParity(std::uint64_t* bar, std::uint32_t parity) {
  const char* op = "mbarrier.try_wait.parity";
  Find(bar, op);
  if (parity > 1) {
    Fault(absl::StrCat(op, " with parity ", parity, " (the ISA's valid values are 0 and 1)"));
  }
  TmaCtaState& cta = ThisCtaTma();
  // The copies in flight on this barrier land now, in issue order.
  for (auto it = cta.loads.begin(); it != cta.loads.end();) {
    if (it->bar == bar) {
      const PendingLoad l = *it;
      it = cta.loads.erase(it);
      Perform(l);
    } else {
      ++it;
    }
  }
  const Mbarrier& b = Find(bar, op);
  if ((b.phase & 1) != parity) return true;
  // Not yet: a watchdog for the GPU's hang, then let the other threads run.
  const auto now = std::chrono::steady_clock::now();
  if (cta.waited_epoch != cta.epoch) {
    cta.waited_epoch = cta.epoch;
    cta.waiting_since = now;
  } else if (now - cta.waiting_since >
             std::chrono::milliseconds(WaitWatchdogMs().load(std::memory_order_relaxed))) {
    Fault(absl::StrCat(op, " ", parity, " on the mbarrier at ", Where(bar),
                       " never completed: phase ", b.phase, " waits for ", b.pending, " of ",
                       b.expected, " arrivals and ", b.tx,
                       " tx bytes, and no mbarrier operation or TMA copy of the CTA happened "
                       "for ",
                       WaitWatchdogMs().load(), " ms (a GPU would hang)"));
  }
  YieldThread();
  return false;
}

}  // namespace tma
}  // namespace hsap_emu

// The entry points of jit/device/hsap_tma.cuh's emulation side.
inline void hsap_emu_mbarrier_init(unsigned long long* bar, unsigned count) {
  hsap_emu::tma::Init(reinterpret_cast<std::uint64_t*>(bar), count);
}
inline void hsap_emu_mbarrier_arrive(unsigned long long* bar, bool expect_tx, unsigned bytes) {
  hsap_emu::tma::Arrive(reinterpret_cast<std::uint64_t*>(bar), expect_tx, bytes);
}
inline bool hsap_emu_mbarrier_try_wait_parity(unsigned long long* bar, unsigned parity) {
  return hsap_emu::tma::TryWaitParity(reinterpret_cast<std::uint64_t*>(bar), parity);
}
inline void hsap_emu_fence_barrier_init() {
  hsap_emu::GlobalTmaCounters().fence_barrier_init.fetch_add(1, std::memory_order_relaxed);
}
inline void hsap_emu_fence_proxy_async_shared() {
  hsap_emu::GlobalTmaCounters().fence_proxy_async.fetch_add(1, std::memory_order_relaxed);
}
inline void hsap_emu_prefetch_tensormap(const void* map) {
  if (reinterpret_cast<std::uintptr_t>(map) % 64 != 0) {
    hsap_emu::Fault(absl::StrCat("prefetch.tensormap: the tensor map at 0x",
                                 absl::Hex(reinterpret_cast<std::uintptr_t>(map)),
                                 " is not 64-byte aligned"));
  }
  hsap_emu::GlobalTmaCounters().prefetch_tensormap.fetch_add(1, std::memory_order_relaxed);
}
inline void hsap_emu_tma_load(void* dst, const void* map, int rank, const int* coords,
                              unsigned long long* bar) {
  hsap_emu::tma::Load(dst, map, rank, coords, reinterpret_cast<std::uint64_t*>(bar));
}

#endif  // HSAP_TESTS_SUPPORT_EMULATED_TMA_H_
