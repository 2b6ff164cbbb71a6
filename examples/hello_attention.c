/* The smallest complete use of hsap from C: one packed row of three documents (causal, full,
 * sliding window), distributed attention over 4 host ranks (threads of this process),
 * forward and backward, and the forward checked against single-device attention.
 *
 *   bash scripts/build.sh      # or scripts/main_job.sh, which builds too
 *   cc -std=c99 -O2 -Iinclude examples/hello_attention.c -Lbuild -lhsap -lpthread -lm \
 *      -Wl,-rpath,$PWD/build -o build/hello_attention && build/hello_attention
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hsap/hsap.h"

enum { kRanks = 4, kHq = 8, kHkv = 2, kDim = 64, kTokens = 2301 };

/* The whole row, [tokens, heads, dim] fp32; each rank copies its own tokens out of it. */
static float q_row[kTokens * kHq * kDim], k_row[kTokens * kHkv * kDim],
    v_row[kTokens * kHkv * kDim], out_row[kTokens * kHq * kDim], ref_row[kTokens * kHq * kDim];

typedef struct {
  hsapComm_t comm;
  hsapLayout_t layout;
  hsapResult_t result;
} Rank;

/* Copies the rows of `ranges` between a full row and a rank's shard (to_shard: row -> shard). */
static void CopyRanges(const int64_t* ranges, int64_t n, size_t row_floats, float* row,
                       float* shard, int to_shard) {
  int64_t i, at = 0;
  for (i = 0; i < n; ++i) {
    const size_t len = (size_t)(ranges[2 * i + 1] - ranges[2 * i]) * row_floats * sizeof(float);
    float* full = row + ranges[2 * i] * (int64_t)row_floats;
    if (to_shard) memcpy(shard + at * (int64_t)row_floats, full, len);
    else memcpy(full, shard + at * (int64_t)row_floats, len);
    at += ranges[2 * i + 1] - ranges[2 * i];
  }
}

static hsapTensor_t Tensor(float* data, int64_t tokens, int heads) {
  hsapTensor_t t;
  t.data = data;
  t.dtype = hsapFloat32;
  t.numTokens = tokens;
  t.numHeads = heads;
  t.headDim = kDim;
  return t;
}

/* One rank, on its own thread: every call below is collective over the 4 ranks. */
static void* RunRank(void* arg) {
  Rank* r = (Rank*)arg;
  hsapBatchConfig_t cfg = HSAP_BATCH_CONFIG_INITIALIZER;
  hsapBatch_t batch;
  hsapPartition_t part;
  int rank;
  int64_t n, num_ranges, *ranges;
  float *q, *k, *v, *out, *lse, *dq, *dk, *dv;
  hsapTensor_t tq, tk, tv, tout, tdq, tdk, tdv;

  cfg.dtype = hsapFloat32;
  cfg.numHeadsQ = kHq;
  cfg.numHeadsKV = kHkv; /* GQA: 4 query heads per KV head */
  cfg.headDim = kDim;
  r->result = hsapBatchCreate(&batch, r->comm, r->layout, NULL /* equal weights */, &cfg);
  if (r->result != hsapSuccess) return NULL;

  /* Which tokens of the row this rank holds (whole short documents, zigzag cuts of long ones). */
  hsapCommUserRank(r->comm, &rank);
  hsapBatchGetPartition(batch, &part);
  hsapPartitionGetRanges(part, rank, NULL, &num_ranges, &n);
  ranges = malloc(sizeof(int64_t) * 2 * (size_t)num_ranges);
  hsapPartitionGetRanges(part, rank, ranges, &num_ranges, NULL);
  q = malloc(sizeof(float) * (size_t)(n * kHq * kDim + 1));
  out = malloc(sizeof(float) * (size_t)(n * kHq * kDim + 1));
  dq = malloc(sizeof(float) * (size_t)(n * kHq * kDim + 1));
  k = malloc(sizeof(float) * (size_t)(n * kHkv * kDim + 1));
  v = malloc(sizeof(float) * (size_t)(n * kHkv * kDim + 1));
  dk = malloc(sizeof(float) * (size_t)(n * kHkv * kDim + 1));
  dv = malloc(sizeof(float) * (size_t)(n * kHkv * kDim + 1));
  lse = malloc(sizeof(float) * (size_t)(n * kHq + 1));
  CopyRanges(ranges, num_ranges, kHq * kDim, q_row, q, 1);
  CopyRanges(ranges, num_ranges, kHkv * kDim, k_row, k, 1);
  CopyRanges(ranges, num_ranges, kHkv * kDim, v_row, v, 1);
  tq = Tensor(q, n, kHq), tk = Tensor(k, n, kHkv), tv = Tensor(v, n, kHkv);
  tout = Tensor(out, n, kHq), tdq = Tensor(dq, n, kHq);
  tdk = Tensor(dk, n, kHkv), tdv = Tensor(dv, n, kHkv);

  r->result = hsapAttentionForward(batch, &tq, &tk, &tv, &tout, lse);
  /* Backward with dout = out, to show the call: dq, dk, dv of this rank's tokens. */
  if (r->result == hsapSuccess) {
    r->result = hsapAttentionBackward(batch, &tout, &tq, &tk, &tv, &tout, lse, &tdq, &tdk, &tdv);
  }
  if (r->result == hsapSuccess) CopyRanges(ranges, num_ranges, kHq * kDim, out_row, out, 0);
  if (r->result != hsapSuccess) fprintf(stderr, "rank %d: %s\n", rank, hsapGetLastError());
  hsapBatchDestroy(batch);
  free(ranges), free(q), free(k), free(v), free(out), free(lse), free(dq), free(dk), free(dv);
  return NULL;
}

