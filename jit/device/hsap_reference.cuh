// The reference attention on the GPU: plain kernels computing what attention/reference.h
// computes on the host, for rows far too long for the host (a 32K-token row of 16 heads at
// head dim 128 is ~1.5e13 FLOP forward and backward).
//
// Two arithmetics, one code (the kernels are templates on the arithmetic A):
//  - RefExact: every value a double (inputs converted exactly on load), as
//    ReferenceForward/ReferenceBackward: the ground truth of the checks;
//  - RefRounded<T>: every intermediate a float rounded to the storage type T after each
//    operation, in the order of NaiveForward/NaiveBackward (dot products sequential over the
//    head dim; the row's max, sum and output sequential over its keys in ascending order;
//    dq over the keys, dk and dv over the query heads of the kv head in ascending order, then
//    the queries): the same-precision single-device computation whose error sets the
//    tolerance of the checks (attention/tolerance.h). Roundings use __fmul_rn / __fadd_rn /
//    __fsub_rn / __fdiv_rn (never contracted into an FMA), expf / logf and the conversions of
//    hsap_device.cuh; the emulator (tests/support/cuda_emulator.h) reproduces the host's
//    NaiveForward/Backward bit for bit, a GPU up to the last bits of expf / logf.
//
// Visibility. The host compiles the layout's mask slices into interval lists (RefIntervals):
// for every query the keys it sees, for every key the queries that see it, as sorted,
// disjoint, half-open token intervals; and for every tile of ref_tile(D) rows the union of its
// rows' intervals, which is what the tile visits. Each (row, column) pair of a visited tile is
// tested against the row's own intervals, so any layout (documents of every mask kind, or
// arbitrary slices) is exact, and a row that sees nothing gets out = 0, lse = -inf.
//
// Kernels: kRefThreads (256) threads, thread (ty, tx) = (tid / 16, tid % 16). A CTA owns a tile
// of kT = ref_tile(D) rows (queries, or keys for ref_dkdv_kernel) staged in shared memory; it
// walks the columns it visits in tiles of kT, staged too. A thread owns rows ty + 16 i and
// columns tx + 16 j of the score tile (dot products over the head dim) and rows ty + 16 i,
// dims tx + 16 c of the output tile, which it accumulates column by column. Every output
// element is written by one thread: no atomics, deterministic results.
//   ref_fwd_kernel     grid (ceil(T / kT), heads_q): three passes over the visible keys of each
//                      query, as the host does: the max score, the sum of exp(score - max),
//                      then out = sum p v. Writes out, lse, row_max and row_sum.
//   ref_rowdot_kernel  grid (ceil(T * heads_q / 256)), grid-stride: delta = dO . out per
//                      (query, head).
//   ref_dq_kernel      grid (ceil(T / kT), heads_q): dq = sum over keys of ds k, with
//                      ds = scale * p * (dO . v - delta).
//   ref_dkdv_kernel    grid (ceil(T / kT), heads_kv): dk = sum ds q and dv = sum p dO over the
//                      query heads of the kv head, then the queries that see the key.
// The dynamic shared memory of each is ref_*_smem_bytes(D, sizeof(value)) (8 for RefExact,
// 4 for RefRounded), up to 150 KB: set the kernel's maximum dynamic shared memory first.
// Measured on one H200 (bf16, one causal document of 32768 tokens, 16 heads, D = 128): RefExact
// forward 1.2 s, forward and backward 3.6 s (about 7 TFLOP/s fp64 over the 11 D multiply-adds
// per visible pair and head), RefRounded forward and backward about 7.4 s more.
//
// The Params part below is plain C++ (the host fills it, as hsap_params.cuh); the kernels are
// visible only to CUDA compilers and to the emulation (HSAP_DEVICE_EMULATION).
#ifndef HSAP_JIT_DEVICE_HSAP_REFERENCE_CUH_
#define HSAP_JIT_DEVICE_HSAP_REFERENCE_CUH_

