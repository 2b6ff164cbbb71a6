"""The C-level objects of hsap over ctypes: no torch import here (numpy arrays suffice).

Arrays passed to the calls are "THD" packed rows as in include/hsap/hsap.h: contiguous
[tokens, heads, head_dim] in host memory (numpy arrays, or anything exposing the buffer
protocol through numpy; torch tensors are adapted by hsap.torch). Handles are freed by
close(), by leaving a `with` block, or by the garbage collector as a last resort.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import threading
from typing import Any, Iterable, Sequence

import numpy as np

from hsap import _lib as L

# ---- errors ----------------------------------------------------------------------------


class HsapError(RuntimeError):
    """A failed hsap call: `result` is the hsapResult_t, `message` hsapGetLastError()."""

    def __init__(self, function: str, result: int, message: str):
        self.function = function
        self.result = result
        self.message = message
        super().__init__(f"{function}: {_result_name(result)}: {message}")


class InvalidArgumentError(HsapError, ValueError):
    """hsapInvalidArgument: an argument is null, out of range or inconsistent."""


class InvalidUsageError(HsapError):
    """hsapInvalidUsage: calls in the wrong order, or ranks disagree."""


class HsapSystemError(HsapError):
    """hsapSystemError: the OS or a loaded library failed."""


class InternalError(HsapError):
    """hsapInternalError: a bug in hsap."""


class UnsupportedError(HsapError):
    """hsapUnsupported: valid, but not supported by this build or machine."""


class HsapTimeoutError(HsapError, TimeoutError):
    """hsapTimeout: a wait on a peer ran past the communicator's timeout."""


class AbortedError(HsapError):
    """hsapAborted: the communicator was aborted."""


class CompileError(HsapError):
    """hsapCompileError: a JIT compile failed (the log is in `message`)."""


class HsapMemoryError(HsapError, MemoryError):
    """hsapOutOfMemory."""


_ERRORS: dict[int, type[HsapError]] = {
    L.INVALID_ARGUMENT: InvalidArgumentError,
    L.INVALID_USAGE: InvalidUsageError,
    L.SYSTEM_ERROR: HsapSystemError,
    L.INTERNAL_ERROR: InternalError,
    L.UNSUPPORTED: UnsupportedError,
    L.TIMEOUT: HsapTimeoutError,
    L.ABORTED: AbortedError,
    L.COMPILE_ERROR: CompileError,
    L.OUT_OF_MEMORY: HsapMemoryError,
}


def _result_name(result: int) -> str:
    name = L.lib().hsapGetErrorString(result)
    return name.decode() if name else f"hsapResult_t {result}"


def _call(name: str, *args: Any) -> None:
    """Calls hsap function `name`; raises the HsapError subclass of its result."""
    lib = L.lib()
    result = getattr(lib, name)(*args)
    if result != L.SUCCESS:
        # hsapGetLastError is per thread and valid until the next hsap call on this thread.
        message = (lib.hsapGetLastError() or b"").decode(errors="replace")
        raise _ERRORS.get(result, HsapError)(name, result, message)


class _Handle:
    """Owns one opaque handle; destroyed once, by close(), `with` or __del__."""

    _destroy_fn = ""

    def __init__(self) -> None:
        self._handle = ctypes.c_void_p()
        self._close_lock = threading.Lock()

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return not self._handle

    def close(self) -> None:
        """Frees the C handle (idempotent)."""
        with self._close_lock:
            if self._handle:
                _call(self._destroy_fn, self._handle)  # on failure the handle stays valid
                self._handle = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if getattr(self, "_handle", None):
                self.close()
        except Exception:  # interpreter shutdown or a dependent handle still alive
            pass


# ---- dtypes and arrays -----------------------------------------------------------------

_DTYPE_CODES = {
    "float32": L.FLOAT32,
    "fp32": L.FLOAT32,
    "bfloat16": L.BFLOAT16,
    "bf16": L.BFLOAT16,
    "float16": L.FLOAT16,
    "fp16": L.FLOAT16,
    "half": L.FLOAT16,
}
_DTYPE_NAMES = {L.FLOAT32: "float32", L.BFLOAT16: "bfloat16", L.FLOAT16: "float16"}
_DTYPE_SIZES = {L.FLOAT32: 4, L.BFLOAT16: 2, L.FLOAT16: 2}


