// Work-list helpers shared by the attention kernels (the FMA kernels of hsap_attention.cuh
// and the tensor-core kernels of hsap_attention_mma_*.cuh): the visible key range of a
// segment, the band test of a tile, the kv head of a query head, error reporting.
// NVRTC-clean (no system include), like hsap_device.cuh.
#ifndef HSAP_JIT_DEVICE_HSAP_WORKLIST_CUH_
#define HSAP_JIT_DEVICE_HSAP_WORKLIST_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_device.cuh"
#include "hsap_params.cuh"

namespace hsap_dev {

constexpr long long kNoDiagLimit = 1LL << 60;  // attention/layout.h

HSAP_DEV long long min64(long long a, long long b) { return a < b ? a : b; }
HSAP_DEV long long max64(long long a, long long b) { return a > b ? a : b; }

HSAP_DEV void report(unsigned int* error_flag, unsigned int bits) {
  if (error_flag != nullptr && threadIdx.x == 0) atomicOr(error_flag, bits);
}

// The visible key range [k_lo, k_hi) of `seg` for query rows [q0, q0 + rows).
HSAP_DEV void visible_keys(const KeySegment& seg, long long q0, int rows, long long* k_lo,
                           long long* k_hi) {
  *k_lo = max64(seg.k_begin, q0 + seg.diag_lo);
  *k_hi = min64(seg.k_end, q0 + rows + seg.diag_hi);  // last visible: q0 + rows - 1 + diag_hi
}

HSAP_DEV bool segment_is_full(const KeySegment& seg) {
  return seg.diag_lo <= -kNoDiagLimit && seg.diag_hi >= kNoDiagLimit;
}

// Every (row, col) of the tile is inside the band.
HSAP_DEV bool tile_inside_band(const KeySegment& seg, long long q0, int rows, long long k0,
                               int cols) {
  return k0 - (q0 + rows - 1) >= seg.diag_lo && (k0 + cols - 1) - q0 <= seg.diag_hi;
}

// Whether block qb lies within [0, q_rows) (a well-formed work list's blocks do); else it
// reports kErrorRowsOutOfRange and the caller skips the block.
HSAP_DEV bool block_rows_in_range(const QueryBlock& qb, long long q_rows,
                                  unsigned int* error_flag) {
  if (qb.q_begin >= 0 && qb.q_end <= q_rows && qb.q_begin <= qb.q_end) return true;
  report(error_flag, kErrorRowsOutOfRange);
  return false;
}

// Whether every tensor is 16-byte aligned, as cp.async and TMA, which move 16-byte rows,
// need; else it reports kErrorMisaligned and the caller computes nothing.
template <class... Tensors>
HSAP_DEV bool tensors_aligned16(unsigned int* error_flag, const Tensors*... tensors) {
  const unsigned long long bits = (0ull | ... | reinterpret_cast<unsigned long long>(tensors));
  if ((bits & 15ull) == 0) return true;
  report(error_flag, kErrorMisaligned);
  return false;
}

// The kv head of query head h, or -1 (reported) when the head geometry breaks the contract.
template <class Cfg>
HSAP_DEV int kv_head(const int* kv_head_of_q, int heads_q, int heads_kv, int h,
                     unsigned int* error_flag) {
  int kvh = -1;
  if (kv_head_of_q != nullptr) {
    kvh = kv_head_of_q[h];
  } else if (heads_q == heads_kv * Cfg::kGqa) {
    kvh = h / Cfg::kGqa;
  }
  if (kvh < 0 || kvh >= heads_kv) {
    report(error_flag, kErrorHeads);
    return -1;
  }
  return kvh;
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_WORKLIST_CUH_
