"""The per-step key of a training loop: one packed row's partition, its batches, and the
token dispatch between the whole row and this rank's shard.

A trainer makes one StepKey per step from the row's `cu_seqlens` (or HF-style
`position_ids` that restart at 0 in each document) and the masks its layers use; every
rank makes the same one (creation of the batches is collective). The key holds:

- one Partition shared by every mask (balanced for the sum of the layers' work), so that
  a hybrid model (full and sliding-window layers) shards its tokens once for all layers;
- the Batch of each (mask, dtype, head shape, scale) the layers ask for, created on first
  use over that partition and kept (a new dtype, e.g. under autocast, is a new batch over
  the same partition: no new partition, no new schedule decision);
- dispatch(x) / undispatch(x) for any per-token tensor, the local-to-global index map,
  labels shifted inside documents.

Keys are cached per communicator by (cu_seqlens, masks, weights): a layout that comes
again reuses its key (`StepKey.get`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
import threading
import time
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from hsap import _core
from hsap._core import Batch, Comm, Layout, Partition

__all__ = ["StepKey", "current_key", "cu_seqlens_from_position_ids", "mask_spec"]

MaskSpec = tuple  # (kind, param): ("causal", 0), ("sliding_window", w), ("full", 0), ...


def mask_spec(mask: Any = "causal") -> tuple[str, int]:
    """A mask as (kind, param): "causal", "full", ("sliding_window", w), ("prefix_lm", n),
    or an int w (a sliding window of w tokens: token i sees (i - w, i] of its document; a
    window longer than a document is the whole document)."""
    if mask is None:
        return ("causal", 0)
    if isinstance(mask, (int, np.integer)) and not isinstance(mask, bool):
        return ("sliding_window", int(mask))
    if isinstance(mask, str):
        kind, param = mask, 0
    else:
        kind, param = mask
    if kind not in _core.MASK_KIND_NAMES:
        raise ValueError(f"hsap: unknown mask kind {kind!r}; use one of {_core.MASK_KIND_NAMES}")
    param = int(param)
    if kind == "sliding_window" and param < 1:
        raise ValueError(f"hsap: a sliding window is at least 1 token, not {param}")
    if kind in ("causal", "full"):
        param = 0
    return (kind, param)


def cu_seqlens_from_position_ids(position_ids: Any) -> np.ndarray:
    """cu_seqlens of a packed row from HF-style position_ids ([T] or [1, T]) that restart
    at 0 in every document and count up by one inside it."""
    pos = position_ids.detach().cpu().numpy() if hasattr(position_ids, "detach") else np.asarray(
        position_ids)
    if pos.ndim == 2:
        if pos.shape[0] != 1:
            raise ValueError(f"hsap: position_ids of one packed row are [1, T]; got {pos.shape}")
        pos = pos[0]
    pos = pos.astype(np.int64, copy=False)
    if pos.ndim != 1:
        raise ValueError(f"hsap: position_ids must be [T] or [1, T]; got shape {pos.shape}")
    if len(pos) == 0:
        return np.zeros(1, dtype=np.int64)
    starts = np.flatnonzero(pos == 0)
    if len(starts) == 0 or starts[0] != 0:
        raise ValueError("hsap: position_ids must start at 0 (a document starts where its "
                         "position is 0)")
    step = np.diff(pos)
    bad = np.flatnonzero((step != 1) & (pos[1:] != 0))
    if len(bad):
        i = int(bad[0]) + 1
        raise ValueError(f"hsap: position_ids[{i}] = {int(pos[i])} after {int(pos[i - 1])}; "
                         "inside a document positions count up by one, and a new document "
                         "starts at 0")
    return np.append(starts, len(pos)).astype(np.int64)


_current: contextvars.ContextVar["StepKey | None"] = contextvars.ContextVar("hsap_step_key",
                                                                            default=None)


def current_key() -> "StepKey | None":
    """The key of the innermost `with key:` block of this thread (or task), or None."""
    return _current.get()


def _as_index_tensor(index: np.ndarray, device: Any) -> torch.Tensor:
    return torch.from_numpy(index).to(device)


class StepKey:
    """One packed row of one step on this rank: see the module's doc.

    comm: this rank's Comm (e.g. Comm.from_process_group(), or StepKey.comm_for(group)).
    cu_seqlens: the whole row's documents ([num_docs + 1], int; every rank the same).
    masks: the masks the model's layers use (mask_spec forms); the partition balances the
      sum of their work. A layer may still ask for another mask: its batch is made over the
      same partition.
    weights: per-rank work shares (None: equal). group: the torch.distributed group of the
      ranks, for undispatch (None: the default group when one is initialised).
    device: where the index tensors live (default: cpu for a host communicator, the
      current CUDA device for a CUDA one).
    """

    def __init__(self, comm: Comm, cu_seqlens: Any, masks: Iterable[Any] = ("causal",),
                 weights: Sequence[float] | None = None, group: Any = None,
                 device: Any = None):
        start = time.perf_counter()
        self.comm, self.group = comm, group
        self.cu_seqlens = _core._int64_array(cu_seqlens, "cu_seqlens")
        self.masks: list[tuple[str, int]] = []
        for m in masks:
            spec = mask_spec(m)
            if spec not in self.masks:
                self.masks.append(spec)
        if not self.masks:
            raise ValueError("hsap: a step key needs at least one mask")
        self.weights = None if weights is None else tuple(float(w) for w in weights)
        self._layouts: dict[tuple[str, int], Layout] = {}
        layouts = [self.layout(m) for m in self.masks]
        self.rank, self.size = comm.rank, comm.size
        self.partition = Partition(layouts, self.size, self.weights)
        self.num_tokens = int(self.cu_seqlens[-1]) if len(self.cu_seqlens) else 0
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if comm.is_cuda
                      else torch.device("cpu"))
        self.device = torch.device(device)
        self._index_np = [self.partition.local_index(r) for r in range(self.size)]
        self.global_index = _as_index_tensor(self._index_np[self.rank], self.device)
        self._batches: dict[tuple, Batch] = {}
        self._lock = threading.Lock()
        self._tokens: list[contextvars.Token] = []
        self.closed = False
        self.create_seconds = time.perf_counter() - start

    # ---- caching --------------------------------------------------------------------

    _cache: "collections.OrderedDict[tuple, StepKey]" = collections.OrderedDict()
    _cache_lock = threading.Lock()
    cache_size = 8

    @classmethod
    def get(cls, comm: Comm, cu_seqlens: Any, masks: Iterable[Any] = ("causal",),
            weights: Sequence[float] | None = None, group: Any = None,
            device: Any = None) -> "StepKey":
        """The cached key of this row and masks on `comm`, made when new (a layout that
        comes again is reused, batches included). The cache keeps the last
        StepKey.cache_size keys; every rank must see the same rows (it does when the ranks
        run the same steps), so that they create their batches together."""
        cu = _core._int64_array(cu_seqlens, "cu_seqlens")
        specs = tuple(dict.fromkeys(mask_spec(m) for m in masks))
        wkey = None if weights is None else tuple(float(w) for w in weights)
        key = (id(comm), cu.tobytes(), specs, wkey)
        with cls._cache_lock:
            hit = cls._cache.get(key)
            if hit is not None and hit.comm is comm and not comm.closed and not hit.closed:
                cls._cache.move_to_end(key)
                return hit
        made = cls(comm, cu, specs, weights, group, device)
        with cls._cache_lock:
            cls._cache[key] = made
            while len(cls._cache) > cls.cache_size:
                cls._cache.popitem(last=False)[1].close()
        return made

    @classmethod
    def find(cls, comm: Comm | None, cu_seqlens: Any) -> "StepKey | None":
        """The most recent cached key of this row (on `comm`, or any when None)."""
        cu = _core._int64_array(cu_seqlens, "cu_seqlens").tobytes()
        with cls._cache_lock:
            for (comm_id, row, _, _), key in reversed(cls._cache.items()):
                if row == cu and (comm is None or comm_id == id(comm)):
                    return key
        return None

    @classmethod
    def clear_cache(cls) -> None:
        with cls._cache_lock:
            keys = list(cls._cache.values())
            cls._cache.clear()
        for k in keys:
            k.close()

    _comms: dict[Any, Comm] = {}

    @classmethod
    def comm_for(cls, group: Any = None, **kwargs: Any) -> Comm:
        """One hsap communicator per torch.distributed group, made on first use
        (Comm.from_process_group(group, **kwargs); collective then)."""
        name = "default" if group is None else id(group)
        comm = cls._comms.get(name)
        if comm is None or comm.closed:
            comm = Comm.from_process_group(group, **kwargs)
            cls._comms[name] = comm
        return comm

    # ---- masks and batches ----------------------------------------------------------

    def layout(self, mask: Any = "causal") -> Layout:
        """The Layout of the row under one mask (made on first use)."""
        spec = mask_spec(mask)
        layout = self._layouts.get(spec)
        if layout is None:
            layout = Layout(self.cu_seqlens, spec[0], spec[1])
            self._layouts[spec] = layout
        return layout

    def batch(self, mask: Any, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype: Any,
              softmax_scale: float | None = None) -> Batch:
        """The batch of one mask and shape over the key's partition: collective the first
        time (every rank asks for it in the same order, as the layers of one model do)."""
        spec = mask_spec(mask)
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        code = _core.dtype_code(dtype)
        key = (spec, int(num_heads_q), int(num_heads_kv), int(head_dim), code,
               np.float32(scale).item())
        with self._lock:
            batch = self._batches.get(key)
            if batch is None:
                batch = Batch(self.comm, self.layout(spec), num_heads_q, num_heads_kv, head_dim,
                              _core.dtype_name(code), softmax_scale=scale,
                              partition=self.partition)
                self._batches[key] = batch
        return batch

    def prepare(self, num_heads_q: int, num_heads_kv: int, head_dim: int,
                dtypes: Iterable[Any] = (torch.float32,), masks: Iterable[Any] | None = None,
                softmax_scale: float | None = None) -> list[Batch]:
        """Makes the batches of `masks` (default: the key's) x `dtypes` for one head shape
        that do not exist yet, all in one collective call (hsapBatchCreateManyWithPartition:
        the ranks agree once for all of them, instead of once per batch as the first call of
        each layer would). Collective: every rank calls it with the same arguments. Returns
        the batches, in (dtype, mask) order."""
        specs = [mask_spec(m) for m in (self.masks if masks is None else masks)]
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        wanted = []
        for dtype in dtypes:
            code = _core.dtype_code(dtype)
            for spec in dict.fromkeys(specs):
                wanted.append((spec, int(num_heads_q), int(num_heads_kv), int(head_dim), code,
                               np.float32(scale).item()))
        with self._lock:
            missing = [k for k in dict.fromkeys(wanted) if k not in self._batches]
            if missing:
                made = Batch.create_many(
                    self.comm, [self.layout(k[0]) for k in missing], self.partition,
                    [(k[1], k[2], k[3], _core.dtype_name(k[4]), scale) for k in missing])
                self._batches.update(zip(missing, made))
            return [self._batches[k] for k in wanted]

    @property
    def batches(self) -> list[Batch]:
        return list(self._batches.values())

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = "causal",
                  softmax_scale: float | None = None) -> torch.Tensor:
        """Distributed attention of this rank's tokens (collective, forward and backward):
        q [local_tokens, Hq, D], k/v [local_tokens, Hkv, D], one floating dtype (k and v
        are cast to q's) -> out like q."""
        from hsap.torch import attention

        if q.shape[0] != len(self.global_index):
            raise ValueError(f"hsap: q holds {q.shape[0]} tokens but this rank's shard of the "
                             f"step has {len(self.global_index)}; dispatch the inputs with the "
                             "same key")
        if k.dtype != q.dtype:
            k = k.to(q.dtype)
        if v.dtype != q.dtype:
            v = v.to(q.dtype)
        batch = self.batch(mask, q.shape[1], k.shape[1], q.shape[2], q.dtype, softmax_scale)
        return attention(q, k, v, batch)

    # ---- dispatch ---------------------------------------------------------------------

    @property
    def local_tokens(self) -> int:
        return len(self.global_index)

    def index_of(self, rank: int) -> torch.Tensor:
        """Row positions of `rank`'s tokens, in its shard order."""
        return _as_index_tensor(self._index_np[rank], self.device)

    def dispatch(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's tokens of a whole-row tensor (tokens along `dim`; e.g. dim=1 for
        [1, T, ...] HF tensors), in shard order. A copy; differentiable."""
        if x.shape[dim] != self.num_tokens:
            raise ValueError(f"hsap: dim {dim} of x has {x.shape[dim]} tokens but the row has "
                             f"{self.num_tokens}")
        return x.index_select(dim, self.global_index.to(x.device))

    def undispatch(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The whole row from every rank's shard (collective over the key's torch.distributed
        group: an all-gather; any dtype, bit for bit). Not differentiable (for outputs,
        logging and checks; train on the dispatched tensors)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("hsap: undispatch gathers over torch.distributed; initialise a "
                               "process group (or use gather() with every rank's shard)")
        x = x.detach().movedim(dim, 0).contiguous()
        if x.shape[0] != self.local_tokens:
            raise ValueError(f"hsap: x holds {x.shape[0]} tokens along dim {dim}; this rank's "
                             f"shard has {self.local_tokens}")
        counts = [len(i) for i in self._index_np]
        longest = max(counts)
        flat = x.reshape(x.shape[0], -1)  # sent as raw bytes: any dtype, exact
        raw = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)
        padded = raw.new_zeros((longest, raw.shape[1]))
        padded[:x.shape[0]] = raw
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return self.gather([p[:n] for p, n in zip(parts, counts)], dim=0,
                           _like=x).movedim(0, dim)

    def gather(self, shards: Sequence[torch.Tensor], dim: int = 0,
               _like: torch.Tensor | None = None) -> torch.Tensor:
        """The whole row from the shards of every rank (a list, rank order), in one process."""
        if len(shards) != self.size:
            raise ValueError(f"hsap: {len(shards)} shards for {self.size} ranks")
        shards = [s.movedim(dim, 0) for s in shards]
        row = shards[0].new_empty((self.num_tokens,) + tuple(shards[0].shape[1:]))
        for r, s in enumerate(shards):
            row[self.index_of(r).to(row.device)] = s
        if _like is not None:  # raw bytes from undispatch: back to the caller's dtype/shape
            if _like.dtype == torch.bool:
                row = row.to(torch.bool)
            else:
                row = row.view(_like.dtype)
            row = row.reshape((self.num_tokens,) + tuple(_like.shape[1:]))
        return row.movedim(0, dim)

    # ---- labels and positions ---------------------------------------------------------

    def position_ids(self, device: Any = None) -> torch.Tensor:
        """Each token's position in its document, for the whole row ([T], int64)."""
        cu = self.cu_seqlens
        pos = np.arange(self.num_tokens, dtype=np.int64)
        lengths = np.diff(cu)
        pos -= np.repeat(cu[:-1], lengths)
        return torch.from_numpy(pos).to(device or self.device)

    def shift_labels(self, input_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Next-token labels of the whole row, shifted inside each document: label[i] =
        input_ids[i + 1] when token i + 1 is in the same document, else ignore_index (the
        last token of every document predicts nothing). Same shape as input_ids ([T] or
        [1, T]); dispatch it like the inputs, and pass it as HF's `shift_labels`."""
        ids = input_ids.reshape(-1)
        if ids.shape[0] != self.num_tokens:
            raise ValueError(f"hsap: input_ids has {ids.shape[0]} tokens, the row "
                             f"{self.num_tokens}")
        labels = torch.full_like(ids, ignore_index)
        if self.num_tokens > 1:
            labels[:-1] = ids[1:]
        ends = self.cu_seqlens[1:][np.diff(self.cu_seqlens) > 0] - 1
        labels[torch.from_numpy(ends).to(ids.device)] = ignore_index
        return labels.reshape(input_ids.shape)

    def num_label_tokens(self) -> int:
        """Tokens of the row that have a label (every token but the last of each document):
        the divisor of a mean loss over the whole row (HF's num_items_in_batch)."""
        return int(self.num_tokens - np.count_nonzero(np.diff(self.cu_seqlens) > 0))

    # ---- context ----------------------------------------------------------------------

    def __enter__(self) -> "StepKey":
        self._tokens.append(_current.set(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _current.reset(self._tokens.pop())

    def close(self) -> None:
        """Frees the batches (they must go before their communicator)."""
        self.closed = True
        with self._lock:
            batches, self._batches = list(self._batches.values()), {}
        for b in batches:
            b.close()
        self.partition.close()
        for layout in self._layouts.values():
            layout.close()
        self._layouts = {}

    def __repr__(self) -> str:
        return (f"StepKey(rank {self.rank}/{self.size}, {self.num_tokens} tokens, "
                f"{len(self.cu_seqlens) - 1} documents, {self.local_tokens} local, "
                f"masks {self.masks})")


@contextlib.contextmanager
def use(key: StepKey):
    """`with hsap.step.use(key):` is `with key:`."""
    with key:
        yield key