// The constexpr helpers below are called by the host and the device code alike.
#if defined(__CUDACC_RTC__)
#define HSAP_REF_HD __device__
#elif defined(__CUDACC__)
#define HSAP_REF_HD __host__ __device__
#else
#define HSAP_REF_HD
#endif

namespace hsap_dev {

// Intervals of one axis: row r's are [row_offsets[r], row_offsets[r + 1]) and tile t's (the
// union over its rows) [tile_offsets[t], tile_offsets[t + 1]), indices into lo / hi; interval
// i is the tokens [lo[i], hi[i]). Each list is sorted and disjoint.
struct RefIntervals {
  const long long* row_offsets;   // [rows + 1]
  const long long* tile_offsets;  // [ceil(rows / kT) + 1]
  const long long* lo;
  const long long* hi;
};

// q, dout: [T, heads_q, D], k, v: [T, heads_kv, D] in the storage type of the kernel;
// out, dq: [T, heads_q, D] and dk, dv: [T, heads_kv, D] in double; the per-row values lse,
// row_max, row_sum, delta: [heads_q, T] in double. In RefRounded kernels every double holds a
// float (exactly).
struct RefFwdParams {
  const void* q;
  const void* k;
  const void* v;
  double* out;
  double* lse;      // -inf where the query sees no key
  double* row_max;  // max visible score (-inf: none)
  double* row_sum;  // sum of exp(score - row_max) over the visible keys
  RefIntervals keys_of_query;
  const int* kv_head_of_q;  // [heads_q]
  long long tokens;
  int heads_q, heads_kv;
  float scale;
};

struct RefRowDotParams {
  const void* dout;
  const double* out;
  double* delta;
  long long tokens;
  int heads_q;
};

struct RefBwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const double* lse;  // of the forward of the same arithmetic
  const double* row_max;
  const double* row_sum;
  const double* delta;  // of ref_rowdot_kernel
  double* dq;
  double* dk;
  double* dv;
  RefIntervals keys_of_query;
  RefIntervals queries_of_key;
  const int* kv_head_of_q;    // [heads_q]
  const int* q_head_offsets;  // [heads_kv + 1]: the query heads of kv head g are
  const int* q_heads;         //   q_heads[q_head_offsets[g] .. q_head_offsets[g + 1]), ascending
  long long tokens;
  int heads_q, heads_kv;
  float scale;
};

inline constexpr int kRefThreads = 256;

// Rows (and columns) of a tile: 32 up to head dim 128, else 16 (the shared memory of the
// backward stays under the 163 KB of sm_80).
HSAP_REF_HD constexpr int ref_tile(int head_dim) { return head_dim <= 128 ? 32 : 16; }

// Shared memory, in bytes, for values of `value_bytes` (8: RefExact, 4: RefRounded): the row
// intervals (two long long per row), tiles of kT rows of the head dim (padded by one value),
// tiles of kT x kT scores (padded by one), and four per-row values. Carved in this order by
// RefSmem below.
HSAP_REF_HD constexpr int ref_interval_bytes(int d) { return 2 * ref_tile(d) * 8; }
HSAP_REF_HD constexpr int ref_rows_bytes(int d, int value_bytes) {
  return ref_tile(d) * (d + 1) * value_bytes;
}
HSAP_REF_HD constexpr int ref_scores_bytes(int d, int value_bytes) {
  return ref_tile(d) * (ref_tile(d) + 1) * value_bytes;
}
HSAP_REF_HD constexpr int ref_stats_bytes(int d, int value_bytes) {
  return 4 * ref_tile(d) * value_bytes;
}
HSAP_REF_HD constexpr int ref_smem_bytes(int d, int value_bytes, int row_tiles, int score_tiles) {
  return ref_interval_bytes(d) + row_tiles * ref_rows_bytes(d, value_bytes) +
         score_tiles * ref_scores_bytes(d, value_bytes) + ref_stats_bytes(d, value_bytes);
}
// Forward: Q and one column tile (K, then V); the scores.
HSAP_REF_HD constexpr int ref_fwd_smem_bytes(int d, int vb) { return ref_smem_bytes(d, vb, 2, 1); }
// dq: Q, dO and one column tile (V, then K); ds.
HSAP_REF_HD constexpr int ref_dq_smem_bytes(int d, int vb) { return ref_smem_bytes(d, vb, 3, 1); }
// dk/dv: K, V, and the column tiles Q, dO; p and ds.
HSAP_REF_HD constexpr int ref_dkdv_smem_bytes(int d, int vb) { return ref_smem_bytes(d, vb, 4, 2); }

}  // namespace hsap_dev

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_device.cuh"

