/* The C ABI from C99: a packed layout, forward and backward on small fp32 data checked
 * against a plain double-precision attention written here, and the error paths. Returns
 * nonzero on any failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hsap/hsap.h"

static int failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

#define CHECK_OK(call)                                                          \
  do {                                                                          \
    hsapResult_t r_ = (call);                                                   \
    if (r_ != hsapSuccess) {                                                    \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call, \
              hsapGetErrorString(r_), hsapGetLastError());                      \
      ++failures;                                                               \
    }                                                                           \
  } while (0)

/* The documents of the test row. */
enum { kNumDocs = 5, kHq = 4, kHkv = 2, kD = 32 };
static const int64_t kCu[kNumDocs + 1] = {0, 5, 12, 12, 18, 27};
static const hsapMaskKind_t kKinds[kNumDocs] = {hsapMaskCausal, hsapMaskFull, hsapMaskCausal,
                                                hsapMaskPrefixLM, hsapMaskSlidingWindow};
static const int64_t kParams[kNumDocs] = {0, 0, 0, 3, 4};

static int64_t DocOf(int64_t t) {
  int d;
  for (d = 0; d < kNumDocs; ++d) {
    if (t >= kCu[d] && t < kCu[d + 1]) return d;
  }
  return -1;
}

/* Whether key k is visible to query q, straight from the document rules of hsap.h. */
static int Visible(int64_t q, int64_t k) {
  const int64_t d = DocOf(q);
  int64_t qq, kk;
  if (d < 0 || d != DocOf(k)) return 0;
  qq = q - kCu[d];
  kk = k - kCu[d];
  switch (kKinds[d]) {
    case hsapMaskCausal:
      return kk <= qq;
    case hsapMaskFull:
      return 1;
    case hsapMaskPrefixLM:
      return kk <= qq || kk < kParams[d];
    case hsapMaskSlidingWindow:
      return kk <= qq && kk > qq - kParams[d];
  }
  return 0;
}

static int SliceCovers(const hsapMaskSlice_t* s, int64_t q, int64_t k) {
  int64_t dq, dk;
  if (q < s->qBegin || q >= s->qEnd || k < s->kBegin || k >= s->kEnd) return 0;
  if (s->kind == hsapSliceFull) return 1;
  dq = q - s->qBegin;
  dk = k - s->kBegin;
  if (dk > dq) return 0;
  return s->window == 0 || dk > dq - s->window;
}

