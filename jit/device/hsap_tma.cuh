// The sm_90 asynchronous-copy layer: mbarrier (the shared-memory transaction barrier), the
// TMA bulk tensor copies (cp.async.bulk.tensor, global -> shared, tiled mode) that complete
// their bytes on an mbarrier, the tensor-map prefetch, and the fences that order mbarrier
// initialisation and generic-proxy shared-memory writes with the async proxy. One function
// per PTX instruction; the sm_90a forward (hsap_attention_wgmma_fwd.cuh) is written on these
// and on hsap_wgmma.cuh, and on nothing else sm_90 specific.
//
// NVRTC-clean (no include at all); include after hsap_device.cuh (HSAP_DEV). The instructions
// exist from sm_90 on (PTX ISA 8.0); nothing here needs the `a` target, but the kernels that
// use it are compiled for sm_90a (wgmma). Under HSAP_DEVICE_EMULATION each function calls a
// hook of the CPU emulator (tests/support/emulated_tma.h), written from the same ISA sections.
//
// ---- mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier") --
// An mbarrier is an opaque 64-bit object in shared memory, 8-byte aligned ("Size and alignment
// of mbarrier object"). Its state ("Contents of the mbarrier object"): the current phase, the
// expected arrival count (set by mbarrier.init, 1 .. 2^20 - 1), the pending arrival count, and
// the tx-count (-(2^20 - 1) .. 2^20 - 1). mbarrier.init sets phase 0, pending = expected =
// count, tx-count 0. An arrive-on operation decrements the pending count; an expect-tx
// operation (mbarrier.arrive.expect_tx, before its arrive-on) increments the tx-count by
// `bytes`; a complete-tx operation (done by the TMA copy that names the barrier, as its bytes
// land) decrements it. The current phase completes when the pending count AND the tx-count are
// both zero ("Phase Completion of the mbarrier object"): the phase advances, pending is reset
// to the expected count, and the next phase begins. Any other access to the object than the
// mbarrier instructions is undefined, and so is every operation but init on an uninitialised
// object.
// mbarrier.try_wait.parity waitComplete, [bar], parity ("mbarrier.test_wait/mbarrier.try_wait"):
// `parity` names the phase waited for by its parity (0: even phases, 1: odd); waitComplete is
// true when that phase has completed, i.e. when the CURRENT phase's parity differs from
// `parity` (the waited phase is the current or the immediately preceding one). try_wait may
// suspend the thread for a system-dependent time before answering false; the usual loop is
// mbarrier_wait_parity below. A consumer waiting on the k-th use of a barrier passes parity
// k % 2.
//
// ---- cp.async.bulk.tensor (PTX ISA "Data Movement and Conversion Instructions:
// cp.async.bulk.tensor", "Tensor Access Modes: Tiled mode", "Tensor-map") ----
//   cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes
//       [dst], [map, {c0, .., cN-1}], [bar]
// copies the box of the tensor map whose first element has coordinates (c0 innermost, signed
// 32-bit, possibly negative or past the end) into shared memory at dst (128-byte aligned),
// packed in box order (dimension 0 contiguous), with the map's swizzle applied to the shared
// addresses. Box elements outside the tensor are filled with zeros (or the NaN constant of
// CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA) and still count as bytes. When the copy is
// done, a complete-tx of the box's byte count is performed on bar. The copy is asynchronous: it
// is only ordered with the thread's later instructions through the barrier. The map is
// CUtensorMap's 128 opaque bytes, built on the host by cuTensorMapEncodeTiled
// (lib/cuda/runtime/tensor_map.h), passed as a `__grid_constant__ const TensorMap` kernel
// parameter (or in global memory), 64-byte aligned.
//
// ---- fences (PTX ISA "Parallel Synchronization and Communication Instructions: membar/fence")
// fence.mbarrier_init.release.cluster orders the thread's prior mbarrier.init with later
// operations of other threads and of the async proxy (use it after initialising the barriers,
// before the __syncthreads that publishes them). fence.proxy.async.shared::cta orders the
// thread's prior generic-proxy accesses to shared memory with later async-proxy accesses
// (TMA, wgmma operands) and vice versa.
#ifndef HSAP_JIT_DEVICE_HSAP_TMA_CUH_
#define HSAP_JIT_DEVICE_HSAP_TMA_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

