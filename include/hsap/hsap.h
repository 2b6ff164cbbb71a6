/*
 * hsap — sequence-aware distributed attention for long-context LLM training.
 *
 * The only public header of libhsap.so. C99; every call returns hsapResult_t and never
 * throws. On failure, hsapGetLastError() returns a message (per thread) that names the
 * argument at fault and what to do about it.
 *
 * Conventions
 *  - Tensors are packed rows in "THD" order, contiguous: [numTokens, numHeads, headDim],
 *    like flash_attn_varlen_func. Log-sum-exp tensors are float32 [numHeadsQ, numTokens].
 *  - Token positions and cu_seqlens are int64.
 *  - Config structs start with size/magic/version and must be filled by their
 *    HSAP_*_INITIALIZER macro before fields are set, so that fields can be added later
 *    without breaking callers (the rule is under Limits).
 *  - Handles are opaque. Every hsap*Destroy accepts NULL and does nothing.
 *  - Threads. Layouts, plans and partitions are read-only once created (no call changes
 *    them), so the threads of several ranks may use one at the same time, e.g. every rank
 *    passing the same layout to hsapBatchCreate; destroy one only after every call using it
 *    has returned. Communicators and batches belong to their rank's thread: use each from
 *    one thread at a time (hsapCommAbort excepted).
 *  - Head dims: headDim is a multiple of 8 in [32, 256] everywhere (local attention, batch
 *    creation with or without a plan); any other value gives hsapInvalidArgument.
 *
 * Limits (beyond them a call returns hsapInvalidArgument naming the argument and the limit)
 *  - Row: at most 2^31 tokens (cu_seqlens[numDocs], numTokens of a slice layout), so that
 *    every count derived from a row -- its visible pairs, at most tokens^2 = 2^62 -- fits
 *    int64_t exactly.
 *  - Heads: numHeadsQ and numHeadsKV in [1, 65535] (a CUDA grid's y extent, one query head
 *    per block row), numHeadsQ a multiple of numHeadsKV; the same in plans, batch configs
 *    and the tensors of local attention.
 *  - Head dims: a multiple of 8 in [32, 256] (above).
 *  - Windows and prefixes of documents: a prefix length in [0, L] for a document of L > 0
 *    tokens (a longer one is an error); a window >= 1, applied per document: one longer than
 *    L is clamped to L (the whole document, causal), as in other attention libraries, so
 *    that one window serves every document of a row. A causal slice's window is >= 0 (0:
 *    unlimited) and may be any length: one of at least qEnd - qBegin excludes nothing and is
 *    the same as 0.
 *  - Partition copies: numTokens * bytesPerToken at most 2^56 bytes (the largest user
 *    address space of a 64-bit host), so that no byte offset can overflow.
 *  - Config structs: `magic` is HSAP_CONFIG_MAGIC; `version` is the HSAP_VERSION_CODE of the
 *    caller's header: 0, a code below HSAP_VERSION(0, 1, 0) or one of another major version
 *    is an error, a later minor version of this major is accepted; `size` is at least the
 *    struct's first version and at most 65536 bytes. A larger struct than this library's
 *    (from a newer header) is accepted only if every byte past this library's
 *    sizeof(struct) is zero: the library cannot honour a field it does not know.
 */
#ifndef HSAP_HSAP_H_
#define HSAP_HSAP_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HSAP_MAJOR 0
#define HSAP_MINOR 1
#define HSAP_PATCH 0
#define HSAP_SUFFIX ""
#define HSAP_VERSION_CODE (HSAP_MAJOR * 10000 + HSAP_MINOR * 100 + HSAP_PATCH)
#define HSAP_VERSION(X, Y, Z) ((X)*10000 + (Y)*100 + (Z))

/* Tag placed in the `magic` field of every config struct by its initializer. */
#define HSAP_CONFIG_MAGIC 0x48534150u /* "HSAP" */

typedef enum {
  hsapSuccess = 0,
  hsapInvalidArgument = 1, /* an argument is null, out of range or inconsistent */
  hsapInvalidUsage = 2,    /* calls made in the wrong order, or ranks disagree */
  hsapSystemError = 3,     /* the OS or a loaded library failed */
  hsapInternalError = 4,   /* a bug in hsap: please report it */
  hsapUnsupported = 5,     /* valid, but not supported by this build or machine */
  hsapTimeout = 6,         /* a wait on a peer ran past the communicator's timeout */
  hsapAborted = 7,         /* the communicator was aborted */
  hsapCompileError = 8,    /* a JIT compile failed; the log is in hsapGetLastError() */
  hsapOutOfMemory = 9,
  hsapNumResults = 10
} hsapResult_t;

typedef enum { hsapFloat32 = 0, hsapBFloat16 = 1, hsapFloat16 = 2 } hsapDataType_t;

/* Mask kind of one document of a packed row. */
typedef enum {
  hsapMaskCausal = 0,       /* token i sees tokens 0..i of its document */
  hsapMaskFull = 1,         /* bidirectional inside the document */
  hsapMaskPrefixLM = 2,     /* bidirectional over the first `param` tokens, causal after */
  hsapMaskSlidingWindow = 3 /* causal, restricted to the last `param` tokens (i-param, i] */
} hsapMaskKind_t;

/* A rectangle of the (query, key) plane with a mask. Ranges are half-open token positions
 * of the packed row. Key k is visible to query q when q is in [qBegin, qEnd), k is in
 * [kBegin, kEnd) and:
 *   hsapSliceFull:   always;
 *   hsapSliceCausal: (k - kBegin) <= (q - qBegin), and, when window > 0, also
 *                    (k - kBegin) > (q - qBegin) - window.
 * Slices of one layout must not overlap (no (q, k) pair may be covered twice). */
