/* A plan batch on a host communicator with a described topology, from C99: 4 ranks on 2
 * nodes (rankNodes {0, 0, 1, 1}), a plan of two groups {0, 1} and {2, 3} (one per node),
 * MQA (2 query heads, 1 KV head, one query head per member). Each group needs the other's
 * rows of one full (bidirectional) document, and both members of a node hold the one KV
 * head: the rows cross the node boundary once and are fanned out inside the node.
 * hsapBatchGetLinkTraffic reports the split, the link classes add up to hsapBatchGetTraffic,
 * and out is bitwise the same as without rankNodes. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hsap/hsap.h"

#define RANKS 4
#define TOKENS 128
#define HEADS_Q 2
#define DIM 32

typedef struct {
  hsapComm_t comm;
  hsapLayout_t layout;
  hsapPlan_t plan;
  int rank;
  hsapResult_t result;
  char error[256];
  float out[TOKENS * HEADS_Q * DIM];
  hsapTraffic_t traffic;
  hsapLinkTraffic_t links;
} Rank;

static hsapResult_t Fail(Rank* r, hsapResult_t e) {
  r->result = e;
  snprintf(r->error, sizeof(r->error), "%s", hsapGetLastError());
  return e;
}

static void* RunRank(void* arg) {
  Rank* r = (Rank*)arg;
  hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
  hsapBatch_t batch = NULL;
  int64_t n = 0, i;
  float *q, *k, *v, *lse;
  hsapTensor_t tq, tk, tv, tout;
  hsapResult_t e;
  bc.dtype = hsapFloat32;
  bc.numHeadsQ = HEADS_Q;
  bc.numHeadsKV = 1;
  bc.headDim = DIM;
  r->result = hsapSuccess;
  if ((e = hsapBatchCreateWithPlan(&batch, r->comm, r->layout, r->plan, &bc)) != hsapSuccess) {
    Fail(r, e);
    return NULL;
  }
  hsapBatchGetLocalTokens(batch, &n);
  q = (float*)malloc(sizeof(float) * (size_t)(n * HEADS_Q * DIM + 1));
  k = (float*)malloc(sizeof(float) * (size_t)(n * DIM + 1));
  v = (float*)malloc(sizeof(float) * (size_t)(n * DIM + 1));
  lse = (float*)malloc(sizeof(float) * (size_t)(n * HEADS_Q + 1));
  for (i = 0; i < n * HEADS_Q * DIM; ++i) q[i] = (float)sin(0.1 * (double)(i + 977 * r->rank));
  for (i = 0; i < n * DIM; ++i) {
    k[i] = (float)cos(0.3 * (double)(i + 131 * r->rank));
    v[i] = (float)sin(0.7 * (double)(i + 71 * r->rank));
  }
  tq.data = q;
  tk.data = k;
  tv.data = v;
  tout.data = r->out;
  tq.dtype = tk.dtype = tv.dtype = tout.dtype = hsapFloat32;
  tq.numTokens = tk.numTokens = tv.numTokens = tout.numTokens = n;
  tq.numHeads = tout.numHeads = HEADS_Q;
  tk.numHeads = tv.numHeads = 1;
  tq.headDim = tk.headDim = tv.headDim = tout.headDim = DIM;
  if ((e = hsapAttentionForward(batch, &tq, &tk, &tv, &tout, lse)) != hsapSuccess) {
    Fail(r, e);
  } else if ((e = hsapBatchGetTraffic(batch, &r->traffic)) != hsapSuccess ||
             (e = hsapBatchGetLinkTraffic(batch, &r->links)) != hsapSuccess) {
    Fail(r, e);
  }
  hsapBatchDestroy(batch);
  free(q);
  free(k);
  free(v);
  free(lse);
  return NULL;
}

/* Runs the batch on RANKS threads; rank_nodes may be NULL. Returns 0 on success. */
static int RunAll(Rank* ranks, hsapLayout_t layout, hsapPlan_t plan, const int* rank_nodes) {
  hsapComm_t comms[RANKS];
  hsapCommConfig_t cc = HSAP_COMM_CONFIG_INITIALIZER;
  pthread_t threads[RANKS];
  int r, failed = 0;
  cc.rankNodes = rank_nodes;
  if (hsapCommInitAll(comms, RANKS, &cc) != hsapSuccess) {
    fprintf(stderr, "hsapCommInitAll: %s\n", hsapGetLastError());
    return 1;
  }
  for (r = 0; r < RANKS; ++r) {
    ranks[r].comm = comms[r];
    ranks[r].layout = layout;
    ranks[r].plan = plan;
    ranks[r].rank = r;
    pthread_create(&threads[r], NULL, RunRank, &ranks[r]);
  }
  for (r = 0; r < RANKS; ++r) pthread_join(threads[r], NULL);
  for (r = 0; r < RANKS; ++r) {
    if (ranks[r].result != hsapSuccess) {
      fprintf(stderr, "rank %d: %s\n", r, ranks[r].error);
      failed = 1;
    }
    hsapCommDestroy(comms[r]);
  }
  return failed;
}

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                                \
    }                                                                          \
  } while (0)