namespace hsap_dev {

// ---- the arithmetics ----

HSAP_DEV double ref_neg_inf_double() {
#ifdef HSAP_DEVICE_EMULATION
  return -__builtin_huge_val();
#else
  return __longlong_as_double(static_cast<long long>(0xfff0000000000000ULL));
#endif
}

// Float operations rounded once to nearest (never fused into an FMA by the compiler).
HSAP_DEV float ref_mul_rn(float a, float b) {
#ifdef HSAP_DEVICE_EMULATION
  return a * b;
#else
  return __fmul_rn(a, b);
#endif
}
HSAP_DEV float ref_add_rn(float a, float b) {
#ifdef HSAP_DEVICE_EMULATION
  return a + b;
#else
  return __fadd_rn(a, b);
#endif
}
HSAP_DEV float ref_sub_rn(float a, float b) {
#ifdef HSAP_DEVICE_EMULATION
  return a - b;
#else
  return __fsub_rn(a, b);
#endif
}
HSAP_DEV float ref_div_rn(float a, float b) {
#ifdef HSAP_DEVICE_EMULATION
  return a / b;
#else
  return __fdiv_rn(a, b);
#endif
}

// The operations of ReferenceForward/Backward, in double.
struct RefExact {
  using V = double;
  static HSAP_DEV double neg_inf() { return ref_neg_inf_double(); }
  static HSAP_DEV double add(double a, double b) { return a + b; }
  static HSAP_DEV double mul(double a, double b) { return a * b; }
  static HSAP_DEV double dot_step(double acc, double a, double b) { return acc + a * b; }
  static HSAP_DEV double score(double dot, float scale) { return dot * static_cast<double>(scale); }
  static HSAP_DEV double max(double m, double s) { return m < s ? s : m; }
  static HSAP_DEV double exp_shift(double s, double m) { return exp(s - m); }
  static HSAP_DEV double lse(double m, double sum) { return m + log(sum); }
  static HSAP_DEV double prob(double s, double m, double sum, double lse) { return exp(s - lse); }
  // dL/dS times the scale: what multiplies k into dq and q into dk.
  static HSAP_DEV double ds_scaled(double p, double dp, double delta, float scale) {
    return static_cast<double>(scale) * (p * (dp - delta));
  }
};

// The operations of NaiveForward/Backward: floats rounded to T after every operation.
template <typename T>
struct RefRounded {
  using V = float;
  static HSAP_DEV float r(float x) { return to_float(from_float<T>(x)); }
  static HSAP_DEV float neg_inf() { return hsap_dev::neg_inf(); }
  static HSAP_DEV float add(float a, float b) { return r(ref_add_rn(a, b)); }
  static HSAP_DEV float mul(float a, float b) { return r(ref_mul_rn(a, b)); }
  static HSAP_DEV float dot_step(float acc, float a, float b) { return add(acc, mul(a, b)); }
  static HSAP_DEV float score(float dot, float scale) { return mul(dot, scale); }
  static HSAP_DEV float max(float m, float s) { return m < s ? s : m; }
  static HSAP_DEV float exp_shift(float s, float m) { return r(expf(r(ref_sub_rn(s, m)))); }
  static HSAP_DEV float lse(float m, float sum) { return add(m, r(logf(sum))); }
  static HSAP_DEV float prob(float s, float m, float sum, float lse) {
    return r(ref_div_rn(exp_shift(s, m), sum));
  }
  static HSAP_DEV float ds_scaled(float p, float dp, float delta, float scale) {
    return mul(mul(p, r(ref_sub_rn(dp, delta))), scale);
  }
};

// ---- tiles ----

// The kernel's shared memory, carved as ref_smem_bytes counts it.
template <typename V, int D>
struct RefSmem {
  static constexpr int kT = ref_tile(D);
  long long* iv_first;  // [kT]: first interval of each row of the CTA's tile
  long long* iv_last;   // [kT]: one past its last
  char* next;