typedef enum { hsapSliceFull = 0, hsapSliceCausal = 1 } hsapSliceKind_t;

typedef struct {
  int64_t qBegin, qEnd;
  int64_t kBegin, kEnd;
  hsapSliceKind_t kind;
  int64_t window; /* >= 0, 0: unlimited; only with hsapSliceCausal (hsapSliceFull: 0) */
} hsapMaskSlice_t;

/* A dense tensor [numTokens, numHeads, headDim], contiguous, in host memory for the host
 * backend (device memory for the CUDA backend). */
typedef struct {
  void* data;
  hsapDataType_t dtype;
  int64_t numTokens;
  int32_t numHeads;
  int32_t headDim;
} hsapTensor_t;

/* ---- Version and errors -------------------------------------------------------------- */

/* Writes HSAP_VERSION_CODE of the library actually loaded. */
hsapResult_t hsapGetVersion(int* version);
const char* hsapGetErrorString(hsapResult_t result);
/* Detail of the last failure on the calling thread; "" when none. Valid until the next
 * hsap call on this thread. */
const char* hsapGetLastError(void);

/* ---- Layouts: the mask of one packed row --------------------------------------------- */

typedef struct hsapLayout_st* hsapLayout_t;

/* Documents from cu_seqlens[0..numDocs] (cu_seqlens[0] == 0, non-decreasing; empty
 * documents allowed). `kinds` may be NULL (all causal). `params` holds the prefix length
 * (prefix-LM) or the window (sliding window) per document; NULL when no document needs one.
 * For a document of L > 0 tokens, a prefix length must be in [0, L] (0: causal, L: full) and
 * a window at least 1 (1: each token sees only itself; L or more: the whole document, causal
 * -- a window longer than its document is clamped to it, per document); anything else, a
 * longer prefix included, gives hsapInvalidArgument naming the document. Other kinds and
 * empty documents ignore their param. The row has cu_seqlens[numDocs] tokens (at most 2^31, see
 * Limits). */
hsapResult_t hsapLayoutCreate(hsapLayout_t* layout, const int64_t* cuSeqlens, int64_t numDocs,
                              const hsapMaskKind_t* kinds, const int64_t* params);
/* A row of numTokens tokens with an arbitrary block-sparse mask given as slices. */
hsapResult_t hsapLayoutCreateFromSlices(hsapLayout_t* layout, int64_t numTokens,
                                        const hsapMaskSlice_t* slices, int64_t numSlices);
/* Partitions and batches created from a layout keep what they need of it: the layout may be
 * destroyed right after their creation. */
hsapResult_t hsapLayoutDestroy(hsapLayout_t layout);
hsapResult_t hsapLayoutGetNumTokens(hsapLayout_t layout, int64_t* numTokens);
/* Number of visible (query, key) pairs: the work of one head of attention. */
hsapResult_t hsapLayoutGetVisiblePairs(hsapLayout_t layout, int64_t* pairs);
/* The mask slices the layout compiles to. With slices == NULL only *numSlices is written;
 * otherwise up to *numSlices are copied and *numSlices is set to the count. */
hsapResult_t hsapLayoutGetSlices(hsapLayout_t layout, hsapMaskSlice_t* slices, int64_t* numSlices);

/* ---- Single-device attention on the host (the CPU analogue of flash_attn_varlen) ------- */

typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  float softmaxScale; /* 0: 1/sqrt(headDim) */
  int numThreads;     /* 0: every hardware thread */
} hsapAttentionConfig_t;

#define HSAP_ATTENTION_CONFIG_INITIALIZER \
  { sizeof(hsapAttentionConfig_t), HSAP_CONFIG_MAGIC, HSAP_VERSION_CODE, 0.0f, 0 }

/* out = softmax(q k^T * scale, masked by layout) v, per query head; lse receives the
 * natural-log log-sum-exp of the scaled scores, float32 [numHeadsQ, numTokens], -inf for a
 * query that sees no key (its output is 0). q/out: [T, Hq, D]; k/v: [T, Hkv, D] with Hq a
 * multiple of Hkv (GQA/MQA); one dtype for all; 32 <= D <= 256, D a multiple of 8.
 * config may be NULL (defaults). */
hsapResult_t hsapAttentionForwardLocal(const hsapAttentionConfig_t* config, hsapLayout_t layout,
                                       const hsapTensor_t* q, const hsapTensor_t* k,
                                       const hsapTensor_t* v, hsapTensor_t* out, float* lse);

/* NaN and infinity, in every kernel (host or CUDA, local or distributed), as in a naive
 * softmax: a query row with a NaN or +inf among the scores of the keys it sees (from NaN
 * or infinite q or k), or whose scores are all -inf, gets NaN in out and lse, and the call
 * still succeeds; a row that sees no key stays out = 0, lse = -inf. A NaN in v, and in
 * the backward a NaN lse, q or dout row, makes NaN what the naive computation does (out of
 * the rows that see that key; dq of the row, dk/dv of the keys it sees) and may also reach
 * rows or keys masked from it that share a kernel tile with it. */

/* Gradients of the forward above. out and lse are the forward's outputs; dq/dk/dv are
 * overwritten. */
hsapResult_t hsapAttentionBackwardLocal(const hsapAttentionConfig_t* config, hsapLayout_t layout,
                                        const hsapTensor_t* dout, const hsapTensor_t* q,
                                        const hsapTensor_t* k, const hsapTensor_t* v,
                                        const hsapTensor_t* out, const float* lse, hsapTensor_t* dq,
                                        hsapTensor_t* dk, hsapTensor_t* dv);

