// The exchange programs (exchange_program.h) of one rank's hierarchical batch
// (gpu_hier_executor.h): the group's all-to-all of each tensor, and per sub-ring step its
// K/V, its fp32 dK/dV partials back, its node fan-out and fan-in (hierarchy.h, 5.) and its
// node stores (hierarchy.h, 6.). Built on the host from the rank's RankHierarchy; the
// buffers they read and write are named in each comment. Internal to the GPU hierarchical
// executor.
#ifndef HSAP_LIB_CUDA_EXEC_HIER_EXCHANGE_PROGRAMS_H_
#define HSAP_LIB_CUDA_EXEC_HIER_EXCHANGE_PROGRAMS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/cuda/exec/exchange_program.h"
#include "lib/exec/protocol.h"
#include "lib/sched/hierarchy.h"

namespace hsap::cuda::hier_internal {

// Bytes of `rows` rows of `heads` heads of `width` elements of `es` bytes.
inline size_t Bytes(int64_t rows, size_t heads, int width, size_t es) {
  return static_cast<size_t>(rows) * heads * static_cast<size_t>(width) * es;
}

// The all-to-all of one tensor: shard [n_me, full, width] -> group buffer [N, mine, width]
// (in), or back (`back`; `add`: fp32 partial sums added by the owner).
absl::StatusOr<ExchangeProgram> AllToAllProgram(const RankHierarchy& r, int full, int width,
                                                size_t es, bool q_like, protocol::PlanPayload kind,
                                                bool back, bool add = false);

// lse of the holder [hq, N] fp32 -> the owner's lse [HQ, n_me] (one piece per head).
absl::StatusOr<ExchangeProgram> LseBackProgram(const RankHierarchy& r);

// The owner's (lse, delta) [2, HQ, n_me] -> the holders' [2, hq, N] (one piece per head).
absl::StatusOr<ExchangeProgram> StatsInProgram(const RankHierarchy& r, int HQ);

// Sub-ring step K/V: [gk | gv] of the group buffer -> the step's receive slot [k | v].
absl::StatusOr<ExchangeProgram> RingKvProgram(const RankHierarchy& r, const SubRingStep& s, int D,
                                              size_t es);

// Sub-ring step dK/dV partials (fp32): the slot's [pk | pv] back to the senders, added into
// the holders' [dk32 | dv32].
absl::StatusOr<ExchangeProgram> RingGradProgram(const RankHierarchy& r, const SubRingStep& s,
                                                int D);

// Node fan-out of a step's K/V (hierarchy.h, 5.): the gateway forwards heads of its receive
// slot [k | v] to the node's other receivers, which place them in theirs.
absl::StatusOr<ExchangeProgram> FanOutKvProgram(const RankHierarchy& r, const SubRingStep& s, int D,
                                                size_t es);

// The fan-in of a step's fp32 dK/dV partials (the fan-out backwards), as legs of one stage:
// leg 0 sends this rank's partials [pk | pv] of the heads it got from gateways; leg 1 + x
// adds those of fan-out receiver x into the gateway's partials. One leg per receiver, so
// the gateway adds them one launch after another in fan-out order (bitwise reproducible).
absl::StatusOr<std::vector<ExchangeProgram>> FanInGradPrograms(const RankHierarchy& r,
                                                               const SubRingStep& s, int D);

// ---- Node stores (hierarchy.h, 6.) ----------------------------------------------------
// The keeper's store is [sk | sv], [store_rows, D] each (one KV head per row), in the
// storage dtype; backward adds its fp32 partials [spk | spv] of the same shape.

// A step's store K/V (with the step's K/V stage): this rank's group-buffer rows to keepers
// (from [gk | gv]) and the segments arriving into its store [sk | sv].
absl::StatusOr<ExchangeProgram> StoreKvProgram(const RankHierarchy& r, const SubRingStep& s, int D,
                                               size_t es);

// A keeper's fills of its step buffer from its store, as self copies: forward, store rows
// (packed) -> slot rows 0..recv_rows of the filled head; `grad`, the fp32 step partial of
// those rows added back into the store partial.
absl::StatusOr<ExchangeProgram> StoreFillProgram(const RankHierarchy& r, const SubRingStep& s,
                                                 int D, size_t es, bool grad);

// A step's forwards from the store to receivers of other groups (sends of the step's
// fan-out exchange, tag kKvFanOut), from [sk | sv].
absl::StatusOr<ExchangeProgram> StoreFanOutProgram(const RankHierarchy& r, const SubRingStep& s,
                                                   int D, size_t es);

// Backward, in the step's fan-in exchange: the fp32 partials of each store forward's
// receiver, added into the store partial [spk | spv] (one leg per receiver, in list order).
absl::StatusOr<std::vector<ExchangeProgram>> StoreFanInPrograms(const RankHierarchy& r,
                                                                const SubRingStep& s, int D);

// In the gradient group of a store's last participant step (hierarchy.h 6.): leg 0 sends
// the keeper's store partial sums of the step's store_return_send (tag kKvStoreGrad); leg
// 1 + x adds the sums of its x-th store_return_recv into the holder's [dk32 | dv32] (one
// add per message, in list order, after the step's other returned partials).
absl::StatusOr<std::vector<ExchangeProgram>> StoreReturnPrograms(const RankHierarchy& r,
                                                                 const SubRingStep& s, int D);

}  // namespace hsap::cuda::hier_internal

#endif  // HSAP_LIB_CUDA_EXEC_HIER_EXCHANGE_PROGRAMS_H_
