// A hsap::KernelSet backed by JIT-generated host kernels (jit/codegen_host.h).
//
// GetHostJitKernels(spec) generates the source for `spec`, compiles it through the compile
// cache (jit/cache.h, jit/host_compiler.h) and loads it; the result is shared by every
// caller asking for the same spec in this process. Compile at plan/batch creation, not in
// the first forward call:
//
//   HostKernelSpec spec = HostKernelSpecFor(dims, dtype, HasBandMasks(work_list));
//   ASSIGN_OR_RETURN(std::shared_ptr<const KernelSet> kernels, GetHostJitKernels(spec));
//   kernels->Forward(args, work_list, num_threads);   // same contract as KernelForward
//
// Forward/Backward check that the arguments match the compiled spec (dtype, head dim,
// heads_q == gqa_ratio * heads_kv, no banded segment for a kernel compiled without band
// masks, blocks and segments inside the buffers) and return InvalidArgument otherwise,
// never a wrong result. Work-list blocks longer than block_q are cut into chunks. Results
// are deterministic and independent of num_threads.
//
// Errors: InvalidArgument for a bad spec; CompileError (hsapCompileError) with the
// compiler log and the kept source path when the generated code does not compile;
// Unimplemented on a CPU without AVX2/FMA/F16C.
#ifndef HSAP_JIT_HOST_JIT_KERNELS_H_
#define HSAP_JIT_HOST_JIT_KERNELS_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/kernel.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "jit/cache.h"
#include "jit/codegen_host.h"

namespace hsap::jit {

// The JIT kernel set of one spec, with the LSE merge kernel as an extra.
class HostJitKernelSet : public KernelSet {
 public:
  const HostKernelSpec& spec() const { return spec_; }

  // MergePartial (attention/merge.h) for this spec's head dim, run on num_threads.
  virtual absl::Status Merge(float* o1, float* lse1, const float* o2, const float* lse2,
                             int64_t rows, int heads, int head_dim, int64_t lse_stride1,
                             int64_t lse_stride2, int num_threads) const = 0;

 protected:
  explicit HostJitKernelSet(const HostKernelSpec& spec) : spec_(spec) {}
  const HostKernelSpec spec_;
};

// The spec for a job: dims.heads_q / dims.heads_kv as the GQA ratio, the default tiles.
HostKernelSpec HostKernelSpecFor(const AttentionDims& dims, DType dtype, bool band_masks);

// Whether any segment of `work` carries a diagonal band (needs the masking code).
bool HasBandMasks(const WorkList& work);

// Compiles (or reuses) the kernels of `spec`. cache == nullptr: CompileCache::Global().
// Loaded kernel sets are kept per (cache, spec) for the life of the process, so repeated
// calls (one per plan or batch) are cheap; thread-safe. With a disabled cache every call
// compiles and loads anew. An Unavailable failure (no compiler, a compile past
// HSAP_JIT_COMPILE_TIMEOUT_MS) is said once on stderr and returned again without retrying, so
// that HostKernelsForBatch falls back to the hand-written kernels at once.
absl::StatusOr<std::shared_ptr<const HostJitKernelSet>> GetHostJitKernels(
    const HostKernelSpec& spec, CompileCache* cache = nullptr);

// The kernels a host batch should run, compiled at batch creation: the JIT set for
// (dims, dtype, band masks iff some slice of `layout` is not full), or the hand-written
// kernels when this machine cannot JIT (no working C++ compiler, or a compile past its time
// limit: Unavailable; a CPU without AVX2/FMA/F16C: Unimplemented) or when $HSAP_HOST_KERNELS is
// "handwritten" (the yardstick; unset or "jit" selects the JIT set, anything else is an error).
// Compile errors and invalid dims are returned. The result must outlive the batch that uses it
// (hold the shared_ptr in the handle).
absl::StatusOr<std::shared_ptr<const KernelSet>> HostKernelsForBatch(const AttentionDims& dims,
                                                                     DType dtype,
                                                                     const Layout& layout);

// For tests: compiles `spec` without validating it first (an unsupported head dim then
// fails in the compiler and must come back as CompileError). Not memoised.
absl::StatusOr<std::shared_ptr<const HostJitKernelSet>> CompileHostJitKernelsUnchecked(
    const HostKernelSpec& spec, CompileCache& cache);

}  // namespace hsap::jit

#endif  // HSAP_JIT_HOST_JIT_KERNELS_H_