/* ---- Communicators ------------------------------------------------------------------ */

typedef struct hsapComm_st* hsapComm_t;

/* The backend of a communicator made by hsapCommInitRank. */
typedef enum {
  hsapBackendDefault = 0, /* CUDA where the unique id and this process have NCCL and a CUDA
                           * device, else host (see hsapCommInitRank) */
  hsapBackendHost = 1,    /* CPU ranks: processes (or threads) of one host, shared memory */
  hsapBackendCuda = 2     /* one GPU per rank over NCCL */
} hsapBackend_t;

typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int timeoutMs;  /* every wait on a peer; 0: $HSAP_TIMEOUT_MS, else 300000 (5 minutes) */
  int numThreads; /* compute threads per rank; 0: hardware threads / ranks (at least 1) */
  /* Added in 0.1 for the CUDA backend (callers built against the older, shorter struct are
   * told apart by `size`): the caller's cudaStream_t. A CUDA communicator enqueues the
   * kernels of hsapAttentionForward/Backward on it and returns once they are enqueued
   * (inputs are read, and outputs are ready, in that stream's order; transfers run on a
   * stream of the communicator's, ordered with it by events). It must be a stream of the
   * communicator's GPU (a stream of another GPU is hsapInvalidArgument). NULL: a stream of
   * its own, and the calls return after their work finished. Ignored by the host backend.
   * A stream per call instead: hsapAttentionForwardOnStream / BackwardOnStream. */
  void* cudaStream;
  /* Added in 0.1 for ranks as processes (older, shorter structs read as
   * hsapBackendDefault): which backend hsapCommInitRank creates (see there).
   * hsapCommInitAll accepts hsapBackendDefault and hsapBackendHost only. */
  hsapBackend_t backend;
  /* Added for topology-aware K/V delivery (callers built against the older, shorter struct
   * are told apart by `size`): rankNodes[r] is the index (>= 0) of the node of rank r
   * (nranks entries); NULL: every rank on one node. Host backend: the described topology
   * (so multi-node behaviour runs on one machine); a batch then sends a K/V row needed by
   * several ranks of another node across the node boundary once, to one of them, which
   * forwards it inside its node, and its dK/dV partials come back the same way
   * (hsapBatchGetLinkTraffic reports the bytes per link class). Plan batches
   * (hsapBatchCreateWithPlan) do the same on their sub-rings: at each step, rows of a KV
   * head needed by several members of the receiving group on one node cross once, to one
   * of them, which fans them out inside the node (a holder of that head on the node itself
   * is used when the source group has one); rows that DIFFERENT groups need cross once per
   * group. CUDA backend: the nodes are discovered at initialisation the way NCCL finds them
   * (each rank hashes its hostname and boot id -- or $NCCL_HOSTID, which replaces both as it
   * does for NCCL -- the hashes are all-gathered over NCCL, and ranks with equal hashes share
   * a node, numbered in order of first rank); rankNodes, when given, is a described topology
   * that replaces discovery (every rank must pass the same one, or all NULL:
   * hsapInvalidArgument otherwise), e.g. to run multi-node delivery on loopback ranks of one
   * GPU. CUDA batches on several nodes relay as above and move forward's K/V in stages (not
   * through peer windows); CUDA plan batches run the same sub-ring node fan-outs as the
   * host's. */
  const int* rankNodes;
} hsapCommConfig_t;

#define HSAP_COMM_CONFIG_INITIALIZER                                            \
  {                                                                             \
    sizeof(hsapCommConfig_t), HSAP_CONFIG_MAGIC, HSAP_VERSION_CODE, 0, 0, NULL, \
        hsapBackendDefault, NULL                                                \
  }

/* Creates nranks ranks of the host backend in this process (comms[0..nranks-1]), like
 * ncclCommInitAll. Each rank's later calls are made from its own thread. config may be
 * NULL. For host ranks in several processes, see hsapCommInitRank. */
hsapResult_t hsapCommInitAll(hsapComm_t* comms, int nranks, const hsapCommConfig_t* config);
/* Frees one rank. Not collective; a rank must not be destroyed while a peer still waits on
 * it (abort first if unsure). The batches created on comm must be destroyed first: while one
 * exists, hsapInvalidUsage is returned and comm stays valid. */
hsapResult_t hsapCommDestroy(hsapComm_t comm);
/* Releases every rank of the communicator from its current and future waits with
 * hsapAborted. Any thread may call it. */
hsapResult_t hsapCommAbort(hsapComm_t comm);
hsapResult_t hsapCommCount(hsapComm_t comm, int* count);
hsapResult_t hsapCommUserRank(hsapComm_t comm, int* rank);

/* ---- Partitions: which tokens of a packed row each rank holds ------------------------ */

typedef struct hsapPartition_st* hsapPartition_t;

/* Splits the row of `layout` over nranks so that each rank's attention work (visible
 * pairs) is proportional to weights[r] (NULL: equal). Weights are finite and >= 0, at least
 * one positive; a rank of weight 0 holds no token (a shard of 0 rows). Causal documents are
 * cut head to tail (zigzag). Deterministic: the same inputs give the same partition on every
 * rank. */
hsapResult_t hsapPartitionCreate(hsapPartition_t* partition, hsapLayout_t layout, int nranks,
                                 const double* weights);
