"""kvstore as an LMCache L2 adapter (LMCache's ``plugin`` adapter type).

Configure LMCache with::

    --l2-adapter '{"type": "plugin", "module_path": "kvstore.integrations.lmcache",
                   "class_name": "KVStoreL2Adapter",
                   "adapter_params": {"endpoint": "ipc:///run/kvstore.sock",
                                      "tenant": "acme", "object_bytes": 262144}}'

LMCache objects are byte strings of up to ``object_bytes`` (LMCache's chunk size in
bytes), so they live in namespaces of their own (layout ``lmcache-object``), one per
LMCache model name, ``cache_salt`` and KV layout (the objects' shapes and dtypes:
``kv_layout``); a slot holds a 16-byte header (magic, length) and the object.  The
chunk hash, ``kv_rank`` and object group make the key.

The adapter keeps LMCache's contract: every call only queues a task; a worker thread,
the only user of its daemon connection, runs the lookups, loads and unlocks in order,
and a store thread with a connection of its own runs the stores (so a slow store never
holds up a lookup or a load queued after it); they signal three distinct event fds
(store, lookup-and-lock, load).  ``delete`` (LMCache's L2 eviction) runs on the store
thread, and is waited for.  Lookup-and-lock pins the
blocks it finds (a daemon pin, renewed by the worker's pings every third of the daemon's
lease while any is held) until ``submit_unlock``; a load pins, copies and unpins.  A
task's keys go to the daemon in requests of at most its per-request key limit (and the
pins of a lookup or a load, of a quarter of its DRAM's slots: see ``_lock_part``).
``close()`` fails the tasks not started (and any submitted later, at once), stops the
threads, releases the locks left, then closes the connections and the event fds.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import os
import queue
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kvstore.client import Client, Held, Namespace
from kvstore.errors import (
    CapacityError,
    ConfigError,
    KVStoreError,
    LimitExceededError,
    UnavailableError,
)
from kvstore.identity import Identity
from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings
from kvstore.integrations.engine_side import (
    acquire_runs,
    checkpoint_fingerprint,
    hub_commit,
    read_blocks,
    release_all,
    store_missing,
)

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger(__name__)

_MAGIC = b"kvsLMC01"
_HEADER = struct.Struct("<8sQ")  # magic, object length
_KEY_DOMAIN = b"kvstore.lmcache"
_MAX_DIM = 1 << 20  # Identity's bound on head_dim and block_tokens
_LEASE_S = 30.0  # the daemon's default lease, for a daemon whose hello did not say


class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of the plugin: where the daemon is and how big objects are."""

    def __init__(self, *, object_bytes: int, endpoint: str | None = None,
                 tenant: str | None = None, token: str | None = None,
                 model_revision: str | None = None, timeout: float = 10.0) -> None:
        self.object_bytes = object_bytes
        self.endpoint = endpoint
        self.tenant = tenant or os.environ.get("KVSTORE_TENANT", "default")
        self.token = token
        self.model_revision = model_revision
        self.timeout = timeout
        self._revisions: dict[str, str] = {}  # worked out per model, once

    def revision_of(self, model_name: str) -> str:
        """The revision of ``model_name``'s weights: ``model_revision`` where given; else
        a fingerprint of the checkpoint directory the name is (LMCache's vLLM
        integration names a model by the path vLLM loaded), or the commit a hub id
        resolves to in the local cache; else "unversioned".  Before, "unversioned"
        always: an engine whose checkpoint was replaced in place loaded the objects the
        old weights computed."""
        if self.model_revision:
            return self.model_revision
        found = self._revisions.get(model_name)
        if found is None:
            found = (checkpoint_fingerprint(model_name) or hub_commit(model_name)
                     or "unversioned")
            self._revisions[model_name] = found
        return found

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVStoreL2AdapterConfig:
        object_bytes = d.get("object_bytes")
        if type(object_bytes) is not int or object_bytes <= 0:
            raise ValueError("object_bytes must be a positive integer (LMCache's chunk "
                             "size in bytes: the largest object this adapter stores)")
        unknown = set(d) - {"object_bytes", "endpoint", "tenant", "token", "model_revision",
                            "timeout"}
        if unknown:
            raise ValueError(f"unknown kvstore adapter parameters: {sorted(unknown)}")
        timeout = d.get("timeout", 10.0)
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout) or timeout <= 0):
            raise ConfigError(f"the kvstore adapter parameter 'timeout' is {timeout!r}: "
                              "it takes a positive number of seconds (per request to "
                              "the daemon)")
        endpoint = d.get("endpoint")
        if endpoint is not None and not isinstance(endpoint, str):
            raise ConfigError(f"the kvstore adapter parameter 'endpoint' is {endpoint!r}: "
                              "it takes text (ipc://PATH or tcp://HOST:PORT)")
        return cls(object_bytes=object_bytes, endpoint=endpoint,
                   tenant=_name_param(d, "tenant"), token=_name_param(d, "token"),
                   model_revision=_name_param(d, "model_revision"), timeout=float(timeout))

    @classmethod
    def help(cls) -> str:
        return ("kvstore L2 adapter parameters:\n"
                "- object_bytes (int, required): the largest object stored (LMCache's "
                "chunk size in bytes)\n"
                "- endpoint (str): the daemon's endpoint (default: KVSTORE_ENDPOINT or "
                "the runtime directory's socket)\n"
                "- tenant (str): the daemon tenant (default: KVSTORE_TENANT or 'default')\n"
                "- token (str): the daemon token (default: KVSTORE_TOKEN)\n"
                "- model_revision (str): the weights' revision (default: a fingerprint "
                "of the model's checkpoint directory, or its hub commit, else "
                "'unversioned')\n"
                "- timeout (float seconds)")


