// The per-batch hierarchical layout of a plan (HexiSeq CP x HP, with HSAP's sequence-aware
// context parallelism across groups): who holds which tokens and heads, the all-to-all
// split tables inside each group, and the cross-group "sub-ring" transfers.
//
// 1. Across groups. The row is partitioned over the groups by the sequence-aware partition
//    (Partition::Create) with the groups' sequence weights; its "ranks" are RING POSITIONS
//    (position p holds group plan.RingOrder()[p]), so the issue-3 schedule of position p
//    (BuildSchedule) is the group's context-parallel schedule: at step t the group receives
//    from position p - t the key rows its queries see and sends to position p + t the rows
//    that position's queries see.
// 2. Inside group g. The group's tokens, in position order (the "group buffer"), are cut
//    into contiguous pieces, one per member in group order, sized by the token weights
//    (largest remainder): member i's piece is its shard before the all-to-all. After the
//    all-to-all, member i holds the whole group buffer for its query heads and the KV heads
//    they use (GQA: kv = q / (heads_q / heads_kv)), in increasing head order.
// 3. All-to-all split tables (per pair of members i -> j, before attention): i's shard rows
//    x j's query heads (Q, dout) and x j's KV heads (K, V); j places them at rows
//    [row_begin(i), row_begin(i) + tokens(i)) of its group buffer, all of its local heads.
//    After attention the same tables run backwards (out, lse, dq, dk, dv). A KV head held
//    by several members of a group reaches each of them once; their dK/dV partials for it
//    are added by the shard's owner in member order (in fp32, so the sum is rounded once).
// 4. Sub-rings. At step t, member r of group g needs, for each of its KV heads h, the key
//    rows of the source group gs (the group-level stage's recv_runs) for head h. They come
//    from one holder of h in gs, chosen deterministically: among the members of gs holding
//    h (group order), the one at index (index of r in g) mod (number of holders), so that
//    receivers spread over holders (MQA: receiver i of g reads from member i mod |gs|).
//    Every KV row a rank needs arrives exactly once, head by head; no rank receives a head
//    it does not use; ranks that exchange nothing at a step skip it. Backward sends the
//    fp32 dK/dV partials of those rows back to the chosen holder, which adds them in step
//    order.
// 5. Topology (Create with the node of every world rank; empty: one node, and then every
//    table is exactly the direct one above). The holder of head h for receiver r is chosen
//    among the holders on r's node when gs has any (same rule, index mod their count), else
//    among all holders as above. When r's holder is on another node and k >= 2 members of
//    r's group on r's node hold h (the "node receivers" of (step, h, node), group order),
//    the rows of h cross once: the holder sends them to one of them, the GATEWAY, at index
//    (h + step) mod k (so gateway duty rotates over heads, steps and the node's members),
//    and the gateway forwards them to the others over the node (the step's FAN-OUT: after
//    the step's direct receives complete, one exchange among the group's members of each
//    node; every receive buffer is then whole before the step's kernels run). Backward:
//    the fan-out's receivers return their fp32 dK/dV partials of those rows to the gateway
//    (right after computing the step), which adds them to its own in fan-out order (group
//    order) and returns the one sum to the holder with its other partials, so gradients
//    cross the node boundary once and the result stays bitwise reproducible.
//    Deduplicated: per step and receiving group, each (row, KV head) needed on a node from
//    a holder on another node enters that node once; across groups, see 6.
// 6. Node stores (topology). Several groups with members on node B may receive rows of KV
//    head h from the same source group gs (no holder of h in gs on B), each at its own step
//    t_g = position(g) - position(gs) mod G. The groups whose rows overlap another's (the
//    PARTICIPANTS) take them from a NODE STORE: the union of their rows crosses into B once,
//    at the earliest participant's step, from SenderOf(gs, h, keeper) to the KEEPER, which
//    keeps it: among the participants' node receivers of h, the one with the fewest store
//    rows so far (ties: participant order, then group order), so crossings spread over the
//    node's links. At each participant's step the keeper is the gateway of that group's
//    node receivers of h: in its own group it fills its buffer from the store and forwards
//    to its members as a gateway; to other groups it forwards from the store, in the step's
//    fan-out exchange (a step may then hold only a store's arrival or forwards). Cost:
//    inter-node bytes are the node-level bound (each needed (row, head) enters each needing
//    node once); intra-node bytes are one fan-out per receiver other than the keeper, as for
//    a gateway; the union crosses at the earliest step, in one message, so Plan::node_stores
//    lets the planner price both ways. Backward: every participant's fp32 partials of the
//    store's rows are added into the keeper's store partial in step order (at the keeper's
//    own step, its partial after its fan-out's), and in the last participant's gradient
//    group the keeper returns the segment's sum to its holder, which adds it after that
//    step's other returned partials: gradients cross once too, overlapped with the
//    following steps, bitwise reproducibly.
//
// Degenerate plans: one group is Ulysses (no sub-ring step); groups of one rank with all
// heads are the issue-3 sequence-aware ring (identical partition and schedule when the
// ring order is the identity); equal groups with equal heads are USP / a2a+p2p.
//
// Everything here is a pure function of (layout, plan, topology, rank): every rank computes
// the same tables, so sends and receives always match.
#ifndef HSAP_LIB_SCHED_HIERARCHY_H_
#define HSAP_LIB_SCHED_HIERARCHY_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/worklist.h"
#include "lib/sched/partition.h"
#include "lib/sched/plan.h"
#include "lib/sched/schedule.h"

