/* Ranks as processes through the C ABI: the parent makes a token with hsapGetUniqueId, forks
 * three children that join one host communicator with hsapCommInitRank (hsapBackendHost),
 * run forward on their rows of a packed row of documents and compare them with
 * hsapAttentionForwardLocal over the whole row. Then a rank is killed with SIGKILL while
 * the others wait for it: they must fail with hsapAborted (or hsapTimeout), not hang. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hsap/hsap.h"

#define RANKS 3
#define HEADS 2
#define DIM 32

static const int64_t kCu[] = {0, 70, 71, 250, 400};
static const int64_t kNumDocs = 4;

static float Value(int64_t i) { return (float)sin((double)i * 0.37) * 0.8f; }

/* Exit codes of a child: 0 ok, 10 + result of the call that failed, 2 wrong output. */
static int RunRank(hsapUniqueId_t id, int rank) {
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  hsapComm_t comm = NULL;
  hsapLayout_t layout = NULL;
  hsapBatch_t batch = NULL;
  hsapPartition_t part = NULL;
  hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
  hsapAttentionConfig_t local = HSAP_ATTENTION_CONFIG_INITIALIZER;
  const int64_t tokens = kCu[kNumDocs];
  const int64_t row = (int64_t)HEADS * DIM;
  float *q, *k, *v, *want, *want_lse, *sq, *sk, *sv, *out, *lse;
  int64_t n = 0, num_ranges = 0, ranges[64], t, i, at = 0;
  hsapTensor_t tq, tk, tv, tout;
  hsapResult_t e;
  int status = 0;

  config.timeoutMs = 60000;
  config.numThreads = 1;
  config.backend = hsapBackendHost;
  if ((e = hsapCommInitRank(&comm, RANKS, id, rank, &config)) != hsapSuccess) return 10 + e;
  if ((e = hsapLayoutCreate(&layout, kCu, kNumDocs, NULL, NULL)) != hsapSuccess) return 10 + e;
  bc.dtype = hsapFloat32;
  bc.numHeadsQ = HEADS;
  bc.numHeadsKV = HEADS;
  bc.headDim = DIM;
  if ((e = hsapBatchCreate(&batch, comm, layout, NULL, &bc)) != hsapSuccess) return 10 + e;
  hsapBatchGetLocalTokens(batch, &n);
  hsapBatchGetPartition(batch, &part);
  hsapPartitionGetRanges(part, rank, NULL, &num_ranges, NULL);
  if (num_ranges > 32) return 3;
  hsapPartitionGetRanges(part, rank, ranges, &num_ranges, NULL);

  q = malloc(sizeof(float) * tokens * row);
  k = malloc(sizeof(float) * tokens * row);
  v = malloc(sizeof(float) * tokens * row);
  want = malloc(sizeof(float) * tokens * row);
  want_lse = malloc(sizeof(float) * tokens * HEADS);
  sq = malloc(sizeof(float) * (n + 1) * row);
  sk = malloc(sizeof(float) * (n + 1) * row);
  sv = malloc(sizeof(float) * (n + 1) * row);
  out = malloc(sizeof(float) * (n + 1) * row);
  lse = malloc(sizeof(float) * (n + 1) * HEADS);
  for (i = 0; i < tokens * row; ++i) {
    q[i] = Value(i);
    k[i] = Value(3 * i + 1);
    v[i] = Value(7 * i + 2);
  }
  for (i = 0; i < num_ranges; ++i) {
    for (t = ranges[2 * i]; t < ranges[2 * i + 1]; ++t, ++at) {
      memcpy(sq + at * row, q + t * row, sizeof(float) * row);
      memcpy(sk + at * row, k + t * row, sizeof(float) * row);
      memcpy(sv + at * row, v + t * row, sizeof(float) * row);
    }
  }
  tq = (hsapTensor_t){sq, hsapFloat32, n, HEADS, DIM};
  tk = (hsapTensor_t){sk, hsapFloat32, n, HEADS, DIM};
  tv = (hsapTensor_t){sv, hsapFloat32, n, HEADS, DIM};
  tout = (hsapTensor_t){out, hsapFloat32, n, HEADS, DIM};
  if ((e = hsapAttentionForward(batch, &tq, &tk, &tv, &tout, lse)) != hsapSuccess) {
    status = 10 + e;
  } else {
    hsapTensor_t fq = {q, hsapFloat32, tokens, HEADS, DIM},
                 fk = {k, hsapFloat32, tokens, HEADS, DIM},
                 fv = {v, hsapFloat32, tokens, HEADS, DIM},
                 fo = {want, hsapFloat32, tokens, HEADS, DIM};
    local.numThreads = 1;
    if ((e = hsapAttentionForwardLocal(&local, layout, &fq, &fk, &fv, &fo, want_lse)) !=
        hsapSuccess) {
      status = 10 + e;
    } else {
      at = 0;
      for (i = 0; i < num_ranges && status == 0; ++i) {
        for (t = ranges[2 * i]; t < ranges[2 * i + 1]; ++t, ++at) {
          int64_t j;
          for (j = 0; j < row; ++j) {
            if (fabsf(out[at * row + j] - want[t * row + j]) > 1e-4f) status = 2;
          }
        }
      }
    }
  }
  free(q);
  free(k);
  free(v);
  free(want);
  free(want_lse);
  free(sq);
  free(sk);
  free(sv);
  free(out);
  free(lse);
  hsapBatchDestroy(batch);
  hsapLayoutDestroy(layout);
  hsapCommDestroy(comm);
  return status;
}