def _name_param(params: dict[str, Any], key: str) -> str | None:
    """An adapter parameter that names something (the tenant, the token, the weights'
    revision): text, a whole number taken as its text, or None.  Anything else was
    taken as its ``str()`` (a list became the revision "['r']"), or failed at the first
    request with a header error naming no parameter (a tenant of 5)."""
    value = params.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"the kvstore adapter parameter {key!r} is {value!r} "
                      f"({type(value).__name__}): it takes text or a whole number")


def object_identity(model_name: str, cache_salt: str, config: KVStoreL2AdapterConfig,
                    layout: str | None = None) -> Identity:
    """The namespace of one LMCache model's objects of one KV layout (``kv_layout``;
    None: objects of bytes that name none) under one cache salt.

    A slot is ``2 * head_dim * block_tokens`` bytes of uint8 (one layer, one head):
    the header plus ``object_bytes``, rounded up to even (``_slot_shape``).
    """
    tokens, head_dim = _slot_shape((_HEADER.size + config.object_bytes + 1) // 2)
    return Identity(model=model_name, model_revision=config.revision_of(model_name),
                    tenant=config.tenant, kv_dtype="uint8", num_layers=1, num_kv_heads=1,
                    head_dim=head_dim, block_tokens=tokens,
                    layout="lmcache-object" + (f";{layout}" if layout else ""),
                    salt=cache_salt)


def _slot_shape(half: int) -> tuple[int, int]:
    """``(block_tokens, head_dim)``, each at most Identity's bound, whose product holds
    ``half``: exactly where ``half`` factors so (the fewest tokens: the shape objects
    were always stored under), else ``half`` rounded up to a multiple of a power of two.
    Half an object's slot may have a prime factor past the bound (a DeepSeek-V3 chunk of
    256 tokens, 17,989,632 bytes, has 1,124,353): no exact shape is a valid identity."""
    exact = next((t for t in range(1, min(half, _MAX_DIM) + 1)
                  if half % t == 0 and half // t <= _MAX_DIM), None)
    if exact is not None:
        return exact, half // exact
    tokens = 1 << max(0, math.ceil(math.log2(half / _MAX_DIM)))
    return tokens, -(-half // tokens)


@functools.lru_cache(maxsize=256)
def kv_layout(shapes: tuple[Any, ...], dtypes: tuple[Any, ...]) -> str | None:
    """The text that names a KV layout in a namespace: each tensor's dtype and shape
    (``bfloat16[2,32,256,1024]``, joined by ``+``; a digest of them past 256
    characters), from a memory object's or a ``MemoryLayoutDesc``'s shapes and
    dtypes.  None where they name no KV layout: none given (LMCache's benchmark passes
    an empty one to lookups), or one flat buffer of bytes (its serde wrapper's and its
    benchmark's objects), whose objects keep the namespace they always had.  Before,
    no object's namespace named its layout: engines of one model whose KV was fp16 and
    bf16 (or of other shapes, as many bytes) loaded each other's objects."""
    parts = [f"{str(dtype).removeprefix('torch.')}[{','.join(map(str, shape))}]"
             for shape, dtype in zip(shapes, dtypes, strict=True)]
    if not parts or (len(shapes) == 1 and len(shapes[0]) == 1
                     and str(dtypes[0]).removeprefix("torch.") == "uint8"):
        return None
    return _bounded("+".join(parts))


def _bounded(text: str) -> str:
    """A layout's name as a namespace keeps it: a digest of it past 256 characters (an
    identity's text fields are of 512 characters at most)."""
    if len(text) > 256:
        return "blake2b:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    return text


def _object_layout(obj: MemoryObj) -> str | None:
    """A memory object's KV layout (``kv_layout``): its shapes and dtypes, or the one
    shape and dtype of an object made without them."""
    meta = getattr(obj, "meta", None)
    if meta is None:  # (not one of LMCache's objects: its bytes name no layout)
        return None
    if meta.shapes is not None and meta.dtypes is not None:
        return kv_layout(tuple(meta.shapes), tuple(meta.dtypes))
    return kv_layout((meta.shape,), (meta.dtype,))


def object_key(key: ObjectKey) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=_KEY_DOMAIN)
    h.update(struct.pack("<qi", key.kv_rank, key.object_group_id))
    h.update(key.chunk_hash)
    return h.digest()


@dataclass
class _Task:
    kind: str                     # store | lookup | load | unlock | delete | stop
    task_id: L2TaskId
    keys: list[ObjectKey]
    objects: list[MemoryObj] | None = None
    descs: dict[int, MemoryLayoutDesc] | None = None  # a lookup's layouts, per group
    done: threading.Event | None = None  # a delete's caller waits on it


def serde_layout(config: Any) -> str | None:
    """The layout that names an adapter's objects when LMCache serializes them for it
    (``serde_config`` set on the adapter's config: LMCache then wraps the adapter in its
    ``SerdeL2AdapterWrapper``), None when it does not.  Such an adapter is handed the
    serialized bytes to store and load, but the engine's own layout to look up: named
    by each, every lookup missed the objects stored.  The serializer and its settings
    name them instead, for all three."""
    serde = getattr(config, "serde_config", None)
    if serde is None:
        return None
    settings = ",".join(f"{k}={v}" for k, v in sorted((serde.kwargs or {}).items()))
    return _bounded(f"serde:{serde.type}" + (f"({settings})" if settings else ""))


def _by_namespace(task: _Task, serde: str | None = None
                  ) -> dict[tuple[str, str, str | None], list[int]]:
    """Positions of a task's keys grouped by namespace (model, salt and KV layout), in
    order.  The layout is the objects' for a store or a load, and for a lookup the one
    LMCache gives for the key's object group (the layout of the objects it loads); or,
    for all, ``serde``'s (``serde_layout``)."""
    layouts: list[str | None]
    if serde is not None:
        layouts = [serde] * len(task.keys)
    elif task.objects is not None:
        layouts = [_object_layout(obj) for obj in task.objects]
    else:
        descs = task.descs or {}
        layouts = [None if (desc := descs.get(key.object_group_id)) is None
                   else kv_layout(tuple(desc.shapes), tuple(desc.dtypes))
                   for key in task.keys]
    groups: dict[tuple[str, str, str | None], list[int]] = defaultdict(list)
    for i, (key, layout) in enumerate(zip(task.keys, layouts)):
        groups[(key.model_name, key.cache_salt, layout)].append(i)
    return groups


class KVStoreL2Adapter(L2AdapterInterface):
    """An LMCache L2 adapter that keeps objects in a kvstore daemon."""

    def __init__(self, config: KVStoreL2AdapterConfig | dict[str, Any],
                 l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)  # the daemon evicts by its own policy
        if isinstance(config, dict):
            config = KVStoreL2AdapterConfig.from_dict(config)
        self._config = config
        self._serde = serde_layout(config)  # (set by LMCache's parse, before it makes us)
        # The worker thread is the link's only user, but for this first connection: here,
        # so a wrong endpoint fails adapter creation rather than every task.
        self._link = DaemonLink(DaemonSettings(config.endpoint, config.tenant, config.token,
                                               config.timeout))
        self._lease_s = _lease_of(self._link.connect())
        self._store_link = DaemonLink(self._link.settings)  # the store thread's own
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the result dicts and the id counter
        self._store_results: dict[L2TaskId, L2StoreResult] = {}
        self._lookup_results: dict[L2TaskId, Bitmap] = {}
        self._load_results: dict[L2TaskId, Bitmap] = {}
        # Worker-thread state: the pins held for lookup-and-lock, per LMCache key, and
        # per pin how many of its keys are still locked.  Keyed by the whole ObjectKey:
        # object_key() leaves out the model, salt and layout (they pick the namespace),
        # so two models' or two salts' same chunk share it, and an unlock of one would
        # release the other's pin.  Pins are keyed by the Held, not by the daemon's pin
        # id, which a daemon restarted on the endpoint hands out again.
        self._pins_by_key: dict[ObjectKey, list[Held]] = defaultdict(list)
        self._pin_keys_left: dict[Held, int] = {}
        # Store-thread state: per model, salt and object group, the layout and size of
        # its objects (``delete``, given keys alone, finds them by it): ``_note_stored``
        self._stored_as: dict[tuple[str, str, int], tuple[str | None, int]] = {}
        self._pinged_at = time.monotonic()
        # Per thread (by name), the error of its last task if that raised or met a
        # daemon failure (or of the worker's last ping), until a later task on the thread
        # completes without one (or a ping answers): report_status is unhealthy while
        # any stands, and shows the latest error anyway.
        self._failing: dict[str, str] = {}
        self._troubles: dict[str, str] = {}  # per thread, a failure its task met
        self._last_error = ""
        self._closed = self._efds_closed = False  # (under the lock)
        self._tasks: queue.Queue[_Task] = queue.Queue()
        self._store_tasks: queue.Queue[_Task] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="kvstore-l2", daemon=True)
        self._worker.start()
        self._storer = threading.Thread(target=self._run_stores, name="kvstore-l2-stores",
                                        daemon=True)
        self._storer.start()

    # -- event fds ------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- submissions (any thread) ---------------------------------------------------------
    def _submit(self, kind: str, keys: list[ObjectKey], objects: list[MemoryObj] | None = None,
                descs: dict[int, MemoryLayoutDesc] | None = None,
                done: threading.Event | None = None) -> L2TaskId:
        if objects is not None and len(objects) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        with self._lock:
            task = _Task(kind, next(self._ids), list(keys), objects,
                         None if descs is None else dict(descs), done)
            if not self._closed:
                writes = kind in ("store", "delete")  # (in order, on the store thread)
                (self._store_tasks if writes else self._tasks).put(task)
                return task.task_id
        self._fail(task)  # a closed adapter answers at once: nothing is ever run
        return task.task_id

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("store", keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:  # emptied, not swapped: the store thread may hold it to publish
            done = dict(self._store_results)
            self._store_results.clear()
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        return self._submit("lookup", keys, descs=group_layout_descs)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookup_results.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._submit("unlock", keys)

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove objects (LMCache's L2 eviction: ``IsolatedLRU``, for a salt over its
        quota or with none), then tell LMCache's listeners; on the store thread, after
        the stores queued before it (at once if asked there: by a listener told of a
        store, queued, it waited on its own thread for the whole wait)."""
        done = threading.Event()
        if threading.current_thread() is self._storer:
            return self._do_delete(_Task("delete", -1, list(keys), None, None, done))
        self._submit("delete", keys, done=done)
        if not done.wait(self._config.timeout * 3):
            logger.warning("kvstore L2 adapter: a delete of %d keys goes on", len(keys))

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("load", keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._load_results.pop(task_id, None)

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": (self._worker.is_alive() and self._storer.is_alive()
                               and not self._failing),
                "type": "KVStoreL2Adapter", "endpoint": self._link.endpoint,
                "pinned_keys": len(self._pins_by_key), "last_error": self._last_error,
                "queued_tasks": self._tasks.qsize() + self._store_tasks.qsize()}

    def close(self) -> None:
        """Fail the tasks not started (and any submitted from now on), let the threads
        finish the ones they run, release the locks left, then close the connections
        and the event fds."""
        with self._lock:
            self._closed = True
        for thread, tasks in ((self._worker, self._tasks),
                              (self._storer, self._store_tasks)):
            while True:  # (a backlog ran whole first, and tasks queued behind the stop
                try:     # were never answered: LMCache waited for them for good)
                    queued = tasks.get_nowait()
                except queue.Empty:
                    break
                self._fail(queued)
            if thread.is_alive():
                tasks.put(_Task("stop", -1, []))
                thread.join()
        # LMCache unlocks nothing after close: release the locks left, so the connection's
        # goodbye ends the session now (a client holding pins at close sends none, and
        # they stayed pinned for the daemon's lease)
        release_all(list(self._pin_keys_left))
        self._pin_keys_left.clear()
        self._pins_by_key.clear()
        self._link.close()
        self._store_link.close()
        with self._lock:
            self._efds_closed = True
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()

    def __repr__(self) -> str:
        return (f"KVStoreL2Adapter({self._link.endpoint}, pinned_keys="
                f"{len(self._pins_by_key)}, queued={self._tasks.qsize()})")

    # -- the worker thread ----------------------------------------------------------------
    def _run(self) -> None:
        self._serve(self._tasks, keep_alive=True)

    def _run_stores(self) -> None:
        self._serve(self._store_tasks, keep_alive=False)

    def _serve(self, tasks: queue.Queue[_Task], *, keep_alive: bool) -> None:
        while True:
            wait: float | None = None
            if keep_alive:  # the next ping is due a third of the lease after the last
                wait = max(0.0, self._pinged_at + self._lease_s / 3 - time.monotonic())
            try:
                task = tasks.get(timeout=wait)
            except queue.Empty:
                task = None
            # On time whether or not tasks keep coming: not every task calls the daemon
            # (an unlock of nothing held), and one that does renews the lease only then.
            if keep_alive and time.monotonic() >= self._pinged_at + self._lease_s / 3:
                self._keep_pins_alive()
            if task is None:
                continue
            if task.kind == "stop":
                return
            handler: Callable[[_Task], None] = getattr(self, f"_do_{task.kind}")
            try:
                handler(task)
            except Exception as exc:  # never let one task kill the worker
                logger.exception("kvstore L2 adapter: %s task failed", task.kind)
                self._failed(f"{type(exc).__name__}: {exc}")
                self._fail(task)
            else:  # (for an unlock: the others did before their result)
                if self._troubles.get(threading.current_thread().name) is None:
                    self._recovered()
            self._troubles.pop(threading.current_thread().name, None)

    def _failed(self, error: str) -> None:
        self._last_error = self._failing[threading.current_thread().name] = error

    def _recovered(self) -> None:
        self._failing.pop(threading.current_thread().name, None)

    def _daemon_failed(self, link: DaemonLink | None, what: str, error: Exception) -> None:
        """A failure the running task met and took as misses (told to ``link``, if
        any): its thread reports unhealthy once the task is done, until one that meets
        none.  DRAM out of room for pins is no failure of the adapter's."""
        if link is not None and isinstance(error, KVStoreError):
            link.failed(what, error)
        if not isinstance(error, CapacityError):
            self._troubles[threading.current_thread().name] = \
                f"{what}: {type(error).__name__}: {error}"

    def _keep_pins_alive(self) -> None:
        self._pinged_at = time.monotonic()
        client = self._link.client() if self._pin_keys_left else None
        if client is not None:
            try:
                client.ping()
            except KVStoreError as exc:
                self._failed(str(exc))
                self._link.failed("ping", exc)
            else:
                self._recovered()

    def _fail(self, task: _Task) -> None:
        if task.done is not None:
            task.done.set()
        if task.kind == "store":
            self._finish(self._store_results, task.task_id,
                         L2StoreResult(False, 0), self._store_efd, failed=True)
        elif task.kind in ("lookup", "load"):
            results = self._lookup_results if task.kind == "lookup" else self._load_results
            efd = self._lookup_efd if task.kind == "lookup" else self._load_efd
            self._finish(results, task.task_id, Bitmap(len(task.keys)), efd, failed=True)

    def _finish(self, results: dict[L2TaskId, Any], task_id: L2TaskId, value: Any,
                efd: Any, *, failed: bool = False) -> None:
        """Publish a task's result; a completed task's thread is healthy again first
        (or failing, if the task met a daemon failure), so that report_status agrees
        with the result as soon as LMCache sees it."""
        trouble = self._troubles.get(threading.current_thread().name)
        if trouble is not None:
            self._failed(trouble)
        elif not failed:
            self._recovered()
        with self._lock:
            results[task_id] = value
            if not self._efds_closed:
                efd.notify()

    def _namespace(self, where: tuple[str, str, str | None], link: DaemonLink | None = None,
                   *, holding: bool = False) -> Namespace | None:
        """The namespace of a model, salt and KV layout on ``link`` (the worker's by
        default; ``holding``: the task holds pins through it); None while the daemon is
        failing (a failure of the task's)."""
        link = link or self._link
        failures = link.failures
        model, salt, layout = where

        def identity() -> Identity:
            return object_identity(model, salt, self._config, layout)

        ns = link.namespace(where, identity)
        if (ns is None and link.failures > failures
                and isinstance(link.last_error, LimitExceededError)
                and (link is self._store_link or not (holding or self._pin_keys_left))):
            # The session has as many namespaces open as the daemon allows (one per
            # model, salt and layout, and none is ever closed: past 1024 salts, say, every
            # new one failed for the adapter's life).  A new session opens them again as
            # they are used; a link holding locks keeps its session (a miss this time).
            link.close()
            ns = link.namespace(where, identity)
        if ns is None:
            self._daemon_failed(None, f"namespace of {where}", UnavailableError(
                f"no namespace on the daemon at {link.endpoint}: it did not answer, "
                "refused the connection, or cannot hold it (see the log)"))
        return ns

    def _do_store(self, task: _Task) -> None:
        assert task.objects is not None
        objects = task.objects
        stored = 0
        ok = True
        for where, positions in _by_namespace(task, self._serde).items():
            ns = self._namespace(where, self._store_link)
            if ns is None:
                ok = False
                continue
            for part in _chunks(positions, ns.client.max_keys):
                sizes = [objects[i].get_size() for i in part]
                too_big = _too_big(sizes, self._config.object_bytes)
                if too_big is not None:
                    self._daemon_failed(None, "L2 store", too_big)
                    ok = False
                    continue

                written: set[int] = set()
                # The keys are not a chain: no lookup, every object is written.
                result = store_missing(ns, [object_key(task.keys[i]) for i in part],
                                       _writer(objects, part, sizes, written), lookup=False)
                if result.error is not None:
                    self._daemon_failed(self._store_link, "L2 store", result.error)
                    ok = False
                    continue
                # (fewer where a key another writer was storing was not stored by then:
                # neither are those after it in the reservation, a later miss each).
                # LMCache counts salts' quotas by what it is told: those written now (all, before)
                new = [j for j in range(result.present) if j in written]
                stored += sum(sizes[j] for j in new)
                _note_stored(self._stored_as, where[2], [task.keys[i] for i in part], sizes)
                self._notify_keys_stored([task.keys[part[j]] for j in new],
                                         [sizes[j] for j in new])
        self._finish(self._store_results, task.task_id, L2StoreResult(ok, stored),
                     self._store_efd)

    def _do_lookup(self, task: _Task) -> None:
        found = Bitmap(len(task.keys))
        pinned: list[tuple[list[int], Held]] = []  # each pin, with its keys' positions
        try:
            for where, positions in _by_namespace(task, self._serde).items():
                ns = self._namespace(where, holding=bool(pinned))
                if ns is None:
                    continue  # misses
                self._lease_s = _lease_of(ns.client)  # (a new session's, after a reconnect)
                for part in _chunks(positions, _lock_part(ns)):
                    try:
                        runs = acquire_runs(ns, [object_key(task.keys[i]) for i in part])
                    except CapacityError as exc:  # DRAM holds no more pins: the rest miss
                        logger.info("kvstore L2 adapter: locked what DRAM holds (%s)", exc)
                        break
                    except KVStoreError as exc:  # the namespace's keys left are misses
                        self._daemon_failed(self._link, "L2 lookup", exc)
                        if not self._link.holds(ns.client):
                            # the link let the client go (a session the daemon ended, one
                            # that did not answer): the pins taken through it (earlier
                            # parts, earlier namespaces) went with it, or stay only till
                            # its lease ends, and are no locks
                            pinned[:] = [(at, held) for at, held in pinned
                                         if self._link.holds(held.ns.client)]
                        break
                    pinned.extend((part[start:start + len(held.keys)], held)
                                  for start, held in runs)
        except BaseException:  # LMCache is told nothing was locked: none may stay pinned
            release_all(held for _, held in pinned)
            raise
        for held_positions, held in pinned:
            self._pin_keys_left[held] = len(held_positions)
            for i in held_positions:
                found.set(i)
                self._pins_by_key[task.keys[i]].append(held)
        self._finish(self._lookup_results, task.task_id, found, self._lookup_efd)

    def _do_delete(self, task: _Task) -> None:
        try:
            for where, (keys, sizes) in _stored_groups(task.keys, self._stored_as).items():
                ns = self._namespace(where, self._store_link)
                try:  # (no namespace: they stay, and LMCache asks again at its next pass)
                    if ns is not None:
                        _evict(ns, [object_key(k) for k in keys])
                        self._notify_keys_deleted(keys, sizes)
                except KVStoreError as exc:
                    self._daemon_failed(self._store_link, "L2 delete", exc)
        finally:
            assert task.done is not None, "a delete task has its caller's event"
            task.done.set()

    def _do_unlock(self, task: _Task) -> None:
        for key in task.keys:
            pins = self._pins_by_key.get(key)
            if not pins:
                continue
            held = pins.pop()
            if not pins:
                del self._pins_by_key[key]
            self._pin_keys_left[held] -= 1
            if self._pin_keys_left[held] == 0:
                del self._pin_keys_left[held]
                release_all([held])

    def _do_load(self, task: _Task) -> None:
        assert task.objects is not None
        objects = task.objects
        loaded = Bitmap(len(task.keys))
        for where, positions in _by_namespace(task, self._serde).items():
            ns = self._namespace(where)
            if ns is None:
                continue  # not loaded: LMCache recomputes

            # In parts, as a lookup pins (``_lock_part``); each part's pins are
            # released by read_blocks, whatever happens.
            for part in _chunks(positions, _lock_part(ns)):

                def copy(j: int, slot: memoryview, part: list[int] = part) -> None:
                    if _copy_out(slot, objects[part[j]]):
                        loaded.set(part[j])

                result = read_blocks(ns, [object_key(task.keys[i]) for i in part], copy,
                                     runs=True)
                if result.error is not None:  # the namespace's keys left are not loaded
                    self._daemon_failed(self._link, "L2 load", result.error)
                    break
        self._finish(self._load_results, task.task_id, loaded, self._load_efd)


def _evict(ns: Namespace, keys: list[bytes]) -> None:
    """Remove the blocks of ``keys`` (and those below them), in requests the daemon takes."""
    for start in range(0, len(keys), ns.client.max_keys):
        ns.evict(keys[start:start + ns.client.max_keys])


def _too_big(sizes: list[int], object_bytes: int) -> ValueError | None:
    """The error of objects larger than slots hold (logged), None if none is."""
    if max(sizes) <= object_bytes:
        return None
    logger.warning("kvstore L2 adapter: an object of %d bytes exceeds object_bytes=%d; "
                   "not stored", max(sizes), object_bytes)
    return ValueError(f"an object of {max(sizes)} bytes exceeds object_bytes={object_bytes}")


def _writer(objects: list[MemoryObj], part: list[int], sizes: list[int],
            written: set[int]) -> Callable[[Sequence[memoryview], int], None]:
    """``store_missing``'s fill of the objects at ``part``'s positions (a slot: header,
    then the object); adds to ``written`` those of ``part`` it wrote (not those held)."""
    def fill(slots: Sequence[memoryview], first: int) -> None:
        written.update(range(first, first + len(slots)))
        for buf, i, size in zip(slots, part[first:], sizes[first:]):
            _HEADER.pack_into(buf, 0, _MAGIC, size)
            buf[_HEADER.size:_HEADER.size + size] = _bytes_of(objects[i])
    return fill


def _copy_out(slot: memoryview, obj: MemoryObj) -> bool:
    """Copy a slot's object into a load buffer of its size (else none, and False)."""
    magic, length = _HEADER.unpack_from(slot, 0)
    if magic != _MAGIC or length != obj.get_size():
        logger.warning("kvstore L2 adapter: stored object holds %d bytes, the load "
                       "buffer %d; not loaded", length, obj.get_size())
        return False
    _bytes_of(obj)[:] = slot[_HEADER.size:_HEADER.size + length]
    return True


STORED_GROUPS = 1 << 16  # (model, salt, group)s whose layout ``delete`` remembers


def _note_stored(stored_as: dict[tuple[str, str, int], tuple[str | None, int]],
                 layout: str | None, keys: list[ObjectKey], sizes: list[int]) -> None:
    """Remember the layout and size each key's (model, salt, group) was stored with, the
    latest ``STORED_GROUPS`` of them (a delete of an older one's keys finds no namespace:
    they stay, and LMCache asks again, as for any it cannot delete)."""
    for k, size in zip(keys, sizes):
        group = (k.model_name, k.cache_salt, k.object_group_id)
        stored_as.pop(group, None)  # (to the newest end)
        stored_as[group] = (layout, size)
    while len(stored_as) > STORED_GROUPS:
        del stored_as[next(iter(stored_as))]


def _stored_groups(keys: list[ObjectKey],
                   stored_as: dict[tuple[str, str, int], tuple[str | None, int]]
                   ) -> dict[tuple[str, str, str | None], tuple[list[ObjectKey], list[int]]]:
    """The keys of a delete by namespace (model, salt and the layout their object group
    was stored in), each with its objects' size; keys of groups never stored here (none
    LMCache's eviction tracks) are left out."""
    groups: dict[tuple[str, str, str | None], tuple[list[ObjectKey], list[int]]] = {}
    for key in keys:
        known = stored_as.get((key.model_name, key.cache_salt, key.object_group_id))
        if known is not None:
            where = (key.model_name, key.cache_salt, known[0])
            group = groups.setdefault(where, ([], []))
            group[0].append(key)
            group[1].append(known[1])
    return groups


def _bytes_of(obj: MemoryObj) -> memoryview:
    """The object's logical bytes as a plain byte view (``byte_array`` is a ctypes
    buffer whose item format does not match arena slots)."""
    return np.frombuffer(obj.byte_array, dtype=np.uint8).data


def _lock_part(ns: Namespace) -> int:
    """How many keys a lookup pins at once: at most the daemon's per-request limit (more
    are refused whole), and a quarter of the DRAM arena's slots.  Pinning a block kept
    on SSD brings it back to DRAM, and one acquire of more such blocks than DRAM has room
    for was refused whole, so a lookup past DRAM's size locked nothing; in parts, those
    that fit stay locked, and the first refused ends the lookup."""
    slots = ns.arena[1] // ns.slot_bytes if ns.arena[1] and ns.slot_bytes else 0
    return max(1, min(ns.client.max_keys, slots // 4 or ns.client.max_keys))


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _lease_of(client: Client) -> float:
    """How long the daemon keeps a silent session's pins."""
    return client.hello.lease_seconds if client.hello is not None else _LEASE_S

