// The CUDA emulator's tensor-core instructions (jit/device/hsap_mma.cuh under
// HSAP_DEVICE_EMULATION): mma.sync m16n8k16, ldmatrix and cp.async (and ex2.approx, the
// softmax's exponent, for hsap_device.cuh), written from the
// fragment-layout tables of NVIDIA's PTX ISA (the sections are cited in hsap_mma.cuh, whose
// comment states the same layouts), separately from any kernel.
//
// mma and ldmatrix are warp-collective: every lane deposits its operands (registers, a row
// address) in its slot of the warp's exchange, the warp meets at its barrier, then each lane
// rebuilds the whole matrices from the 32 slots and computes its own result registers. The
// slots alternate between two buffers (by the parity of the lanes' count of collectives), so
// one barrier per instruction suffices: a lane overwrites a buffer only two instructions
// later, past a barrier that every reader of that buffer reached after reading it.
// Both instructions are .sync.aligned: all 32 lanes must execute the same instruction. A lane
// that has exited (it dropped out of the warp barrier) or that meets the warp at another
// collective leaves a stale ticket or another opcode in its slot, and the launch faults
// instead of hanging.
//
// mma accumulation order: the ISA leaves it unspecified (and the hardware's internal adds are
// not IEEE additions). The emulator starts from c and adds the 16 products in ascending k,
// each sum rounded to fp32 (round to nearest even). Every product of two bf16 or two f16
// values is exact in fp32 (8 + 8 and 11 + 11 significant bits fit in 24; only bf16 products
// below 2^-126 underflow), so the result differs from the exact c + sum(a * b) by at most
// about 16 * 2^-24 * (|c| + sum |a * b|), whatever the order: ~1e-6 relative to the terms'
// magnitudes. The tolerance rule (attention/tolerance.h) allows twice the error of the naive
// computation that rounds every partial sum to bf16 / f16 (2^-9 / 2^-12 relative), so any
// fp32 order the hardware uses is within it, and a kernel tested here is not tuned to one.
//
// cp.async (16 bytes, .cg; 4, 8 or 16, .ca) is per thread and really asynchronous: a copy is only
// recorded when issued (its addresses checked), and is carried out (global read, shared write, or
// zero fill) by the cp.async.wait_group of the same thread that requires its group; __syncthreads
// does not complete it. A kernel that reads its tile before the matching wait sees stale shared
// memory here, as it may on the GPU. Copies still pending when the thread exits are dropped.
//
// Faults (stopping the launch like the GPU's errors): misaligned or non-shared ldmatrix row
// addresses, misaligned cp.async addresses or a destination outside shared memory, a missing
// or diverged lane at mma / ldmatrix.
//
// Included by tests/support/cuda_emulator.h (before its per-CTA state, which holds one
// PtxWarpExchange per warp); the hooks declared below are defined there.
#ifndef HSAP_TESTS_SUPPORT_EMULATED_PTX_H_
#define HSAP_TESTS_SUPPORT_EMULATED_PTX_H_

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/dtype.h"

