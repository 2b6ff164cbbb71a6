// Stage I of the planner's search (lib/planner/planner.h): which groupings it screens, and
// the screen itself. Each grouping is screened once, by stage II with the overlap-bound ring;
// the fastest are refined with the pipelined ring into the candidates that the planner then
// prices by what runs. Internal to the planner.
#ifndef HSAP_LIB_PLANNER_GROUPING_SCREEN_H_
#define HSAP_LIB_PLANNER_GROUPING_SCREEN_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "lib/planner/candidate_builder.h"
#include "lib/planner/grouping.h"
#include "lib/planner/planner.h"

namespace hsap::planner_internal {

// Stage I search state: each grouping (a choice of option per kind) is screened once, by
// stage II with the overlap-bound ring (O(groups) per price); the groupings that yield a
// plan are kept with their time.
class GroupingScreen {
 public:
  GroupingScreen(const GroupingSpace& space, const CandidateBuilder& builder, int iterations,
                 int* evaluations)
      : space_(space), builder_(builder), iterations_(iterations), evaluations_(evaluations) {}

  const GroupingSpace& space() const { return space_; }

  // The screened time of the grouping `choice`; infinity when no plan of it fits.
  double Screen(const std::vector<int>& choice);

  // The per-kind choice screened fastest (ties: the smaller choice); empty when none fits.
  std::vector<int> BestChoice() const;

  // The screened time of a grouping from outside the per-kind space (keyed by its label).
  double ScreenGrouping(Grouping grouping);

  // The `count` fastest groupings screened, fastest first (ties: screening order).
  std::vector<Grouping> TakeBest(int count);

 private:
  const GroupingSpace& space_;
  const CandidateBuilder& builder_;
  const int iterations_;
  int* const evaluations_;
  std::vector<Grouping> groupings_;
  std::vector<std::pair<double, int>> screened_;  // (time, index into groupings_)
  std::map<std::vector<int>, double> seen_;
  std::map<std::string, double> seen_labels_;
};

// Stage I when the combinations are few: every one, the first kind's option varying fastest.
void ScreenEveryCombination(GroupingScreen* screen);

// Stage I when the combinations are many: coordinate descent (one kind at a time, two
// sweeps) from the best starting point: node-sized groups, or every kind at the same size
// v (the largest option <= v) for every size v on offer.
void ScreenByCoordinateDescent(GroupingScreen* screen);

// Stage I, differing group sizes: around the fastest per-kind choice, each kind's nodes cut
// as a + b + ... + b for every pair of its in-node sizes on offer (GroupingSpace::
// MixedSizes), one kind at a time: at most (sizes per node)^2 groupings per kind.
void ScreenMixedSizes(GroupingScreen* screen);

// Stage II again for the screened groupings, with the pipelined ring (O(groups^2) per
// price): the fastest candidates, fastest first: options.simulate_top of them, or all of them
// on clusters of at most kPriceAllDevices devices (where pricing what runs is cheap).
inline constexpr int kPriceAllDevices = 64;

std::vector<Candidate> RefineCandidates(const CandidateBuilder& builder,
                                        const std::vector<Grouping>& groupings,
                                        const PlannerOptions& options, int* evaluations);

}  // namespace hsap::planner_internal

#endif  // HSAP_LIB_PLANNER_GROUPING_SCREEN_H_
