"""What the engine integrations share, with no engine imports (testable without one).

- Reads of the longest cached prefix: ``acquire_prefix`` / ``acquire_runs`` pin it,
  ``read_blocks`` pins, copies out and releases, ``reload_prefix`` scatters it into an
  engine's pages (``EnginePages``).
- Writes of what the store lacks: ``store_missing`` (the caller fills the slots) and
  ``offload_missing`` (gathered from an engine's pages), one lookup per call.

The engine's connection to the daemon, whose namespaces these steps take, is a
``kvstore.integrations.daemon_link.DaemonLink``.  The steps never raise a daemon error:
they return how far they got (``Loaded``, ``Stored``) and the error, so a failure turns
into a recompute, never into wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstore.client import Held, Namespace, Reservation
from kvstore.errors import CapacityError, KVStoreError, NotFoundError
from kvstore.kernels import KVCaches, Layout, PagedCache, gather, paged_cache
from kvstore.logs import Repeats

logger = logging.getLogger(__name__)


# ========================================================================================
# outcomes
# ========================================================================================

class Loaded(NamedTuple):
    """A read: ``blocks`` copied (the leading ones, for a prefix); ``error`` if the
    daemon failed (then what is not loaded must be recomputed)."""

    blocks: int
    error: KVStoreError | None = None


class Stored(NamedTuple):
    """A write: the leading ``present`` keys are in the store afterwards, ``created`` of
    them by this call; ``error`` if the daemon failed."""

    present: int
    created: int = 0
    error: KVStoreError | None = None


# ========================================================================================
# reads: the longest cached prefix
# ========================================================================================

def _try_acquire(ns: Namespace, keys: Sequence[bytes]) -> Held | None:
    try:
        return ns.acquire(keys)
    except NotFoundError:
        return None


def _acquire_parts(ns: Namespace, keys: Sequence[bytes]) -> list[tuple[int, Held]] | None:
    """Pin every key's block, one acquire per ``max_keys`` of the daemon's (an acquire of
    more keys than a request may name was refused whole): ``(start, pin)`` each; None,
    nothing held, if any is not cached."""
    per = max(1, ns.client.max_keys)
    parts: list[tuple[int, Held]] = []
    try:
        for start in range(0, len(keys), per):
            held = _try_acquire(ns, keys[start:start + per])
            if held is None:
                release_all(h for _, h in parts)
                return None
            parts.append((start, held))
    except BaseException:
        release_all(h for _, h in parts)
        raise
    return parts


def acquire_prefix(ns: Namespace, keys: Sequence[bytes]) -> list[tuple[int, Held]]:
    """Pin the longest cached prefix of ``keys``: its acquires when all are cached, else a
    lookup and the acquires of its hits, one per ``max_keys`` of the daemon's (more were
    refused whole), ``(start, pin)`` each; [] when nothing is (or stayed) cached."""
    if not keys:
        return []
    parts = _acquire_parts(ns, keys)
    if parts is None:
        hits = ns.lookup(keys).blocks
        parts = _acquire_parts(ns, keys[:hits]) if hits else None
    return parts or []


def acquire_runs(ns: Namespace, keys: Sequence[bytes]) -> list[tuple[int, Held]]:
    """Pin every run of cached keys (for keys that are not one chain): ``(start, pin)``
    per run, one lookup per run and per miss; a run evicted before its pin is missing.
    A daemon error releases the runs pinned before it (no caller gets them)."""
    runs: list[tuple[int, Held]] = []
    try:
        i = 0
        while i < len(keys):
            hits = ns.lookup(keys[i:]).blocks
            if hits:
                parts = _acquire_parts(ns, keys[i:i + hits])
                runs += [(i + start, held) for start, held in parts or ()]
            i += hits + 1
    except BaseException:
        release_all(held for _, held in runs)
        raise
    return runs


# a release failing at every pin of every step (the daemon gone) is a line in 10 s
_RELEASES = Repeats(logger)


def release_all(pins: Iterable[Held]) -> None:
    """Release every pin; one that fails is logged (its lease ends it anyway), the same
    failure again at most once in 10 s, with a count."""
    for held in pins:
        try:
            held.release()
        except KVStoreError as exc:
            _RELEASES.log(logging.WARNING, type(exc).__name__, "kvstore: release failed: %s",
                          exc)


def read_blocks(ns: Namespace, keys: Sequence[bytes],
                copy: Callable[[int, memoryview], object], *, runs: bool = False) -> Loaded:
    """Copy out the cached blocks of ``keys``: ``copy(i, slot)`` for each, while pinned.

    The longest cached prefix, or with ``runs`` every run of cached keys.  The pins are
    released whatever ``copy`` does; an error of ``copy`` itself propagates.
    """
    copied = 0
    try:
        if not runs:
            pinned = acquire_prefix(ns, keys)
        else:
            whole = _acquire_parts(ns, keys) if keys else []
            pinned = whole if whole is not None else acquire_runs(ns, keys)
    except KVStoreError as exc:
        return Loaded(0, exc)
    try:
        for start, held in pinned:
            for offset, slot in enumerate(held.buffers):
                copy(start + offset, slot)
                copied += 1
    finally:
        release_all(held for _, held in pinned)
    return Loaded(copied)


class Staged(NamedTuple):
    """Blocks copied out of an engine's pages: ``rows[i]`` is block i's bytes in host
    memory once ``ready()`` returned (None: they are already)."""

    rows: torch.Tensor
    ready: Callable[[], object] | None = None


def page_runs(rows: Sequence[torch.Tensor], page_ids: Sequence[int],
              row_bytes: int) -> Iterator[tuple[torch.Tensor, int, int]]:
    """``(rows [k, row_bytes], first page, k)`` for each run of rows that follow each
    other in memory (one storage) going to pages that follow each other: on the CPU a
    strided copy of a whole run moves at memory speed, where one copy per page pays
    the call's overhead each time (saves, and loads whose slots are not one tensor over
    the arena; the others go by ``arena_runs``)."""
    for row in rows:  # as_strided reads past a short row into its neighbour's bytes
        if row.nbytes < row_bytes:
            raise ValueError(f"a row of {row.nbytes} bytes for pages of {row_bytes}")
    i, n = 0, len(rows)
    while i < n:
        first = rows[i]
        j = i + 1
        while (j < n and page_ids[j] == page_ids[j - 1] + 1
               and rows[j].data_ptr() == rows[j - 1].data_ptr() + row_bytes
               and rows[j].untyped_storage().data_ptr()
               == first.untyped_storage().data_ptr()):
            j += 1
        yield first.as_strided((j - i, row_bytes), (row_bytes, 1)), page_ids[i], j - i
        i = j


class Rows(NamedTuple):
    """Rows side by side in memory (``rows``: ``[k, row bytes]``) going to pages
    ``page_ids`` (``k`` of them, anywhere)."""

    rows: torch.Tensor
    page_ids: Sequence[int]


def arena_runs(arena: torch.Tensor, offsets: Sequence[int], page_ids: Sequence[int],
               row_bytes: int) -> list[Rows]:
    """The rows at byte ``offsets`` of ``arena`` (1-D uint8) going to ``page_ids``, as
    runs of rows side by side in the arena (found from the numbers alone: one view of
    the arena per run, no tensor per row), whatever their pages."""
    if len(offsets) != len(page_ids):
        raise ValueError(f"{len(offsets)} offsets but {len(page_ids)} page ids")
    size, runs, i, n = arena.numel(), [], 0, len(offsets)
    while i < n:
        j = i + 1
        while j < n and offsets[j] == offsets[j - 1] + row_bytes:
            j += 1
        start, end = offsets[i], offsets[i] + (j - i) * row_bytes
        if start < 0 or end > size:
            raise ValueError(f"rows at bytes {start}..{end} of an arena of {size}")
        runs.append(Rows(arena[start:end].view(j - i, row_bytes), page_ids[i:j]))
        i = j
    return runs


class SplitRows(NamedTuple):
    """``Rows`` split among a cache's page tensors (``EnginePages.split``), as numpy
    arrays of integers as wide as their elements: ``parts[c]`` goes to target ``c``'s
    pages ``page_ids`` (an index array, or a slice where they follow each other)."""

    page_ids: np.ndarray | slice
    parts: tuple[np.ndarray, ...]


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor's elements as numpy integers of their width, sharing its memory
    (whatever its dtype, bfloat16 too: the bytes are copied, never converted)."""
    return t.view(_SAME_WIDTH[t.element_size()]).numpy()