namespace hsap_emu {

// ---- hooks (tests/support/cuda_emulator.h) ----
struct PtxWarpExchange;
[[noreturn]] inline void Fault(const std::string& what);
inline void SyncWarp();                                        // the calling thread's warp barrier
inline PtxWarpExchange& ThisWarpExchange();                    // the calling thread's warp's slots
inline bool InSharedMemory(const void* p, std::size_t bytes);  // [p, p + bytes) in CTA smem
inline int ThisLane();                                         // threadIdx.x % 32

enum class PtxOp : int { kNone = 0, kMma, kLdmatrix };

// One lane's operands of a warp-collective instruction.
struct PtxLaneSlot {
  std::uint64_t ticket = 0;  // the lane's count of collectives so far (0: none yet)
  PtxOp op = PtxOp::kNone;
  int variant = 0;  // mma: 1 for bf16; ldmatrix: number of matrices, negative with .trans
  std::uint32_t regs[6] = {};     // mma: a[0..3], b[0..1]
  const void* address = nullptr;  // ldmatrix: this lane's row address
};
struct MmaOperands {
  float a[16][16];
  float b[16][8];
};
// What the first lane to leave a collective's barrier read for the whole warp (the matrices
// of an mma, the rows of an ldmatrix: one snapshot of shared memory for all lanes, as the
// instruction reads it once), reused by the other lanes of the same ticket. The lanes of a
// warp are fibers of one thread (cuda_emulator.h), so they never run at the same time.
struct PtxWarpResult {
  std::uint64_t ticket = 0;
  MmaOperands mma;
  std::uint16_t rows[4][8][8];  // ldmatrix: [matrix][row][col]
};
struct PtxWarpExchange {
  std::array<PtxLaneSlot, 32> lanes[2];  // by ticket parity
  PtxWarpResult results[2];              // by ticket parity
};

namespace ptx {

inline thread_local std::uint64_t tl_collectives = 0;

inline std::string OpName(PtxOp op, int variant) {
  switch (op) {
    case PtxOp::kMma:
      return variant == 1 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16";
    case PtxOp::kLdmatrix:
      return absl::StrCat("ldmatrix.x", variant < 0 ? -variant : variant,
                          variant < 0 ? ".trans" : "");
    case PtxOp::kNone:
      break;
  }
  return "no instruction";
}

// Deposits this lane's slot and meets the warp; returns the 32 slots, all of the same
// instruction (faults otherwise). They stay valid until this lane's next collective.
inline const std::array<PtxLaneSlot, 32>& Gather(const PtxLaneSlot& mine) {
  const int lane = ThisLane();
  const std::uint64_t ticket = ++tl_collectives;
  std::array<PtxLaneSlot, 32>& slots = ThisWarpExchange().lanes[ticket & 1];
  slots[lane] = mine;
  slots[lane].ticket = ticket;
  SyncWarp();
  for (int l = 0; l < 32; ++l) {
    const PtxLaneSlot& s = slots[l];
    if (s.ticket != ticket || s.op != mine.op || s.variant != mine.variant) {
      Fault(absl::StrCat(OpName(mine.op, mine.variant), ".sync.aligned: lane ", l,
                         s.ticket < ticket ? " did not take part (exited or diverged)"
                                           : " executed a different instruction",
                         " (its slot holds ", OpName(s.op, s.variant), ", ticket ", s.ticket,
                         " of ", ticket, ")"));
    }
  }
  return slots;
}

inline std::uint16_t Half(std::uint32_t reg, int which) {
  return static_cast<std::uint16_t>(which == 0 ? reg & 0xffffu : reg >> 16);
}
inline float Decode(std::uint16_t bits, bool bf16) {
  return bf16 ? hsap::BF16ToFloat(hsap::BF16{bits}) : hsap::F16ToFloat(hsap::F16{bits});
}

// The whole A (16x16, [row][col]) and B (16x8, [k][n]) of an m16n8k16, from the lanes'
// fragments (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type").
inline void GatherMmaOperands(const std::array<PtxLaneSlot, 32>& lanes, bool bf16, MmaOperands& m) {
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane % 4;
    const std::uint32_t* r = lanes[lane].regs;
    for (int i = 0; i < 8; ++i) {  // a_i: register i / 2, half i % 2
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      m.a[row][col] = Decode(Half(r[i / 2], i % 2), bf16);
    }
    for (int i = 0; i < 4; ++i) {  // b_i: register 4 + i / 2, half i % 2
      const int row = t * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      m.b[row][g] = Decode(Half(r[4 + i / 2], i % 2), bf16);
    }
  }
}

// (row, col) of c_i / d_i held by `lane`.
inline void AccumulatorPosition(int lane, int i, int& row, int& col) {
  row = (lane >> 2) + (i >= 2 ? 8 : 0);
  col = (lane % 4) * 2 + (i & 1);
}

inline void Mma(bool bf16, float* d, const std::uint32_t* a, const std::uint32_t* b,
                const float* c) {
  PtxLaneSlot mine;
  mine.op = PtxOp::kMma;
  mine.variant = bf16 ? 1 : 0;
  for (int i = 0; i < 4; ++i) mine.regs[i] = a[i];
  mine.regs[4] = b[0];
  mine.regs[5] = b[1];
  const float c_in[4] = {c[0], c[1], c[2], c[3]};  // d may alias c
  const std::array<PtxLaneSlot, 32>& lanes = Gather(mine);
  PtxWarpResult& shared = ThisWarpExchange().results[tl_collectives & 1];
  if (shared.ticket != tl_collectives) {
    GatherMmaOperands(lanes, bf16, shared.mma);
    shared.ticket = tl_collectives;
  }
  const MmaOperands& m = shared.mma;
  const int lane = ThisLane();
  for (int i = 0; i < 4; ++i) {
    int row, col;
    AccumulatorPosition(lane, i, row, col);
    float acc = c_in[i];
    for (int k = 0; k < 16; ++k) {
      const float product = m.a[row][k] * m.b[k][col];  // exact
      acc = acc + product;
    }
    d[i] = acc;
  }
}

// ldmatrix.m8n8.x{num}{.trans}.b16: matrix m's row r is the 16 bytes at the address of lane
// 8m + r (PTX ISA "Warp-level matrix load instruction: ldmatrix").
inline void Ldmatrix(int num, bool trans, std::uint32_t* r, const void* row_address) {
  PtxLaneSlot mine;
  mine.op = PtxOp::kLdmatrix;
  mine.variant = trans ? -num : num;
  mine.address = row_address;
  const std::array<PtxLaneSlot, 32>& lanes = Gather(mine);
  PtxWarpResult& shared = ThisWarpExchange().results[tl_collectives & 1];
  auto& rows = shared.rows;
  if (shared.ticket != tl_collectives) {
    for (int l = 0; l < 8 * num; ++l) {
      const void* p = lanes[l].address;
      const auto address = reinterpret_cast<std::uintptr_t>(p);
      if ((address & 15u) != 0) {
        Fault(absl::StrCat("misaligned address: ldmatrix row address of lane ", l, " at 0x",
                           absl::Hex(address)));
      }
      if (!InSharedMemory(p, 16)) {
        Fault(absl::StrCat("ldmatrix row address of lane ", l, " at 0x", absl::Hex(address),
                           " is not in shared memory"));
      }
      std::memcpy(rows[l / 8][l % 8], p, 16);
    }
    shared.ticket = tl_collectives;
  }
  const int lane = ThisLane();
  const int g = lane >> 2, t = lane % 4;
  for (int m = 0; m < num; ++m) {
    const std::uint16_t lo = trans ? rows[m][2 * t][g] : rows[m][g][2 * t];
    const std::uint16_t hi = trans ? rows[m][2 * t + 1][g] : rows[m][g][2 * t + 1];
    r[m] = static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
  }
}

// ---- cp.async: the calling thread's queue ----
struct PendingCopy {
  void* smem;
  const void* gmem;  // nullptr: zero fill
  int bytes;
};
struct CpAsyncQueue {
  std::vector<PendingCopy> uncommitted;
  std::deque<std::vector<PendingCopy>> groups;  // oldest first
};
inline thread_local CpAsyncQueue tl_cp_async;

// cp.async of `bytes` (cp-size: 16 for .cg, 4, 8 or 16 for .ca), both addresses aligned to
// it; src-size 0 when !valid (nothing read, the bytes zero-filled).
inline void CpAsync(void* smem, const void* gmem, int bytes, bool valid) {
  const auto dst = reinterpret_cast<std::uintptr_t>(smem);
  const auto src = reinterpret_cast<std::uintptr_t>(gmem);
  if (bytes != 4 && bytes != 8 && bytes != 16) {
    Fault(absl::StrCat("cp.async of ", bytes, " bytes: the copy size is 4, 8 or 16"));
  }
  const auto mask = static_cast<std::uintptr_t>(bytes - 1);
  if ((dst & mask) != 0 || (valid && (src & mask) != 0)) {
    Fault(absl::StrCat("misaligned address: cp.async ", bytes, " bytes from 0x", absl::Hex(src),
                       " to 0x", absl::Hex(dst)));
  }
  if (!InSharedMemory(smem, static_cast<std::size_t>(bytes))) {
    Fault(absl::StrCat("cp.async destination 0x", absl::Hex(dst), " is not in shared memory"));
  }
  tl_cp_async.uncommitted.push_back({smem, valid ? gmem : nullptr, bytes});
}
inline void CpAsyncCommit() {
  tl_cp_async.groups.push_back(std::move(tl_cp_async.uncommitted));
  tl_cp_async.uncommitted.clear();
}
// Completes the oldest groups until at most `pending` remain.
inline void CpAsyncWait(int pending) {
  while (tl_cp_async.groups.size() > static_cast<std::size_t>(pending)) {
    for (const PendingCopy& c : tl_cp_async.groups.front()) {
      if (c.gmem != nullptr) {
        std::memcpy(c.smem, c.gmem, static_cast<std::size_t>(c.bytes));
      } else {
        std::memset(c.smem, 0, static_cast<std::size_t>(c.bytes));
      }
    }
    tl_cp_async.groups.pop_front();
  }
}

// ex2.approx.ftz.f32 (PTX ISA, "Floating Point Instructions: ex2"): 2^a within 2 ulp, a
// subnormal input read as +-0 (result 1) and a subnormal result flushed to +0; -inf gives +0,
// +inf gives +inf, NaN gives NaN. The emulator returns the correctly rounded value, one of
// those the ISA allows.
inline float Ex2ApproxFtz(float a) {
  if (std::isnan(a)) return std::numeric_limits<float>::quiet_NaN();
  if (std::fpclassify(a) == FP_SUBNORMAL) a = 0.0f;
  const float r = static_cast<float>(std::exp2(static_cast<double>(a)));
  return std::fpclassify(r) == FP_SUBNORMAL ? 0.0f : r;
}

}  // namespace ptx
}  // namespace hsap_emu

// The entry points of jit/device/hsap_mma.cuh's emulation side.
inline void hsap_emu_mma_m16n8k16(bool bf16, float* d, const unsigned* a, const unsigned* b,
                                  const float* c) {
  hsap_emu::ptx::Mma(bf16, d, a, b, c);
}
inline void hsap_emu_ldmatrix(int num, bool trans, unsigned* r, const void* row) {
  hsap_emu::ptx::Ldmatrix(num, trans, r, row);
}
inline void hsap_emu_cp_async(void* smem, const void* gmem, int bytes, bool valid) {
  hsap_emu::ptx::CpAsync(smem, gmem, bytes, valid);
}
inline void hsap_emu_cp_async_commit() { hsap_emu::ptx::CpAsyncCommit(); }
inline float hsap_emu_ex2_approx_ftz(float a) { return hsap_emu::ptx::Ex2ApproxFtz(a); }
inline void hsap_emu_cp_async_wait(int pending) { hsap_emu::ptx::CpAsyncWait(pending); }

#endif  // HSAP_TESTS_SUPPORT_EMULATED_PTX_H_