static Rank with_nodes[RANKS], without[RANKS];

int main(void) {
  const int64_t cu[] = {0, TOKENS};
  const hsapMaskKind_t kinds[] = {hsapMaskFull};
  const int nodes[RANKS] = {0, 0, 1, 1};
  const int sizes[] = {2, 2};
  const int group_ranks[] = {0, 1, 2, 3};
  const int counts[] = {1, 1, 1, 1};
  const int heads[] = {0, 1, 0, 1};
  /* One node's K/V rows of the other group, once: 64 rows x (K + V) x DIM x fp32. */
  const uint64_t once = (uint64_t)(TOKENS / 2) * 2 * DIM * sizeof(float);
  uint64_t inter = 0, intra = 0;
  hsapLayout_t layout = NULL;
  hsapPlan_t plan = NULL;
  int r;

  CHECK(hsapLayoutCreate(&layout, cu, 1, kinds, NULL) == hsapSuccess);
  CHECK(hsapPlanCreate(&plan, RANKS, HEADS_Q, 1, 2, sizes, group_ranks, NULL, NULL, counts, heads,
                       NULL) == hsapSuccess);
  CHECK(RunAll(with_nodes, layout, plan, nodes) == 0);
  CHECK(RunAll(without, layout, plan, NULL) == 0);
  for (r = 0; r < RANKS; ++r) {
    const hsapLinkTraffic_t* l = &with_nodes[r].links;
    CHECK(l->forwardIntraNodeBytesSent + l->forwardInterNodeBytesSent ==
          with_nodes[r].traffic.forwardBytesSent);
    CHECK(l->forwardIntraNodeBytesReceived + l->forwardInterNodeBytesReceived ==
          with_nodes[r].traffic.forwardBytesReceived);
    /* Without rankNodes every byte is intra-node. */
    CHECK(without[r].links.forwardInterNodeBytesReceived == 0);
    CHECK(memcmp(with_nodes[r].out, without[r].out, sizeof(with_nodes[r].out)) == 0);
    inter += l->forwardInterNodeBytesReceived;
    intra += l->forwardIntraNodeBytesReceived;
  }
  /* Into each of the 2 nodes once (direct delivery: once per member, 4 * once). */
  CHECK(inter == 2 * once);
  /* The fan-out inside each node, plus the group all-to-alls. */
  CHECK(intra >= 2 * once);
  hsapPlanDestroy(plan);
  hsapLayoutDestroy(layout);
  printf("c_api plan_topology: ok (inter-node K/V %llu bytes, direct delivery %llu)\n",
         (unsigned long long)inter, (unsigned long long)(4 * once));
  return 0;
}