/* One partition for the masks of several layers over the same packed row (a model whose
 * layers mix full, sliding-window, ... attention; every layout has the same number of
 * tokens): as hsapPartitionCreate, with a token's work summed over the layouts, so that the
 * sum of the layers' work is balanced. Documents stay whole where they fit and are cut
 * zigzag when some layout makes them causal or prefix-LM, when every layout has the same
 * documents; otherwise the row is cut as one piece. Batches of each mask then share it
 * (hsapBatchCreateWithPartition). With numLayouts == 1 it is hsapPartitionCreate. */
hsapResult_t hsapPartitionCreateForLayouts(hsapPartition_t* partition, const hsapLayout_t* layouts,
                                           int numLayouts, int nranks, const double* weights);
hsapResult_t hsapPartitionDestroy(hsapPartition_t partition);
/* Token ranges [begin, end) of the packed row held by `rank`, in the order of the rank's
 * local shard. ranges holds 2 * *numRanges int64 (begin, end pairs). With ranges == NULL
 * only *numRanges is written; *numTokens (may be NULL) receives the shard's token count. */
hsapResult_t hsapPartitionGetRanges(hsapPartition_t partition, int rank, int64_t* ranges,
                                    int64_t* numRanges, int64_t* numTokens);
/* Copies a packed row [T, bytesPerToken] into per-rank shards (shards[r] holds rank r's
 * tokens), and back. T * bytesPerToken is at most 2^56 bytes (see Limits). */
hsapResult_t hsapPartitionScatter(hsapPartition_t partition, const void* row, size_t bytesPerToken,
                                  void* const* shards);
hsapResult_t hsapPartitionGather(hsapPartition_t partition, const void* const* shards,
                                 size_t bytesPerToken, void* row);

/* ---- Batches: distributed attention over one packed row ------------------------------ */

typedef struct hsapBatch_st* hsapBatch_t;

typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  hsapDataType_t dtype;
  int numHeadsQ;
  int numHeadsKV;
  int headDim;
  float softmaxScale; /* 0: 1/sqrt(headDim) */
} hsapBatchConfig_t;

#define HSAP_BATCH_CONFIG_INITIALIZER \
  { sizeof(hsapBatchConfig_t), HSAP_CONFIG_MAGIC, HSAP_VERSION_CODE, hsapBFloat16, 0, 0, 0, 0.0f }

/* Collective: every rank of comm calls it with the same layout, weights and config (checked:
 * a mismatch returns hsapInvalidUsage on every rank). Partitions the row and builds this
 * rank's schedule. weights: one per rank as in hsapPartitionCreate (a rank of weight 0
 * holds no token and still takes part in every collective call), NULL for equal.
 * config->headDim: a multiple of 8 in [32, 256]. On a CUDA communicator it also
 * compiles (NVRTC, cached on disk) and loads the CUDA kernels of the configuration, uploads
 * the schedule's work lists and grows the communicator's device pool to what the batch
 * needs, so that forward and backward allocate nothing; tensors and lse are then device
 * memory of the rank's GPU. When every rank can map every other's memory (loopback ranks;
 * NCCL ranks of one node with peer access, through CUDA IPC), forward reads the peers' K/V
 * inside the fused kernel instead of sending it; $HSAP_FUSED_FORWARD=0 on any rank turns
 * that off. */
hsapResult_t hsapBatchCreate(hsapBatch_t* batch, hsapComm_t comm, hsapLayout_t layout,
                             const double* weights, const hsapBatchConfig_t* config);
/* Collective, as hsapBatchCreate, but over a given partition instead of one of its own, so
 * that batches of different masks over one row (a model's full and sliding-window layers)
 * hold the same tokens on each rank and their layers can share the activations: e.g.
 * another batch's (hsapBatchGetPartition) or one from hsapPartitionCreateForLayouts. The
 * partition must be for the communicator's size and the layout's token count; every rank
 * passes an equal partition (checked, with the layout and config: hsapInvalidUsage on every
 * rank otherwise). The batch keeps what it needs: the partition may be destroyed after. Each
 * batch keeps the delivery guarantees of hsapBatchCreate for its own mask. */
hsapResult_t hsapBatchCreateWithPartition(hsapBatch_t* batch, hsapComm_t comm, hsapLayout_t layout,
                                          hsapPartition_t partition,
                                          const hsapBatchConfig_t* config);
/* Collective: numBatches batches over one partition at once, batch i of layouts[i] and
 * configs[i] (numBatches in [1, 256]) -- a training step's masks and dtypes over its row
 * (e.g. the partition of hsapPartitionCreateForLayouts) -- as hsapBatchCreateWithPartition
 * would make them one by one, with the collective agreement of one batch: the ranks agree
 * once on the partition, numBatches and every batch's layout and config (in order), and a
 * rank whose arguments differ or are wrong makes the call fail on every rank (hsapInvalidUsage
 * on its peers), as hsapBatchCreateWithPartition does. On success batches[0..numBatches-1]
 * are written; on failure none is. With numBatches == 1 it is hsapBatchCreateWithPartition
 * (ranks may mix the two). */
hsapResult_t hsapBatchCreateManyWithPartition(hsapBatch_t* batches, int numBatches, hsapComm_t comm,
                                              const hsapLayout_t* layouts,
                                              hsapPartition_t partition,
                                              const hsapBatchConfig_t* configs);
/* Not collective. Destroy every batch before its communicator (see hsapCommDestroy). */
hsapResult_t hsapBatchDestroy(hsapBatch_t batch);
/* The partition the batch uses (owned by the batch; do not destroy). */
hsapResult_t hsapBatchGetPartition(hsapBatch_t batch, hsapPartition_t* partition);
/* Tokens held by this rank: the numTokens of its local q/k/v/out shards. */
hsapResult_t hsapBatchGetLocalTokens(hsapBatch_t batch, int64_t* numTokens);