static uint64_t rng_state = 12345;
static float RandomUniform(void) { /* in [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float* RandomTensor(int64_t n) {
  float* x = (float*)malloc((size_t)n * sizeof(float));
  int64_t i;
  for (i = 0; i < n; ++i) x[i] = RandomUniform();
  return x;
}

static hsapTensor_t Tensor(float* data, int64_t tokens, int heads) {
  hsapTensor_t t;
  t.data = data;
  t.dtype = hsapFloat32;
  t.numTokens = tokens;
  t.numHeads = heads;
  t.headDim = kD;
  return t;
}

/* Plain attention in double: out [T, Hq, D], lse [Hq, T], and gradients. */
static void ReferenceAttention(int64_t T, const float* q, const float* k, const float* v,
                               const float* dout, double* out, double* lse, double* dq, double* dk,
                               double* dv) {
  const double scale = 1.0 / sqrt((double)kD);
  double* p = (double*)malloc((size_t)T * sizeof(double));
  int64_t i, j;
  int h, d;
  memset(dq, 0, (size_t)(T * kHq * kD) * sizeof(double));
  memset(dk, 0, (size_t)(T * kHkv * kD) * sizeof(double));
  memset(dv, 0, (size_t)(T * kHkv * kD) * sizeof(double));
  for (h = 0; h < kHq; ++h) {
    const int hk = h / (kHq / kHkv);
    for (i = 0; i < T; ++i) {
      const float* qi = q + (i * kHq + h) * kD;
      const float* doi = dout + (i * kHq + h) * kD;
      double* oi = out + (i * kHq + h) * kD;
      double m = -INFINITY, sum = 0.0, delta = 0.0;
      for (j = 0; j < T; ++j) {
        double s = 0.0;
        if (!Visible(i, j)) continue;
        for (d = 0; d < kD; ++d) s += (double)qi[d] * k[(j * kHkv + hk) * kD + d];
        p[j] = s * scale;
        if (p[j] > m) m = p[j];
      }
      for (d = 0; d < kD; ++d) oi[d] = 0.0;
      if (m == -INFINITY) {
        lse[h * T + i] = -INFINITY;
        continue;
      }
      for (j = 0; j < T; ++j) {
        if (Visible(i, j)) sum += exp(p[j] - m);
      }
      lse[h * T + i] = m + log(sum);
      for (j = 0; j < T; ++j) {
        if (!Visible(i, j)) continue;
        p[j] = exp(p[j] - lse[h * T + i]);
        for (d = 0; d < kD; ++d) oi[d] += p[j] * v[(j * kHkv + hk) * kD + d];
      }
      for (d = 0; d < kD; ++d) delta += (double)doi[d] * oi[d];
      for (j = 0; j < T; ++j) {
        double dp = 0.0, ds;
        if (!Visible(i, j)) continue;
        for (d = 0; d < kD; ++d) dp += (double)doi[d] * v[(j * kHkv + hk) * kD + d];
        ds = p[j] * (dp - delta);
        for (d = 0; d < kD; ++d) {
          dq[(i * kHq + h) * kD + d] += scale * ds * k[(j * kHkv + hk) * kD + d];
          dk[(j * kHkv + hk) * kD + d] += scale * ds * qi[d];
          dv[(j * kHkv + hk) * kD + d] += p[j] * doi[d];
        }
      }
    }
  }
  free(p);
}

/* Largest |got - want| relative to the largest |want| (at least 1). */
static double MaxError(const float* got, const double* want, int64_t n) {
  double err = 0.0, scale = 1.0;
  int64_t i;
  for (i = 0; i < n; ++i) {
    if (fabs(want[i]) > scale) scale = fabs(want[i]);
  }
  for (i = 0; i < n; ++i) {
    const double e = fabs((double)got[i] - want[i]);
    if (!(e <= err)) err = e; /* NaN propagates */
  }
  return err / scale;
}

static int Contains(const char* haystack, const char* needle) {
  return strstr(haystack, needle) != NULL;
}

static void TestVersionAndErrors(void) {
  int version = -1;
  int r;
  CHECK_OK(hsapGetVersion(&version));
  CHECK(version == HSAP_VERSION_CODE);
  CHECK(hsapGetVersion(NULL) == hsapInvalidArgument);
  CHECK(Contains(hsapGetLastError(), "version"));
  CHECK_OK(hsapGetVersion(&version));
  CHECK(strcmp(hsapGetLastError(), "") == 0); /* a success clears the last error */
  for (r = 0; r < hsapNumResults; ++r) {
    const char* s = hsapGetErrorString((hsapResult_t)r);
    CHECK(s != NULL && s[0] != '\0');
    if (r > 0) CHECK(strcmp(s, hsapGetErrorString((hsapResult_t)(r - 1))) != 0);
  }
  CHECK(hsapGetErrorString((hsapResult_t)99) != NULL);
}

static hsapLayout_t TestLayout(void) {
  hsapLayout_t layout = NULL;
  int64_t tokens = -1, pairs = -1, want_pairs = 0, num_slices = -1, i, q, k;
  hsapMaskSlice_t* slices;
  int covered_ok = 1;
  CHECK_OK(hsapLayoutCreate(&layout, kCu, kNumDocs, kKinds, kParams));
  if (layout == NULL) return NULL;
  CHECK_OK(hsapLayoutGetNumTokens(layout, &tokens));
  CHECK(tokens == kCu[kNumDocs]);
  for (q = 0; q < tokens; ++q) {
    for (k = 0; k < tokens; ++k) want_pairs += Visible(q, k);
  }
  CHECK_OK(hsapLayoutGetVisiblePairs(layout, &pairs));
  CHECK(pairs == want_pairs);

  /* The slices cover every visible pair exactly once and nothing else. */
  CHECK_OK(hsapLayoutGetSlices(layout, NULL, &num_slices));
  CHECK(num_slices > 0);
  slices = (hsapMaskSlice_t*)calloc((size_t)num_slices, sizeof(hsapMaskSlice_t));
  CHECK_OK(hsapLayoutGetSlices(layout, slices, &num_slices));
  for (q = 0; q < tokens; ++q) {
    for (k = 0; k < tokens; ++k) {
      int covers = 0;
      for (i = 0; i < num_slices; ++i) covers += SliceCovers(&slices[i], q, k);
      if (covers != Visible(q, k)) covered_ok = 0;
    }
  }
  CHECK(covered_ok);

  /* The same mask rebuilt from those slices has the same pairs. */
  {
    hsapLayout_t from_slices = NULL;
    int64_t pairs2 = -1;
    CHECK_OK(hsapLayoutCreateFromSlices(&from_slices, tokens, slices, num_slices));
    CHECK_OK(hsapLayoutGetVisiblePairs(from_slices, &pairs2));
    CHECK(pairs2 == want_pairs);
    CHECK_OK(hsapLayoutDestroy(from_slices));
  }
  free(slices);
  return layout;
}

static void TestAttention(hsapLayout_t layout) {
  const int64_t T = kCu[kNumDocs];
  const int64_t nq = T * kHq * kD, nk = T * kHkv * kD;
  float *q = RandomTensor(nq), *k = RandomTensor(nk), *v = RandomTensor(nk);
  float *dout = RandomTensor(nq), *out = (float*)calloc((size_t)nq, sizeof(float));
  float* dq = (float*)calloc((size_t)nq, sizeof(float));
  float* dk = (float*)calloc((size_t)nk, sizeof(float));
  float* dv = (float*)calloc((size_t)nk, sizeof(float));
  float* lse = (float*)calloc((size_t)(kHq * T), sizeof(float));
  double* ref_out = (double*)malloc((size_t)nq * sizeof(double));
  double* ref_lse = (double*)malloc((size_t)(kHq * T) * sizeof(double));
  double* ref_dq = (double*)malloc((size_t)nq * sizeof(double));
  double* ref_dk = (double*)malloc((size_t)nk * sizeof(double));
  double* ref_dv = (double*)malloc((size_t)nk * sizeof(double));
  hsapTensor_t tq = Tensor(q, T, kHq), tk = Tensor(k, T, kHkv), tv = Tensor(v, T, kHkv);
  hsapTensor_t tout = Tensor(out, T, kHq), tdout = Tensor(dout, T, kHq);
  hsapTensor_t tdq = Tensor(dq, T, kHq), tdk = Tensor(dk, T, kHkv), tdv = Tensor(dv, T, kHkv);
  hsapAttentionConfig_t config = HSAP_ATTENTION_CONFIG_INITIALIZER;
  int64_t i;
  double lse_err = 0.0;
  const double tol = 1e-5; /* fp32 kernels on inputs of size 1, rows of at most 9 keys */

  config.numThreads = 2;
  ReferenceAttention(T, q, k, v, dout, ref_out, ref_lse, ref_dq, ref_dk, ref_dv);
  CHECK_OK(hsapAttentionForwardLocal(&config, layout, &tq, &tk, &tv, &tout, lse));
  CHECK(MaxError(out, ref_out, nq) < tol);
  for (i = 0; i < kHq * T; ++i) {
    const double e = fabs((double)lse[i] - ref_lse[i]);
    if (!(e <= lse_err)) lse_err = e;
  }
  CHECK(lse_err < tol);
  /* NULL config: the defaults give the same result. */
  {
    float* out2 = (float*)calloc((size_t)nq, sizeof(float));
    hsapTensor_t tout2 = Tensor(out2, T, kHq);
    CHECK_OK(hsapAttentionForwardLocal(NULL, layout, &tq, &tk, &tv, &tout2, lse));
    CHECK(memcmp(out, out2, (size_t)nq * sizeof(float)) == 0);
    free(out2);
  }
  CHECK_OK(hsapAttentionBackwardLocal(&config, layout, &tdout, &tq, &tk, &tv, &tout, lse, &tdq,
                                      &tdk, &tdv));
  CHECK(MaxError(dq, ref_dq, nq) < tol);
  CHECK(MaxError(dk, ref_dk, nk) < tol);
  CHECK(MaxError(dv, ref_dv, nk) < tol);
  printf(
      "fp32 T=%lld Hq=%d Hkv=%d D=%d: out err %.2e, lse err %.2e, dq err %.2e, dk err %.2e, "
      "dv err %.2e\n",
      (long long)T, kHq, kHkv, kD, MaxError(out, ref_out, nq), lse_err, MaxError(dq, ref_dq, nq),
      MaxError(dk, ref_dk, nk), MaxError(dv, ref_dv, nk));

  /* Error paths leave the outputs untouched and name the argument. */
  {
    float* saved = (float*)malloc((size_t)nq * sizeof(float));
    hsapTensor_t short_q = tq;
    hsapTensor_t bf16_v = tv;
    hsapAttentionConfig_t bad_config = HSAP_ATTENTION_CONFIG_INITIALIZER;
    memcpy(saved, out, (size_t)nq * sizeof(float));
    short_q.numTokens = T - 1;
    CHECK(hsapAttentionForwardLocal(NULL, layout, &short_q, &tk, &tv, &tout, lse) ==
          hsapInvalidArgument);
    CHECK(Contains(hsapGetLastError(), "hsapAttentionForwardLocal"));
    CHECK(Contains(hsapGetLastError(), "q has"));
    bf16_v.dtype = hsapBFloat16;
    CHECK(hsapAttentionForwardLocal(NULL, layout, &tq, &tk, &bf16_v, &tout, lse) ==
          hsapInvalidArgument);
    CHECK(Contains(hsapGetLastError(), "mismatched dtypes"));
    CHECK(hsapAttentionForwardLocal(NULL, layout, &tq, &tk, &tv, &tout, NULL) ==
          hsapInvalidArgument);
    CHECK(Contains(hsapGetLastError(), "lse"));
    bad_config.magic = 0;
    CHECK(hsapAttentionForwardLocal(&bad_config, layout, &tq, &tk, &tv, &tout, lse) ==
          hsapInvalidArgument);
    CHECK(Contains(hsapGetLastError(), "HSAP_ATTENTION_CONFIG_INITIALIZER"));
    CHECK(hsapAttentionForwardLocal(NULL, NULL, &tq, &tk, &tv, &tout, lse) == hsapInvalidArgument);
    CHECK(Contains(hsapGetLastError(), "layout"));
    CHECK(hsapAttentionBackwardLocal(NULL, layout, &tdout, &tq, &tk, &tv, &tout, lse, &tdq, &tdk,
                                     NULL) == hsapInvalidArgument);
    CHECK(Contains(hsapGetLastError(), "dv"));
    CHECK(memcmp(saved, out, (size_t)nq * sizeof(float)) == 0);
    free(saved);
  }

  free(q);
  free(k);
  free(v);
  free(dout);
  free(out);
  free(dq);
  free(dk);
  free(dv);
  free(lse);
  free(ref_out);
  free(ref_lse);
  free(ref_dq);
  free(ref_dk);
  free(ref_dv);
}

static void TestLayoutErrors(void) {
  hsapLayout_t layout = NULL;
  const int64_t not_from_zero[3] = {1, 4, 8};
  const int64_t decreasing[3] = {0, 6, 4};
  const hsapMaskKind_t bad_kind[2] = {hsapMaskCausal, (hsapMaskKind_t)7};
  const int64_t cu[3] = {0, 4, 8};
  hsapMaskSlice_t overlap[2];
  int64_t n = 0;

  CHECK(hsapLayoutCreate(NULL, cu, 2, NULL, NULL) == hsapInvalidArgument);
  CHECK(Contains(hsapGetLastError(), "layout"));
  CHECK(hsapLayoutCreate(&layout, NULL, 2, NULL, NULL) == hsapInvalidArgument);
  CHECK(Contains(hsapGetLastError(), "cuSeqlens"));
  CHECK(hsapLayoutCreate(&layout, cu, -1, NULL, NULL) == hsapInvalidArgument);
  CHECK(Contains(hsapGetLastError(), "numDocs"));
  CHECK(hsapLayoutCreate(&layout, not_from_zero, 2, NULL, NULL) == hsapInvalidArgument);
  CHECK(hsapLayoutCreate(&layout, decreasing, 2, NULL, NULL) == hsapInvalidArgument);
  CHECK(hsapLayoutCreate(&layout, cu, 2, bad_kind, NULL) == hsapInvalidArgument);
  CHECK(Contains(hsapGetLastError(), "kinds[1]"));
  CHECK(layout == NULL); /* never written on failure */

  overlap[0].qBegin = 0;
  overlap[0].qEnd = 4;
  overlap[0].kBegin = 0;
  overlap[0].kEnd = 4;
  overlap[0].kind = hsapSliceFull;
  overlap[0].window = 0;
  overlap[1] = overlap[0];
  overlap[1].kind = hsapSliceCausal;
  CHECK(hsapLayoutCreateFromSlices(&layout, 8, overlap, 2) == hsapInvalidArgument);
  CHECK(hsapLayoutCreateFromSlices(&layout, 8, NULL, 2) == hsapInvalidArgument);
  CHECK(Contains(hsapGetLastError(), "slices"));
  CHECK(layout == NULL);
  CHECK(hsapLayoutGetNumTokens(NULL, &n) == hsapInvalidArgument);
  CHECK(hsapLayoutDestroy(NULL) == hsapSuccess);
}

int main(void) {
  hsapLayout_t layout;
  TestVersionAndErrors();
  TestLayoutErrors();
  layout = TestLayout();
  if (layout != NULL) {
    TestAttention(layout);
    CHECK_OK(hsapLayoutDestroy(layout));
  }
  if (failures != 0) {
    fprintf(stderr, "c_api_test: %d check(s) failed\n", failures);
    return 1;
  }
  printf("c_api_test: all checks passed\n");
  return 0;
}
