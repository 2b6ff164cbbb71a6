// The CUDA emulator's sm_90a warpgroup instructions (jit/device/hsap_wgmma.cuh under
// HSAP_DEVICE_EMULATION): wgmma.mma_async with its fence, commit_group and wait_group, the
// shared-memory matrix descriptor, and setmaxnreg, written from NVIDIA's PTX ISA sections
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions" (wgmma.mma_async,
// wgmma.fence, wgmma.commit_group, wgmma.wait_group; "Register Fragments and Shared Memory
// Matrix Layouts", "Matrix Descriptor Format", "Canonical Layouts") and "setmaxnreg",
// separately from any kernel. hsap_wgmma.cuh's comment states the same layouts.
//
// Warpgroup collectives. Every instruction here is .sync.aligned over the warpgroup (the 4
// warps of threads 128w .. 128w + 127): each thread deposits its operands in its slot of the
// warpgroup's exchange and the warpgroup meets at its barrier (cuda_emulator.h), as the warp
// collectives of emulated_ptx.h do (two buffers by ticket parity, one barrier per
// instruction). A thread that exited, or that meets the others at another instruction, or
// with other operands (N, type, transpose, scale-d, descriptors, setmaxnreg count), faults
// the launch; so does a CTA whose size is not a multiple of 128 threads.
//
// Asynchrony, as the ISA states it and a kernel may not rely on more:
//   - wgmma.mma_async only records the operation: the first thread of the warpgroup to leave
//     its barrier reads A and B from shared memory (through the descriptors, with the
//     swizzle of emulated_swizzle.h) and keeps both the values and their addresses; the
//     accumulator registers of every thread are then overwritten with a NaN pattern (the
//     "in flight" value), their input kept aside. A kernel that reads its accumulators before
//     the wait sees NaN, where the GPU gives undefined values.
//   - wgmma.commit_group closes the thread's group; wgmma.wait_group N completes its oldest
//     groups until at most N remain: each operation's D = A * B (+ input) is computed then
//     and written to the accumulators. Operations still uncommitted are never completed by a
//     wait (the ISA waits for committed groups only).
//   - Several operations on the same accumulators may be in flight (the ISA orders them):
//     the later one's input is the earlier one's result.
//   - Faults, where the ISA leaves the result undefined: accumulator registers written while
//     an operation on them is in flight (the NaN pattern changed), shared memory read by an
//     operation written before its wait (the first thread to complete the operation reads
//     the operands again and compares), a wgmma.mma_async without a wgmma.fence since the
//     thread last had its accumulators (at the start, or since the wait that completed the
//     last operation on them; for A in registers: since its last wgmma.wait_group, which
//     is slightly stricter than the ISA for a kernel that builds A and fences before a wait
//     and issues after it), a descriptor whose operand leaves shared memory or has a matrix
//     base offset (not modelled: hsap_wgmma.cuh never sets one), N not a multiple of 8 in
//     [8, 256].
//   - Not caught: A registers (RS) changed between the issue and the wait (the emulator has
//     their values from the issue); reads of the accumulators in flight (they see NaN).
//   - Not modelled: the async proxy (shared memory written by ordinary stores needs a
//     fence.proxy.async before wgmma reads it: the emulator reads it either way), the
//     hardware's internal summation order (below).
//
// Arithmetic: as emulated_ptx.h's mma: each accumulator starts from its input (or 0 when
// scale-d is false) and adds the 16 products in ascending k, rounded to fp32 each time; the
// products of two bf16 or f16 values are exact in fp32. The tolerance rule covers any order.
//
// setmaxnreg.{inc,dec}.sync.aligned.u32 N: N a multiple of 8 in [24, 256] (hsap_wgmma.cuh also
// checks it at compile time), the same N across the warpgroup, .inc never below and .dec never
// above the warpgroup's current count, which starts at the launch's (LaunchRegisters: what
// ptxas gives a kernel of blockDim threads under __launch_bounds__(blockDim, 1), all of the
// SM's 65536 / blockDim rounded down to 8, at most 256; the compile tests hold the sm_90a
// kernels to it). The CTA's pool: a .dec releases 128 x (current - N) registers to it, an .inc
// takes 128 x (N - current) from it and waits until the other warpgroups' .dec have released
// them; an .inc the releases never cover (the warpgroups' counts summing to more than the
// launch gave the CTA) would wait forever on a GPU, and faults here once the CTA's other
// threads have run kPoolSpins times without covering it.
//
// Included by tests/support/cuda_emulator.h (before its per-CTA state, which holds one
// WgmmaCtaState); the hooks declared below are defined there.
#ifndef HSAP_TESTS_SUPPORT_EMULATED_WGMMA_H_
#define HSAP_TESTS_SUPPORT_EMULATED_WGMMA_H_

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/dtype.h"
#include "tests/support/emulated_swizzle.h"

