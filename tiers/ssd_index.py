"""The SSD tier's durable index: block records, namespaces and layout metadata in LMDB.

Three sub-databases: ``blocks`` (namespace id + key -> msgpack ``BlockRecord``),
``namespaces`` (namespace id -> opaque identity bytes) and ``meta`` (format version and
the layout the data file was written with).
"""

from __future__ import annotations

import errno
import itertools
import operator
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import lmdb
import msgspec
import numpy as np

from kvstore.errors import BackendError, CapacityError, ConfigError

from .ssd_layout import (
    FORMAT_VERSION,
    BlockRecord,
    SlabLayout,
    decode_record,
    encode_record,
)
from .ssd_pages import mapped_leaves

SyncPolicy = Literal["always", "batch", "none"]

_META_FIELDS = ("format_version", "capacity_bytes", "slab_bytes")
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_NEARLY_FULL = 1 << 20


def _is_disk_full(exc: lmdb.Error, path: Path) -> bool:
    # py-lmdb reports system errors as a plain lmdb.Error carrying strerror() in the text,
    # and LMDB turns a short page write on a full disk into EIO: look at the disk too
    if any(os.strerror(code) in str(exc) for code in _DISK_FULL):
        return True
    try:
        fs = os.statvfs(path)
    except OSError:
        return False
    return fs.f_bavail * fs.f_frsize < _NEARLY_FULL