def dtype_code(dtype: Any) -> int:
    """hsapDataType_t of a dtype given as a string, numpy dtype or torch dtype."""
    name = str(dtype).replace("torch.", "")
    if name in _DTYPE_CODES:
        return _DTYPE_CODES[name]
    try:
        name = np.dtype(dtype).name
    except TypeError:
        pass
    if name in _DTYPE_CODES:
        return _DTYPE_CODES[name]
    raise ValueError(f"hsap: unsupported dtype {dtype!r}; use float32, bfloat16 or float16")


def dtype_name(code: int) -> str:
    return _DTYPE_NAMES[code]


@dataclasses.dataclass(frozen=True)
class ArrayRef:
    """A contiguous [tokens, heads, head_dim] buffer seen by the C ABI (no copy)."""

    ptr: int
    dtype: int
    shape: tuple[int, ...]
    device: str = "cpu"

    def tensor(self) -> L.Tensor:
        if len(self.shape) != 3:
            raise ValueError(f"hsap: tensors are [tokens, heads, head_dim]; got shape {self.shape}")
        return L.Tensor(self.ptr, self.dtype, self.shape[0], self.shape[1], self.shape[2])


def array_ref(x: Any, name: str = "array") -> ArrayRef:
    """An ArrayRef over a numpy array (C-contiguous, float32/float16) or a torch tensor."""
    if hasattr(x, "data_ptr") and hasattr(x, "is_contiguous"):  # a torch tensor, no import
        if not x.is_contiguous():
            raise ValueError(f"hsap: {name} must be contiguous")
        device = "cuda" if x.is_cuda else "cpu"
        return ArrayRef(x.data_ptr(), dtype_code(x.dtype), tuple(x.shape), device)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"hsap: {name} must be a numpy array or torch tensor, not {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(f"hsap: {name} must be C-contiguous")
    return ArrayRef(x.ctypes.data, dtype_code(x.dtype), tuple(x.shape))


def _float_ptr(ptr: int) -> L.c_float_p:
    return ctypes.cast(ctypes.c_void_p(ptr), L.c_float_p)


def _int64_array(values: Any, name: str) -> np.ndarray:
    if hasattr(values, "detach"):  # torch tensor, possibly on a GPU
        values = values.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(values), dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"hsap: {name} must be one-dimensional; got shape {arr.shape}")
    return arr


def _ptr(arr: np.ndarray, ctype: Any) -> Any:
    return arr.ctypes.data_as(ctypes.POINTER(ctype)) if arr is not None else None


# ---- layouts ---------------------------------------------------------------------------

_MASK_KINDS = {
    "causal": L.MASK_CAUSAL,
    "full": L.MASK_FULL,
    "prefix_lm": L.MASK_PREFIX_LM,
    "sliding_window": L.MASK_SLIDING_WINDOW,
}
MASK_KIND_NAMES = tuple(_MASK_KINDS)


def _mask_kind(kind: Any) -> int:
    if isinstance(kind, str):
        if kind not in _MASK_KINDS:
            raise ValueError(f"hsap: unknown mask kind {kind!r}; use one of {MASK_KIND_NAMES}")
        return _MASK_KINDS[kind]
    return int(kind)


@dataclasses.dataclass(frozen=True)
class Slice:
    """A rectangle of the (query, key) plane: half-open ranges; kind "full" or "causal"
    (causal: k - k_begin <= q - q_begin, and > q - q_begin - window when window > 0)."""

    q_begin: int
    q_end: int
    k_begin: int
    k_end: int
    kind: str = "full"
    window: int = 0