namespace hsap_emu {

// ---- hooks (tests/support/cuda_emulator.h) ----
struct WgmmaCtaState;
[[noreturn]] inline void Fault(const std::string& what);
inline WgmmaCtaState& ThisCtaWgmma();
inline void SyncWarpgroup();                    // the calling thread's warpgroup barrier
inline void YieldThread();                      // lets the CTA's other threads run
inline int ThisThreadIndex();                   // threadIdx.x
inline int CtaThreads();                        // blockDim.x
inline unsigned char* SharedWindow();           // the CTA's shared memory, offset 0
inline std::size_t SharedWindowBytes();

namespace wgmma {

enum class Op : int { kNone = 0, kFence, kCommit, kWait, kMma, kSetmaxnregInc, kSetmaxnregDec };

inline const char* OpName(Op op) {
  switch (op) {
    case Op::kFence:
      return "wgmma.fence";
    case Op::kCommit:
      return "wgmma.commit_group";
    case Op::kWait:
      return "wgmma.wait_group";
    case Op::kMma:
      return "wgmma.mma_async";
    case Op::kSetmaxnregInc:
      return "setmaxnreg.inc";
    case Op::kSetmaxnregDec:
      return "setmaxnreg.dec";
    case Op::kNone:
      break;
  }
  return "no instruction";
}

// One thread's operands of a warpgroup collective.
struct Slot {
  std::uint64_t ticket = 0;
  Op op = Op::kNone;
  int n = 0;  // mma: N; wait: the count; setmaxnreg: the register count
  bool bf16 = false, trans_b = false, rs = false, accumulate = false;
  std::uint64_t a_desc = 0, b_desc = 0;
  std::uint32_t a[4] = {};  // RS: the A fragment
};

// One wgmma.mma_async of a warpgroup, shared by its 128 threads: the operands as read at issue.
struct MmaRecord {
  int n = 0;
  bool bf16 = false, trans_b = false, rs = false;
  std::vector<float> a;                  // [64][16]
  std::vector<float> b;                  // [16][n]
  std::vector<std::uint32_t> offsets;    // shared offsets read (SS: A then B; RS: B)
  std::vector<std::uint16_t> bits;       // the 16-bit values read there
  bool rechecked = false;                // operands compared again at the first completion
};

struct Exchange {
  std::array<Slot, 128> slots[2];  // by ticket parity
  std::shared_ptr<MmaRecord> record[2];
  std::uint64_t record_ticket[2] = {0, 0};
};

// One accumulator operation in flight for one thread.
struct Pending {
  std::shared_ptr<MmaRecord> record;
  float* d = nullptr;
  bool accumulate = false;
  bool chained = false;     // input: the previous in-flight operation's result on d
  std::vector<float> input;  // otherwise: d at issue (when accumulating)
};

struct ThreadState {
  std::uint64_t tickets = 0;
  std::vector<Pending> uncommitted;
  std::deque<std::vector<Pending>> groups;  // committed, oldest first
  std::uint64_t events = 0;                 // fences and completions, in order
  std::uint64_t last_fence = 0, last_wait = 0;
  std::map<const float*, std::uint64_t> released;   // d -> event of its last completion
  std::map<const float*, std::vector<float>> chain;  // d -> result awaiting a later op on d
};

}  // namespace wgmma

// Allocated at a CTA's first warpgroup instruction: CTAs that use none (every pre-sm_90
// kernel) pay nothing for it.
struct WgmmaCtaState {
  std::vector<wgmma::ThreadState> threads;
  std::vector<wgmma::Exchange> exchanges;  // per warpgroup
  std::vector<int> regs;                   // per warpgroup: setmaxnreg's count (0: none yet)
  long pool = 0;                           // registers released by .dec, not yet taken

