// The JSON form of a plan (written by hsapPlanToJson and bench/hsap_plan --json).
//
// Kept apart from plan.h so that the units that only use plans do not parse the JSON
// library's header.
#ifndef HSAP_LIB_SCHED_PLAN_JSON_H_
#define HSAP_LIB_SCHED_PLAN_JSON_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lib/sched/plan.h"

namespace hsap {

// Heads are written as strings like "0-5,12"; on reading, a head list may be such a string
// or an array of integers. Reading fails with InvalidArgument naming the field at fault;
// Validate() runs on reading. indent < 0 writes one line.
absl::StatusOr<Plan> PlanFromJsonText(absl::string_view text);
std::string PlanToJsonText(const Plan& plan, int indent = 2);

}  // namespace hsap

#endif  // HSAP_LIB_SCHED_PLAN_JSON_H_