class Layout(_Handle):
    """The mask of one packed row of documents (flash_attn_varlen_func vocabulary).

    cu_seqlens: int array/tensor [num_docs + 1], 0 first, non-decreasing.
    mask_kinds: None (all causal), one kind for every document, or one per document; a kind
      is "causal", "full", "prefix_lm" or "sliding_window" (or its hsapMaskKind_t value).
    params: the prefix length (prefix_lm) or window (sliding_window): None, one value for
      all, or one per document; other kinds ignore it.
    """

    _destroy_fn = "hsapLayoutDestroy"

    def __init__(self, cu_seqlens: Any, mask_kinds: Any = None, params: Any = None):
        super().__init__()
        cu = _int64_array(cu_seqlens, "cu_seqlens")
        num_docs = max(len(cu) - 1, 0)
        kinds = None
        if mask_kinds is not None:
            if isinstance(mask_kinds, (str, int)):
                mask_kinds = [mask_kinds] * num_docs
            kinds = np.array([_mask_kind(k) for k in mask_kinds], dtype=np.intc)
            if len(kinds) != num_docs:
                raise ValueError(f"hsap: {len(kinds)} mask kinds for {num_docs} documents")
        par = None
        if params is not None:
            if np.isscalar(params):
                params = [params] * num_docs
            par = _int64_array(params, "params")
            if len(par) != num_docs:
                raise ValueError(f"hsap: {len(par)} params for {num_docs} documents")
        _call("hsapLayoutCreate", ctypes.byref(self._handle), _ptr(cu, ctypes.c_int64), num_docs,
              _ptr(kinds, ctypes.c_int), _ptr(par, ctypes.c_int64))
        self.cu_seqlens = cu
        self.mask_kinds: list[str] | None = (
            None if kinds is None else [MASK_KIND_NAMES[k] for k in kinds])
        self.params = par

    @classmethod
    def from_slices(cls, num_tokens: int, slices: Iterable[Slice | Sequence[Any]]) -> "Layout":
        """A row of num_tokens tokens with a block-sparse mask given as non-overlapping
        slices (Slice objects or (q_begin, q_end, k_begin, k_end[, kind[, window]]) tuples)."""
        items = [s if isinstance(s, Slice) else Slice(*s) for s in slices]
        arr = (L.MaskSlice * max(len(items), 1))()
        for i, s in enumerate(items):
            kind = {"full": L.SLICE_FULL, "causal": L.SLICE_CAUSAL}.get(s.kind, s.kind)
            arr[i] = L.MaskSlice(s.q_begin, s.q_end, s.k_begin, s.k_end, int(kind), s.window)
        self = cls.__new__(cls)
        _Handle.__init__(self)
        _call("hsapLayoutCreateFromSlices", ctypes.byref(self._handle), int(num_tokens), arr,
              len(items))
        self.cu_seqlens, self.mask_kinds, self.params = None, None, None
        return self

    @property
    def num_tokens(self) -> int:
        n = ctypes.c_int64()
        _call("hsapLayoutGetNumTokens", self.handle, ctypes.byref(n))
        return n.value

    @property
    def visible_pairs(self) -> int:
        """Visible (query, key) pairs: the work of one head of attention."""
        n = ctypes.c_int64()
        _call("hsapLayoutGetVisiblePairs", self.handle, ctypes.byref(n))
        return n.value

    def slices(self) -> list[Slice]:
        """The slices the layout compiles to."""
        n = ctypes.c_int64()
        _call("hsapLayoutGetSlices", self.handle, None, ctypes.byref(n))
        arr = (L.MaskSlice * max(n.value, 1))()
        _call("hsapLayoutGetSlices", self.handle, arr, ctypes.byref(n))
        return [Slice(s.qBegin, s.qEnd, s.kBegin, s.kEnd,
                      "causal" if s.kind == L.SLICE_CAUSAL else "full", s.window)
                for s in arr[:n.value]]

    def dense_mask(self) -> np.ndarray:
        """The mask as a bool [num_tokens, num_tokens] array (query, key): for tests."""
        n = self.num_tokens
        mask = np.zeros((n, n), dtype=bool)
        for s in self.slices():
            q = np.arange(s.q_begin, s.q_end)[:, None] - s.q_begin
            k = np.arange(s.k_begin, s.k_end)[None, :] - s.k_begin
            if s.kind == "full":
                block = np.ones((len(q), k.shape[1]), dtype=bool)
            else:
                block = k <= q
                if s.window > 0:
                    block &= k > q - s.window
            mask[s.q_begin:s.q_end, s.k_begin:s.k_end] |= block
        return mask


# ---- communicators ---------------------------------------------------------------------

_BACKENDS = {"default": L.BACKEND_DEFAULT, "host": L.BACKEND_HOST, "cuda": L.BACKEND_CUDA}


def _comm_config(timeout_ms: int, num_threads: int, cuda_stream: int | None = None,
                 backend: str = "default") -> L.CommConfig:
    config = L.new_config(L.CommConfig)
    config.timeoutMs = int(timeout_ms)
    config.numThreads = int(num_threads)
    config.cudaStream = cuda_stream or None
    if backend not in _BACKENDS:
        raise ValueError(f"hsap: backend must be one of {tuple(_BACKENDS)}, not {backend!r}")
    config.backend = _BACKENDS[backend]
    return config


def get_unique_id() -> bytes:
    """A new 128-byte bootstrap token (hsapGetUniqueId), to be sent to every rank."""
    uid = L.UniqueId()
    _call("hsapGetUniqueId", ctypes.byref(uid))
    return ctypes.string_at(ctypes.addressof(uid), 128)