  void EnsureFor(int cta_threads) {
    if (!threads.empty()) return;
    const auto groups = static_cast<std::size_t>((cta_threads + 127) / 128);
    threads.resize(static_cast<std::size_t>(cta_threads));
    exchanges.resize(groups);
    regs.assign(groups, 0);
  }
};

namespace wgmma {

// The in-flight pattern of an accumulator register: a quiet NaN with a payload.
constexpr std::uint32_t kInFlightBits = 0x7fc0a5a5u;
inline float InFlight() { return std::bit_cast<float>(kInFlightBits); }
inline bool IsInFlight(float x) { return std::bit_cast<std::uint32_t>(x) == kInFlightBits; }

inline ThreadState& This() {
  WgmmaCtaState& cta = ThisCtaWgmma();
  cta.EnsureFor(CtaThreads());
  return cta.threads[static_cast<std::size_t>(ThisThreadIndex())];
}

inline std::string SlotText(const Slot& s) {
  if (s.op == Op::kMma) {
    return absl::StrCat(OpName(s.op), ".m64n", s.n, "k16.", s.bf16 ? "bf16" : "f16",
                        s.rs ? " (A in registers)" : "", " trans-b ", s.trans_b ? 1 : 0,
                        " scale-d ", s.accumulate ? 1 : 0, " a-desc 0x", absl::Hex(s.a_desc),
                        " b-desc 0x", absl::Hex(s.b_desc));
  }
  if (s.op == Op::kNone) return OpName(s.op);
  return absl::StrCat(OpName(s.op), " ", s.n);
}
inline bool SameInstruction(const Slot& x, const Slot& y) {
  return x.op == y.op && x.n == y.n && x.bf16 == y.bf16 && x.trans_b == y.trans_b &&
         x.rs == y.rs && x.accumulate == y.accumulate && x.a_desc == y.a_desc &&
         x.b_desc == y.b_desc;
}

// Deposits this thread's slot and meets the warpgroup; returns the 128 slots (all the same
// instruction, or a fault), valid until this thread's next collective, and the ticket.
inline const std::array<Slot, 128>& Gather(const Slot& mine, std::uint64_t& ticket) {
  const int thread = ThisThreadIndex();
  if (CtaThreads() % 128 != 0) {
    Fault(absl::StrCat(OpName(mine.op), ".sync.aligned needs whole warpgroups: the CTA has ",
                       CtaThreads(), " threads, not a multiple of 128"));
  }
  ThreadState& me = This();
  ticket = ++me.tickets;
  Exchange& ex = ThisCtaWgmma().exchanges[static_cast<std::size_t>(thread / 128)];
  std::array<Slot, 128>& slots = ex.slots[ticket & 1];
  slots[static_cast<std::size_t>(thread % 128)] = mine;
  slots[static_cast<std::size_t>(thread % 128)].ticket = ticket;
  SyncWarpgroup();
  for (int t = 0; t < 128; ++t) {
    const Slot& s = slots[static_cast<std::size_t>(t)];
    if (s.ticket != ticket || !SameInstruction(s, mine)) {
      Fault(absl::StrCat(SlotText(mine), ": thread ", (thread / 128) * 128 + t,
                         " of the warpgroup ",
                         s.ticket < ticket ? "did not take part (exited or diverged)"
                                           : "executed another instruction or operands",
                         " (its slot holds ", SlotText(s), ", ticket ", s.ticket, " of ", ticket,
                         "); the ISA requires all threads of the warpgroup to execute the same "
                         "instruction"));
    }
  }
  return slots;
}

// ---- the matrix descriptor ----

struct Descriptor {
  std::uint32_t start, lbo, sbo;  // bytes
  int base_offset;
  SwizzleMode swizzle;
};
inline Descriptor Decode(std::uint64_t desc) {
  Descriptor d;
  d.start = static_cast<std::uint32_t>(desc & 0x3fffu) << 4;
  d.lbo = static_cast<std::uint32_t>((desc >> 16) & 0x3fffu) << 4;
  d.sbo = static_cast<std::uint32_t>((desc >> 32) & 0x3fffu) << 4;
  d.base_offset = static_cast<int>((desc >> 49) & 7u);
  d.swizzle = *SwizzleFromWgmmaField(static_cast<int>(desc >> 62));
  return d;
}

// The shared offset of element (mn, k) of an operand (rows along M or N, 16 columns along K)
// under the ISA's canonical layouts (hsap_wgmma.cuh's comment), after the swizzle.
inline std::uint32_t ElementOffset(const Descriptor& d, bool mn_major, int mn, int k) {
  const std::uint32_t m = static_cast<std::uint32_t>(mn), kk = static_cast<std::uint32_t>(k);
  const std::uint32_t span = SwizzleSpanBytes(d.swizzle);
  std::uint32_t at;
  if (!mn_major) {
    at = d.swizzle == SwizzleMode::kNone
             ? d.start + (m / 8) * d.sbo + (kk / 8) * d.lbo + (m % 8) * 16 + (kk % 8) * 2
             : d.start + (m / 8) * d.sbo + (m % 8) * span + kk * 2;
  } else if (d.swizzle == SwizzleMode::kNone) {
    at = d.start + (m / 8) * d.sbo + (kk / 8) * d.lbo + (kk % 8) * 16 + (m % 8) * 2;
  } else {
    const std::uint32_t e = span / 2;  // elements per swizzled row
    at = d.start + (m / e) * d.lbo + (kk / 8) * d.sbo + (kk % 8) * span + (m % e) * 2;
  }
  return SwizzleSharedOffset(at, d.swizzle);
}

inline float DecodeElement(std::uint16_t bits, bool bf16) {
  return bf16 ? hsap::BF16ToFloat(hsap::BF16{bits}) : hsap::F16ToFloat(hsap::F16{bits});
}

// Reads a rows x 16 operand through `desc` into out[row * 16 + k] (transposed into
// out[k * rows + row] when `k_outer`), recording the offsets and bits read.
inline void ReadOperand(const char* name, std::uint64_t desc, bool mn_major, int rows, bool bf16,
                        bool k_outer, std::vector<float>& out, MmaRecord& r) {
  const Descriptor d = Decode(desc);
  if (d.base_offset != 0) {
    Fault(absl::StrCat("wgmma.mma_async: the ", name, " descriptor 0x", absl::Hex(desc),
                       " has matrix base offset ", d.base_offset,
                       ", which the emulator does not model (hsap_wgmma.cuh never sets one: align "
                       "the swizzled tile to its repeat)"));
  }
  const std::size_t window = SharedWindowBytes();
  const unsigned char* base = SharedWindow();
  out.assign(static_cast<std::size_t>(rows) * 16, 0.0f);
  for (int mn = 0; mn < rows; ++mn) {
    for (int k = 0; k < 16; ++k) {
      const std::uint32_t at = ElementOffset(d, mn_major, mn, k);
      if (static_cast<std::size_t>(at) + 2 > window) {
        Fault(absl::StrCat("wgmma.mma_async: element (", mn, ", ", k, ") of the ", name,
                           " operand (descriptor 0x", absl::Hex(desc), ", ",
                           SwizzleName(d.swizzle), " swizzle) lies at shared offset ", at,
                           ", outside the CTA's ", window, " bytes of shared memory"));
      }
      std::uint16_t bits;
      std::memcpy(&bits, base + at, 2);
      r.offsets.push_back(at);
      r.bits.push_back(bits);
      out[k_outer ? static_cast<std::size_t>(k) * rows + mn : static_cast<std::size_t>(mn) * 16 + k] =
          DecodeElement(bits, bf16);
    }
  }
}

// The whole 64 x 16 A from the 128 threads' fragments (the mma.m16n8k16 A layout per warp).
inline void GatherFragmentA(const std::array<Slot, 128>& slots, bool bf16, std::vector<float>& a) {
  a.assign(64 * 16, 0.0f);
  for (int t = 0; t < 128; ++t) {
    const int w = t / 32, lane = t % 32, g = lane >> 2, q = lane % 4;
    for (int r = 0; r < 4; ++r) {
      const int row = 16 * w + g + 8 * (r & 1);
      const int col = 2 * q + 8 * (r >> 1);
      const std::uint32_t reg = slots[static_cast<std::size_t>(t)].a[r];
      a[static_cast<std::size_t>(row) * 16 + col] =
          DecodeElement(static_cast<std::uint16_t>(reg & 0xffffu), bf16);
      a[static_cast<std::size_t>(row) * 16 + col + 1] =
          DecodeElement(static_cast<std::uint16_t>(reg >> 16), bf16);
    }
  }
}

// (row, col) of D held in register i of warpgroup thread t (0..127).
inline void AccumulatorPosition(int t, int i, int& row, int& col) {
  const int w = t / 32, lane = t % 32;
  row = 16 * w + (lane >> 2) + 8 * ((i % 4) >> 1);
  col = 8 * (i / 4) + 2 * (lane % 4) + (i & 1);
}

// wgmma.fence rules (see the top of the file). Accumulators: a fence after the thread last
// had them (its start, or the completion of the last operation on them).
inline void RequireAccumulatorFence(const ThreadState& me, const float* d) {
  auto released = me.released.find(d);
  const std::uint64_t since = released == me.released.end() ? 0 : released->second;
  if (me.last_fence == 0 || me.last_fence < since) {
    Fault(absl::StrCat("wgmma.mma_async without a wgmma.fence since the thread ",
                       me.last_fence == 0 ? "started" : "last had these accumulator registers",
                       ": the ISA requires wgmma.fence before the first wgmma.mma_async and "
                       "between other accesses to its registers and the wgmma.mma_async"));
  }
}
// A in registers: a fence after the thread's last wait (the A fragment is built by the thread).
inline void RequireFragmentFence(const ThreadState& me) {
  if (me.last_fence == 0 || me.last_fence < me.last_wait) {
    Fault("wgmma.mma_async with A in registers without a wgmma.fence since the thread's "
          "last wgmma.wait_group: the A registers were written by the thread, and the ISA "
          "requires wgmma.fence between that access and the wgmma.mma_async");
  }
}

inline bool InFlightOn(const ThreadState& me, const float* d) {
  for (const Pending& q : me.uncommitted) {
    if (q.d == d) return true;
  }
  for (const auto& g : me.groups) {
    for (const Pending& q : g) {
      if (q.d == d) return true;
    }
  }
  return false;
}

inline void MmaAsync(int n, bool bf16, bool trans_b, float* d, const std::uint32_t* a,
                     std::uint64_t a_desc, std::uint64_t b_desc, bool accumulate) {
  if (n < 8 || n > 256 || n % 8 != 0) {
    Fault(absl::StrCat("wgmma.mma_async.m64n", n, "k16: N must be a multiple of 8 in [8, 256]"));
  }
  Slot mine;
  mine.op = Op::kMma;
  mine.n = n;
  mine.bf16 = bf16;
  mine.trans_b = trans_b;
  mine.rs = a != nullptr;
  mine.accumulate = accumulate;
  mine.a_desc = a_desc;
  mine.b_desc = b_desc;
  if (a != nullptr) std::memcpy(mine.a, a, sizeof(mine.a));
  std::uint64_t ticket = 0;
  const std::array<Slot, 128>& slots = Gather(mine, ticket);
  Exchange& ex = ThisCtaWgmma().exchanges[static_cast<std::size_t>(ThisThreadIndex() / 128)];
  if (ex.record_ticket[ticket & 1] != ticket) {
    auto r = std::make_shared<MmaRecord>();
    r->n = n, r->bf16 = bf16, r->trans_b = trans_b, r->rs = mine.rs;
    if (mine.rs) {
      GatherFragmentA(slots, bf16, r->a);
    } else {
      ReadOperand("A", a_desc, /*mn_major=*/false, 64, bf16, /*k_outer=*/false, r->a, *r);
    }
    ReadOperand("B", b_desc, /*mn_major=*/trans_b, n, bf16, /*k_outer=*/true, r->b, *r);
    ex.record[ticket & 1] = std::move(r);
    ex.record_ticket[ticket & 1] = ticket;
  }
  ThreadState& me = This();
  Pending p;
  p.record = ex.record[ticket & 1];
  p.d = d;
  p.accumulate = accumulate;
  p.chained = InFlightOn(me, d);
  const int regs = n / 2;
  if (p.chained) {
    for (int i = 0; i < regs; ++i) {
      if (!IsInFlight(d[i])) {
        Fault(absl::StrCat("accumulator register d[", i, "] was written while a wgmma.mma_async "
                           "on it is in flight (before the wgmma.wait_group that completes it): "
                           "the ISA leaves the result undefined"));
      }
    }
  } else {
    RequireAccumulatorFence(me, d);
    if (accumulate) p.input.assign(d, d + regs);
  }
  if (mine.rs) RequireFragmentFence(me);
  for (int i = 0; i < regs; ++i) d[i] = InFlight();
  me.uncommitted.push_back(std::move(p));
}

inline void Fence() {
  Slot mine;
  mine.op = Op::kFence;
  std::uint64_t ticket = 0;
  Gather(mine, ticket);
  ThreadState& me = This();
  me.last_fence = ++me.events;
}

inline void CommitGroup() {
  Slot mine;
  mine.op = Op::kCommit;
  std::uint64_t ticket = 0;
  Gather(mine, ticket);
  ThreadState& me = This();
  me.groups.push_back(std::move(me.uncommitted));
  me.uncommitted.clear();
}

// The first thread to complete an operation reads its operands again: shared memory the
// operation reads must not change before its wait.
inline void Recheck(MmaRecord& r) {
  if (r.rechecked) return;
  r.rechecked = true;
  const unsigned char* base = SharedWindow();
  for (std::size_t i = 0; i < r.offsets.size(); ++i) {
    std::uint16_t now;
    std::memcpy(&now, base + r.offsets[i], 2);
    if (now != r.bits[i]) {
      Fault(absl::StrCat("shared memory at offset ", r.offsets[i],
                         ", an operand of an in-flight wgmma.mma_async.m64n", r.n,
                         "k16, was written before the wgmma.wait_group that completes it (0x",
                         absl::Hex(r.bits[i]), " at issue, 0x", absl::Hex(now),
                         " now): the ISA leaves the result undefined"));
    }
  }
}

inline void Complete(ThreadState& me, Pending& p, bool more_on_d) {
  MmaRecord& r = *p.record;
  Recheck(r);
  const int t = ThisThreadIndex() % 128, regs = r.n / 2;
  for (int i = 0; i < regs; ++i) {
    if (!IsInFlight(p.d[i])) {
      Fault(absl::StrCat("accumulator register d[", i, "] was written while a wgmma.mma_async "
                         "on it was in flight: the ISA leaves the result undefined"));
    }
  }
  std::vector<float> input;
  if (p.chained) {
    auto it = me.chain.find(p.d);
    input = std::move(it->second);
    me.chain.erase(it);
  } else {
    input = std::move(p.input);
  }
  std::vector<float> out(static_cast<std::size_t>(regs));
  for (int i = 0; i < regs; ++i) {
    int row, col;
    AccumulatorPosition(t, i, row, col);
    float acc = p.accumulate ? input[static_cast<std::size_t>(i)] : 0.0f;
    for (int k = 0; k < 16; ++k) {
      const float product = r.a[static_cast<std::size_t>(row) * 16 + k] *
                            r.b[static_cast<std::size_t>(k) * r.n + col];  // exact
      acc = acc + product;
    }
    out[static_cast<std::size_t>(i)] = acc;
  }
  if (more_on_d) {
    me.chain[p.d] = std::move(out);  // the registers stay in flight
  } else {
    std::memcpy(p.d, out.data(), out.size() * sizeof(float));
    me.released[p.d] = ++me.events;
  }
}

inline void WaitGroup(int pending) {
  Slot mine;
  mine.op = Op::kWait;
  mine.n = pending;
  std::uint64_t ticket = 0;
  Gather(mine, ticket);
  ThreadState& me = This();
  while (me.groups.size() > static_cast<std::size_t>(pending)) {
    std::vector<Pending> group = std::move(me.groups.front());
    me.groups.pop_front();
    for (std::size_t i = 0; i < group.size(); ++i) {
      bool more = InFlightOn(me, group[i].d);  // a later operation on the same accumulators
      for (std::size_t j = i + 1; j < group.size(); ++j) more = more || group[j].d == group[i].d;
      Complete(me, group[i], more);
    }
  }
  me.last_wait = ++me.events;
}

// Registers per thread at launch (see the top of the file).
inline int LaunchRegisters(int threads) { return std::min(256, 65536 / threads / 8 * 8); }

// Rounds of the CTA's other threads an .inc waits through before it faults: the kernels
// release at their start (their producer's .dec), a few rounds.
inline constexpr long kPoolSpins = 1024;

inline void Setmaxnreg(bool inc, int count) {
  const char* name = inc ? "setmaxnreg.inc" : "setmaxnreg.dec";
  if (count < 24 || count > 256 || count % 8 != 0) {
    Fault(absl::StrCat(name, " ", count, ": the count must be a multiple of 8 in [24, 256]"));
  }
  Slot mine;
  mine.op = inc ? Op::kSetmaxnregInc : Op::kSetmaxnregDec;
  mine.n = count;
  std::uint64_t ticket = 0;
  Gather(mine, ticket);
  WgmmaCtaState& cta = ThisCtaWgmma();
  int& regs = cta.regs[static_cast<std::size_t>(ThisThreadIndex() / 128)];
  const int current = regs != 0 ? regs : LaunchRegisters(CtaThreads());
  if (inc ? count < current : count > current) {
    Fault(absl::StrCat(name, " ", count, " with the warpgroup at ", current,
                       " registers per thread: .inc must not lower the count and .dec must not "
                       "raise it"));
  }
  SyncWarpgroup();  // every thread has read the count before the first thread changes it
  if (ThisThreadIndex() % 128 == 0) {
    const long delta = 128L * (count - current);
    for (long spins = 0; delta > 0 && cta.pool < delta; ++spins) {
      if (spins == kPoolSpins) {
        Fault(
            absl::StrCat(name, " ", count, ": warpgroup ", ThisThreadIndex() / 128, " at ", current,
                         " registers per thread waits for ", delta,
                         " registers and the CTA's pool holds ", cta.pool,
                         "; no warpgroup releases more. The warpgroups' counts must sum to at most "
                         "what the launch gave the CTA: ",
                         CtaThreads() / 128, " warpgroups x ", LaunchRegisters(CtaThreads()),
                         " registers per thread"));
      }
      YieldThread();
    }
    cta.pool -= delta;
    regs = count;
  }
  SyncWarpgroup();  // the warpgroup goes on with its new count, as the instruction returns
}

}  // namespace wgmma
}  // namespace hsap_emu

