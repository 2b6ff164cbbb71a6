// Flags for signalling between CTAs of one kernel and between devices (peer memory), with
// explicit PTX memory-model semantics (sm_70+):
//   release:  st.release / atom.add.release  -- prior writes become visible first
//   acquire:  ld.acquire                     -- later reads see what the releaser wrote
// at .gpu scope (CTAs of one device) or .sys scope (peers over NVLink/PCIe, host-mapped).
//
// The CTA-level pattern used by the kernels:
//   producer: all threads write data; __syncthreads(); thread 0: signal_*(flag)
//   consumer: thread 0: wait_*(flag, value); __syncthreads(); all threads read data
// bar.sync orders the CTA's threads with thread 0, and release/acquire are cumulative, so
// the whole CTA's writes are published and the whole CTA may read after the wait.
// Counters only grow (modulo 2^32), so no flag is ever reset inside a kernel; comparisons
// are wrap-safe.
//
// NVRTC-clean and nvcc-clean: no include, no host function.
#ifndef HSAP_JIT_DEVICE_HSAP_SYNC_CUH_
#define HSAP_JIT_DEVICE_HSAP_SYNC_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

namespace hsap_dev {

#ifdef HSAP_DEVICE_EMULATION
__device__ __forceinline__ unsigned int ld_acquire_gpu(const unsigned int* p) {
  return hsap_emu_load_acquire(p);
}
__device__ __forceinline__ unsigned int ld_acquire_sys(const unsigned int* p) {
  return hsap_emu_load_acquire(p);
}
__device__ __forceinline__ void st_release_sys(unsigned int* p, unsigned int v) {
  hsap_emu_store_release(p, v);
}
__device__ __forceinline__ unsigned int add_release_gpu(unsigned int* p, unsigned int v) {
  return hsap_emu_fetch_add_release(p, v);
}
__device__ __forceinline__ unsigned int add_release_sys(unsigned int* p, unsigned int v) {
  return hsap_emu_fetch_add_release(p, v);
}
__device__ __forceinline__ unsigned long long globaltimer_ns() { return hsap_emu_globaltimer_ns(); }
#else
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned int ld_acquire_gpu(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned int ld_acquire_sys(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned int* p, unsigned int v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned int add_release_gpu(unsigned int* p, unsigned int v) {
  unsigned int old;
  asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}
__device__ __forceinline__ unsigned int add_release_sys(unsigned int* p, unsigned int v) {
  unsigned int old;
  asm volatile("atom.release.sys.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}
#endif

// Named barriers (PTX ISA, "Parallel Synchronization and Communication Instructions: bar,
// barrier"): each CTA has sixteen, ids 0..15 (0 is __syncthreads'). bar.sync a, b makes the
// calling warp arrive at barrier a and wait until b threads have arrived; bar.arrive a, b
// arrives without waiting. b is a multiple of the warp size (not 0 for arrive); a warp
// arrives as a whole (.aligned: every thread of the warp executes the same instruction);
// when b threads have arrived the waiters go on and the barrier is ready for its next
// phase. Threads that exited do not arrive. The ids a kernel uses are compile-time
// constants, checked here; under HSAP_DEVICE_EMULATION each call goes to the emulator
// (tests/support/cuda_emulator.h), which faults on the misuses the ISA leaves undefined.
template <int kId, int kThreads>
struct NamedBarrierCheck {
  static_assert(kId >= 1 && kId <= 15, "named barrier: ids 1..15 (0 is __syncthreads' barrier)");
  static_assert(kThreads > 0 && kThreads % 32 == 0,
                "named barrier: the thread count is a non-zero multiple of the warp size");
  static constexpr bool ok = true;
};
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  static_assert(NamedBarrierCheck<kId, kThreads>::ok, "");
#ifdef HSAP_DEVICE_EMULATION
  hsap_emu_named_barrier(kId, kThreads, /*wait=*/true);
#else
  asm volatile("bar.sync %0, %1;" : : "n"(kId), "n"(kThreads) : "memory");
#endif
}
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_arrive() {
  static_assert(NamedBarrierCheck<kId, kThreads>::ok, "");
#ifdef HSAP_DEVICE_EMULATION
  hsap_emu_named_barrier(kId, kThreads, /*wait=*/false);
#else
  asm volatile("bar.arrive %0, %1;" : : "n"(kId), "n"(kThreads) : "memory");
#endif
}

// a >= b for counters that may wrap around 2^32.
__device__ __forceinline__ bool counter_reached(unsigned int a, unsigned int b) {
  return static_cast<int>(a - b) >= 0;
}

// Spin until *flag >= value. Call from ONE thread, then __syncthreads().
__device__ __forceinline__ void wait_geq_gpu(const unsigned int* flag, unsigned int value) {
  while (!counter_reached(ld_acquire_gpu(flag), value)) __nanosleep(64);
}

// Spin until *flag >= value, or false once timeout_ns (0: never) have passed. ONE thread.
__device__ __forceinline__ bool wait_geq_sys_until(const unsigned int* flag, unsigned int value,
                                                   unsigned long long timeout_ns) {
  const unsigned long long start = timeout_ns != 0 ? globaltimer_ns() : 0;
  while (!counter_reached(ld_acquire_sys(flag), value)) {
    if (timeout_ns != 0 && globaltimer_ns() - start > timeout_ns) return false;
    __nanosleep(128);
  }
  return true;
}

// CTA-wide: wait (thread 0) then barrier.
__device__ __forceinline__ void cta_wait_geq_gpu(const unsigned int* flag, unsigned int value) {
  if (threadIdx.x == 0) wait_geq_gpu(flag, value);
  __syncthreads();
}
// CTA-wide: barrier then signal (thread 0). The fence makes the CTA's plain stores visible
// device-wide before the release even on paths the memory model leaves implementation-
// defined (e.g. stores through generic pointers).
__device__ __forceinline__ void cta_signal_add_gpu(unsigned int* flag, unsigned int v) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    add_release_gpu(flag, v);
  }
}
__device__ __forceinline__ void cta_signal_add_sys(unsigned int* flag, unsigned int v) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    add_release_sys(flag, v);
  }
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_SYNC_CUH_