class Comm(_Handle):
    """One rank of a communicator. Use it from one thread at a time (abort() excepted);
    destroy its batches first (Batch.close) or close() raises InvalidUsageError."""

    _destroy_fn = "hsapCommDestroy"
    cuda_stream: int | None = None  # the cudaStream_t a CUDA communicator enqueues on

    @classmethod
    def _adopt(cls, handle: int) -> "Comm":
        self = cls.__new__(cls)
        _Handle.__init__(self)
        self._handle = ctypes.c_void_p(handle)
        return self

    @classmethod
    def init_all(cls, nranks: int, timeout_ms: int = 0, num_threads: int = 0) -> list["Comm"]:
        """nranks host ranks in this process (hsapCommInitAll); each rank's calls are then
        made from its own thread. timeout_ms 0: $HSAP_TIMEOUT_MS, else 5 minutes;
        num_threads 0: hardware threads / ranks."""
        handles = (ctypes.c_void_p * nranks)()
        config = _comm_config(timeout_ms, num_threads)  # backend 0: InitAll is always host
        _call("hsapCommInitAll", handles, int(nranks), ctypes.byref(config))
        return [cls._adopt(h) for h in handles]

    @classmethod
    def init_rank(cls, nranks: int, unique_id: bytes, rank: int, backend: str = "host",
                  timeout_ms: int = 0, num_threads: int = 0,
                  cuda_stream: int | None = None) -> "Comm":
        """Rank `rank` of nranks processes (or threads) holding the same unique_id
        (hsapCommInitRank; collective). backend "host" (shared memory between processes of
        one machine), "cuda" (NCCL, the current CUDA device; kernels on cuda_stream, a
        cudaStream_t as int) or "default" (the library decides)."""
        if len(unique_id) != 128:
            raise ValueError(f"hsap: a unique id has 128 bytes, not {len(unique_id)}")
        uid = L.UniqueId.from_buffer_copy(unique_id)
        config = _comm_config(timeout_ms, num_threads, cuda_stream, backend)
        self = cls.__new__(cls)
        _Handle.__init__(self)
        _call("hsapCommInitRank", ctypes.byref(self._handle), int(nranks), uid, int(rank),
              ctypes.byref(config))
        self.cuda_stream = cuda_stream
        return self

    @classmethod
    def from_process_group(cls, group: Any = None, backend: str | None = None,
                           timeout_ms: int = 0, num_threads: int = 0) -> "Comm":
        """A communicator over the ranks of a torch.distributed process group (None: the
        default group): rank 0 creates the unique id, torch.distributed broadcasts it.
        backend None: "cuda" when the group's backend is NCCL (CUDA tensors, the current
        device and stream), else "host" (CPU tensors, shared memory; processes of one
        machine)."""
        from hsap.torch import comm_from_process_group  # torch only when asked for

        return comm_from_process_group(group, backend, timeout_ms, num_threads)

    def abort(self) -> None:
        """Releases every rank from its current and future waits with AbortedError."""
        _call("hsapCommAbort", self.handle)

    @property
    def size(self) -> int:
        n = ctypes.c_int()
        _call("hsapCommCount", self.handle, ctypes.byref(n))
        return n.value

    @property
    def rank(self) -> int:
        n = ctypes.c_int()
        _call("hsapCommUserRank", self.handle, ctypes.byref(n))
        return n.value

    @property
    def is_cuda(self) -> bool:
        n = ctypes.c_int()
        _call("hsapCommIsCuda", self.handle, ctypes.byref(n))
        return bool(n.value)


# ---- plans -----------------------------------------------------------------------------