def _index(page_ids: Sequence[int]) -> np.ndarray | slice:
    ids = np.asarray(page_ids, dtype=np.int64)
    if len(ids) and ids[-1] - ids[0] == len(ids) - 1 and bool((np.diff(ids) == 1).all()):
        return slice(int(ids[0]), int(ids[-1]) + 1)
    return ids


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each ``(dst, src)``, in one call that runs without the GIL
    (a thread copying a step's pages lets the engine's own Python run meanwhile)."""
    if pairs:
        with torch.no_grad():
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def slot_rows(slots: Sequence[memoryview]) -> list[torch.Tensor]:
    """Writable slots of one arena (a reservation's) as 1-D uint8 tensors, all views of
    one tensor over the arena, so that ``page_runs`` finds the slots side by side."""
    if not slots:
        return []
    arena = torch.frombuffer(slots[0].obj, dtype=torch.uint8)
    base = arena.data_ptr()
    return [arena.narrow(0, torch.frombuffer(slot, dtype=torch.uint8).data_ptr() - base,
                         len(slot)) for slot in slots]


class EnginePages:
    """An engine's paged KV cache as kvstore blocks (``[layers, 2, T, H, D]`` bytes).

    ``EnginePages.direct(kv_caches, layout)``: pages the copy kernels read and write in
    place (a ``kvstore.kernels`` layout).  ``EnginePages.staged(views)``: one
    ``[pages, 2, T, H, D]`` view per layer whose pages are not contiguous in that
    order (strided views of the engine's own layout); blocks go through a contiguous
    staging copy of just the pages moved.
    """

    def __init__(self, layout: Layout, cache: PagedCache | None,
                 views: list[torch.Tensor] | None) -> None:
        self.layout = layout
        self.cache = cache
        self.views = views
        self._cut_cache: list[list[tuple[torch.Tensor, int, int]]] | None = None
        self._np_cache: list[np.ndarray] | None = None
        # Worked out once (the cache's tensors never change): a staged cache's took a
        # view per layer, ~15-30 us, several times in each step that loads or saves.
        self.block_bytes = (cache.info.block_bytes if cache is not None
                            else sum(v[0].numel() * v.element_size() for v in views or ()))

    @classmethod
    def direct(cls, kv_caches: KVCaches, layout: Layout) -> EnginePages:
        return cls(layout, paged_cache(kv_caches, layout), None)

    @classmethod
    def staged(cls, views: Sequence[torch.Tensor]) -> EnginePages:
        return cls("per_layer", None, list(views))

    def _index(self, page_ids: Sequence[int]) -> torch.Tensor:
        assert self.views is not None, "a direct cache has no staging"
        return torch.tensor(list(page_ids), dtype=torch.long, device=self.views[0].device)

    def gather(self, page_ids: Sequence[int], slots: Sequence[memoryview]) -> None:
        """Copy the blocks of ``page_ids`` into ``slots`` (one batched copy)."""
        if self.cache is not None:
            gather(self.cache, list(page_ids), slots, layout=self.layout)
        else:
            assert self.views is not None
            index = self._index(page_ids)
            staging = [v.index_select(0, index) for v in self.views]
            gather(staging, list(range(len(page_ids))), slots, layout="per_layer")
        device = (self.cache.device if self.cache is not None
                  else self.views[0].device if self.views else torch.device("cpu"))
        if device.type == "cuda":  # the copy is queued: the slots are read once committed
            torch.cuda.current_stream(device).synchronize()

    def reload(self, ns: Namespace, keys: Sequence[bytes], page_ids: Sequence[int]) -> int:
        """``ns.reload`` into these pages (NotFoundError if a key is missing, and then no
        page is written)."""
        if self.cache is not None:
            return ns.reload(keys, self.cache, page_ids, layout=self.layout)
        assert self.views is not None
        n = len(keys)
        staging = [torch.empty((n, *v.shape[1:]), dtype=v.dtype, device=v.device)
                   for v in self.views]
        ns.reload(keys, staging, list(range(n)), layout="per_layer")
        index = self._index(page_ids)
        for view, block in zip(self.views, staging):
            view.index_copy_(0, index, block)
        return n

    # -- copies for the pipeline (kvstore.integrations.pipeline) ---------------------------
    @property
    def device(self) -> torch.device:
        if self.cache is not None:
            return self.cache.device
        assert self.views
        return self.views[0].device

    def layer_targets(self) -> list[list[torch.Tensor]]:
        """Per layer (or per run of layers that cannot be told apart), the page tensors
        its bytes go to, in block order, each indexed by page on dim 0: the group's
        share of a block splits evenly among them."""
        if self.views is not None:
            return [[v] for v in self.views]
        assert self.cache is not None
        segments, layers = list(self.cache.segments), self.cache.info.layers
        if len(segments) % layers:  # an all-layer page in one segment: one group
            return [segments]
        per = len(segments) // layers
        return [segments[i * per:(i + 1) * per] for i in range(layers)]

    def _cuts(self) -> list[list[tuple[torch.Tensor, int, int]]]:
        """Per layer group, ``(page tensor, first byte, bytes)`` of each of its targets
        within a block's row (worked out once: the cache's tensors never change)."""
        if self._cut_cache is None:
            cuts, at = [], 0
            for targets in self.layer_targets():
                group = []
                for t in targets:
                    size = t[0].numel() * t.element_size()
                    group.append((t, at, size))
                    at += size
                cuts.append(group)
            self._cut_cache = cuts
        return self._cut_cache

    def _chosen(self, groups: Sequence[int] | None) -> list[int]:
        """The indices, among every layer group's targets in order, of ``groups``'s."""
        cuts = self._cuts()
        starts = [0]
        for group in cuts:
            starts.append(starts[-1] + len(group))
        return [i for g in (range(len(cuts)) if groups is None else groups)
                for i in range(starts[g], starts[g + 1])]

    def _numpy_targets(self) -> list[np.ndarray]:
        if self._np_cache is None:
            self._np_cache = [as_numpy(t) for group in self._cuts() for t, _, _ in group]
        return self._np_cache

    def split(self, runs: Iterable[Rows]) -> list[SplitRows]:
        """Each run's bytes as numpy views per target (``_cuts``, all layer groups in
        order), worked out once for every layer group copied (``scatter_split``)."""
        flat = [c for group in self._cuts() for c in group]
        first = flat[0][0]
        uniform = all(t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
                      for t, _, _ in flat)
        out = []
        for rows, page_ids in runs:
            k = rows.shape[0]
            if uniform:  # every target's share at once: [k, targets, *page]
                whole = as_numpy(rows.view(first.dtype).view(k, len(flat), *first.shape[1:]))
                parts = tuple(whole[:, c] for c in range(len(flat)))
            else:
                parts = tuple(as_numpy(self._as_run(rows[:, at:at + size], t))
                              for t, at, size in flat)
            out.append(SplitRows(_index(page_ids), parts))
        return out

    def scatter_split(self, split: Sequence[SplitRows],
                      groups: Sequence[int] | None = None) -> None:
        """Copy split rows into their pages (in host memory): every layer group, or just
        ``groups`` (indices into ``layer_targets``); one numpy assignment per run and
        target, pages in any order (a strided copy per run of pages that follow each
        other paid each call's overhead, and vLLM hands out pages in falling runs)."""
        assert self.device.type != "cuda", "a GPU cache is loaded by scatter_rows()"
        targets = self._numpy_targets()
        for c in self._chosen(groups):
            target = targets[c]
            for s in split:
                target[s.page_ids] = s.parts[c]

    def _pairs(self, rows: Sequence[torch.Tensor], page_ids: Sequence[int],
               groups: Sequence[int] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(pages, rows' bytes)`` views of each run of rows (``page_runs``) and target
        of the layer groups ``groups`` (None: all), for one batched copy either way."""
        flat = [c for group in self._cuts() for c in group]
        chosen = self._chosen(groups)
        first = flat[0][0]
        uniform = all(t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
                      for t, _, _ in flat)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for run, page, k in page_runs(rows, page_ids, self.block_bytes):
            if uniform:  # every target's share at once: [k, targets, *page] split
                part = run if first.dtype == torch.uint8 else run.view(first.dtype)
                parts = part.view(k, len(flat), *first.shape[1:]).unbind(1)
            else:
                parts = tuple(self._as_run(run[:, at:at + size], t) for t, at, size in flat)
            pairs.extend((flat[c][0][page:page + k], parts[c]) for c in chosen)
        return pairs

    @staticmethod
    def _as_run(rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """A byte range of ``k`` rows (``[k, bytes]``) seen as ``k`` pages of ``t``."""
        part = rows if t.dtype == torch.uint8 else rows.view(t.dtype)
        return part.view(rows.shape[0], *t.shape[1:])

    def stage(self, page_ids: Sequence[int]) -> Staged:
        """Copy the blocks of ``page_ids`` out of the engine's pages into host memory
        (``[n, block_bytes]`` uint8, one row per page): done on the CPU when this
        returns; on a GPU queued on the current stream (so before any later write to
        those pages), with ``ready`` waiting for it."""
        n, device = len(page_ids), self.device
        rows = torch.empty((n, self.block_bytes), dtype=torch.uint8, device=device)
        if device.type != "cuda":
            self.copy_into(page_ids, list(rows))
            return Staged(rows)
        cuts = [c for group in self._cuts() for c in group]
        with torch.no_grad():
            index = torch.tensor(list(page_ids), dtype=torch.long, device=device)
            for t, at, size in cuts:
                part = t.index_select(0, index).reshape(n, -1)
                rows[:, at:at + size].copy_(part.view(torch.uint8).reshape(n, size)
                                            if part.dtype != torch.uint8 else part)
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return Staged(host, event.synchronize)

    def copy_into(self, page_ids: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
        """Copy the blocks of ``page_ids`` (pages in host memory) into ``rows`` (1-D
        uint8, ``block_bytes`` each: rows of a staging tensor, or daemon slots seen
        through ``slot_rows``), a run of pages at a time where the rows follow each
        other in memory."""
        assert self.device.type != "cuda", "a GPU cache is staged by stage()"
        copy_pairs([(row, page) for page, row in self._pairs(rows, page_ids, None)])

    def scatter_rows(self, rows: Sequence[torch.Tensor], page_ids: Sequence[int],
                     groups: Sequence[int] | None = None) -> None:
        """Copy block rows (1-D uint8, ``[layers, 2, T, H, D]`` bytes each) into the pages
        of ``page_ids``: every layer, or just the layer groups ``groups`` (indices into
        ``layer_targets``).  Queued on the current stream on a GPU."""
        if not rows:
            return
        n, device = len(rows), self.device
        if device.type != "cuda":  # per run of pages and layer, as in ``copy_into``
            self.scatter_split(self.split(
                Rows(run, range(page, page + k))
                for run, page, k in page_runs(rows, page_ids, self.block_bytes)), groups)
            return
        cuts = self._cuts()
        chosen = [c for g in (range(len(cuts)) if groups is None else groups)
                  for c in cuts[g]]
        with torch.no_grad():
            index = torch.tensor(list(page_ids), dtype=torch.long, device=device)
            whole = torch.stack(list(rows)).to(device, non_blocking=True)
            for t, at, size in chosen:
                part = whole[:, at:at + size]
                if t.dtype != torch.uint8:
                    part = part.view(t.dtype).view(n, *t.shape[1:])
                t.index_copy_(0, index, part)

    def __repr__(self) -> str:
        how = repr(self.cache) if self.cache is not None else f"staged x{len(self.views or [])}"
        return f"EnginePages({self.layout}, {how})"


def reload_prefix(ns: Namespace, keys: Sequence[bytes], pages: EnginePages,
                  page_ids: Sequence[int]) -> Loaded:
    """Load the longest cached prefix of ``keys`` into ``pages`` (``keys[i]`` into page
    ``page_ids[i]``): one acquire when all are cached, else a lookup and a reload of the
    hits; a block evicted in between leaves its pages unwritten and uncounted."""
    try:
        try:
            return Loaded(pages.reload(ns, keys, page_ids))
        except NotFoundError:  # evicted since the caller's lookup: load what is left
            present = ns.lookup(keys).blocks
            if not present:
                return Loaded(0)
            try:
                return Loaded(pages.reload(ns, keys[:present], page_ids[:present]))
            except NotFoundError:
                return Loaded(0)
    except KVStoreError as exc:
        return Loaded(0, exc)


# ========================================================================================
# writes: what the store lacks
# ========================================================================================

def blocks_per_request(ns: Namespace) -> int:
    """The most blocks one reservation or pin of the namespace may ask for: the daemon's
    key limit, and no more than its arena has slots (more were refused whole)."""
    per = max(1, ns.client.max_keys)
    if ns.arena[1] and ns.slot_bytes:
        per = min(per, max(1, ns.arena[1] // ns.slot_bytes))
    return per


def store_missing(ns: Namespace, keys: Sequence[bytes],
                  fill: Callable[[Sequence[memoryview], int], None], *,
                  parent: bytes | None = None, lookup: bool = True) -> Stored:
    """Store the blocks of ``keys`` the namespace lacks, in one reservation (one per
    ``max_keys`` of the daemon's, in order, where they are more: a reserve of more keys
    than a request may name was refused whole, and nothing was stored).

    One lookup finds the cached leading keys (``lookup=False`` skips it, for keys not
    chained to each other, or known to be missing); ``fill(slots, first)`` writes the
    blocks of ``keys[first:first + len(slots)]`` into the reserved slots (called for
    each run of keys given slots: none for those the daemon holds already, or another
    writer's open reservation holds a slot for); then commit (the daemon makes it wait
    for that writer's).  Where the commit stores no key after one of another writer's
    that was not cached by then (it aborted, or its lease ran out), those keys are not
    ``present``, and the rest are not tried.
    ``parent`` is the key before ``keys[0]``; a parent evicted since starts a chain of
    its own.  No reservation asks for more blocks than the namespace's arena has slots:
    of a chain longer than that, the leading blocks that fit are stored (one reservation
    of them all was refused, and none was), and the rest as far as the tier makes room
    (demoting the earlier ones to SSD, say).  A reservation the tier has no room for is
    asked again for half as many blocks (the arena's free slots are fewer than its
    size where other block sizes hold slabs, pins hold slots, or the reservation's own
    parent and its prefix may not leave); the refusal of one block ends it.
    """
    hits = done = created = 0
    per = blocks_per_request(ns)
    try:
        if lookup:
            hits = ns.lookup(keys).blocks
        done = hits
        while done < len(keys):
            todo = keys[done:done + per]
            first_parent = keys[done - 1] if done else parent
            try:
                reservation = _reserve(ns, todo, first_parent)
            except CapacityError:
                if len(todo) == 1:
                    raise
                per = len(todo) // 2
                continue
            with reservation as r:
                for start, end in slot_runs(r.offsets):  # (none for keys held already)
                    fill(r.buffers[start:end], done + start)
                created += r.commit()
            if r.dropped:  # another writer's block it awaited was not stored: nor are
                return Stored(done + len(todo) - r.dropped, created)  # the keys after it
            done += len(todo)
    except KVStoreError as exc:
        return Stored(done, created, exc)
    return Stored(len(keys), created)


def slot_runs(offsets: Sequence[int]) -> list[tuple[int, int]]:
    """The runs ``(start, end)`` of a reservation's keys given slots; a key the daemon
    holds already, or another writer is to store (offset -1), has no bytes to write."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, offset in enumerate([*offsets, -1]):
        if offset >= 0 and start is None:
            start = i
        elif offset < 0 and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _reserve(ns: Namespace, keys: Sequence[bytes], parent: bytes | None) -> Reservation:
    """A reservation of ``keys`` after ``parent``; of a chain of their own where the
    parent is gone."""
    try:
        return ns.reserve(keys, parent=parent)
    except NotFoundError:
        if parent is None:
            raise
        return ns.reserve(keys, parent=None)


def offload_missing(ns: Namespace, pages: EnginePages, page_ids: Sequence[int],
                    keys: Sequence[bytes], *, parent: bytes | None = None) -> Stored:
    """Store the pages (``page_ids[i]`` holds the block of ``keys[i]``) whose blocks the
    namespace lacks: one lookup, then one batched gather of just those pages."""
    if len(page_ids) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(page_ids)} page ids")
    return store_missing(ns, keys, lambda slots, first: pages.gather(
        page_ids[first:first + len(slots)], slots), parent=parent)


# A local checkpoint's fingerprint reads each weight file at this many places, this much
# at each (512 KiB a file: 50 MiB for a model of a hundred files, once at start)
_SPANS, _SPAN_BYTES = 8, 1 << 16
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
_SETTINGS_MOST = 16 << 20  # a JSON file larger than this is not a setting: named, not read


def settings_tag(overrides: Any, quantization: Any) -> str:
    """What an engine's settings change of the KV its checkpoint computes, as a suffix
    of the revision: the model configuration overridden (vLLM's ``hf_overrides``, a
    dict or a function; SGLang's ``--json-model-override-args``, JSON text), the
    weights quantized as they load; "" where neither.  Before, an engine started with
    overrides took the blocks of one without (the same checkpoint, the same revision),
    and its answers were neither's."""
    found = ""
    if callable(overrides):  # a function rewrites the config: named, its effect unknown
        found += f"+overrides:{overrides.__module__}.{overrides.__qualname__}"
    elif overrides:
        text = ""
        try:
            parsed = json.loads(overrides) if isinstance(overrides, str) else overrides
            text = json.dumps(parsed, sort_keys=True, default=str) if parsed else ""
        except ValueError:  # (not JSON: the engine refuses it; named as it is)
            text = str(overrides)
        if text:
            found += "+overrides:" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    if quantization:
        found += f"+quantization:{quantization}"
    return found


def checkpoint_fingerprint(path: str) -> str | None:
    """A digest of a local checkpoint directory (None: ``path`` is no directory, a hub
    id): its JSON settings whole (``config.json`` and the like), and each weight file's
    name, size and ``_SPANS`` spans of its bytes spread over it; nothing else there (a
    log, a lock file: the engine's ranks and sides would see different directories).
    Weights replaced in place (a fine-tune of the same shape: the same names and sizes) read differently
    somewhere in nearly every tensor; without it a checkpoint with no revision was
    ``unversioned``, and an engine loaded the blocks the old weights computed."""
    root = Path(path)
    if not root.is_dir():
        return None
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(os.listdir(root)):
        file = root / name
        if name.startswith(".") or not name.endswith((".json", *_WEIGHTS)) \
                or not file.is_file():
            continue
        size = file.stat().st_size
        digest.update(f"{name}\0{size}\0".encode())
        if name.endswith(".json") and size <= _SETTINGS_MOST:
            digest.update(file.read_bytes())
        elif name.endswith(_WEIGHTS):
            with open(file, "rb") as f:
                for i in range(_SPANS):
                    f.seek(max(0, size - _SPAN_BYTES) * i // max(1, _SPANS - 1))
                    digest.update(f.read(_SPAN_BYTES))
    return "weights:" + digest.hexdigest()


_COMMIT = frozenset("0123456789abcdef")


def hub_commit(model_id: str, revision: str | None = None) -> str | None:
    """The commit a hub model id resolves to in the local Hugging Face cache, where the
    engine downloaded it (``refs/<revision>`` names it; a revision that is a commit
    already is one): "hub:<commit>", or None (no such id there, or ``model_id`` is a
    path).  Read from the cache's layout, with no hub library: engines' environments
    need not have one."""
    if "/" not in model_id or model_id.startswith((".", "/", "~")) or Path(model_id).exists():
        return None
    rev = revision or "main"
    if len(rev) == 40 and set(rev) <= _COMMIT:
        return f"hub:{rev}"
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join("~", ".cache", "huggingface"), "hub")
    ref = (Path(cache).expanduser() / ("models--" + model_id.replace("/", "--"))
           / "refs" / rev)
    try:
        commit = ref.read_text().strip() if ref.is_file() else ""
    except OSError:
        return None
    return f"hub:{commit}" if len(commit) == 40 and set(commit) <= _COMMIT else None
