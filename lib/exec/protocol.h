// The executor protocol, written once for every executor (host ring, host plan, GPU ring,
// GPU plan) and for the NCCL lowering that checks it (lib/cuda/exec/nccl_lowering.h).
//
// Tags. Every message of a batch call carries a 64-bit tag:
//
//   bit  63      collective (lib/comm/transport.h: AllGather, AllToAllV); never set here
//   bit  62      a plan batch's message (sub-ring step or group exchange); clear: ring batch
//   bits 25..61  the call id (the batch's call number; 37 bits, wrapping)
//   bits 20..24  the payload (K, V, their gradients, a group exchange's tensor)
//   bits  0..19  the step (the rank distance a ring message travels; 0 for group exchanges)
//
// The host plan executor runs its group exchanges as AllToAllV collectives; their caller tag
// is GroupExchangeTag (call id and payload, below the collective's sequence bits).
//
// Order. NCCL matches messages by posting order, so every executor posts its stages in one
// global order of labels: forward kv(1), kv(2), ...; backward kv(1), kv(2), grad(1), kv(3),
// grad(2), ... (the K/V of step t + 1 is in flight while step t's gradients go back).
// BackwardPostingOrder gives a rank's groups in that order; RunBackwardStages
// (lib/exec/staged.h) follows it.
#ifndef HSAP_LIB_EXEC_PROTOCOL_H_
#define HSAP_LIB_EXEC_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "lib/comm/transport.h"

namespace hsap::protocol {

inline constexpr int kStepBits = 20;
inline constexpr int kPayloadShift = kStepBits;
inline constexpr int kPayloadBits = 5;
inline constexpr int kCallShift = kPayloadShift + kPayloadBits;
inline constexpr int kCallBits = 37;
inline constexpr uint64_t kCallMask = (uint64_t{1} << kCallBits) - 1;
inline constexpr uint64_t kPlanBit = uint64_t{1} << (kCallShift + kCallBits);

static_assert(kCallShift == 25 && kCallShift + kCallBits == 62, "tag fields as documented");
static_assert(kPlanBit << 1 == kCollectiveTagBit, "the plan bit sits just below collectives");
// A step is a rank distance: plans and communicators have at most 2^20 ranks.
static_assert((uint64_t{1} << kStepBits) >= (uint64_t{1} << 20), "steps must fit");

// The payloads of a ring batch (sequence-aware ring, host and GPU).
// kRelayKeyGrad / kRelayValueGrad: a gateway's summed partials of a relayed buffer, returned
// to the owner after every stage (lib/sched/schedule.h); their step is the direct stage's.
enum class Payload : uint64_t {
  kKey = 1,
  kValue = 2,
  kKeyGrad = 3,
  kValueGrad = 4,
  kRelayKeyGrad = 5,
  kRelayValueGrad = 6,
};

// The payloads of a plan batch: sub-ring K/V and fp32 dK/dV partials, and the group
// exchanges in (q, k, v, dout, lse with delta) and back (out, lse, dq, dk, dv).
enum class PlanPayload : uint64_t {
  kKv = 1,
  kKvGrad = 2,
  kInQ = 3,
  kInK = 4,
  kInV = 5,
  kInDout = 6,
  kInStats = 7,
  kOutO = 8,
  kOutLse = 9,
  kOutDq = 10,
  kOutDk = 11,
  kOutDv = 12,
  // A sub-ring step's fan-out inside a node (lib/sched/hierarchy.h, topology): K/V from the
  // gateway, and the fp32 dK/dV partials back to it.
  kKvFanOut = 13,
  kKvGradFanIn = 14,
  // A node store (lib/sched/hierarchy.h, 6.): rows crossing into a node once, from a holder
  // to the keeper, and after every step the keeper's summed fp32 dK/dV partials back.
  kKvStore = 15,
  kKvStoreGrad = 16,
};
static_assert(static_cast<uint64_t>(PlanPayload::kKvStoreGrad) < (uint64_t{1} << kPayloadBits),
              "payloads must fit their bits");

constexpr uint64_t CallBits(uint64_t call_id) { return (call_id & kCallMask) << kCallShift; }

constexpr uint64_t RingTag(uint64_t call_id, Payload payload, int step) {
  return CallBits(call_id) | (static_cast<uint64_t>(payload) << kPayloadShift) |
         static_cast<uint64_t>(step);
}

// The call-independent part of a plan batch's tag (what a prepared exchange stores).
constexpr uint64_t PlanMessage(PlanPayload payload, int step = 0) {
  return kPlanBit | (static_cast<uint64_t>(payload) << kPayloadShift) | static_cast<uint64_t>(step);
}
constexpr uint64_t PlanTag(uint64_t call_id, uint64_t plan_message) {
  return CallBits(call_id) | plan_message;
}

// The caller tag of a host group exchange (an AllToAllV collective, which adds its own bits).
constexpr uint64_t GroupExchangeTag(uint64_t call_id, PlanPayload payload) {
  return ((call_id & kCallMask) << 8) | static_cast<uint64_t>(payload);
}
static_assert(((kCallMask << 8) | 0xff) <= kCollectiveSequenceMask,
              "a group exchange tag must survive CollectiveTag");

// One group of a rank's backward: the K/V group (is_grad false) or the gradient group of
// its stage at `index`.
struct BackwardGroup {
  bool is_grad = false;
  size_t index = 0;
  friend bool operator==(const BackwardGroup&, const BackwardGroup&) = default;
};

// A rank's backward groups in the global order above, for its stages with steps `steps`
// (increasing): kv(t) sorts as 2t, grad(t) as 2t + 3 (after kv(t + 1), before kv(t + 2)).
std::vector<BackwardGroup> BackwardPostingOrder(absl::Span<const int> steps);

}  // namespace hsap::protocol

#endif  // HSAP_LIB_EXEC_PROTOCOL_H_