/* Rank 2 never calls forward and is killed; ranks 0 and 1 report what forward returned. */
static int RunVictimRank(hsapUniqueId_t id, int rank) {
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  hsapComm_t comm = NULL;
  hsapLayout_t layout = NULL;
  hsapBatch_t batch = NULL;
  hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
  int64_t n = 0;
  float* buf;
  hsapTensor_t t;
  hsapResult_t e;

  config.timeoutMs = 60000;
  config.numThreads = 1;
  config.backend = hsapBackendHost;
  if ((e = hsapCommInitRank(&comm, RANKS, id, rank, &config)) != hsapSuccess) return 10 + e;
  if ((e = hsapLayoutCreate(&layout, kCu, kNumDocs, NULL, NULL)) != hsapSuccess) return 10 + e;
  bc.dtype = hsapFloat32;
  bc.numHeadsQ = HEADS;
  bc.numHeadsKV = HEADS;
  bc.headDim = DIM;
  if ((e = hsapBatchCreate(&batch, comm, layout, NULL, &bc)) != hsapSuccess) return 10 + e;
  if (rank == 2) {
    for (;;) pause(); /* until SIGKILL */
  }
  hsapBatchGetLocalTokens(batch, &n);
  buf = calloc((size_t)(n + 1) * HEADS * DIM * 4 + (size_t)(n + 1) * HEADS, sizeof(float));
  t = (hsapTensor_t){buf, hsapFloat32, n, HEADS, DIM};
  {
    hsapTensor_t tk = t, tv = t, to = t;
    tk.data = buf + (n + 1) * HEADS * DIM;
    tv.data = buf + 2 * (n + 1) * HEADS * DIM;
    to.data = buf + 3 * (n + 1) * HEADS * DIM;
    e = hsapAttentionForward(batch, &t, &tk, &tv, &to, buf + 4 * (n + 1) * HEADS * DIM);
  }
  if (strstr(hsapGetLastError(), "died") == NULL) e = hsapSuccess; /* must say why */
  free(buf);
  hsapBatchDestroy(batch);
  hsapLayoutDestroy(layout);
  hsapCommDestroy(comm);
  return 10 + e;
}

/* Whether the segment the token names is still in /dev/shm: hsapGetUniqueId puts the 16
 * random bytes that name it ("hsap-" and their hex digits) at offset 16. */
static int SegmentLeft(const hsapUniqueId_t* id) {
  char path[64] = "/dev/shm/hsap-";
  size_t at = strlen(path);
  int i;
  for (i = 16; i < 32; ++i) {
    snprintf(path + at, sizeof(path) - at, "%02x", (unsigned)(unsigned char)id->internal[i]);
    at += 2;
  }
  return access(path, F_OK) == 0;
}

static int Spawn(hsapUniqueId_t id, int victim, pid_t* pids) {
  int r;
  for (r = 0; r < RANKS; ++r) {
    fflush(NULL);
    pids[r] = fork();
    if (pids[r] < 0) return 0;
    if (pids[r] == 0) _exit(victim ? RunVictimRank(id, r) : RunRank(id, r));
  }
  return 1;
}

int main(void) {
  hsapUniqueId_t id;
  pid_t pids[RANKS];
  int r, status, failures = 0;

  if (hsapGetUniqueId(&id) != hsapSuccess) {
    fprintf(stderr, "hsapGetUniqueId: %s\n", hsapGetLastError());
    return 1;
  }
  if (!Spawn(id, 0, pids)) return 1;
  for (r = 0; r < RANKS; ++r) {
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "rank %d: exit status %d\n", r, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
      ++failures;
    }
  }

  if (SegmentLeft(&id)) {
    fprintf(stderr, "the segment was left in /dev/shm\n");
    ++failures;
  }

  if (hsapGetUniqueId(&id) != hsapSuccess) return 1;
  if (!Spawn(id, 1, pids)) return 1;
  {
    struct timespec wait = {1, 0};
    nanosleep(&wait, NULL);
  }
  kill(pids[2], SIGKILL);
  for (r = 0; r < RANKS; ++r) {
    waitpid(pids[r], &status, 0);
    if (r == 2) {
      if (!WIFSIGNALED(status)) ++failures;
      continue;
    }
    if (!WIFEXITED(status) ||
        (WEXITSTATUS(status) != 10 + hsapAborted && WEXITSTATUS(status) != 10 + hsapTimeout)) {
      fprintf(stderr, "rank %d after its peer died: exit status %d\n", r,
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
      ++failures;
    }
  }
  if (SegmentLeft(&id)) {
    fprintf(stderr, "the segment was left in /dev/shm after a rank was killed\n");
    ++failures;
  }
  if (failures == 0) printf("processes: OK\n");
  return failures == 0 ? 0 : 1;
}
