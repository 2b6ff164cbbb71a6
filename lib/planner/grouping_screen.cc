#include "lib/planner/grouping_screen.h"

#include <algorithm>
#include <limits>

namespace hsap::planner_internal {

double GroupingScreen::Screen(const std::vector<int>& choice) {
  if (auto it = seen_.find(choice); it != seen_.end()) return it->second;
  Grouping grouping = space_.Build(choice);
  auto best = builder_.Balance(grouping, iterations_, RingPricing::kOverlapBound, evaluations_);
  const double t = best ? best->cost.Seconds() : std::numeric_limits<double>::infinity();
  seen_[choice] = t;
  if (best) {
    screened_.push_back({t, static_cast<int>(groupings_.size())});
    groupings_.push_back(std::move(grouping));
  }
  return t;
}

std::vector<int> GroupingScreen::BestChoice() const {
  std::vector<int> best;
  double t = std::numeric_limits<double>::infinity();
  for (const auto& [choice, time] : seen_) {
    if (time < t) {
      t = time;
      best = choice;
    }
  }
  return best;
}

double GroupingScreen::ScreenGrouping(Grouping grouping) {
  if (auto it = seen_labels_.find(grouping.label); it != seen_labels_.end()) return it->second;
  auto best = builder_.Balance(grouping, iterations_, RingPricing::kOverlapBound, evaluations_);
  const double t = best ? best->cost.Seconds() : std::numeric_limits<double>::infinity();
  seen_labels_[grouping.label] = t;
  if (best) {
    screened_.push_back({t, static_cast<int>(groupings_.size())});
    groupings_.push_back(std::move(grouping));
  }
  return t;
}

std::vector<Grouping> GroupingScreen::TakeBest(int count) {
  std::stable_sort(screened_.begin(), screened_.end());
  if (static_cast<int>(screened_.size()) > count) screened_.resize(count);
  std::vector<Grouping> best;
  for (auto [unused, i] : screened_) best.push_back(std::move(groupings_[i]));
  return best;
}

void ScreenEveryCombination(GroupingScreen* screen) {
  const GroupingSpace& space = screen->space();
  const int num_kinds = space.num_kinds();
  std::vector<int> choice(num_kinds, 0);
  while (true) {
    screen->Screen(choice);
    int k = 0;
    while (k < num_kinds && ++choice[k] == static_cast<int>(space.options(k).size())) {
      choice[k++] = 0;
    }
    if (k == num_kinds) break;
  }
}

void ScreenByCoordinateDescent(GroupingScreen* screen) {
  const GroupingSpace& space = screen->space();
  const int num_kinds = space.num_kinds();
  std::vector<int> choice = space.NodeSizedChoice();
  double current = screen->Screen(choice);
  std::vector<int> sizes;
  for (int k = 0; k < num_kinds; ++k) {
    sizes.insert(sizes.end(), space.options(k).begin(), space.options(k).end());
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (int v : sizes) {
    std::vector<int> start(num_kinds, 0);
    for (int k = 0; k < num_kinds; ++k) {
      for (size_t i = 0; i < space.options(k).size(); ++i) {
        if (space.options(k)[i] <= v) start[k] = static_cast<int>(i);
      }
    }
    const double t = screen->Screen(start);
    if (t < current) {
      current = t;
      choice = start;
    }
  }
  for (int sweep = 0; sweep < 2; ++sweep) {
    for (int k = 0; k < num_kinds; ++k) {
      int best_option = choice[k];
      for (int o = 0; o < static_cast<int>(space.options(k).size()); ++o) {
        std::vector<int> trial = choice;
        trial[k] = o;
        const double t = screen->Screen(trial);
        if (t < current) {
          current = t;
          best_option = o;
        }
      }
      choice[k] = best_option;
    }
  }
}

void ScreenMixedSizes(GroupingScreen* screen) {
  const GroupingSpace& space = screen->space();
  const std::vector<int> best = screen->BestChoice();
  if (best.empty()) return;
  for (int k = 0; k < space.num_kinds(); ++k) {
    for (auto [a, b] : space.MixedSizes(k)) screen->ScreenGrouping(space.BuildMixed(best, k, a, b));
  }
}

std::vector<Candidate> RefineCandidates(const CandidateBuilder& builder,
                                        const std::vector<Grouping>& groupings,
                                        const PlannerOptions& options, int* evaluations) {
  std::vector<Candidate> candidates;
  for (const Grouping& grouping : groupings) {
    auto best =
        builder.Balance(grouping, options.balance_iterations, RingPricing::kPipelined, evaluations);
    if (best) candidates.push_back(*std::move(best));
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
    return a.cost.Seconds() < b.cost.Seconds();
  });
  const int keep = builder.devices() <= kPriceAllDevices ? static_cast<int>(candidates.size())
                                                         : options.simulate_top;
  if (static_cast<int>(candidates.size()) > keep) {
    candidates.resize(keep);
  }
  return candidates;
}

}  // namespace hsap::planner_internal
