// The plain-C interface between the library and the JIT-generated host kernels.
//
// The declarations live in one macro, HSAP_HOST_ABI_DECLS, so that the very same text is
// both compiled into the library and handed to the generated code: HostAbiHeaderText()
// returns it as the header "hsap_host_abi.h" that generated sources include, and that
// text is part of the compile-cache key, so editing this file recompiles every kernel.
//
// Conventions shared by all tasks (one call of an entry point = one task; the library
// runs tasks in parallel, the generated code never starts threads):
//  - D is the compiled head dim, DP = D rounded up to the vector width (16 lanes with
//    AVX-512, 8 with AVX2); BQ/BK the compiled tile sizes.
//  - Storage tensors (q, k, v, dout) are in the compiled dtype, rows of `row_stride`
//    elements, head h at element offset h * D.
//  - "Packed" K/V: per kv head, the key buffer is cut into tiles of BK rows aligned at
//    multiples of BK; tile t occupies BK * DP floats, either transposed (element
//    [d * BK + j], for Q.K^T and dO.V^T) or row-major (element [j * DP + d], for P.V and
//    dS.K). Rows past the buffer and columns past D are zero.
//  - fp32 copies of q and dout for the backward: [rows][heads][DP] with RA spare zero rows
//    at the end (the kernels read whole register blocks).
//  - Segments are the KeySegment of attention/worklist.h: keys [k_begin, k_end) seen by a
//    query row qr iff diag_lo <= kr - qr <= diag_hi.
#ifndef HSAP_JIT_HOST_ABI_H_
#define HSAP_JIT_HOST_ABI_H_

#include <stdint.h>

#define HSAP_HOST_ABI_DECLS                                                                 \
  typedef struct HsapHostSegment {                                                          \
    int64_t k_begin, k_end, diag_lo, diag_hi;                                               \
  } HsapHostSegment;                                                                        \
  /* Packs tile `tile` of kv head `head` of src ([rows][row_stride]) into dst (BK*DP). */   \
  typedef struct HsapHostPackTask {                                                         \
    const void* src;                                                                        \
    int64_t row_stride, rows, tile;                                                         \
    int32_t head, transposed;                                                               \
    float* dst;                                                                             \
  } HsapHostPackTask;                                                                       \
  /* Converts rows [row_begin, row_end) x heads of src to fp32 [rows][heads][DP]. */        \
  typedef struct HsapHostConvertTask {                                                      \
    const void* src;                                                                        \
    int64_t row_stride, row_begin, row_end;                                                 \
    int32_t heads;                                                                          \
    float* dst;                                                                             \
  } HsapHostConvertTask;                                                                    \
  /* Forward of query rows [q_begin, q_end) (at most BQ) of one query head over the keys */ \
  /* of `segments`, merged into out/lse. kt/v: the packed tiles of its kv head. */          \
  typedef struct HsapHostForwardTask {                                                      \
    const void* q;                                                                          \
    int64_t q_row_stride;                                                                   \
    const float* kt;                                                                        \
    const float* v;                                                                         \
    float* out;                                                                             \
    int64_t out_row_stride;                                                                 \
    float* lse; /* this head's lse row: lse[q] */                                           \
    int32_t q_head;                                                                         \
    float scale;                                                                            \
    int64_t q_begin, q_end;                                                                 \
    const HsapHostSegment* segments;                                                        \
    int64_t num_segments;                                                                   \
    float* scratch; /* hsap_scratch_floats() floats, 64-byte aligned */                     \
  } HsapHostForwardTask;                                                                    \
  /* One block of query rows that sees keys of a key tile, in buffer rows. */               \
  typedef struct HsapHostKvItem {                                                           \
    int64_t q_begin, q_end, k_begin, k_end, diag_lo, diag_hi;                               \
  } HsapHostKvItem;                                                                         \
  /* Fused backward (FlashAttention-2 order) of key tile `tile` of one kv head against */   \
  /* `items` (query blocks of at most BQ rows with a segment that sees the tile, sorted */  \
  /* by block) and the query heads q_heads[0..num_q_heads): recomputes P and dS once, */    \
  /* adds dk, dv of the tile and dq of the items' rows. Before it first adds to the dq */   \
  /* rows of item i it calls before_item(ctx, i) (when set), where the library waits */     \
  /* until it may. */                                                                       \
  typedef struct HsapHostBackwardTask {                                                     \
    const float* q32;                                                                       \
    const float* do32;                                                                      \
    int64_t qd_row_stride; /* heads_q * DP */                                               \
    const float* lse;      /* [heads_q][lse_stride] */                                      \
    const float* delta;                                                                     \
    int64_t lse_stride;                                                                     \
    const float* kt_tile;                                                                   \
    const float* vt_tile;                                                                   \
    const float* krow_tile;                                                                 \
    float* dq;                                                                              \
    int64_t dq_row_stride;                                                                  \
    float* dk;                                                                              \
    float* dv;                                                                              \
    int64_t kv_row_stride, k_rows, tile;                                                    \
    int32_t kv_head, num_q_heads;                                                           \
    const int32_t* q_heads;                                                                 \
    float scale;                                                                            \
    const HsapHostKvItem* items;                                                            \
    int64_t num_items;                                                                      \
    void (*before_item)(void* ctx, int64_t item);                                           \
    void* ctx;                                                                              \
    float* scratch;                                                                         \
  } HsapHostBackwardTask;                                                                   \
  /* Merges (o2, lse2) into (o1, lse1) for rows [row_begin, row_end), all heads. */         \
  typedef struct HsapHostMergeTask {                                                        \
    float* o1;                                                                              \
    float* lse1;                                                                            \
    const float* o2;                                                                        \
    const float* lse2;                                                                      \
    int64_t row_begin, row_end, lse_stride1, lse_stride2;                                   \
    int32_t heads;                                                                          \
  } HsapHostMergeTask;                                                                      \
  /* What the module was compiled for (checked by the library after loading). */            \
  typedef struct HsapHostKernelInfo {                                                       \
    int32_t abi_version, head_dim, padded_head_dim, block_q, block_k, gqa, dtype, masked,   \
        vector_width, spare_rows;                                                           \
    int64_t scratch_floats;                                                                 \
  } HsapHostKernelInfo;

#define HSAP_HOST_ABI_VERSION 2

#ifdef __cplusplus
extern "C" {
#endif
HSAP_HOST_ABI_DECLS
#ifdef __cplusplus
}
#endif

// Exported entry points of a generated module (extern "C"):
//   void hsap_kernel_info(HsapHostKernelInfo*);
//   void hsap_pack(const HsapHostPackTask*);
//   void hsap_convert(const HsapHostConvertTask*);
//   void hsap_forward(const HsapHostForwardTask*);
//   void hsap_backward(const HsapHostBackwardTask*);
//   void hsap_merge(const HsapHostMergeTask*);

#ifdef __cplusplus
namespace hsap::jit {
// The header text the generated code includes as "hsap_host_abi.h".
const char* HostAbiHeaderText();
}  // namespace hsap::jit
#endif

#endif  // HSAP_JIT_HOST_ABI_H_
