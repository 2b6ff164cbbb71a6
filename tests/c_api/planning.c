/* The "Planning at start-up" section of hsap.h from C99: a plan from a cluster description
 * and a model, its predictions, and a plan from a one-rank host communicator. */
#include <stdio.h>
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

static const char kTestbed[] =
    "{\"name\": \"testbed\", \"nodes\": ["
    "{\"kind\": \"H100\", \"devices\": 8, \"nics\": 1, \"nic_gbps\": 25},"
    "{\"kind\": \"A100\", \"devices\": 8, \"nics\": 1, \"nic_gbps\": 25}]}";

int main(void) {
  hsapPlanModel_t model = HSAP_PLAN_MODEL_INITIALIZER;
  hsapPlan_t plan = NULL;
  hsapComm_t comm = NULL;
  double fwd = 0.0, bwd = 0.0, bytes = 0.0, h100 = 0.0;
  int ranks = 0, heads_q = 0, r;

  /* Llama 3 8B at 128K tokens on 8 H100 + 8 A100. */
  model.seqLen = 131072;
  model.numLayers = 32;
  model.numHeadsQ = 32;
  model.numHeadsKV = 8;
  model.headDim = 128;
  model.hidden = 4096;
  model.ffnHidden = 14336;
  model.vocab = 128256;
  CHECK(hsapPlanCreateForCluster(&plan, kTestbed, &model) == hsapSuccess);
  CHECK(hsapPlanGetShape(plan, &ranks, &heads_q, NULL, NULL) == hsapSuccess);
  CHECK(ranks == 16 && heads_q == 32);
  CHECK(hsapPlanGetPredictedTime(plan, &fwd, &bwd) == hsapSuccess);
  CHECK(fwd > 0.0 && bwd > fwd);
  for (r = 0; r < 16; ++r) {
    CHECK(hsapPlanGetRankMemory(plan, r, &bytes) == hsapSuccess);
    /* Above the model state (16 bytes x ~8e9 parameters / 16 ranks), within 80 GiB. */
    CHECK(bytes > 7e9 && bytes < 80.0 * 1024 * 1024 * 1024);
    if (r == 0) h100 = bytes;
  }
  CHECK(h100 > 0.0);
  CHECK(hsapPlanGetRankMemory(plan, 16, &bytes) == hsapInvalidArgument);
  CHECK(strstr(hsapGetLastError(), "rank = 16 must be in [0, 16)") != NULL);
  CHECK(hsapPlanDestroy(plan) == hsapSuccess);

  /* A malformed description and an inconsistent model are refused with the reason. */
  plan = NULL;
  CHECK(hsapPlanCreateForCluster(&plan, "{\"nodes\": []}", &model) == hsapInvalidArgument);
  CHECK(plan == NULL && strstr(hsapGetLastError(), "nodes") != NULL);
  model.numHeadsKV = 5;
  CHECK(hsapPlanCreateForCluster(&plan, kTestbed, &model) == hsapInvalidArgument);
  CHECK(strstr(hsapGetLastError(), "multiple of numHeadsKV") != NULL);

  /* From a host communicator of one rank: a "cpu" device; a small model. */
  model.numHeadsKV = 8;
  model.seqLen = 4096;
  model.numLayers = 2;
  model.hidden = 0;
  model.ffnHidden = 0;
  model.vocab = 0;
  CHECK(hsapCommInitAll(&comm, 1, NULL) == hsapSuccess);
  CHECK(hsapPlanCreateForComm(&plan, comm, NULL, &model) == hsapSuccess);
  CHECK(hsapPlanGetShape(plan, &ranks, NULL, NULL, NULL) == hsapSuccess && ranks == 1);
  CHECK(hsapPlanGetPredictedTime(plan, &fwd, NULL) == hsapSuccess && fwd > 0.0);
  CHECK(hsapPlanDestroy(plan) == hsapSuccess);
  CHECK(hsapCommDestroy(comm) == hsapSuccess);
  printf("c_api planning: ok\n");
  return 0;
}