/* Collective. q/k/v/out are this rank's shards [localTokens, H, D]; lse is float32
 * [numHeadsQ, localTokens]. */
hsapResult_t hsapAttentionForward(hsapBatch_t batch, const hsapTensor_t* q, const hsapTensor_t* k,
                                  const hsapTensor_t* v, hsapTensor_t* out, float* lse);
/* Collective. Gradients for this rank's shards; dq/dk/dv are overwritten. */
hsapResult_t hsapAttentionBackward(hsapBatch_t batch, const hsapTensor_t* dout,
                                   const hsapTensor_t* q, const hsapTensor_t* k,
                                   const hsapTensor_t* v, const hsapTensor_t* out, const float* lse,
                                   hsapTensor_t* dq, hsapTensor_t* dk, hsapTensor_t* dv);
/* The same calls on a CUDA stream of the caller's, per call, as NCCL takes one (cudaStream
 * is a cudaStream_t): the call's kernels are enqueued on it, so they run after the work the
 * stream holds before the call (e.g. what produced q/k/v), and work enqueued on it after the
 * call sees out/lse (dq/dk/dv); the call returns once its work is enqueued (the host still
 * waits for each stage's transfers, which run on a stream of the communicator's), whether or
 * not the communicator has a stream of its own. Calls may use a different stream each time:
 * every call of a communicator (of any of its batches) runs after the one before, on
 * whatever stream that ran. The stream must belong to the communicator's GPU (another GPU's
 * is hsapInvalidArgument on this rank, and its peers fail the call too, as for any bad
 * argument). NULL is CUDA's default stream (cudaStreamLegacy), as for NCCL; the plain
 * hsapAttentionForward / hsapAttentionBackward keep the communicator's stream
 * (hsapCommConfig_t.cudaStream). A host communicator accepts only NULL (and ignores it). */
hsapResult_t hsapAttentionForwardOnStream(hsapBatch_t batch, const hsapTensor_t* q,
                                          const hsapTensor_t* k, const hsapTensor_t* v,
                                          hsapTensor_t* out, float* lse, void* cudaStream);
hsapResult_t hsapAttentionBackwardOnStream(hsapBatch_t batch, const hsapTensor_t* dout,
                                           const hsapTensor_t* q, const hsapTensor_t* k,
                                           const hsapTensor_t* v, const hsapTensor_t* out,
                                           const float* lse, hsapTensor_t* dq, hsapTensor_t* dk,
                                           hsapTensor_t* dv, void* cudaStream);

/* Bytes this rank moved in the last forward and the last backward of the batch. */
typedef struct {
  uint64_t forwardBytesSent, forwardBytesReceived;
  uint64_t backwardBytesSent, backwardBytesReceived;
} hsapTraffic_t;
hsapResult_t hsapBatchGetTraffic(hsapBatch_t batch, hsapTraffic_t* traffic);

/* ---- Plans: head-parallel groups x context parallelism (HexiSeq layouts) ------------ */

/* A plan says how the ranks share attention: ranks form head-parallel groups; group g
 * holds a share of the row's attention work proportional to its sequence weight; inside a
 * group, rank i holds a token shard (before the all-to-all) proportional to its token
 * weight and, after the all-to-all, all of the group's tokens for its own set of query
 * heads (any subset, possibly non-contiguous). The heads of a group's ranks partition
 * [0, numHeadsQ) exactly. K/V travels between groups along the ring order. One group is
 * Ulysses; groups of one rank are ring attention. Plans are immutable once created (shared
 * by the ranks' threads as layouts are). A rank of token weight 0 holds no token before the
 * all-to-all (it still computes its heads for its group's tokens). On communicators whose
 * ranks span nodes, groups that share a node share its crossings ("node stores": rows
 * several of them need cross into the node once); the planner turns that off where it
 * prices slower, written as "node_stores": false in the plan's JSON (hsapPlanCreate: on). */
typedef struct hsapPlan_st* hsapPlan_t;

/* Builds a plan by hand. Flat arrays, groups one after another:
 *   groupSizes[g]          ranks in group g (g < numGroups); their sum is numRanks;
 *   groupRanks[]           the world ranks of group 0, then of group 1, ... (numRanks);
 *   sequenceWeights[g]     > 0, relative; NULL: equal;
 *   tokenWeights[]         >= 0 per entry of groupRanks, relative within the group; NULL:
 *                          equal;
 *   headCounts[]           number of query heads of each entry of groupRanks;
 *   heads[]                the query heads of each entry of groupRanks, one list after
 *                          another (sum of headCounts entries);
 *   ringOrder[g]           a permutation of the groups; NULL: 0, 1, ..., numGroups - 1.
 * Validated on creation: a rank in two groups or none, a head owned twice or not at all in
 * a group, a group with zero sequence weight, ... give hsapInvalidArgument with the
 * detail in hsapGetLastError(). */
hsapResult_t hsapPlanCreate(hsapPlan_t* plan, int numRanks, int numHeadsQ, int numHeadsKV,
                            int numGroups, const int* groupSizes, const int* groupRanks,
                            const double* sequenceWeights, const double* tokenWeights,
                            const int* headCounts, const int* heads, const int* ringOrder);
/* From the JSON text written by hsapPlanToJson or the planner (bench/hsap_plan --json; it
 * plans clusters of 1 to 4096 devices and refuses larger ones at once). */
hsapResult_t hsapPlanCreateFromJson(hsapPlan_t* plan, const char* json);
/* Writes the plan as NUL-terminated JSON. With buffer == NULL only *size is set (bytes
 * needed, NUL included); otherwise *size is the buffer's capacity and, if too small,
 * hsapInvalidArgument is returned with *size set to the bytes needed. */