namespace hsap {

// A member of a group as seen by the all-to-all.
struct GroupMember {
  int rank = 0;               // world rank
  int64_t row_begin = 0;      // its shard is rows [row_begin, row_begin + tokens) of the
  int64_t tokens = 0;         // group buffer
  std::vector<int> q_heads;   // global query heads, increasing
  std::vector<int> kv_heads;  // global KV heads its query heads use, increasing
};

// One message of a sub-ring step: KV heads between this rank and `peer`.
struct KvTransfer {
  int peer = -1;                 // world rank
  std::vector<int> heads;        // global KV heads, increasing
  std::vector<int> local_heads;  // their indices in THIS rank's kv_heads
  friend bool operator==(const KvTransfer&, const KvTransfer&) = default;
};

// A node store's rows of one KV head in one message (6. above): K rows then V rows,
// [rows, D] each, packed in the order of `runs`.
struct StoreTransfer {
  int peer = -1;               // world rank: the keeper (holder side) or the holder (keeper side)
  int kv_head = -1;            // global KV head
  int local_head = -1;         // its index in THIS rank's kv_heads
  std::vector<TokenRun> runs;  // global positions -> rows of this rank's group buffer (holder)
                               // or store (keeper), increasing positions
  int64_t rows = 0;
  friend bool operator==(const StoreTransfer&, const StoreTransfer&) = default;
};

// Rows of the keeper's store forwarded to a node receiver of another participant group
// (6. above), in the step's fan-out exchange: one message [rows, heads, D] K then V, as a
// gateway's.
struct StoreFanOut {
  int peer = -1;                            // world rank
  int64_t rows = 0;                         // the receiver's recv_rows
  std::vector<int> heads;                   // global KV heads, increasing
  std::vector<std::vector<TokenRun>> runs;  // per head: global -> store rows, packed in order
  friend bool operator==(const StoreFanOut&, const StoreFanOut&) = default;
};

// One step of this rank's sub-ring schedule (the group-level stage `step`).
struct SubRingStep {
  int step = 0;
  // Receive: the key rows recv_runs (global positions -> rows of a [recv_rows, kv_heads, D]
  // buffer) of group recv_group, each transfer bringing some of this rank's KV heads.
  int recv_group = -1;
  std::vector<TokenRun> recv_runs;
  int64_t recv_rows = 0;
  std::vector<KvTransfer> recv;  // from holders; with fan_out_recv they partition kv_heads
  // Topology: heads of the buffer that come from a gateway of this group on this node
  // (peer: the gateway), after the direct receives; and, when this rank is a gateway, the
  // heads it forwards from its receive buffer to other members on its node. Group order.
  std::vector<KvTransfer> fan_out_recv;
  std::vector<KvTransfer> fan_out_send;
  WorkList recv_work;  // group-buffer queries x the receive buffer
  // Send: rows send_runs (global positions -> rows of this rank's group buffer) to members
  // of send_group, each transfer carrying the heads this rank is the chosen holder for.
  int send_group = -1;
  std::vector<TokenRun> send_runs;
  int64_t send_rows = 0;
  std::vector<KvTransfer> send;
  // Node stores (6. above). store_send: segments this rank sends to keepers with the step's
  // K/V; store_recv: segments arriving into this rank's store (runs: store rows); store_fill:
  // heads of this step's receive buffer a keeper copies from its store (peer -1; runs: store
  // rows packed into buffer rows 0..recv_rows) before the fan-out; store_fan_send: the
  // step's forwards from the store to receivers of other groups. Backward, at the last
  // participant's step: store_return_send: the keeper's summed fp32 partials of a segment
  // ([rows, D] dK then dV, runs: store rows) back to its holder in the step's gradient
  // group; store_return_recv: the holder's side (runs: group buffer rows), added after the
  // step's other returned partials. Both sorted by (peer, head).
  std::vector<StoreTransfer> store_send, store_recv, store_fill;
  std::vector<StoreFanOut> store_fan_send;
  std::vector<StoreTransfer> store_return_send, store_return_recv;
};

// Everything one rank needs to run a batch under a plan.
struct RankHierarchy {
  int rank = 0;
  int group = 0;                     // index into plan.groups
  int index = 0;                     // position in the group
  int ring_position = 0;             // position of the group in the ring
  std::vector<GroupMember> members;  // of this rank's group, group order
  // Before the all-to-all: this rank's shard (global ranges, increasing) and its size.
  std::vector<TokenRange> shard;
  int64_t shard_tokens = 0;
  // After the all-to-all: the group buffer (global -> rows) and this rank's heads.
  std::vector<TokenRun> group_runs;
  int64_t group_tokens = 0;
  std::vector<int> q_heads, kv_heads;
  std::vector<int> kv_head_of_q;  // per local query head: index into kv_heads
  // dK/dV after attention are partial sums when some KV head of the group is held by more
  // than one member: they then travel in fp32 and are rounded by the shard's owner.
  bool kv_grad_partial = false;
  WorkList local_work;             // group buffer x group buffer
  std::vector<SubRingStep> steps;  // increasing step; only steps that move something
  int64_t store_rows = 0;          // rows of this rank's node store (one KV head each)
};

// Bytes of one forward or backward, split by kind; `local` copies are not counted.
struct HierTraffic {
  uint64_t a2a_sent = 0, a2a_received = 0;    // inside the group
  uint64_t ring_sent = 0, ring_received = 0;  // across groups (sub-rings)
  uint64_t sent() const { return a2a_sent + ring_sent; }
  uint64_t received() const { return a2a_received + ring_received; }
  friend bool operator==(const HierTraffic&, const HierTraffic&) = default;
};

class Hierarchy {
 public:
  // Validates the plan (Plan::Validate) and partitions the row over groups and members.
  // node_of_rank: the node of every world rank (empty: all on one node), see 5. above.
  static absl::StatusOr<Hierarchy> Create(const Layout& layout, const Plan& plan,
                                          absl::Span<const int> node_of_rank = {});

