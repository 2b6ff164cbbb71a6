// The object behind hsapPlan_t, shared by the plan entry points (lib/api_plan.cc) and the
// runtime entry points that execute a plan.
#ifndef HSAP_LIB_API_PLAN_H_
#define HSAP_LIB_API_PLAN_H_

#include "hsap/hsap.h"
#include "lib/plan.h"

struct hsapPlan_st {
  hsap::Plan plan;  // validated on creation, immutable afterwards
};

#endif  // HSAP_LIB_API_PLAN_H_