hsapResult_t hsapPlanToJson(hsapPlan_t plan, char* buffer, size_t* size);
hsapResult_t hsapPlanDestroy(hsapPlan_t plan);
/* Predicted wall time of one layer's attention, forward and backward, in seconds; 0 for a
 * plan without predictions (built by hand). Either pointer may be NULL. */
hsapResult_t hsapPlanGetPredictedTime(hsapPlan_t plan, double* forwardSeconds,
                                      double* backwardSeconds);
/* numRanks, numHeadsQ, numHeadsKV and numGroups of the plan; any pointer may be NULL. */
hsapResult_t hsapPlanGetShape(hsapPlan_t plan, int* numRanks, int* numHeadsQ, int* numHeadsKV,
                              int* numGroups);

/* ---- Planning at start-up: a plan for a cluster and a model ------------------------- */

/* The model and the row a plan is made for (one packed row of seqLen tokens). */
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int64_t seqLen; /* tokens of the packed row, >= 1 */
  int numLayers;  /* >= 1 */
  int numHeadsQ;  /* a multiple of numHeadsKV */
  int numHeadsKV;
  int headDim;
  int hidden;                  /* model width; 0: numHeadsQ x headDim */
  int ffnHidden;               /* MLP width; 0: 4 x hidden */
  int vocab;                   /* 0: 32000 */
  hsapDataType_t dtype;        /* storage dtype of weights and activations */
  int causal;                  /* 1: one causal document; 0: bidirectional */
  double memoryMargin;         /* fraction of device memory kept free, in [0, 1) */
  int activationCheckpointing; /* 1: layers keep only their input; 0: everything */
  /* How the plan is priced (docs/cost_model.md). engine: the attention engine the plan is
   * priced for: NULL or "auto" (cuDNN where calibrated, else the JIT kernels, as
   * HSAP_ATTENTION_ENGINE=auto runs), "jit", "cudnn", the what-ifs "fa2" / "fa3", or "none"
   * (no calibration: the flat peak x attentionEfficiency). calibrationJson: NULL for the
   * built-in calibration, or the text of a calibration file (hsap_attn_perf
   * --calibration-out writes one) whose figures replace the built-in ones they name. */
  const char* engine;
  const char* calibrationJson;
} hsapPlanModel_t;

#define HSAP_PLAN_MODEL_INITIALIZER                                                        \
  {                                                                                        \
    sizeof(hsapPlanModel_t), HSAP_CONFIG_MAGIC, HSAP_VERSION_CODE, 0, 0, 0, 0, 0, 0, 0, 0, \
        hsapBFloat16, 1, 0.10, 1, NULL, NULL                                               \
  }

/* Plans attention for `model` on the cluster that `clusterJson` describes (the format of the
 * clusters/ files of the source tree: device kinds, nodes with their devices and NICs,
 * latencies; docs/planner.md), with the planner of bench/hsap_plan. The plan carries its
 * predicted times (hsapPlanGetPredictedTime) and per-rank memory (hsapPlanGetRankMemory).
 * Not collective. hsapInvalidArgument: a malformed description or model, or a model that
 * fits on no arrangement of the cluster (the message names the device and the bytes). */
hsapResult_t hsapPlanCreateForCluster(hsapPlan_t* plan, const char* clusterJson,
                                      const hsapPlanModel_t* model);

/* One rank's device as the planner sees it. Figures of 0 take those of a built-in kind
 * (H100, H200, A100, A800, L40S); any other kind needs peakTflops, memoryGib, hbmGbps,
 * attentionEfficiency and intraNodeGbps. */
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  char kind[32];     /* NUL-terminated, e.g. "H100" */
  double peakTflops; /* dense 16-bit TFLOP/s */
  double memoryGib;
  double hbmGbps;
  double attentionEfficiency; /* fraction of peak an attention kernel sustains, (0, 1] */
  double intraNodeGbps;       /* to any device of its node, per direction */
  int node;                   /* ranks of equal node share one; they must be consecutive */
  int nics;                   /* NICs of the node; 0: 1 */
  double nicGbps;             /* per NIC, per direction; needed with more than one node */
} hsapPlanDevice_t;

#define HSAP_PLAN_DEVICE_INITIALIZER                                                              \
  {                                                                                               \
    sizeof(hsapPlanDevice_t), HSAP_CONFIG_MAGIC, HSAP_VERSION_CODE, {0}, 0.0, 0.0, 0.0, 0.0, 0.0, \
        0, 0, 0.0                                                                                 \
  }

/* Collective over comm: every rank passes the same model and a description of its own
 * device; the descriptions are gathered over comm and every rank plans the same cluster
 * (as hsapPlanCreateForCluster) and gets the same plan. self == NULL takes what the
 * communicator knows: a rank of a host communicator is a "cpu" device with nominal figures
 * (1 TFLOP/s, 16 GiB, 10 GB/s inside a node; every host rank alike, so only the shares
 * matter) in its node of the communicator's topology (hsapCommConfig_t.rankNodes; node 0
 * without), each node with one nominal 1 GB/s NIC (self, when given, says its own node);
 * a rank of a CUDA communicator is the built-in kind its GPU's name names (e.g. "NVIDIA H100
 * 80GB HBM3": H100; hsapUnsupported naming the device when none does: pass self) with its
 * own memory, in its node as discovered at
 * initialisation, each node with one 400 Gb/s NIC per GPU (a DGX-class node; pass self for
 * other fabrics). */
hsapResult_t hsapPlanCreateForComm(hsapPlan_t* plan, hsapComm_t comm, const hsapPlanDevice_t* self,
                                   const hsapPlanModel_t* model);