class SSDIndex:
    """LMDB environment of the SSD tier.  Thread-safe: LMDB serialises write transactions."""

    def __init__(self, path: Path, layout: SlabLayout, *, map_size: int, sync: SyncPolicy) -> None:
        """Open (or create) the index at ``path`` and check it was written for ``layout``.

        A new index records the layout only when ``write_layout()`` is called, so a store
        that fails to open does not pin a layout it never used.
        """
        self.path = path
        self.layout = layout
        self.fresh = False
        if _not_a_file(path / "data.mdb"):
            raise BackendError(
                f"SSD index {path}: its data.mdb is not a regular file (a FIFO, a device); "
                f"delete it to start the tier cold"
            )
        if _truncated(path / "data.mdb"):
            raise BackendError(
                f"SSD index {path} is shorter than its last commit wrote (truncated?); "
                f"delete it to start the tier cold"
            )
        try:
            # batch: data pages are synced at commit, the meta page at the next one, so a
            # power loss can undo the last commit but never corrupts the index
            self._env = lmdb.open(
                str(path),
                map_size=map_size,
                max_dbs=3,
                sync=sync != "none",
                metasync=sync == "always",
                mode=0o700,  # its directory; its files 0600: block keys tell prompts
            )
        except lmdb.Error as exc:
            raise BackendError(
                f"SSD index {path} cannot be opened ({exc}); delete it to start the tier cold"
            ) from exc
        try:
            with self._damaged("opening its databases"):
                self._blocks = self._env.open_db(b"blocks")
                self._namespaces = self._env.open_db(b"namespaces")
                self._meta = self._env.open_db(b"meta")
            self.fresh = self._check_meta(layout)
        except BaseException:
            self._env.close()
            raise

    @contextmanager
    def _mapped_errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except lmdb.MapFullError as exc:
            raise CapacityError(
                f"SSD index {self.path} is full while {action}; raise map_size"
            ) from exc
        except lmdb.Error as exc:
            if _is_disk_full(exc, self.path):
                raise CapacityError(
                    f"disk full under SSD index {self.path} while {action}: {exc}"
                ) from exc
            raise BackendError(f"SSD index {self.path} failed while {action}: {exc}") from exc

    @contextmanager
    def _damaged(self, action: str) -> Iterator[None]:
        """LMDB's errors while reading the index at start (a damaged page: MDB_CORRUPTED,
        a traceback and no daemon) as the reason to start cold."""
        try:
            yield
        except lmdb.Error as exc:
            raise BackendError(f"SSD index {self.path} is damaged ({action}: {exc}); "
                               f"delete it to start the tier cold") from exc

    @staticmethod
    def _wanted_meta(layout: SlabLayout) -> dict[str, int]:
        return {
            "format_version": FORMAT_VERSION,
            "capacity_bytes": layout.capacity_bytes,
            "slab_bytes": layout.slab_bytes,
        }

    def _check_meta(self, layout: SlabLayout) -> bool:
        """Refuse a layout other than the stored one; True when none is stored yet."""
        wanted = self._wanted_meta(layout)
        with self._mapped_errors("reading its metadata"), self._env.begin() as txn:
            stored = {
                name: txn.get(name.encode(), db=self._meta) for name in _META_FIELDS
            }
        if all(value is None for value in stored.values()):
            return True
        found = {name: (v.decode() if v is not None else "missing") for name, v in stored.items()}
        if found["format_version"] != str(FORMAT_VERSION):
            raise ConfigError(
                f"SSD index {self.path} has format version {found['format_version']}, this "
                f"kvstore reads version {FORMAT_VERSION}; delete the directory to start cold"
            )
        differ = [
            f"{name}={found[name]} (config: {wanted[name]})"
            for name in _META_FIELDS
            if found[name] != str(wanted[name])
        ]
        if differ:
            raise ConfigError(
                f"SSD index {self.path} was written with a different layout: "
                + ", ".join(differ)
                + "; restore the old values or delete the directory to start cold"
            )
        return False

    def write_layout(self) -> None:
        """Record the layout in a fresh index (no-op once recorded)."""
        if not self.fresh:
            return
        with self._mapped_errors("writing its metadata"), self._env.begin(write=True) as txn:
            for name, value in self._wanted_meta(self.layout).items():
                txn.put(name.encode(), str(value).encode(), db=self._meta)
        self.fresh = False

    # blocks

    def commit(
        self, records: Sequence[BlockRecord], touches: Mapping[bytes, float] | None = None,
        namespaces: Mapping[bytes, bytes] | None = None,
    ) -> None:
        """Publish ``records`` (and pending last-access updates, and the identity bytes of
        ``namespaces``) in one write transaction."""
        with self._mapped_errors("committing records"), self._env.begin(write=True) as txn:
            for namespace, identity in (namespaces or {}).items():
                txn.put(namespace, identity, db=self._namespaces)
            for record in records:
                txn.put(record.index_key, encode_record(record), db=self._blocks)
            if touches:
                self._apply_touches(txn, touches)

    def apply_touches(self, touches: Mapping[bytes, float]) -> None:
        """Raise stored last-access times to ``touches`` (index key -> time)."""
        if touches:
            with self._mapped_errors("updating access times"), self._env.begin(write=True) as txn:
                self._apply_touches(txn, touches)

    def _apply_touches(self, txn: lmdb.Transaction[bytes], touches: Mapping[bytes, float]) -> None:
        for index_key, when in touches.items():
            value = txn.get(index_key, db=self._blocks)
            if value is None:
                continue
            try:
                record = decode_record(value)
            except msgspec.DecodeError:  # load() drops it; nothing to update
                continue
            if when > record.last_access:
                txn.put(
                    index_key,
                    encode_record(msgspec.structs.replace(record, last_access=when)),
                    db=self._blocks,
                )

    def delete(self, index_keys: Iterable[bytes]) -> int:
        """Remove records by index key; returns how many were there."""
        removed = 0
        with self._mapped_errors("removing records"), self._env.begin(write=True) as txn:
            for index_key in index_keys:
                removed += txn.delete(index_key, db=self._blocks)
        return removed

    def delete_if_current(self, records: Iterable[BlockRecord]) -> int:
        """Remove each record only if the index still holds that very block (same offset,
        length and checksum), so a newer write of the same key survives."""
        removed = 0
        with self._mapped_errors("dropping records"), self._env.begin(write=True) as txn:
            for record in records:
                value = txn.get(record.index_key, db=self._blocks)
                if value is None:
                    continue
                try:
                    stored = decode_record(value)
                except msgspec.DecodeError:
                    stored = None
                if stored is None or (
                    (stored.offset, stored.length, stored.checksum)
                    == (record.offset, record.length, record.checksum)
                ):
                    removed += txn.delete(record.index_key, db=self._blocks)
        return removed

    def get(self, index_key: bytes) -> BlockRecord | None:
        """The record under ``index_key``, or None (also when it does not decode)."""
        with self._env.begin() as txn:
            value = txn.get(index_key, db=self._blocks)
        if value is None:
            return None
        try:
            return decode_record(value)
        except msgspec.DecodeError:
            return None

    def count(self) -> int:
        """Number of block records."""
        with self._env.begin() as txn:
            return txn.stat(self._blocks)["entries"]

    def scan(
        self, progress: Callable[[int], None] | None = None
    ) -> tuple[list[BlockRecord], list[bytes]]:
        """Every record, and the index keys of values that do not decode or do not match
        their key.  ``progress`` is called with counts of entries read as the scan goes."""
        records: list[BlockRecord] = []

        def take(keys: Sequence[bytes], values: Sequence[bytes], bad: list[bytes]) -> None:
            records.extend(decode_chunk(keys, values, bad))

        bad = self.scan_into(take, progress)
        return records, bad

    def scan_into(
        self, take: Callable[[Sequence[bytes], Sequence[bytes], list[bytes]], None],
        progress: Callable[[int], None] | None = None, chunk_entries: int = 0,
    ) -> list[bytes]:
        """``scan``, a chunk of entries at a time into ``take`` (index keys, values and
        the list of bad keys to add to), which decodes them (``decode_chunk``) and keeps
        what it needs: a warm restart of millions of records never holds them all as
        objects.  Returns the index keys of values that do not decode or do not match
        their key.  ``chunk_entries``: entries a chunk (0: the plain scan's)."""
        bad: list[bytes] = []
        size = chunk_entries or _SCAN_CHUNK
        with self._damaged("reading its records"), self._env.begin() as txn:
            # keys and values by two cursors over the same snapshot, in the same order:
            # a list of each, with no (key, value) tuple an entry to make and take apart
            # again (half of the scan's CPU, a tenth of a warm restart's)
            all_keys = txn.cursor(db=self._blocks).iternext(keys=True, values=False)
            all_values = txn.cursor(db=self._blocks).iternext(keys=False, values=True)
            while keys := list(itertools.islice(all_keys, size)):
                values = list(itertools.islice(all_values, len(keys)))
                assert len(values) == len(keys), "two cursors over one snapshot agree"
                take(keys, values, bad)
                if progress is not None:
                    progress(len(keys))
        return bad

    def scan_mapped(
        self, take: Callable[[np.ndarray, np.ndarray, np.ndarray, list[bytes]], None],
        progress: Callable[[int], None] | None = None, chunk_entries: int = 0,
    ) -> list[bytes] | None:
        """``scan_into`` by the data file's pages read in place (``ssd_pages``): ``take``
        is given a chunk's leaf pages (a buffer reused for the next), each entry's
        index key place in it and its value's length.  None where the pages are not
        read so, found before or after some chunks were taken (nothing taken is to be
        kept then: the caller scans by ``scan_into``)."""
        bad: list[bytes] = []
        size = chunk_entries or _SCAN_CHUNK
        with self._damaged("reading its records"), self._env.begin() as txn, \
                mapped_leaves(self.path / "data.mdb", txn.id(),
                              txn.stat(self._blocks)) as leaves:
            if leaves is None:
                return None
            for chunk in leaves.chunks(size):
                if chunk is None:
                    return None
                buf, key_at, lens = chunk
                take(buf, key_at, lens, bad)
                if progress is not None:
                    progress(len(key_at))
        return bad

    # namespaces

    def put_namespace(self, namespace: bytes, identity: bytes) -> None:
        """Store the opaque identity bytes of a namespace."""
        with self._mapped_errors("storing a namespace"), self._env.begin(write=True) as txn:
            txn.put(namespace, identity, db=self._namespaces)

    def delete_namespaces(self, namespaces: list[bytes]) -> int:
        """Forget namespaces' identity bytes, in one transaction (how many were there)."""
        with self._mapped_errors("forgetting namespaces"), \
                self._env.begin(write=True) as txn:
            return sum(bool(txn.delete(ns, db=self._namespaces)) for ns in namespaces)

    def namespaces(self) -> dict[bytes, bytes]:
        """Every namespace id with its identity bytes."""
        with self._damaged("reading its namespaces"), self._env.begin() as txn:
            return dict(txn.cursor(db=self._namespaces))

    # lifecycle

    def flush(self) -> None:
        """Force committed transactions to disk, whatever the sync policy."""
        with self._mapped_errors("syncing"):
            self._env.sync(True)

    def close(self) -> None:
        """Flush and close the environment."""
        try:
            self.flush()
        finally:
            self._env.close()


