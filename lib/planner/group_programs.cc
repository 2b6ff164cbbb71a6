#include "lib/planner/group_programs.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/schedule.h"

namespace hsap {
namespace {

// Hierarchy::SenderOf as a table: holders_[g][kv] lists the members of group g holding KV
// head kv (group order); a receiver of index i in its own group reads from holder i mod count.
class Holders {
 public:
  explicit Holders(const Plan& plan) : plan_(plan), index_of_(plan.IndexInGroup()) {
    holders_.resize(plan.groups.size());
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      holders_[g].assign(plan.heads_kv, {});
      for (size_t i = 0; i < plan.groups[g].ranks.size(); ++i) {
        for (int kv : plan.KvHeadsOf(static_cast<int>(g), static_cast<int>(i))) {
          holders_[g][kv].push_back(static_cast<int>(i));
        }
      }
    }
  }

  int SenderOf(int source_group, int kv_head, int receiver) const {
    const std::vector<int>& h = holders_[source_group][kv_head];
    return plan_.groups[source_group].ranks[h[index_of_[receiver] % h.size()]];
  }
  int IndexOf(int rank) const { return index_of_[rank]; }

 private:
  const Plan& plan_;
  std::vector<int> index_of_;
  std::vector<std::vector<std::vector<int>>> holders_;  // [group][kv head] -> member indices
};

// The sub-ring steps of member `self` of a group whose ring position runs `sched`
// (Hierarchy::BuildRank's loop, without the runs and work lists the program does not use).
std::vector<SubRingStep> StepsOf(const Schedule& sched, const RankHierarchy& self,
                                 const std::vector<int>& ring,
                                 const std::vector<std::vector<std::vector<int>>>& kv_heads,
                                 const Plan& plan, const Holders& holders) {
  std::vector<SubRingStep> steps;
  for (const Stage& st : sched.stages) {
    SubRingStep step;
    step.step = st.step;
    if (st.recv_from >= 0) {
      step.recv_group = ring[st.recv_from];
      for (int h : self.kv_heads) {
        const int sender = holders.SenderOf(step.recv_group, h, self.rank);
        auto it = std::find_if(step.recv.begin(), step.recv.end(),
                               [&](const KvTransfer& t) { return t.peer == sender; });
        if (it == step.recv.end()) it = step.recv.insert(step.recv.end(), {sender, {}, {}});
        it->heads.push_back(h);
      }
      std::sort(step.recv.begin(), step.recv.end(), [&](const KvTransfer& a, const KvTransfer& b) {
        return holders.IndexOf(a.peer) < holders.IndexOf(b.peer);
      });
      step.recv_rows = st.recv_rows;
      step.recv_work.visible_pairs = st.recv_work.visible_pairs;
    }
    if (st.send_to >= 0) {
      const int gd = ring[st.send_to];
      const PlanGroup& dst = plan.groups[gd];
      for (size_t j = 0; j < dst.ranks.size(); ++j) {
        KvTransfer t;
        t.peer = dst.ranks[j];
        for (int h : kv_heads[gd][j]) {
          if (holders.SenderOf(self.group, h, t.peer) == self.rank) t.heads.push_back(h);
        }
        if (!t.heads.empty()) step.send.push_back(std::move(t));
      }
      if (!step.send.empty()) {
        step.send_group = gd;
        step.send_rows = st.send_rows;
      }
    }
    if (step.recv_group >= 0 || step.send_group >= 0) steps.push_back(std::move(step));
  }
  return steps;
}

}  // namespace

absl::StatusOr<std::vector<RankProgram>> PlanProgramsByGroup(const Layout& layout, const Plan& plan,
                                                             const LayerShape& shape) {
  if (plan.heads_q != shape.heads_q || plan.heads_kv != shape.heads_kv) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan is for ", plan.heads_q, "/", plan.heads_kv,
                     " query/KV heads but the layer has ", shape.heads_q, "/", shape.heads_kv));
  }
  HSAP_ASSIGN_OR_RETURN(Hierarchy h, Hierarchy::Create(layout, plan));
  const int num_groups = static_cast<int>(plan.groups.size());
  const std::vector<int> ring = plan.RingOrder();
  std::vector<int> position_of(num_groups);
  for (int p = 0; p < num_groups; ++p) position_of[ring[p]] = p;
  std::vector<std::vector<std::vector<int>>> kv_heads(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    for (size_t i = 0; i < plan.groups[g].ranks.size(); ++i) {
      kv_heads[g].push_back(plan.KvHeadsOf(g, static_cast<int>(i)));
    }
  }
  const Holders holders(plan);
  // One block per run: the pair counts are those of any blocking.
  const int64_t whole_row = std::max<int64_t>(1, layout.num_tokens());

  std::vector<RankProgram> programs(plan.num_ranks);
  for (int g = 0; g < num_groups; ++g) {
    const PlanGroup& group = plan.groups[g];
    HSAP_ASSIGN_OR_RETURN(Schedule sched,
                          BuildSchedule(layout, h.positions(), position_of[g], whole_row));
    RankHierarchy r;
    r.group = g;
    r.ring_position = position_of[g];
    r.group_tokens = sched.local_rows;
    std::vector<int> holders_of_kv(plan.heads_kv, 0);
    int64_t row = 0;
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      GroupMember m;
      m.rank = group.ranks[i];
      m.row_begin = row;
      m.tokens = h.shard_tokens(m.rank);
      row += m.tokens;
      m.q_heads = group.heads[i];
      std::sort(m.q_heads.begin(), m.q_heads.end());
      m.kv_heads = kv_heads[g][i];
      for (int kv : m.kv_heads) ++holders_of_kv[kv];
      r.members.push_back(std::move(m));
    }
    r.kv_grad_partial =
        std::any_of(holders_of_kv.begin(), holders_of_kv.end(), [](int n) { return n > 1; });
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      r.rank = group.ranks[i];
      r.index = static_cast<int>(i);
      r.shard_tokens = r.members[i].tokens;
      r.q_heads = r.members[i].q_heads;
      r.kv_heads = r.members[i].kv_heads;
      r.local_work.visible_pairs = 0;
      r.steps.clear();
      if (!r.q_heads.empty()) {
        r.local_work.visible_pairs = sched.local_work.visible_pairs;
        r.steps = StepsOf(sched, r, ring, kv_heads, plan, holders);
      }
      programs[r.rank] = ProgramOf(r, shape.head_dim, shape.dtype);
    }
  }
  return programs;
}

}  // namespace hsap