/* Predicted peak memory of `rank` under the plan, in bytes; 0 for a plan without
 * predictions (built by hand or read from JSON without them). */
hsapResult_t hsapPlanGetRankMemory(hsapPlan_t plan, int rank, double* bytes);

/* ---- Batches under a plan: head parallelism inside groups, context parallelism across --- */

/* Collective, like hsapBatchCreate, but the ranks are arranged by `plan` (HexiSeq CP x HP):
 * the row is split over the plan's groups by the sequence-aware partition (group sequence
 * weights), each group's share over its ranks by their token weights. Each rank passes its
 * shard (hsapBatchGetLocalTokens rows, hsapBatchGetPartition ranges) with ALL heads:
 * q/out [localTokens, numHeadsQ, headDim], k/v [localTokens, numHeadsKV, headDim]; the
 * batch runs a ragged all-to-all inside each group (every rank then holds its group's
 * tokens for its own query heads and the KV heads they use) and sequence-aware sub-rings
 * across groups, and returns the outputs in the same shard layout. The plan's numRanks
 * must equal the communicator's size and its head counts config's numHeadsQ/numHeadsKV.
 * Use the batch with hsapAttentionForward/Backward, hsapBatchGetTraffic and
 * hsapBatchGetTrafficDetail; the plan may be destroyed afterwards. On a CUDA communicator
 * the batch is prepared as hsapBatchCreate says (kernels, uploads, device pool). */
hsapResult_t hsapBatchCreateWithPlan(hsapBatch_t* batch, hsapComm_t comm, hsapLayout_t layout,
                                     hsapPlan_t plan, const hsapBatchConfig_t* config);

/* Bytes this rank moved in the last forward and backward, split into the all-to-all
 * inside its group and the sub-rings across groups (a batch without a plan has only ring
 * bytes; one with a single group only all-to-all bytes). */
typedef struct {
  uint64_t forwardAllToAllBytesSent, forwardAllToAllBytesReceived;
  uint64_t forwardRingBytesSent, forwardRingBytesReceived;
  uint64_t backwardAllToAllBytesSent, backwardAllToAllBytesReceived;
  uint64_t backwardRingBytesSent, backwardRingBytesReceived;
} hsapTrafficDetail_t;
hsapResult_t hsapBatchGetTrafficDetail(hsapBatch_t batch, hsapTrafficDetail_t* traffic);

/* Bytes this rank moved in the last forward and backward, split by link class: messages to
 * and from ranks of its own node (intra) and of other nodes (inter), per the communicator's
 * topology (rankNodes, or for CUDA communicators the nodes discovered at initialisation).
 * Counted from the messages sent and received, host and CUDA batches alike (plan batches:
 * the group all-to-alls, the sub-ring K/V with their node fan-outs and the gradients). With
 * every rank on one node all bytes are intra-node. hsapUnsupported for a batch whose runner
 * does not classify messages on a communicator spanning several nodes (none in this
 * version). */
typedef struct {
  uint64_t forwardIntraNodeBytesSent, forwardIntraNodeBytesReceived;
  uint64_t forwardInterNodeBytesSent, forwardInterNodeBytesReceived;
  uint64_t backwardIntraNodeBytesSent, backwardIntraNodeBytesReceived;
  uint64_t backwardInterNodeBytesSent, backwardInterNodeBytesReceived;
} hsapLinkTraffic_t;
hsapResult_t hsapBatchGetLinkTraffic(hsapBatch_t batch, hsapLinkTraffic_t* traffic);

/* How a batch's attention work is split between the engines of CUDA batches, decided at
 * hsapBatchCreate / hsapBatchCreateWithPlan under $HSAP_ATTENTION_ENGINE (docs/environment.md,
 * docs/gpu_backend.md "Attention engines"): each step's work is cut into pieces (a query
 * range x a key range under one mask) and each piece goes to cuDNN's fused attention or to
 * hsap's JIT kernels. cuDNN pieces run through libhsap's libcudnn piece runner, made at
 * batch creation where libcudnn.so.9 loads on an sm_80+ GPU; where it cannot be made every
 * piece runs on the JIT kernels, the report says why, and mode hsapEngineCudnn makes batch
 * creation fail on every rank, hsapGetLastError() naming the reason. Counts are over every
 * step of
 * one forward (the backward runs the same pieces). hsapUnsupported for a batch of the host
 * backend. */
typedef enum { hsapEngineAuto = 0, hsapEngineCudnn = 1, hsapEngineJit = 2 } hsapEngineMode_t;
typedef struct {
  hsapEngineMode_t mode;                /* $HSAP_ATTENTION_ENGINE at creation */
  int64_t cudnnPieces, jitPieces;       /* pieces per engine */
  int64_t cudnnPairs, jitPairs;         /* visible (query, key) pairs per head, per engine */
  int64_t cudnnCalls;                   /* cuDNN executions (ragged batches) per forward */
} hsapEngines_t;
hsapResult_t hsapBatchGetEngines(hsapBatch_t batch, hsapEngines_t* engines);
/* The same as one NUL-terminated line, with the reason of every JIT piece ("cudnn 0 pieces in
 * 0 calls (0.0% of FLOPs), jit 5 pieces (100.0%): 5 x cuDNN is not available: ...") and,
 * under auto where cuDNN can run the batch, the calibration the choice went by ("[auto by
 * calibration built-in, kind H200: per piece the faster engine]"), then the cuDNN calls that
 * ran on the JIT kernels at run time because cuDNN built no graph for them ("; at run time 2
 * cuDNN calls ran on the JIT kernels instead (first: ...)"; results unchanged). With
 * buffer == NULL only *size is set (bytes needed, NUL included); otherwise *size is the
 * buffer's capacity and, if too small, hsapInvalidArgument is returned with *size set to the
 * bytes needed (as hsapPlanToJson). */
