// The blocked, flash-style host attention kernels (hand-written; the JIT-generated host
// kernels in jit/ have the same contract and use this one as their yardstick).
//
// Forward: online softmax over the key tiles listed by a WorkList, fp32 accumulation; the
// partial (out, lse) of the listed keys is merged into the caller's (out, lse), so calls
// over disjoint key sets compose (initialise with InitPartial first).
// Backward (FlashAttention-2 style): recomputes probabilities from the final lse and adds
// the gradients of the listed pairs into fp32 accumulators. Both are deterministic: the
// result does not depend on the number of threads, and is bitwise the same from run to run.
//
// Hand-written kernel: forward tasks are (query head, work-list block); a block of more
// than kKernelBlockQ rows is processed kKernelBlockQ rows at a time, so any block_q works.
// Each task walks its segments in key tiles of kKernelBlockK, skips empty tiles, masks
// partial ones per element and converts the storage type to fp32 once per tile. Backward
// is fused (FlashAttention-2 order, five matrix products per tile): a task is one (query
// tile, key chunk of kKernelBlockK rows, kv head) pair, which recomputes P and dS once per
// q head of the group and adds dv += P^T dO, dk += dS^T Q and dq += dS K into the caller's
// buffers. Pairs run in waves in which no two share a query tile or a key chunk, so every
// dq, dk and dv element sums its contributions in wave order: no atomics, no order that
// depends on the thread count.
//
// Accuracy (tests/attention/kernel_test.cc): out, lse, dq, dk and dv meet the rule of
// attention/tolerance.h with the kernels' floor,
//   max |kernel - ref| <= 2 * max |naive - ref| + 1e-6 * max(1, max |ref|).
// Rows that see no key stay exactly (0, -inf).
#ifndef HSAP_ATTENTION_KERNEL_H_
#define HSAP_ATTENTION_KERNEL_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "attention/dtype.h"
#include "attention/worklist.h"

namespace hsap {

// Head geometry. Query head h reads key/value head kv_head_of_q[h] when that vector is
// non-empty, else h / (heads_q / heads_kv).
struct AttentionDims {
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  float scale = 0.0f;  // softmax scale; must be set (no default here)
  std::vector<int> kv_head_of_q;

  int KvHead(int h) const {
    return kv_head_of_q.empty() ? h / (heads_q / heads_kv) : kv_head_of_q[h];
  }
};

// Checks heads (heads_q a multiple of heads_kv unless kv_head_of_q is given, entries in
// range), head_dim in [32, 256] and a multiple of 8, scale finite and positive.
absl::Status ValidateDims(const AttentionDims& dims);

struct ForwardArgs {
  AttentionDims dims;
  DType dtype = DType::kF32;  // storage type of q, k, v
  const void* q = nullptr;    // [q_rows, heads_q, head_dim]
  int64_t q_rows = 0;
  const void* k = nullptr;  // [k_rows, heads_kv, head_dim]
  const void* v = nullptr;  // [k_rows, heads_kv, head_dim]
  int64_t k_rows = 0;
  float* out = nullptr;  // fp32 [q_rows, heads_q, head_dim], merged into
  float* lse = nullptr;  // fp32 [heads_q, q_rows], merged into
};

struct BackwardArgs {
  AttentionDims dims;
  DType dtype = DType::kF32;     // storage type of q, k, v, dout
  const void* q = nullptr;       // [q_rows, heads_q, head_dim]
  const void* dout = nullptr;    // [q_rows, heads_q, head_dim]
  const float* lse = nullptr;    // final lse, [heads_q, q_rows]
  const float* delta = nullptr;  // rowsum(dout * out), [heads_q, q_rows] (ComputeDelta)
  int64_t q_rows = 0;
  const void* k = nullptr;  // [k_rows, heads_kv, head_dim]
  const void* v = nullptr;
  int64_t k_rows = 0;
  float* dq = nullptr;  // fp32 [q_rows, heads_q, head_dim], added into
  float* dk = nullptr;  // fp32 [k_rows, heads_kv, head_dim], added into
  float* dv = nullptr;  // fp32 [k_rows, heads_kv, head_dim], added into
};

// Sets out to 0 and lse to -inf: the partial result of attending to no key.
void InitPartial(float* out, float* lse, int64_t rows, int heads, int head_dim);

// Tile shape of the hand-written kernel; BuildWorkList should use kKernelBlockQ.
inline constexpr int64_t kKernelBlockQ = 64;
inline constexpr int64_t kKernelBlockK = 64;

// num_threads <= 0: all hardware threads. Errors (InvalidArgument): ValidateDims fails,
// a work-list block or segment outside q_rows / k_rows, a null buffer when there is work.
// An empty work list is a no-op.
absl::Status KernelForward(const ForwardArgs& args, const WorkList& work, int num_threads);
absl::Status KernelBackward(const BackwardArgs& args, const WorkList& work, int num_threads);

// A forward/backward pair with the contract above. The executor runs whichever set it is
// given: the hand-written kernels, or a set compiled by the JIT for one configuration.
class KernelSet {
 public:
  virtual ~KernelSet() = default;
  virtual absl::Status Forward(const ForwardArgs& args, const WorkList& work,
                               int num_threads) const = 0;
  virtual absl::Status Backward(const BackwardArgs& args, const WorkList& work,
                                int num_threads) const = 0;
  virtual std::string_view name() const = 0;
};

// KernelForward/KernelBackward as a KernelSet.
const KernelSet& HandWrittenKernels();

// Instruction sets the hand-written kernels are compiled for. The library itself is built
// for the baseline x86-64 ISA (it runs on any x86-64 CPU); KernelForward, KernelBackward and
// HandWrittenKernels() run the best copy this CPU supports, chosen once per process. Each
// copy is deterministic as above; copies differ from each other by fp32 rounding (FMA
// contraction), each within the accuracy rule. Off x86 only kBaseline exists.
enum class KernelIsa { kBaseline, kAvx2, kAvx512 };  // AVX2 means AVX2 + FMA
std::string_view KernelIsaName(KernelIsa isa);       // "baseline", "avx2", "avx512"
bool CpuSupportsKernelIsa(KernelIsa isa);
KernelIsa BestKernelIsa();  // the copy KernelForward/KernelBackward run

// The kernels of one copy, named "host-handwritten/<isa>"; where the CPU lacks the ISA their
// calls return FailedPrecondition.
const KernelSet& HandWrittenKernels(KernelIsa isa);

// delta[h, r] = sum_d dout[r, h, d] * out[r, h, d] (fp32), out and dout in `dtype`.
void ComputeDelta(DType dtype, const void* dout, const void* out, int64_t rows, int heads,
                  int head_dim, float* delta);

}  // namespace hsap

#endif  // HSAP_ATTENTION_KERNEL_H_