int main(void) {
  /* One packed row: documents of 300, 1 and 2000 tokens; causal, full, sliding window 128. */
  const int64_t cu[] = {0, 300, 301, kTokens};
  const hsapMaskKind_t kinds[] = {hsapMaskCausal, hsapMaskFull, hsapMaskSlidingWindow};
  const int64_t params[] = {0, 0, 128};
  hsapLayout_t layout;
  hsapComm_t comms[kRanks];
  Rank ranks[kRanks];
  pthread_t threads[kRanks];
  hsapTensor_t tq, tk, tv, tref;
  float* lse = malloc(sizeof(float) * kTokens * kHq);
  double max_err = 0.0;
  int i, failed = 0;

  for (i = 0; i < kTokens * kHq * kDim; ++i) q_row[i] = (float)sin(0.37 * i);
  for (i = 0; i < kTokens * kHkv * kDim; ++i) {
    k_row[i] = (float)cos(0.11 * i);
    v_row[i] = (float)sin(0.53 * i + 1.0);
  }
  if (hsapLayoutCreate(&layout, cu, 3, kinds, params) != hsapSuccess ||
      hsapCommInitAll(comms, kRanks, NULL) != hsapSuccess) { /* host backend, 4 ranks */
    fprintf(stderr, "hsap: %s\n", hsapGetLastError());
    return 1;
  }
  for (i = 0; i < kRanks; ++i) {
    ranks[i].comm = comms[i];
    ranks[i].layout = layout;
    pthread_create(&threads[i], NULL, RunRank, &ranks[i]);
  }
  for (i = 0; i < kRanks; ++i) pthread_join(threads[i], NULL);
  for (i = 0; i < kRanks; ++i) failed |= ranks[i].result != hsapSuccess;

  /* The same attention on one device: the CPU analogue of flash_attn_varlen_func. */
  tq = Tensor(q_row, kTokens, kHq), tk = Tensor(k_row, kTokens, kHkv);
  tv = Tensor(v_row, kTokens, kHkv), tref = Tensor(ref_row, kTokens, kHq);
  if (!failed && hsapAttentionForwardLocal(NULL, layout, &tq, &tk, &tv, &tref, lse) != hsapSuccess) {
    fprintf(stderr, "hsap: %s\n", hsapGetLastError());
    failed = 1;
  }
  for (i = 0; i < kTokens * kHq * kDim; ++i) {
    const double err = fabs((double)out_row[i] - (double)ref_row[i]);
    if (err > max_err) max_err = err;
  }
  printf("%d ranks, %d tokens: max |distributed - single device| = %.2e\n", kRanks, kTokens,
         max_err);
  for (i = 0; i < kRanks; ++i) hsapCommDestroy(comms[i]);
  hsapLayoutDestroy(layout);
  free(lse);
  return failed || max_err > 1e-4;
}