  const Plan& plan() const { return plan_; }
  // The partition over ring positions (rank p = group RingOrder()[p]).
  const Partition& positions() const { return positions_; }
  // Shard of a world rank before the all-to-all (global ranges, increasing).
  const std::vector<TokenRange>& shard(int rank) const { return shards_[rank]; }
  int64_t shard_tokens(int rank) const;
  // Every world rank's shard, indexed by rank.
  const std::vector<std::vector<TokenRange>>& shards() const { return shards_; }
  // Tokens of group g (its group buffer size).
  int64_t group_tokens(int group) const;
  // The chosen holder in `source_group` of KV head `kv_head` for receiving rank `receiver`
  // (a world rank of another group).
  int SenderOf(int source_group, int kv_head, int receiver) const;
  // The gateway through which `receiver` gets head `kv_head` from `source_group` at `step`
  // (5. above): -1 when it receives directly from SenderOf, `receiver` itself when it is
  // the gateway, else the member of its group on its node that forwards the rows to it.
  int GatewayOf(int step, int source_group, int kv_head, int receiver) const;
  // The node of every world rank as given to Create (empty: one node).
  const std::vector<int>& node_of_rank() const { return node_of_rank_; }

  // The rows of a node store (6. above), shared by the KV heads with the same participants.
  struct StoreRows {
    std::vector<int> groups;                    // participants, by increasing step
    std::vector<int> steps;                     // their steps
    std::vector<std::vector<TokenRange>> rows;  // the rows each receives (sorted, merged)
    std::vector<int64_t> counts;                // their sizes
    std::vector<TokenRange> all_rows;           // their union: the store's segment
    int64_t all_count = 0;                      // its size
  };
  // A node store: rows of one KV head of `source_group` that several groups with members
  // on `node` receive; they cross into the node once, to `keeper`.
  struct NodeStore {
    int source_group = -1, kv_head = -1, node = -1;
    int keeper = -1;  // world rank, a participant's receiver of kv_head on node
    std::shared_ptr<const StoreRows> rows;
  };
  // The store of (source group, KV head, node), or null when there is none.
  const NodeStore* StoreOf(int source_group, int kv_head, int node) const;
  // Every store, ordered by (source group, node, KV head).
  const std::vector<NodeStore>& stores() const { return stores_; }
  // Whether `group` takes head `kv_head` of `source_group` from a store on `node`.
  bool TakesFromStore(int source_group, int kv_head, int node, int group) const;