namespace hsap_dev {

// CUtensorMap (cuda.h): 16 opaque 64-bit words. The driver requires 64-byte alignment of the
// map (cuTensorMapEncodeTiled: "tensorMap address must be aligned to 64 bytes"); CUDA 13's
// cuda.h declares the type alignas(128), which satisfies it too.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

#ifdef HSAP_DEVICE_EMULATION

HSAP_DEV void mbarrier_init(unsigned long long* bar, unsigned count) {
  hsap_emu_mbarrier_init(bar, count);
}
HSAP_DEV void mbarrier_arrive(unsigned long long* bar) {
  hsap_emu_mbarrier_arrive(bar, /*expect_tx=*/false, 0);
}
HSAP_DEV void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  hsap_emu_mbarrier_arrive(bar, /*expect_tx=*/true, bytes);
}
HSAP_DEV bool mbarrier_try_wait_parity(unsigned long long* bar, unsigned phase) {
  return hsap_emu_mbarrier_try_wait_parity(bar, phase);
}
HSAP_DEV void fence_barrier_init() { hsap_emu_fence_barrier_init(); }
HSAP_DEV void fence_proxy_async_shared() { hsap_emu_fence_proxy_async_shared(); }
HSAP_DEV void prefetch_tensormap(const TensorMap* map) { hsap_emu_prefetch_tensormap(map); }
HSAP_DEV void tma_load_2d(void* smem_dst, const TensorMap* map, int c0, int c1,
                          unsigned long long* bar) {
  const int c[2] = {c0, c1};
  hsap_emu_tma_load(smem_dst, map, 2, c, bar);
}
HSAP_DEV void tma_load_3d(void* smem_dst, const TensorMap* map, int c0, int c1, int c2,
                          unsigned long long* bar) {
  const int c[3] = {c0, c1, c2};
  hsap_emu_tma_load(smem_dst, map, 3, c, bar);
}
HSAP_DEV void tma_load_4d(void* smem_dst, const TensorMap* map, int c0, int c1, int c2, int c3,
                          unsigned long long* bar) {
  const int c[4] = {c0, c1, c2, c3};
  hsap_emu_tma_load(smem_dst, map, 4, c, bar);
}

#else  // the GPU: inline PTX, sm_90 and up

HSAP_DEV unsigned tma_shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The "memory" clobbers keep the compiler from moving shared-memory accesses across the
// barrier operations and the copies.
HSAP_DEV void mbarrier_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tma_shared_address(bar)),
               "r"(count)
               : "memory");
}
HSAP_DEV void mbarrier_arrive(unsigned long long* bar) {
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.shared::cta.b64 state, [%0];\n"
      "}\n" ::"r"(tma_shared_address(bar))
      : "memory");
}
HSAP_DEV void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n"
      "}\n" ::"r"(tma_shared_address(bar)),
      "r"(bytes)
      : "memory");
}
HSAP_DEV bool mbarrier_try_wait_parity(unsigned long long* bar, unsigned phase) {
  unsigned done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(tma_shared_address(bar)), "r"(phase)
      : "memory");
  return done != 0;
}
HSAP_DEV void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
HSAP_DEV void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
HSAP_DEV void prefetch_tensormap(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
HSAP_DEV void tma_load_2d(void* smem_dst, const TensorMap* map, int c0, int c1,
                          unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(tma_shared_address(smem_dst)),
      "l"(map), "r"(tma_shared_address(bar)), "r"(c0), "r"(c1)
      : "memory");
}
HSAP_DEV void tma_load_3d(void* smem_dst, const TensorMap* map, int c0, int c1, int c2,
                          unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(tma_shared_address(smem_dst)),
      "l"(map), "r"(tma_shared_address(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
HSAP_DEV void tma_load_4d(void* smem_dst, const TensorMap* map, int c0, int c1, int c2, int c3,
                          unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(tma_shared_address(smem_dst)),
      "l"(map), "r"(tma_shared_address(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

#endif  // HSAP_DEVICE_EMULATION

// Loops on try_wait until the phase of parity `phase` has completed. (In the emulator each
// unsuccessful try_wait lets the CTA's other threads run.)
HSAP_DEV void mbarrier_wait_parity(unsigned long long* bar, unsigned phase) {
  while (!mbarrier_try_wait_parity(bar, phase)) {
  }
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_TMA_CUH_