// The entry points of jit/device/hsap_wgmma.cuh's emulation side.
inline unsigned hsap_emu_shared_offset(const void* p) {
  const auto q = reinterpret_cast<std::uintptr_t>(p);
  const auto base = reinterpret_cast<std::uintptr_t>(hsap_emu::SharedWindow());
  if (q < base || q >= base + hsap_emu::SharedWindowBytes()) {
    hsap_emu::Fault(absl::StrCat("address 0x", absl::Hex(q),
                                 " is not in the CTA's shared memory (a .shared::cta address "
                                 "was expected)"));
  }
  return static_cast<unsigned>(q - base);
}
inline void hsap_emu_wgmma_check_desc(const void* smem, unsigned lbo, unsigned sbo, int swizzle) {
  const unsigned offset = hsap_emu_shared_offset(smem);
  std::string bad;
  if (offset % 16 != 0) bad = absl::StrCat("start offset ", offset, " is not 16-byte aligned");
  if (offset >= (1u << 18)) bad = absl::StrCat("start offset ", offset, " exceeds 18 bits");
  if (lbo % 16 != 0 || lbo >= (1u << 18)) {
    bad = absl::StrCat("leading byte offset ", lbo, " is not a multiple of 16 below 2^18");
  }
  if (sbo % 16 != 0 || sbo >= (1u << 18)) {
    bad = absl::StrCat("stride byte offset ", sbo, " is not a multiple of 16 below 2^18");
  }
  if (swizzle < 0 || swizzle > 3) bad = absl::StrCat("swizzle ", swizzle, " is not 0..3");
  if (!bad.empty()) {
    hsap_emu::Fault(absl::StrCat("wgmma_desc: ", bad,
                                 " (the descriptor's fields hold 14 bits of value >> 4)"));
  }
}
inline void hsap_emu_wgmma_fence() { hsap_emu::wgmma::Fence(); }
inline void hsap_emu_wgmma_commit_group() { hsap_emu::wgmma::CommitGroup(); }
inline void hsap_emu_wgmma_wait_group(int n) { hsap_emu::wgmma::WaitGroup(n); }
inline void hsap_emu_wgmma_mma_async(int n, bool bf16, bool trans_b, float* d, const unsigned* a,
                                     unsigned long long a_desc, unsigned long long b_desc,
                                     bool accumulate) {
  hsap_emu::wgmma::MmaAsync(n, bf16, trans_b, d, a, a_desc, b_desc, accumulate);
}
inline void hsap_emu_setmaxnreg(bool inc, int regs) { hsap_emu::wgmma::Setmaxnreg(inc, regs); }

#endif  // HSAP_TESTS_SUPPORT_EMULATED_WGMMA_H_