_SCAN_CHUNK = 4096
_namespace = operator.attrgetter("namespace")
_key = operator.attrgetter("key")


_LMDB_MAGIC = 0xBEEFC0DE
_U16 = struct.Struct("=H")
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_META_BYTES = 152  # page header, then MDB_meta up to mm_txnid (64-bit layout)
_NO_PAGE = (1 << 64) - 1  # an empty database's root
_LEAF, _SUBDATA = 0x02, 0x02  # a page's P_LEAF flag; a node's F_SUBDATA flag


def _not_a_file(data_file: Path) -> bool:
    """Whether something other than a regular file is where the index's data file goes:
    a FIFO there held the daemon's start for ever (``_truncated`` opens it to read, which
    waits for a writer), nothing logged.  Looked at without opening it.  (A directory
    there is LMDB's to refuse, as the tier's other misplaced files are.)"""
    try:
        mode = os.stat(data_file).st_mode
    except FileNotFoundError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _truncated(data_file: Path) -> bool:
    """Whether an LMDB data file ends before a root page its newest meta page names (the
    free and main databases', and the named databases' the main one lists): LMDB maps
    the file and would read past its end (SIGBUS: the daemon killed, nothing logged, at
    every start).  Roots only: a commit writes every page it names, and copy on write
    makes the roots among its newest, which a file cut short loses first; the meta
    page's last page number is no bound (pages allocated and freed within a commit are
    never written, so a sound file may end before it).  A file LMDB cannot read as its
    own is left to it."""
    try:
        with open(data_file, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(2 * 65536)  # both meta pages, at the largest page size
            if len(head) < _META_BYTES or _U32.unpack_from(head, 16)[0] != _LMDB_MAGIC:
                return False
            page = _U32.unpack_from(head, 40)[0]  # the free DB's md_pad: the page size
            if page < 512 or page > 65536 or page & (page - 1):
                return False
            metas = [(_U64.unpack_from(head, at + 144)[0], at) for at in (0, page)
                     if at + _META_BYTES <= len(head)
                     and _U32.unpack_from(head, at + 16)[0] == _LMDB_MAGIC]
            _, meta = max(metas)
            pages = size // page
            free_root, main_root = (_U64.unpack_from(head, meta + at)[0] for at in (80, 128))
            if any(root != _NO_PAGE and root >= pages for root in (free_root, main_root)):
                return True
            if main_root == _NO_PAGE:
                return False
            file.seek(main_root * page)
            return any(root >= pages for root in _named_roots(file.read(page)))
    except (FileNotFoundError, struct.error, ValueError):
        return False


def _named_roots(leaf: bytes) -> list[int]:
    """The root pages of the named databases a main database's leaf page lists (none if
    it is not a leaf: then its branches are left to LMDB)."""
    if len(leaf) < 16 or not _U16.unpack_from(leaf, 10)[0] & _LEAF:
        return []
    lower = _U16.unpack_from(leaf, 12)[0]
    roots = []
    for slot in range(16, lower, 2):
        node = _U16.unpack_from(leaf, slot)[0]
        flags, key_size = _U16.unpack_from(leaf, node + 4)[0], _U16.unpack_from(leaf, node + 6)[0]
        if flags & _SUBDATA:
            root = _U64.unpack_from(leaf, node + 8 + key_size + 40)[0]  # the MDB_db's md_root
            if root != _NO_PAGE:
                roots.append(root)
    return roots


def decode_chunk(keys: Sequence[bytes], values: Sequence[bytes],
                 bad: list[bytes]) -> list[BlockRecord]:
    """A chunk of index entries' records: those that decode and match their key (a
    chunk at a time in C; record by record where one does not), the others' keys added
    to ``bad``."""
    records: list[BlockRecord] | None
    try:
        records = list(map(decode_record, values))
    except msgspec.DecodeError:
        records = None
    if records is None or list(map(operator.add, map(_namespace, records),
                                   map(_key, records))) != list(keys):
        records = []
        _take_one_by_one(keys, values, records, bad)
    return records


def _take_one_by_one(keys: Sequence[bytes], values: Sequence[bytes],
                     records: list[BlockRecord], bad: list[bytes]) -> None:
    """``SSDIndex.scan`` of entries one at a time: each that decodes and matches its key
    to ``records``, the others' keys to ``bad``."""
    for key, value in zip(keys, values):
        try:
            record = decode_record(value)
        except msgspec.DecodeError:
            bad.append(key)
        else:
            if record.namespace + record.key == key:  # ``index_key``, inline
                records.append(record)
            else:
                bad.append(key)
