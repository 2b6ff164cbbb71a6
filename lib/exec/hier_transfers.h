// The hierarchical executor's transfers (lib/exec/hierarchical_executor.h): the group's
// all-to-all of one tensor, and the double-buffered K/V of one rank's sub-ring steps with
// their fan-out inside a node and the node stores (hierarchy.h, 5. and 6.). Both count the
// bytes they move, in total and by link class. Internal to the executor.
#ifndef HSAP_LIB_EXEC_HIER_TRANSFERS_H_
#define HSAP_LIB_EXEC_HIER_TRANSFERS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lib/comm/alltoallv.h"
#include "lib/comm/transport.h"
#include "lib/exec/executor.h"
#include "lib/exec/hierarchical_executor.h"
#include "lib/exec/protocol.h"
#include "lib/sched/hierarchy.h"

namespace hsap::hier_internal {

inline size_t Bytes(int64_t rows, size_t heads, int width, size_t element_bytes) {
  return static_cast<size_t>(rows) * heads * static_cast<size_t>(width) * element_bytes;
}

// The group's all-to-all for one tensor. "Scatter": a tensor over this rank's shard with
// the layer's full head count (`full_heads`, `width` elements of `element_bytes` per head)
// becomes the group buffer [group_tokens, my heads, width]. "Gather" is the inverse.
class GroupExchange {
 public:
  GroupExchange(const HierExecContext& ctx, const char* pass) : ctx_(ctx), pass_(pass) {}

  static const std::vector<int>& HeadsOf(const GroupMember& m, bool q_like) {
    return q_like ? m.q_heads : m.kv_heads;
  }

  // This rank's shard `src` [shard_tokens, full_heads, width] to the group buffer `dst`
  // [group_tokens, my heads, width] (q_like: the query heads, else the KV heads).
  absl::Status Scatter(const void* src, int full_heads, int width, size_t es, bool q_like,
                       void* dst, protocol::PlanPayload kind, const char* what);

  // Inverse of Scatter. With `sum_into` (fp32 only), the members' contributions are not
  // placed but added, in member order, into sum_into [shard_tokens, full_heads, width],
  // which the caller zeroes; `dst` is then unused.
  absl::Status Gather(const void* src, int full_heads, int width, size_t es, bool q_like, void* dst,
                      protocol::PlanPayload kind, const char* what, float* sum_into = nullptr);

  uint64_t bytes_sent() const { return sent_; }
  uint64_t bytes_received() const { return received_; }
  // The same bytes by link class.
  const ExecTraffic& links() const { return links_; }

 private:
  absl::Status Run(const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
                   const AllToAllVPlan& plan, protocol::PlanPayload kind, const char* what);

  const HierExecContext& ctx_;
  const char* pass_;
  uint64_t sent_ = 0, received_ = 0;
  ExecTraffic links_;
};

// The transport stage's name of a sub-ring step: "<pass> step <step> (<what> from rank a,
// b; to rank c)".
std::string StepName(const char* pass, int step, const char* what,
                     const std::vector<KvTransfer>& from, const std::vector<KvTransfer>& to);
std::string StepName(const char* pass, const SubRingStep& s, const char* what);

// The rows of a sub-ring send, as token ranges of the group buffer.
std::vector<TokenRange> SendRows(const SubRingStep& s);

// Calls fn(store_row, row) for the store rows of `runs`, packed in order into rows 0, 1, ...
template <typename Fn>
void ForEachStoreRow(const std::vector<TokenRun>& runs, Fn&& fn) {
  int64_t row = 0;
  for (const TokenRun& run : runs) {
    for (int64_t i = 0; i < run.length; ++i) fn(run.local_begin + i, row++);
  }
}

// Double-buffered K/V along the sub-ring steps of one rank. A message carries the K rows
// of its heads followed by the V rows, [rows, heads, D] each.
class SubRingKv {
 public:
  SubRingKv(const HierExecContext& ctx, const void* k, const void* v, const char* pass,
            protocol::PlanPayload tag)
      : ctx_(ctx), k_(k), v_(v), pass_(pass), tag_(tag) {}

  // Posts step i's K/V: the sends of this rank's rows and the receives of the step's rows.
  absl::StatusOr<std::unique_ptr<Transport::Pending>> Post(size_t i);

  // After step i's direct receives completed (every rank calls this at every step): keeps
  // the store segments that arrived, fills the buffer's heads that come from the store, runs
  // the step's fan-out inside the node (hierarchy.h, 5. and 6.), then sets the K and V
  // buffers [recv_rows, kv_heads, D] of its rows (unset when the step receives nothing).
  absl::Status Assemble(size_t i, const void** k, const void** v);

  uint64_t sent() const { return sent_; }
  uint64_t received() const { return received_; }
  const ExecTraffic& links() const { return links_; }

 private:
  struct Slot {
    std::vector<std::vector<char>> send, recv, store_send, store_recv;
    std::vector<char> kv;
    bool direct = false;
  };
  // The gateway forwards heads of its receive buffer `kv` (K then V, half_all bytes each)
  // to the node's other receivers of step s; they unpack theirs into `kv`. One exchange,
  // completed here (its data arrived with the step's direct receives).
  absl::Status FanOut(const SubRingStep& s, char* kv, size_t half_all);

  const HierExecContext& ctx_;
  const void* k_;
  const void* v_;
  const char* pass_;
  protocol::PlanPayload tag_;
  Slot slots_[2];
  std::vector<char> store_k_, store_v_;  // the node store: [store_rows, D] each
  uint64_t sent_ = 0, received_ = 0;
  ExecTraffic links_;
};

}  // namespace hsap::hier_internal

#endif  // HSAP_LIB_EXEC_HIER_TRANSFERS_H_
