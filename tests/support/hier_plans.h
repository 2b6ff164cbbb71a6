// Plans for the hierarchy tests: head-parallel groups of given sizes with contiguous,
// round-robin or random head sets, shared by hierarchy_test and hierarchical_test.
#ifndef HSAP_TESTS_SUPPORT_HIER_PLANS_H_
#define HSAP_TESTS_SUPPORT_HIER_PLANS_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lib/sched/plan.h"

namespace hsap::testing {

enum class HeadSplit {
  kContiguous,  // as even as possible, in order (the first members get one more)
  kRoundRobin,  // head h to member h mod size (non-contiguous)
  kRandom,      // each head to a random member (uneven, non-contiguous, maybe empty)
};

inline std::string HeadSplitName(HeadSplit s) {
  return s == HeadSplit::kContiguous ? "contig" : s == HeadSplit::kRoundRobin ? "rr" : "random";
}

struct PlanSpec {
  std::vector<int> group_sizes;
  int heads_q = 4;
  int heads_kv = 4;
  HeadSplit split = HeadSplit::kContiguous;
  bool uneven = false;  // uneven sequence and token weights (and a scrambled rank order)
  uint64_t seed = 1;

  std::string Name() const {
    return absl::StrCat("g", absl::StrJoin(group_sizes, "_"), "_h", heads_q, "kv", heads_kv, "_",
                        HeadSplitName(split), uneven ? "_uneven" : "");
  }
};

inline Plan MakePlan(const PlanSpec& spec) {
  std::mt19937_64 rng(spec.seed);
  Plan plan;
  plan.heads_q = spec.heads_q;
  plan.heads_kv = spec.heads_kv;
  int n = 0;
  for (int s : spec.group_sizes) n += s;
  plan.num_ranks = n;
  // World ranks: in order, or scrambled for uneven plans (groups need not be contiguous).
  std::vector<int> world(n);
  for (int r = 0; r < n; ++r) world[r] = r;
  if (spec.uneven) std::shuffle(world.begin(), world.end(), rng);
  int next = 0;
  for (int size : spec.group_sizes) {
    PlanGroup g;
    g.sequence_weight = spec.uneven ? 1.0 + static_cast<double>(rng() % 4) : 1.0;
    g.heads.assign(size, {});
    for (int i = 0; i < size; ++i) {
      g.ranks.push_back(world[next++]);
      g.token_weights.push_back(spec.uneven ? static_cast<double>(1 + rng() % 3) : 1.0);
    }
    for (int h = 0; h < spec.heads_q; ++h) {
      int member = 0;
      switch (spec.split) {
        case HeadSplit::kContiguous: {
          const int base = spec.heads_q / size, extra = spec.heads_q % size;
          int start = 0;
          for (int i = 0; i < size; ++i) {
            const int count = base + (i < extra ? 1 : 0);
            if (h >= start && h < start + count) member = i;
            start += count;
          }
          break;
        }
        case HeadSplit::kRoundRobin:
          member = h % size;
          break;
        case HeadSplit::kRandom:
          member = static_cast<int>(rng() % size);
          break;
      }
      g.heads[member].push_back(h);
    }
    plan.groups.push_back(std::move(g));
  }
  if (spec.uneven && plan.groups.size() > 2) {
    // A ring order other than the identity.
    for (size_t i = 0; i < plan.groups.size(); ++i) {
      plan.ring_order.push_back(static_cast<int>((i * 2 + 1) % plan.groups.size()));
    }
    std::vector<bool> seen(plan.groups.size(), false);
    bool perm = true;
    for (int g : plan.ring_order) perm = perm && !seen[g], seen[g] = true;
    if (!perm) {
      plan.ring_order.clear();
      for (int g = static_cast<int>(plan.groups.size()) - 1; g >= 0; --g)
        plan.ring_order.push_back(g);
    }
  }
  return plan;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_HIER_PLANS_H_
