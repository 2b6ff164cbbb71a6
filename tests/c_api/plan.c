/* The Plans section of hsap.h from C99: build a plan by hand, serialise it, load it back,
 * and check that an inconsistent plan is refused with a message naming the problem. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hsap/hsap.h"

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              hsapGetLastError());                                                             \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

int main(void) {
  /* Groups {0, 1, 2} (heads {0-2,7}, {3,4}, {5,6}) and {3} (all 8 heads); GQA 8:2. */
  const int sizes[] = {3, 1};
  const int ranks[] = {0, 1, 2, 3};
  const double sequence[] = {3.0, 1.0};
  const int counts[] = {4, 2, 2, 8};
  const int heads[] = {0, 1, 2, 7, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 7};
  const int bad_heads[] = {0, 1, 2, 7, 3, 4, 5, 5, 0, 1, 2, 3, 4, 5, 6, 7};
  hsapPlan_t plan = NULL, back = NULL;
  size_t size = 0;
  char* text;
  int num_ranks = 0, num_groups = 0;
  double fwd = -1.0;

  CHECK(hsapPlanCreate(&plan, 4, 8, 2, 2, sizes, ranks, sequence, NULL, counts, heads, NULL) ==
        hsapSuccess);
  CHECK(hsapPlanToJson(plan, NULL, &size) == hsapSuccess && size > 1);
  text = (char*)malloc(size);
  CHECK(text != NULL);
  CHECK(hsapPlanToJson(plan, text, &size) == hsapSuccess);
  CHECK(strstr(text, "\"0-2,7\"") != NULL);
  CHECK(hsapPlanCreateFromJson(&back, text) == hsapSuccess);
  CHECK(hsapPlanGetShape(back, &num_ranks, NULL, NULL, &num_groups) == hsapSuccess);
  CHECK(num_ranks == 4 && num_groups == 2);
  CHECK(hsapPlanGetPredictedTime(back, &fwd, NULL) == hsapSuccess && fwd == 0.0);
  CHECK(hsapPlanDestroy(back) == hsapSuccess);
  CHECK(hsapPlanDestroy(plan) == hsapSuccess);
  free(text);

  plan = NULL;
  CHECK(hsapPlanCreate(&plan, 4, 8, 2, 2, sizes, ranks, sequence, NULL, counts, bad_heads, NULL) ==
        hsapInvalidArgument);
  CHECK(plan == NULL);
  CHECK(strstr(hsapGetLastError(), "query head 5 is owned twice in group 0") != NULL);
  printf("c_api plan: ok\n");
  return 0;
}