  HSAP_DEV explicit RefSmem(char* base) {
    iv_first = reinterpret_cast<long long*>(base);
    iv_last = iv_first + kT;
    next = base + ref_interval_bytes(D);
  }
  HSAP_DEV V* rows() {  // a tile of kT rows of D values (row stride D + 1)
    V* p = reinterpret_cast<V*>(next);
    next += ref_rows_bytes(D, sizeof(V));
    return p;
  }
  HSAP_DEV V* scores() {  // kT x kT values (row stride kT + 1)
    V* p = reinterpret_cast<V*>(next);
    next += ref_scores_bytes(D, sizeof(V));
    return p;
  }
  HSAP_DEV V* stats() {  // 4 x kT values
    V* p = reinterpret_cast<V*>(next);
    next += ref_stats_bytes(D, sizeof(V));
    return p;
  }
};

// dst[r][d] = element (token first + r, head) of `src` for r < count, zero for the other rows
// of the tile.
template <typename T, typename V, int D>
HSAP_DEV void ref_load_rows(V* dst, const void* src, long long first, int count, int heads,
                            int head) {
  constexpr int kT = ref_tile(D);
  for (int e = threadIdx.x; e < kT * D; e += kRefThreads) {
    const int r = e / D, d = e % D;
    V x = 0;
    if (r < count) x = static_cast<V>(load_float<T>(src, ((first + r) * heads + head) * D + d));
    dst[r * (D + 1) + d] = x;
  }
}

// The thread's scores: acc[i][j] = dot(rows[ty + 16 i], cols[tx + 16 j]), sequential over d.
template <typename A, int D>
HSAP_DEV void ref_micro_dot(const typename A::V* rows, const typename A::V* cols, int ty, int tx,
                            typename A::V (&acc)[ref_tile(D) / 16][ref_tile(D) / 16]) {
  using V = typename A::V;
  constexpr int kN = ref_tile(D) / 16;
  HSAP_UNROLL
  for (int i = 0; i < kN; ++i) {
    HSAP_UNROLL
    for (int j = 0; j < kN; ++j) acc[i][j] = 0;
  }
  for (int d = 0; d < D; ++d) {
    V a[kN], b[kN];
    HSAP_UNROLL
    for (int i = 0; i < kN; ++i) a[i] = rows[(ty + 16 * i) * (D + 1) + d];
    HSAP_UNROLL
    for (int j = 0; j < kN; ++j) b[j] = cols[(tx + 16 * j) * (D + 1) + d];
    HSAP_UNROLL
    for (int i = 0; i < kN; ++i) {
      HSAP_UNROLL
      for (int j = 0; j < kN; ++j) acc[i][j] = A::dot_step(acc[i][j], a[i], b[j]);
    }
  }
}

// The thread's output slice: acc[i][c] += w[ty + 16 i][j] * cols[j][tx + 16 c] for the columns
// j < ncols in ascending order.
template <typename A, int D>
HSAP_DEV void ref_micro_accumulate(const typename A::V* w, int ncols, const typename A::V* cols,
                                   int ty, int tx,
                                   typename A::V (&acc)[ref_tile(D) / 16][(D + 15) / 16]) {
  using V = typename A::V;
  constexpr int kT = ref_tile(D), kN = kT / 16, kDs = (D + 15) / 16;
  for (int j = 0; j < ncols; ++j) {
    V a[kN], b[kDs];
    HSAP_UNROLL
    for (int i = 0; i < kN; ++i) a[i] = w[(ty + 16 * i) * (kT + 1) + j];
    HSAP_UNROLL
    for (int c = 0; c < kDs; ++c) b[c] = tx + 16 * c < D ? cols[j * (D + 1) + tx + 16 * c] : V(0);
    HSAP_UNROLL
    for (int i = 0; i < kN; ++i) {
      HSAP_UNROLL
      for (int c = 0; c < kDs; ++c) acc[i][c] = A::add(acc[i][c], A::mul(a[i], b[c]));
    }
  }
}

// Whether token `col` lies in one of the intervals [first, last) of `iv`.
HSAP_DEV bool ref_visible(const RefIntervals& iv, long long first, long long last, long long col) {
  for (long long i = first; i < last; ++i) {
    if (col < iv.lo[i]) return false;
    if (col < iv.hi[i]) return true;
  }
  return false;
}

// Loads the interval ranges of the tile's rows (zero intervals for rows past the end).
template <int D>
HSAP_DEV void ref_load_row_intervals(long long* first, long long* last, const RefIntervals& iv,
                                     long long row0, int rows) {
  const int r = threadIdx.x;
  if (r < ref_tile(D)) {
    first[r] = r < rows ? iv.row_offsets[row0 + r] : 0;
    last[r] = r < rows ? iv.row_offsets[row0 + r + 1] : 0;
  }
}

// Writes the thread's output slice (rows of the tile < rows) to out [T, heads, D].
template <typename A, int D>
HSAP_DEV void ref_store_rows(double* out,
                             const typename A::V (&acc)[ref_tile(D) / 16][(D + 15) / 16],
                             long long row0, int rows, int heads, int head, int ty, int tx) {
  constexpr int kN = ref_tile(D) / 16, kDs = (D + 15) / 16;
  HSAP_UNROLL
  for (int i = 0; i < kN; ++i) {
    const int row = ty + 16 * i;
    HSAP_UNROLL
    for (int c = 0; c < kDs; ++c) {
      const int d = tx + 16 * c;
      if (row < rows && d < D) {
        out[((row0 + row) * heads + head) * D + d] = static_cast<double>(acc[i][c]);
      }
    }
  }
}

// ---- kernels ----

template <typename T, typename A, int D>
__global__ void __launch_bounds__(kRefThreads) ref_fwd_kernel(const RefFwdParams p) {
  using V = typename A::V;
  constexpr int kT = ref_tile(D), kN = kT / 16, kDs = (D + 15) / 16;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const long long row0 = static_cast<long long>(blockIdx.x) * kT;
  const int rows = p.tokens - row0 < kT ? static_cast<int>(p.tokens - row0) : kT;
  const int head = blockIdx.y;
  const int kv_head = p.kv_head_of_q[head];
  RefSmem<V, D> smem(reinterpret_cast<char*>(dynamic_smem()));
  V* Qs = smem.rows();
  V* Cs = smem.rows();  // K, then V
  V* Ss = smem.scores();
  V* row_max = smem.stats();
  V* row_sum = row_max + kT;
  V* row_lse = row_sum + kT;
  const RefIntervals& iv = p.keys_of_query;
  ref_load_row_intervals<D>(smem.iv_first, smem.iv_last, iv, row0, rows);
  if (tid < kT) {
    row_max[tid] = A::neg_inf();
    row_sum[tid] = 0;
    row_lse[tid] = A::neg_inf();
  }
  ref_load_rows<T, V, D>(Qs, p.q, row0, rows, p.heads_q, head);
  V acc[kN][kDs];
  HSAP_UNROLL
  for (int i = 0; i < kN; ++i) {
    HSAP_UNROLL
    for (int c = 0; c < kDs; ++c) acc[i][c] = 0;
  }
  const long long tiles_first = iv.tile_offsets[blockIdx.x];
  const long long tiles_last = iv.tile_offsets[blockIdx.x + 1];
  // Pass 0: the row max. Pass 1: the sum of exp(s - max), then the lse. Pass 2: out.
  for (int pass = 0; pass < 3; ++pass) {
    for (long long range = tiles_first; range < tiles_last; ++range) {
      for (long long col0 = iv.lo[range]; col0 < iv.hi[range]; col0 += kT) {
        const int ncols = iv.hi[range] - col0 < kT ? static_cast<int>(iv.hi[range] - col0) : kT;
        __syncthreads();  // the previous tile is consumed (and the row values are written)
        ref_load_rows<T, V, D>(Cs, p.k, col0, ncols, p.heads_kv, kv_head);
        __syncthreads();
        V s[kN][kN];
        ref_micro_dot<A, D>(Qs, Cs, ty, tx, s);
        HSAP_UNROLL
        for (int i = 0; i < kN; ++i) {
          const int row = ty + 16 * i;
          HSAP_UNROLL
          for (int j = 0; j < kN; ++j) {
            const int col = tx + 16 * j;
            const bool visible = row < rows && col < ncols &&
                                 ref_visible(iv, smem.iv_first[row], smem.iv_last[row], col0 + col);
            V x = visible ? A::score(s[i][j], p.scale) : A::neg_inf();
            if (pass == 2) {
              x = visible ? A::prob(x, row_max[row], row_sum[row], row_lse[row]) : V(0);
            }
            Ss[row * (kT + 1) + col] = x;
          }
        }
        __syncthreads();
        if (pass == 0 && tid < rows) {
          V m = row_max[tid];
          for (int j = 0; j < ncols; ++j) m = A::max(m, Ss[tid * (kT + 1) + j]);
          row_max[tid] = m;
        } else if (pass == 1 && tid < rows) {
          V sum = row_sum[tid];
          for (int j = 0; j < ncols; ++j) {
            const V x = Ss[tid * (kT + 1) + j];
            if (x != A::neg_inf()) sum = A::add(sum, A::exp_shift(x, row_max[tid]));
          }
          row_sum[tid] = sum;
        } else if (pass == 2) {
          ref_load_rows<T, V, D>(Cs, p.v, col0, ncols, p.heads_kv, kv_head);
          __syncthreads();
          ref_micro_accumulate<A, D>(Ss, ncols, Cs, ty, tx, acc);
        }
      }
    }
    if (pass == 1 && tid < rows && row_sum[tid] > 0) {
      row_lse[tid] = A::lse(row_max[tid], row_sum[tid]);
    }
    __syncthreads();  // the row values of this pass are visible to every thread
  }
  ref_store_rows<A, D>(p.out, acc, row0, rows, p.heads_q, head, ty, tx);
  if (tid < rows) {
    const long long at = static_cast<long long>(head) * p.tokens + row0 + tid;
    p.lse[at] = static_cast<double>(row_lse[tid]);
    p.row_max[at] = static_cast<double>(row_max[tid]);
    p.row_sum[at] = static_cast<double>(row_sum[tid]);
  }
}

template <typename T, typename A, int D>
__global__ void __launch_bounds__(kRefThreads) ref_rowdot_kernel(const RefRowDotParams p) {
  using V = typename A::V;
  const long long items = p.tokens * p.heads_q;
  const long long stride = static_cast<long long>(gridDim.x) * kRefThreads;
  for (long long item = static_cast<long long>(blockIdx.x) * kRefThreads + threadIdx.x;
       item < items; item += stride) {
    V acc = 0;
    for (int d = 0; d < D; ++d) {
      acc = A::dot_step(acc, static_cast<V>(load_float<T>(p.dout, item * D + d)),
                        static_cast<V>(p.out[item * D + d]));
    }
    const long long token = item / p.heads_q;
    const int head = static_cast<int>(item % p.heads_q);
    p.delta[head * p.tokens + token] = static_cast<double>(acc);
  }
}

template <typename T, typename A, int D>
__global__ void __launch_bounds__(kRefThreads) ref_dq_kernel(const RefBwdParams p) {
  using V = typename A::V;
  constexpr int kT = ref_tile(D), kN = kT / 16, kDs = (D + 15) / 16;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const long long row0 = static_cast<long long>(blockIdx.x) * kT;
  const int rows = p.tokens - row0 < kT ? static_cast<int>(p.tokens - row0) : kT;
  const int head = blockIdx.y;
  const int kv_head = p.kv_head_of_q[head];
  RefSmem<V, D> smem(reinterpret_cast<char*>(dynamic_smem()));
  V* Qs = smem.rows();
  V* Ds = smem.rows();  // dO
  V* Cs = smem.rows();  // V, then K
  V* Ss = smem.scores();
  V* row_max = smem.stats();
  V* row_sum = row_max + kT;
  V* row_lse = row_sum + kT;
  V* row_delta = row_lse + kT;
  const RefIntervals& iv = p.keys_of_query;
  ref_load_row_intervals<D>(smem.iv_first, smem.iv_last, iv, row0, rows);
  if (tid < rows) {
    const long long at = static_cast<long long>(head) * p.tokens + row0 + tid;
    row_max[tid] = static_cast<V>(p.row_max[at]);
    row_sum[tid] = static_cast<V>(p.row_sum[at]);
    row_lse[tid] = static_cast<V>(p.lse[at]);
    row_delta[tid] = static_cast<V>(p.delta[at]);
  }
  ref_load_rows<T, V, D>(Qs, p.q, row0, rows, p.heads_q, head);
  ref_load_rows<T, V, D>(Ds, p.dout, row0, rows, p.heads_q, head);
  V acc[kN][kDs];
  HSAP_UNROLL
  for (int i = 0; i < kN; ++i) {
    HSAP_UNROLL
    for (int c = 0; c < kDs; ++c) acc[i][c] = 0;
  }
  for (long long range = iv.tile_offsets[blockIdx.x]; range < iv.tile_offsets[blockIdx.x + 1];
       ++range) {
    for (long long col0 = iv.lo[range]; col0 < iv.hi[range]; col0 += kT) {
      const int ncols = iv.hi[range] - col0 < kT ? static_cast<int>(iv.hi[range] - col0) : kT;
      __syncthreads();
      ref_load_rows<T, V, D>(Cs, p.v, col0, ncols, p.heads_kv, kv_head);
      __syncthreads();
      V dp[kN][kN];
      ref_micro_dot<A, D>(Ds, Cs, ty, tx, dp);
      __syncthreads();
      ref_load_rows<T, V, D>(Cs, p.k, col0, ncols, p.heads_kv, kv_head);
      __syncthreads();
      V s[kN][kN];
      ref_micro_dot<A, D>(Qs, Cs, ty, tx, s);
      HSAP_UNROLL
      for (int i = 0; i < kN; ++i) {
        const int row = ty + 16 * i;
        HSAP_UNROLL
        for (int j = 0; j < kN; ++j) {
          const int col = tx + 16 * j;
          V ds = 0;
          if (row < rows && col < ncols &&
              ref_visible(iv, smem.iv_first[row], smem.iv_last[row], col0 + col)) {
            const V prob =
                A::prob(A::score(s[i][j], p.scale), row_max[row], row_sum[row], row_lse[row]);
            ds = A::ds_scaled(prob, dp[i][j], row_delta[row], p.scale);
          }
          Ss[row * (kT + 1) + col] = ds;
        }
      }
      __syncthreads();
      ref_micro_accumulate<A, D>(Ss, ncols, Cs, ty, tx, acc);
    }
  }
  ref_store_rows<A, D>(p.dq, acc, row0, rows, p.heads_q, head, ty, tx);
}

template <typename T, typename A, int D>
__global__ void __launch_bounds__(kRefThreads) ref_dkdv_kernel(const RefBwdParams p) {
  using V = typename A::V;
  constexpr int kT = ref_tile(D), kN = kT / 16, kDs = (D + 15) / 16;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const long long row0 = static_cast<long long>(blockIdx.x) * kT;  // keys
  const int rows = p.tokens - row0 < kT ? static_cast<int>(p.tokens - row0) : kT;
  const int kv_head = blockIdx.y;
  RefSmem<V, D> smem(reinterpret_cast<char*>(dynamic_smem()));
  V* Ks = smem.rows();
  V* Vs = smem.rows();
  V* Qc = smem.rows();
  V* Dc = smem.rows();  // dO
  V* Ps = smem.scores();
  V* DSs = smem.scores();
  V* col_max = smem.stats();
  V* col_sum = col_max + kT;
  V* col_lse = col_sum + kT;
  V* col_delta = col_lse + kT;
  const RefIntervals& iv = p.queries_of_key;
  ref_load_row_intervals<D>(smem.iv_first, smem.iv_last, iv, row0, rows);
  ref_load_rows<T, V, D>(Ks, p.k, row0, rows, p.heads_kv, kv_head);
  ref_load_rows<T, V, D>(Vs, p.v, row0, rows, p.heads_kv, kv_head);
  V dk[kN][kDs], dv[kN][kDs];
  HSAP_UNROLL
  for (int i = 0; i < kN; ++i) {
    HSAP_UNROLL
    for (int c = 0; c < kDs; ++c) dk[i][c] = dv[i][c] = 0;
  }
  for (int hi = p.q_head_offsets[kv_head]; hi < p.q_head_offsets[kv_head + 1]; ++hi) {
    const int head = p.q_heads[hi];
    for (long long range = iv.tile_offsets[blockIdx.x]; range < iv.tile_offsets[blockIdx.x + 1];
         ++range) {
      for (long long col0 = iv.lo[range]; col0 < iv.hi[range]; col0 += kT) {
        const int ncols = iv.hi[range] - col0 < kT ? static_cast<int>(iv.hi[range] - col0) : kT;
        __syncthreads();
        ref_load_rows<T, V, D>(Qc, p.q, col0, ncols, p.heads_q, head);
        ref_load_rows<T, V, D>(Dc, p.dout, col0, ncols, p.heads_q, head);
        if (tid < ncols) {
          const long long at = static_cast<long long>(head) * p.tokens + col0 + tid;
          col_max[tid] = static_cast<V>(p.row_max[at]);
          col_sum[tid] = static_cast<V>(p.row_sum[at]);
          col_lse[tid] = static_cast<V>(p.lse[at]);
          col_delta[tid] = static_cast<V>(p.delta[at]);
        }
        __syncthreads();
        V s[kN][kN], dp[kN][kN];
        ref_micro_dot<A, D>(Ks, Qc, ty, tx, s);
        ref_micro_dot<A, D>(Vs, Dc, ty, tx, dp);
        HSAP_UNROLL
        for (int i = 0; i < kN; ++i) {
          const int row = ty + 16 * i;
          HSAP_UNROLL
          for (int j = 0; j < kN; ++j) {
            const int col = tx + 16 * j;
            V prob = 0, ds = 0;
            if (row < rows && col < ncols &&
                ref_visible(iv, smem.iv_first[row], smem.iv_last[row], col0 + col)) {
              prob = A::prob(A::score(s[i][j], p.scale), col_max[col], col_sum[col], col_lse[col]);
              ds = A::ds_scaled(prob, dp[i][j], col_delta[col], p.scale);
            }
            Ps[row * (kT + 1) + col] = prob;
            DSs[row * (kT + 1) + col] = ds;
          }
        }
        __syncthreads();
        ref_micro_accumulate<A, D>(Ps, ncols, Dc, ty, tx, dv);
        ref_micro_accumulate<A, D>(DSs, ncols, Qc, ty, tx, dk);
      }
    }
  }
  ref_store_rows<A, D>(p.dk, dk, row0, rows, p.heads_kv, kv_head, ty, tx);
  ref_store_rows<A, D>(p.dv, dv, row0, rows, p.heads_kv, kv_head, ty, tx);
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_REFERENCE_CUH_