  // The schedule of one world rank. block_q: query rows per kernel block.
  absl::StatusOr<RankHierarchy> BuildRank(const Layout& layout, int rank,
                                          int64_t block_q = 64) const;

 private:
  Plan plan_;
  Partition positions_;
  std::vector<int> ring_, position_of_, group_of_, index_of_;
  std::vector<std::vector<TokenRange>> shards_;
  std::vector<std::vector<int64_t>> member_rows_;        // [group][i]: row_begin of member i
  std::vector<std::vector<std::vector<int>>> kv_heads_;  // [group][i]
  std::vector<int> node_of_rank_;                        // empty: one node
  std::vector<NodeStore> stores_;
  // StoreOf: (source group, node) -> heads_kv entries of store_heads_ (index into stores_,
  // or -1) at store_heads_[value * heads_kv + head].
  absl::flat_hash_map<std::pair<int, int>, int> store_blocks_;
  std::vector<int> store_heads_;

  class RankBuilder;  // BuildRank's steps (hierarchy.cc)

  absl::Status PlanStores(const Layout& layout);

  // Members of `group` on `node` holding `kv_head` (world ranks, group order).
  std::vector<int> NodeReceivers(int group, int kv_head, int node) const;
};

// Bytes a forward / backward of `r` moves, predicted from its tables. Forward: Q, K, V in,
// out (storage dtype) and lse (fp32) back, K/V along the sub-rings and their fan-outs
// (counted as sub-ring bytes). Backward: Q, K, V,
// dout in and lse + delta (fp32, 2 per query row and head), K/V again along the sub-rings
// with fp32 dK/dV partials back, dQ back in the storage dtype and dK/dV in the storage
// dtype or, when kv_grad_partial, fp32.
HierTraffic PredictForwardTraffic(const RankHierarchy& r, int head_dim, DType dtype);
HierTraffic PredictBackwardTraffic(const RankHierarchy& r, int head_dim, DType dtype);

// Token counts of a split of `total` tokens by `weights` (>= 0, sum > 0): largest
// remainder, ties to the lower index; the counts sum to `total`.
std::vector<int64_t> SplitByWeights(int64_t total, const std::vector<double>& weights);

}  // namespace hsap

#endif  // HSAP_LIB_SCHED_HIERARCHY_H_