class Plan(_Handle):
    """Head-parallel groups x context parallelism (HexiSeq): from JSON (the planner's
    bench/hsap_plan --json or to_json()) or by hand (Plan.create)."""

    _destroy_fn = "hsapPlanDestroy"

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        self = cls.__new__(cls)
        _Handle.__init__(self)
        _call("hsapPlanCreateFromJson", ctypes.byref(self._handle), text.encode())
        return self

    @classmethod
    def create(cls, num_heads_q: int, num_heads_kv: int, groups: Sequence[Sequence[int]],
               heads: Sequence[Sequence[int]], sequence_weights: Sequence[float] | None = None,
               token_weights: Sequence[float] | None = None,
               ring_order: Sequence[int] | None = None) -> "Plan":
        """groups: the world ranks of each group; heads: the query heads of each rank, in
        the order of the flattened groups; weights and ring order as hsapPlanCreate."""
        flat = [r for g in groups for r in g]
        if len(heads) != len(flat):
            raise ValueError(f"hsap: {len(heads)} head lists for {len(flat)} ranks")

        def ints(values):
            return np.ascontiguousarray(values, dtype=np.intc)

        sizes, ranks = ints([len(g) for g in groups]), ints(flat)
        counts, head_list = ints([len(h) for h in heads]), ints([x for h in heads for x in h])
        seq = None if sequence_weights is None else np.asarray(sequence_weights, np.float64)
        tok = None if token_weights is None else np.asarray(token_weights, np.float64)
        ring = None if ring_order is None else ints(ring_order)
        self = cls.__new__(cls)
        _Handle.__init__(self)
        _call("hsapPlanCreate", ctypes.byref(self._handle), len(flat), num_heads_q, num_heads_kv,
              len(groups), _ptr(sizes, ctypes.c_int), _ptr(ranks, ctypes.c_int),
              _ptr(seq, ctypes.c_double), _ptr(tok, ctypes.c_double),
              _ptr(counts, ctypes.c_int), _ptr(head_list, ctypes.c_int),
              _ptr(ring, ctypes.c_int))
        return self

    def to_json(self) -> str:
        size = ctypes.c_size_t(0)
        _call("hsapPlanToJson", self.handle, None, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        _call("hsapPlanToJson", self.handle, buf, ctypes.byref(size))
        return buf.value.decode()

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(num_ranks, num_heads_q, num_heads_kv, num_groups)."""
        vals = [ctypes.c_int() for _ in range(4)]
        _call("hsapPlanGetShape", self.handle, *[ctypes.byref(v) for v in vals])
        return tuple(v.value for v in vals)  # type: ignore[return-value]

    @property
    def predicted_time(self) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's attention; 0 for a hand-built plan."""
        fwd, bwd = ctypes.c_double(), ctypes.c_double()
        _call("hsapPlanGetPredictedTime", self.handle, ctypes.byref(fwd), ctypes.byref(bwd))
        return fwd.value, bwd.value


# ---- partitions ------------------------------------------------------------------------


def _partition_ranges(handle: ctypes.c_void_p, rank: int) -> list[tuple[int, int]]:
    n, tokens = ctypes.c_int64(), ctypes.c_int64()
    _call("hsapPartitionGetRanges", handle, rank, None, ctypes.byref(n), ctypes.byref(tokens))
    buf = np.zeros(2 * max(n.value, 1), dtype=np.int64)
    _call("hsapPartitionGetRanges", handle, rank, _ptr(buf, ctypes.c_int64), ctypes.byref(n),
          None)
    return [(int(buf[2 * i]), int(buf[2 * i + 1])) for i in range(n.value)]


def _index_of(ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    if not ranges:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(b, e, dtype=np.int64) for b, e in ranges])


class Partition(_Handle):
    """Which tokens of a packed row each of nranks ranks holds (not collective: every rank
    computes the same one). From several layouts of one row (the masks of a model's layers,
    hsapPartitionCreateForLayouts) the sum of their work is balanced; batches of each mask
    then share it (Batch(..., partition=)). weights: one per rank, None: equal."""

    _destroy_fn = "hsapPartitionDestroy"

    def __init__(self, layouts: "Layout | Sequence[Layout]", nranks: int,
                 weights: Sequence[float] | None = None):
        super().__init__()
        layouts = [layouts] if isinstance(layouts, Layout) else list(layouts)
        if not layouts:
            raise ValueError("hsap: a partition needs at least one layout")
        handles = (ctypes.c_void_p * len(layouts))(*[l.handle.value for l in layouts])
        w = None if weights is None else np.ascontiguousarray(weights, dtype=np.float64)
        if w is not None and len(w) != nranks:
            raise ValueError(f"hsap: {len(w)} weights for {nranks} ranks")
        _call("hsapPartitionCreateForLayouts", ctypes.byref(self._handle), handles, len(layouts),
              int(nranks), _ptr(w, ctypes.c_double))
        self.size = int(nranks)
        self.num_tokens = layouts[0].num_tokens
        self._ranges = [_partition_ranges(self._handle, r) for r in range(self.size)]

    def ranges_of(self, rank: int) -> list[tuple[int, int]]:
        """Token ranges [begin, end) of `rank`, in shard order."""
        return list(self._ranges[rank])

    def local_index(self, rank: int) -> np.ndarray:
        """Row positions of `rank`'s tokens (int64): shard = row[local_index(rank)]."""
        return _index_of(self._ranges[rank])