hsapResult_t hsapBatchGetEngineReport(hsapBatch_t batch, char* buffer, size_t* size);

/* ---- CUDA communicators: one GPU per rank, over NCCL ---------------------------------- */

/* CUDA, NCCL and the NVIDIA driver are loaded at run time. Where one is missing these calls
 * return hsapUnsupported and hsapGetLastError() says what is missing ("libcuda.so.1 not
 * found: no NVIDIA driver", "no CUDA device", "libnccl.so.2 not found"); the host backend
 * keeps working. $HSAP_CUDA_LIB_PATH (colon-separated directories) replaces the library
 * search path. Batches, with or without a plan, run on CUDA communicators: the same
 * schedules with the JIT CUDA kernels (see hsapBatchCreate). */

/* Opaque bootstrap token, like ncclUniqueId (128 bytes, copied between processes). */
typedef struct {
  char internal[128];
} hsapUniqueId_t;

/* Creates a token on one rank (to be broadcast to all ranks by the caller), for either
 * backend; it needs neither CUDA nor NCCL. It holds 128 random bits that name the host
 * backend's shared-memory segment and, where NCCL loads and a CUDA device exists, an
 * ncclUniqueId for the CUDA backend. Use a fresh token for every communicator. */
hsapResult_t hsapGetUniqueId(hsapUniqueId_t* uniqueId);
/* Collective over the nranks processes (or threads) that pass the same uniqueId, each with
 * its own rank, like ncclCommInitRank; it returns once every rank has joined, or fails
 * after the timeout (config->timeoutMs) naming the ranks missing. config may be NULL.
 * The backend is config->backend:
 *  - hsapBackendCuda: one GPU per rank (the current CUDA device), over NCCL;
 *    config->cudaStream is honoured. The token must come from hsapGetUniqueId on a machine
 *    with NCCL and a CUDA device; a raw ncclUniqueId copied into the token works too.
 *  - hsapBackendHost: a host rank in this process that talks to the other ranks through
 *    one POSIX shared-memory segment per communicator ("/dev/shm/hsap-<hex>", named from
 *    the token), so the ranks must share one host (and one pid namespace). Rank 0 creates
 *    it, the others open it; once every rank has joined, the name is removed, so nothing
 *    is left in /dev/shm whatever happens to the processes afterwards (the memory is
 *    freed when the last rank destroys its communicator or exits). Everything of the
 *    host backend applies: numThreads (0: hardware threads / nranks), batches with or
 *    without plans, abort from any rank or thread. A rank whose process dies without
 *    hsapCommDestroy aborts the communicator: its peers' pending and later calls return
 *    hsapAborted within about 20 ms (they check the peers' pids while they wait), never
 *    later than their timeout (hsapTimeout). hsapCommSplit is not available (CUDA only).
 *  - hsapBackendDefault: CUDA when the token carries an ncclUniqueId (or is a raw one) and
 *    this process finds NCCL and a CUDA device, host otherwise. Ranks of one communicator
 *    must end up with the same backend: pass it explicitly where unsure (e.g. CPU tensors
 *    on a machine with GPUs). */
hsapResult_t hsapCommInitRank(hsapComm_t* comm, int nranks, hsapUniqueId_t uniqueId, int rank,
                              const hsapCommConfig_t* config);
/* Adopts a trainer's existing ncclComm_t (passed as void*); the ncclComm stays owned by the
 * caller and must outlive the hsap communicator. config may be NULL. Collective over the
 * ncclComm's ranks (node discovery all-gathers a host hash, see rankNodes). */
hsapResult_t hsapCommInitFromNccl(hsapComm_t* comm, void* ncclComm, const hsapCommConfig_t* config);
/* Collective over comm: ranks with equal color form a new communicator (ordered by key, then
 * rank), through ncclCommSplit -- e.g. the head-parallel groups of a plan. color < 0: this
 * rank joins none and *newcomm is set to NULL. Only for CUDA communicators. The new
 * communicator discovers its nodes like hsapCommInitRank (config->rankNodes, with its
 * size's entries, replaces discovery). */
hsapResult_t hsapCommSplit(hsapComm_t comm, int color, int key, hsapComm_t* newcomm,
                           const hsapCommConfig_t* config);
/* 1 when comm is a CUDA communicator (NCCL or loopback), 0 for the host backend. */
hsapResult_t hsapCommIsCuda(hsapComm_t comm, int* isCuda);
/* Creates nranks CUDA ranks that share the current GPU in this process (comms[0..nranks-1]),
 * like hsapCommInitAll: one thread per rank, each with its own stream, data moved by
 * device-to-device copies. For testing and benchmarking the CUDA backend on one GPU.
 * config may be NULL; config->cudaStream is ignored (every rank uses a stream of its own,
 * so calls return after their work finished). Needs a CUDA device, not NCCL. The ranks are
 * on one node unless config->rankNodes describes others (multi-node delivery on one GPU). */
hsapResult_t hsapCommInitLoopback(hsapComm_t* comms, int nranks, const hsapCommConfig_t* config);
/* Device memory held by comm's buffer pool, in bytes: the largest need of the batches
 * created on it so far (their double-buffered K/V slots, fp32 accumulators and gradient
 * partials); 0 for a host communicator. */
hsapResult_t hsapCommGetPoolBytes(hsapComm_t comm, size_t* bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HSAP_HSAP_H_ */