# ---- batches ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes this rank moved in the last forward and backward (hsapTrafficDetail_t)."""

    forward_all_to_all_sent: int
    forward_all_to_all_received: int
    forward_ring_sent: int
    forward_ring_received: int
    backward_all_to_all_sent: int
    backward_all_to_all_received: int
    backward_ring_sent: int
    backward_ring_received: int

    @property
    def forward_sent(self) -> int:
        return self.forward_all_to_all_sent + self.forward_ring_sent

    @property
    def forward_received(self) -> int:
        return self.forward_all_to_all_received + self.forward_ring_received

    @property
    def backward_sent(self) -> int:
        return self.backward_all_to_all_sent + self.backward_ring_sent

    @property
    def backward_received(self) -> int:
        return self.backward_all_to_all_received + self.backward_ring_received


class Batch(_Handle):
    """Distributed attention over one packed row on one rank of `comm` (collective
    creation: every rank passes the same layout, weights/plan and shape).

    weights: one per rank (work proportional to it; None: equal); plan: a Plan instead
    (head-parallel groups); partition: a Partition instead (e.g. one shared by the masks of
    a model's layers, so that every layer's batch holds the same tokens);
    softmax_scale None: 1/sqrt(head_dim).
    Each rank holds the tokens of `ranges` (in that order) as its shard: q/out
    [local_tokens, num_heads_q, head_dim], k/v [local_tokens, num_heads_kv, head_dim].
    """

    _destroy_fn = "hsapBatchDestroy"

    def __init__(self, comm: Comm, layout: Layout, num_heads_q: int, num_heads_kv: int,
                 head_dim: int, dtype: Any, weights: Sequence[float] | None = None,
                 plan: Plan | None = None, softmax_scale: float | None = None,
                 partition: Partition | None = None):
        super().__init__()
        if sum(x is not None for x in (weights, plan, partition)) > 1:
            raise ValueError("hsap: pass weights, a plan or a partition, not several")
        config = L.new_config(L.BatchConfig)
        config.dtype = dtype_code(dtype)
        config.numHeadsQ, config.numHeadsKV, config.headDim = num_heads_q, num_heads_kv, head_dim
        config.softmaxScale = 0.0 if softmax_scale is None else float(softmax_scale)
        if plan is not None:
            _call("hsapBatchCreateWithPlan", ctypes.byref(self._handle), comm.handle,
                  layout.handle, plan.handle, ctypes.byref(config))
        elif partition is not None:
            _call("hsapBatchCreateWithPartition", ctypes.byref(self._handle), comm.handle,
                  layout.handle, partition.handle, ctypes.byref(config))
        else:
            w = None if weights is None else np.ascontiguousarray(weights, dtype=np.float64)
            if w is not None and len(w) != comm.size:
                raise ValueError(f"hsap: {len(w)} weights for {comm.size} ranks")
            _call("hsapBatchCreate", ctypes.byref(self._handle), comm.handle, layout.handle,
                  _ptr(w, ctypes.c_double), ctypes.byref(config))
        self._adopt(comm, layout, config, softmax_scale)

    def _adopt(self, comm: Comm, layout: Layout, config: Any,
               softmax_scale: float | None) -> None:
        """Fills the Python side of a created handle from its layout and config."""
        self.comm = comm  # the batch must be destroyed before its communicator
        self.num_tokens = layout.num_tokens
        self.num_heads_q, self.num_heads_kv = config.numHeadsQ, config.numHeadsKV
        self.head_dim = config.headDim
        self.dtype = dtype_name(config.dtype)
        self.softmax_scale = (1.0 / math.sqrt(self.head_dim) if softmax_scale is None
                              else float(softmax_scale))
        self.rank, self.size = comm.rank, comm.size
        part = ctypes.c_void_p()
        _call("hsapBatchGetPartition", self.handle, ctypes.byref(part))
        self._partition_handle = part  # owned by the batch: valid while it is open
        self._ranges = [self._rank_ranges(r) for r in range(self.size)]

    @classmethod
    def create_many(cls, comm: Comm, layouts: Sequence[Layout], partition: Partition,
                    shapes: Sequence[tuple]) -> list["Batch"]:
        """Collective: several batches over one partition at once, in the collective rounds
        of one (hsapBatchCreateManyWithPartition): batch i of layouts[i] and shapes[i] =
        (num_heads_q, num_heads_kv, head_dim, dtype, softmax_scale or None). Every rank
        passes the same lists (checked: a mismatch fails on every rank)."""
        n = len(layouts)
        if n != len(shapes) or n == 0:
            raise ValueError(f"hsap: {n} layouts and {len(shapes)} shapes; one shape per "
                             "layout, at least one")
        configs = (L.BatchConfig * n)()
        for i, (nq, nkv, hd, dtype, scale) in enumerate(shapes):
            c = L.new_config(L.BatchConfig)
            c.dtype = dtype_code(dtype)
            c.numHeadsQ, c.numHeadsKV, c.headDim = nq, nkv, hd
            c.softmaxScale = 0.0 if scale is None else float(scale)
            configs[i] = c
        handles = (ctypes.c_void_p * n)()
        layout_handles = (ctypes.c_void_p * n)(*[lay.handle.value for lay in layouts])
        _call("hsapBatchCreateManyWithPartition", handles, n, comm.handle, layout_handles,
              partition.handle, configs)
        batches = []
        for i in range(n):
            b = cls.__new__(cls)
            _Handle.__init__(b)
            b._handle = ctypes.c_void_p(handles[i])
            b._adopt(comm, layouts[i], configs[i], shapes[i][4])
            batches.append(b)
        return batches

    @property
    def _partition(self) -> ctypes.c_void_p:
        self.handle  # raises once the batch is closed (the partition went with it)
        return self._partition_handle

    def _rank_ranges(self, rank: int) -> list[tuple[int, int]]:
        return _partition_ranges(self._partition, rank)

    @property
    def local_tokens(self) -> int:
        """Tokens of this rank's shard."""
        n = ctypes.c_int64()
        _call("hsapBatchGetLocalTokens", self.handle, ctypes.byref(n))
        return n.value

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """This rank's token ranges [begin, end) of the row, in shard order."""
        return list(self._ranges[self.rank])

    def ranges_of(self, rank: int) -> list[tuple[int, int]]:
        """The token ranges of any rank."""
        return list(self._ranges[rank])

    def local_index(self, rank: int | None = None) -> np.ndarray:
        """Row positions of the shard's tokens (int64): shard = row[local_index()]."""
        return _index_of(self._ranges[self.rank if rank is None else rank])

    def scatter(self, row: np.ndarray) -> list[np.ndarray]:
        """Splits a packed row [num_tokens, ...] (C-contiguous) into every rank's shard."""
        row = np.ascontiguousarray(row)
        if row.shape[0] != self.num_tokens:
            raise ValueError(f"hsap: the row has {row.shape[0]} tokens, the batch {self.num_tokens}")
        per_token = row.nbytes // max(row.shape[0], 1)
        shards = [np.empty((len(self.local_index(r)),) + row.shape[1:], dtype=row.dtype)
                  for r in range(self.size)]
        ptrs = (ctypes.c_void_p * self.size)(*[s.ctypes.data for s in shards])
        _call("hsapPartitionScatter", self._partition, row.ctypes.data, per_token, ptrs)
        return shards

    def gather(self, shards: Sequence[np.ndarray]) -> np.ndarray:
        """The packed row from every rank's shard (the inverse of scatter)."""
        if len(shards) != self.size:
            raise ValueError(f"hsap: {len(shards)} shards for {self.size} ranks")
        shards = [np.ascontiguousarray(s) for s in shards]
        tail, dtype = shards[0].shape[1:], shards[0].dtype
        row = np.empty((self.num_tokens,) + tail, dtype=dtype)
        per_token = row.nbytes // max(self.num_tokens, 1)
        for r, s in enumerate(shards):
            if s.shape != (len(self.local_index(r)),) + tail or s.dtype != dtype:
                raise ValueError(f"hsap: shard {r} has shape {s.shape} {s.dtype}; expected "
                                 f"{(len(self.local_index(r)),) + tail} {dtype}")
        ptrs = (ctypes.c_void_p * self.size)(*[s.ctypes.data for s in shards])
        _call("hsapPartitionGather", self._partition, ptrs, per_token, row.ctypes.data)
        return row

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank moved in the last forward and backward."""
        t = L.TrafficDetail()
        _call("hsapBatchGetTrafficDetail", self.handle, ctypes.byref(t))
        return Traffic(*(getattr(t, f) for f, _ in L.TrafficDetail._fields_))

    # Raw calls on ArrayRefs; hsap.torch and the numpy methods below build on them.
    # cuda_stream: a cudaStream_t (int) to run this call on (hsapAttentionForwardOnStream:
    # CUDA batches only; the call returns once enqueued), None for the communicator's.
    def forward_raw(self, q: ArrayRef, k: ArrayRef, v: ArrayRef, out: ArrayRef,
                    lse_ptr: int, cuda_stream: int | None = None) -> None:
        args = [self.handle] + [ctypes.byref(x.tensor()) for x in (q, k, v, out)]
        args.append(_float_ptr(lse_ptr))
        if cuda_stream is None:
            _call("hsapAttentionForward", *args)
        else:
            _call("hsapAttentionForwardOnStream", *args, ctypes.c_void_p(cuda_stream))

    def backward_raw(self, dout: ArrayRef, q: ArrayRef, k: ArrayRef, v: ArrayRef,
                     out: ArrayRef, lse_ptr: int, dq: ArrayRef, dk: ArrayRef,
                     dv: ArrayRef, cuda_stream: int | None = None) -> None:
        t = [x.tensor() for x in (dout, q, k, v, out)]
        g = [x.tensor() for x in (dq, dk, dv)]
        args = [self.handle, *[ctypes.byref(x) for x in t], _float_ptr(lse_ptr),
                *[ctypes.byref(x) for x in g]]
        if cuda_stream is None:
            _call("hsapAttentionBackward", *args)
        else:
            _call("hsapAttentionBackwardOnStream", *args, ctypes.c_void_p(cuda_stream))

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Collective. (out, lse) of this rank's shard, numpy float32/float16 arrays."""
        out = np.empty_like(q)
        lse = np.empty((self.num_heads_q, q.shape[0]), dtype=np.float32)
        self.forward_raw(array_ref(q, "q"), array_ref(k, "k"), array_ref(v, "v"),
                         array_ref(out, "out"), lse.ctypes.data)
        return out, lse

    def backward(self, dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Collective. (dq, dk, dv) of this rank's shard."""
        dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
        lse = np.ascontiguousarray(lse, dtype=np.float32)
        self.backward_raw(*[array_ref(x, n) for x, n in
                            ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"))],
                          lse.ctypes.data,
                          array_ref(dq, "dq"), array_ref(dk, "dk"), array_ref(dv, "dv"))
        return dq, dk, dv


# ---- single-device attention -----------------------------------------------------------


def _attention_config(softmax_scale: float | None, num_threads: int) -> L.AttentionConfig:
    config = L.new_config(L.AttentionConfig)
    config.softmaxScale = 0.0 if softmax_scale is None else float(softmax_scale)
    config.numThreads = int(num_threads)
    return config


def forward_local_raw(layout: Layout, q: ArrayRef, k: ArrayRef, v: ArrayRef, out: ArrayRef,
                      lse_ptr: int, softmax_scale: float | None = None,
                      num_threads: int = 0) -> None:
    config = _attention_config(softmax_scale, num_threads)
    tq, tk, tv, to = q.tensor(), k.tensor(), v.tensor(), out.tensor()
    _call("hsapAttentionForwardLocal", ctypes.byref(config), layout.handle, ctypes.byref(tq),
          ctypes.byref(tk), ctypes.byref(tv), ctypes.byref(to), _float_ptr(lse_ptr))


def backward_local_raw(layout: Layout, dout: ArrayRef, q: ArrayRef, k: ArrayRef, v: ArrayRef,
                       out: ArrayRef, lse_ptr: int, dq: ArrayRef, dk: ArrayRef, dv: ArrayRef,
                       softmax_scale: float | None = None, num_threads: int = 0) -> None:
    config = _attention_config(softmax_scale, num_threads)
    t = [x.tensor() for x in (dout, q, k, v, out)]
    g = [x.tensor() for x in (dq, dk, dv)]
    _call("hsapAttentionBackwardLocal", ctypes.byref(config), layout.handle,
          *[ctypes.byref(x) for x in t], _float_ptr(lse_ptr), *[ctypes.byref(x) for x in g])


def attention_forward_local(q: np.ndarray, k: np.ndarray, v: np.ndarray, layout: Layout,
                            softmax_scale: float | None = None,
                            num_threads: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Single-device attention over a packed row on the host: (out, lse), numpy."""
    out = np.empty_like(q)
    lse = np.empty((q.shape[1], q.shape[0]), dtype=np.float32)
    forward_local_raw(layout, array_ref(q, "q"), array_ref(k, "k"), array_ref(v, "v"),
                      array_ref(out, "out"), lse.ctypes.data, softmax_scale, num_threads)
    return out, lse


def attention_backward_local(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                             out: np.ndarray, lse: np.ndarray, layout: Layout,
                             softmax_scale: float | None = None,
                             num_threads: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of attention_forward_local: (dq, dk, dv), numpy."""
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    backward_local_raw(layout, *[array_ref(x, n) for x, n in
                                 ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"))],
                       lse.ctypes.data, array_ref(dq, "dq"), array_ref(dk, "dk"),
                       array_ref(dv, "dv"), softmax_scale=softmax_scale,
                       num_threads=num_threads)
    return dq, dk, dv
