"""kvstore as an SGLang HiCache storage backend (SGLang's ``dynamic`` backend).

Launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
        "endpoint": "ipc:///run/kvstore.sock", "tenant": "acme"}'

HiCache moves whole host-memory pages: a page is a block of ``page_size`` tokens, and
its key is SGLang's chained page hash (which already stands for the whole prefix).  The
backend derives a 16-byte kvstore key from it and keeps the page's bytes in SGLang's
flat page order, so the namespace's layout names that order (``sglang:2LTHD`` for the
``layer_first`` and ``page_first_direct`` host layouts, ``sglang:2TLHD`` for
``page_first``); MHA pages of different tensor-parallel ranks live in different
namespaces, MLA pages (replicated across ranks) in one.

Interfaces: ``exists``/``batch_exists`` (longest cached prefix, one lookup), the tensor
interface ``get``/``batch_get``/``set``/``batch_set``, and the v1 interface
``batch_get_v1``/``batch_set_v1`` (``interface_v1``: pages copied straight between
SGLang's host pool and the daemon's shared-memory slots, no intermediate buffers
besides one page).  The v2 pool-transfer interface (hybrid Mamba/SWA/DSA pools) is
not implemented.  The namespace's KV format comes from the host pool, so it is opened
in ``register_mem_pool_host``, which SGLang calls right after creating the backend.

The calls wait for the daemon, and need not do otherwise: HiCache makes them from its
own threads, never from a forward step (``batch_set_v1`` from its backup thread, which
keeps the host pages locked until the call returns and acks it; the gets from its
prefetch threads, which the scheduler waits for at most its prefetch timeout, policy
``timeout``, the default, or not at all, ``best_effort``).  Returning from a set before
the bytes are in would free pages still to be read.  A daemon that stops answering
costs one ``timeout`` on those threads, then nothing while ``DaemonLink`` backs off.
Those threads take turns on the one connection (a lock: a client is not thread-safe).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import math
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstore.client import Namespace
from kvstore.errors import CapacityError, ConfigError, KVStoreError, UnavailableError
from kvstore.identity import DTYPE_BYTES, Identity
from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings
from kvstore.integrations.engine_side import (
    blocks_per_request,
    checkpoint_fingerprint,
    hub_commit,
    read_blocks,
    settings_tag,
    store_missing,
)

logger = logging.getLogger(__name__)

_KEY_DOMAIN = b"kvstore.sglang"
_PAGE_ORDER = {"layer_first": "2LTHD", "page_first_direct": "2LTHD", "page_first": "2TLHD"}


# The extra-config keys the backend reads (the class's doc), and those SGLang's own code
# reads from the same dict and leaves in it (the dynamic factory's three, the zero-copy
# switch, the dynamic backend's host ``allocator``; the prefetch settings and
# ``tp_lcm_size`` it takes out before)
EXTRA_KEYS = frozenset({"endpoint", "tenant", "token", "timeout", "model_name",
                        "model_revision", "model_path", "salt", "kv_cache_dtype"})
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                          "allocator"})
_TEXT_KEYS = frozenset({"endpoint", "model_name", "model_path", "kv_cache_dtype"})
_NAME_KEYS = frozenset({"tenant", "token", "model_revision", "salt"})  # text, or a number


def check_extra(extra: dict[str, Any]) -> None:
    """Refuse an extra config the backend would misread, naming the key: a value of the
    wrong type (a ``timeout`` of "10s" raised float()'s bare ValueError; one of 0 or
    below, or a salt given as a list, was taken), or a misspelling of one of its keys
    (a ``tennant`` or ``model_revison`` was ignored without a word: the engine's pages
    went to the default tenant, or were shared with other weights').  Keys that are
    neither its own, SGLang's, nor a near miss of its own are warned of and ignored."""
    for key in sorted(set(extra) & EXTRA_KEYS):
        value = extra[key]
        if value is None:
            continue
        if key == "timeout":
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"the kvstore HiCache backend's extra config key "
                                  f"'timeout' is {value!r}: it takes a positive number of "
                                  f"seconds (per request to the daemon)")
        elif not isinstance(value, str) and (
                key in _TEXT_KEYS or isinstance(value, bool) or not isinstance(value, int)):
            kind = "text" if key in _TEXT_KEYS else "text or a whole number"
            raise ConfigError(f"the kvstore HiCache backend's extra config key {key!r} is "
                              f"{value!r} ({type(value).__name__}): it takes {kind}")
    unknown = sorted(set(extra) - EXTRA_KEYS - _SGLANG_KEYS)
    for key in unknown:
        near = difflib.get_close_matches(key, sorted(EXTRA_KEYS), n=1, cutoff=0.75)
        if near:
            raise ConfigError(f"the kvstore HiCache backend's extra config has {key!r}: "
                              f"did you mean {near[0]!r}? (it takes {sorted(EXTRA_KEYS)})")
    if unknown:
        logger.warning("kvstore HiCache storage: extra config keys %s are not the "
                       "backend's and are ignored; it takes %s", unknown, sorted(EXTRA_KEYS))


def page_key(key: str) -> bytes:
    """The kvstore key of an SGLang page hash."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=_KEY_DOMAIN).digest()


def page_identity(config: HiCacheStorageConfig, host: Any, tenant: str,
                  extra: dict[str, Any]) -> Identity:
    """The namespace of this engine's pages, from SGLang's host pool and storage config.

    Everything that makes two engines' pages of one prefix differ is in it: the model
    and its weights (``_model_and_revision``), the KV format (``_kv_dtype``: the host
    pool holds fp8 as bytes), the page layout, and the shard of every page a rank
    holds: its tensor-parallel rank for MHA, its pipeline stage, its attention
    context-parallel rank, its decode-context-parallel shard (each of those ranks holds
    a different slice of every page: SGLang's own backends key by them too)."""
    dtype = _kv_dtype(host, extra)
    layout = f"sglang:{_PAGE_ORDER.get(host.layout, host.layout)}"
    page = host.get_dummy_flat_data_page()
    page_bytes = page.numel() * page.element_size()
    if getattr(config, "should_split_heads", False):
        raise ValueError("kvstore cannot store the pages of mixed tensor-parallel sizes "
                         "(tp_lcm_size with heads split per rank): leave tp_lcm_size unset")
    if config.is_mla_model:
        # One latent vector per token: expressed as one "head" of half its width, K and V.
        heads, head_dim = 1, (page_bytes // (host.layer_num * host.page_size
                                              * DTYPE_BYTES[dtype])) // 2
        layout += ";mla"
    else:
        heads, head_dim = host.head_num, host.head_dim
        if config.tp_size > 1:
            layout += f";tp={config.tp_rank}/{config.tp_size}"
    if config.pp_size > 1:
        layout += f";pp={config.pp_rank}/{config.pp_size}"
    cp_size = getattr(config, "attn_cp_size", 1) or 1
    if cp_size > 1:
        layout += f";cp={config.attn_cp_rank}/{cp_size}"
    dcp_size = getattr(config, "dcp_size", 1) or 1
    if dcp_size > 1:
        layout += (f";dcp={config.dcp_rank}/{dcp_size}"
                   f";page={getattr(config, 'logical_page_size', None)}")
    model, revision = _model_and_revision(config, host, extra)
    # (what the server's arguments change of the KV: ``engine_side.settings_tag``)
    revision += settings_tag(_server_arg("json_model_override_args"),
                             _server_arg("quantization"))
    revision += adapters_tag(_server_arg("lora_paths"))
    identity = Identity(
        model=model, model_revision=revision, tenant=tenant,
        kv_dtype=dtype, num_layers=host.layer_num, num_kv_heads=heads, head_dim=head_dim,
        block_tokens=host.page_size, layout=layout, salt=str(extra.get("salt", "")))
    if identity.block_bytes != page_bytes:
        raise ValueError(f"an SGLang page holds {page_bytes} bytes, the identity "
                         f"{identity} says {identity.block_bytes}")
    return identity


# SGLang's --kv-cache-dtype names of the fp8 formats its pools hold as bytes
_FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e4m3fn": "float8_e4m3fn",
        "float8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
        "float8_e5m2": "float8_e5m2"}


def _kv_dtype(host: Any, extra: dict[str, Any]) -> str:
    """The KV cache's element format.  SGLang's pools keep fp8 KV as ``uint8`` (its
    index_put has no fp8), so the host pool's dtype does not tell e4m3 from e5m2: the
    format then comes from the extra config's ``kv_cache_dtype``, or the server's
    ``--kv-cache-dtype`` (on ROCm, the GPU's own fp8 format: ``_hip_fp8_format``);
    without either, pages of bytes are refused rather than shared between engines of
    different formats."""
    dtype = str(host.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"kvstore cannot store KV pages of dtype {host.dtype}")
    if dtype != "uint8":
        return dtype
    named = str(extra.get("kv_cache_dtype") or _server_arg("kv_cache_dtype") or "")
    if named in _FP8:
        return _hip_fp8_format() if _on_hip() else _FP8[named]
    raise ValueError(
        "SGLang's host pool holds this engine's KV as bytes (uint8: how it keeps fp8), so "
        "its format is unknown and pages of different formats would be shared; set "
        '"kv_cache_dtype" ("fp8_e4m3" or "fp8_e5m2") in the backend\'s extra config'
        + (f" (the server says {named!r})" if named else ""))


def _on_hip() -> bool:
    """Whether SGLang runs on ROCm, as SGLang itself decides (its ``is_hip()``)."""
    from sglang.srt.utils import is_hip
    return bool(is_hip())


def _hip_fp8_format() -> str:
    """The format SGLang on ROCm keeps fp8 KV in, whichever fp8 ``--kv-cache-dtype``
    (its ``configure_kv_cache_dtype``: "natively supported format"): its fp8 kernels'
    ``fp8_dtype``, float8_e4m3fnuz on MI300 (gfx94x), float8_e4m3fn on later GPUs.
    Before, the flag named the format there too: an MI300 engine's e4m3fnuz pages were
    shared with NVIDIA engines' e4m3fn ones, and an AMD engine's e4m3 pages under
    ``fp8_e5m2`` with NVIDIA engines' e5m2 ones (each read the other's bits wrongly)."""
    try:
        from sglang.kernels.ops.quantization.fp8_kernel import fp8_dtype
    except ImportError:
        try:  # (where SGLang kept its fp8 kernels before)
            from sglang.srt.layers.quantization.fp8_kernel import fp8_dtype
        except ImportError as exc:
            raise ValueError("kvstore cannot tell which fp8 format SGLang keeps KV in on "
                             f"ROCm (its fp8_dtype is not found: {exc}); pages of other "
                             "formats would be shared") from exc
    return str(fp8_dtype).removeprefix("torch.")


def _model_and_revision(config: HiCacheStorageConfig, host: Any,
                        extra: dict[str, Any]) -> tuple[str, str]:
    """The model's name and a revision of its weights.

    The name is the extra config's ``model_name``; else the model the server loaded
    (its ``--model-path``), with the host pool's format tag as SGLang appends it; else
    the name SGLang passes.  That name is the server's ``--served-model-name``, an
    alias two deployments of different weights may share (a canary): with no revision
    found, they loaded each other's pages.  The revision is the extra config's
    ``model_revision``; else a fingerprint of the checkpoint the server loaded
    (``model_path``: from the extra config, or the server's arguments, or the name
    SGLang passes less the format tag), or the commit a hub id resolves to in the local
    cache; else the server's ``--revision``; else "unversioned", with a warning (engines
    serving other weights under the same name would share pages)."""
    tag = getattr(host, "storage_format_tag", None)
    served = str(config.model_name or "")
    if tag and served.endswith(f"-{tag}"):
        served = served[:-len(str(tag)) - 1]  # (cache_controller.storage_model_name adds it)
    loaded = _server_arg("model_path")
    name = str(extra.get("model_name") or config.model_name or "unnamed")
    if loaded and not extra.get("model_name"):
        name = f"{loaded}-{tag}" if tag else str(loaded)  # (the format, as SGLang's)
    given = extra.get("model_revision")
    if given:
        return name, str(given)
    paths = [str(p) for p in (extra.get("model_path"), loaded) if p]
    paths.append(served)
    revision = _server_arg("revision")
    for path in paths:
        fingerprint = (checkpoint_fingerprint(path) or hub_commit(path, revision)
                       if path else None)
        if fingerprint:
            return name, fingerprint
    if revision:
        return name, f"revision:{revision}"
    logger.warning("kvstore: no revision of model %r's weights (no model_revision in the "
                   "extra config, no checkpoint directory found): engines serving other "
                   "weights under this name would share its pages", name)
    return name, "unversioned"


def adapters_tag(lora_paths: Any) -> str:
    """The revision's suffix for the LoRA adapters the server was started with
    (``--lora-paths``): "" with none; else a digest of each one's name, path and weights
    (``checkpoint_fingerprint`` of a local directory, the hub commit of a hub id).

    SGLang seeds the page hashes of an adapter's requests with its ``lora_id``, and an
    adapter given at start-up takes a stable one, made of its name and path only (so
    that nodes agree on it): an adapter replaced in place (a new fine-tune at the same
    path) kept its id, and a server restarted on it loaded the pages the old weights
    computed.  The backend is not told which adapter a page is of, so the revision of
    every page of the server carries its adapters' weights: a replaced adapter leaves
    the old pages unfound, its base model's with them.  (An adapter loaded while the
    server runs takes a random id: its pages are never another's.)"""
    adapters = sorted(_adapters(lora_paths))
    if not adapters:
        return ""
    digest = hashlib.blake2b(digest_size=8)
    for name, path in adapters:
        weights = checkpoint_fingerprint(path) or hub_commit(path) or "unversioned"
        digest.update(f"{name}\0{path}\0{weights}\0".encode())
    return f"+lora:{digest.hexdigest()}"


def _adapters(lora_paths: Any) -> list[tuple[str, str]]:
    """(name, path) of each adapter of ``--lora-paths`` in any form SGLang takes it: its
    parsed ``LoRARef`` objects, "name=path" or "path" strings, dicts with ``lora_name``
    and ``lora_path``, or one dict of name to path."""
    if not lora_paths:
        return []
    if isinstance(lora_paths, dict):
        return [(str(k), str(v)) for k, v in lora_paths.items()]
    found = []
    for item in lora_paths:
        name: Any
        path: Any
        if isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        elif isinstance(item, dict):
            name, path = item.get("lora_name"), item.get("lora_path")
        else:
            name, path = getattr(item, "lora_name", None), getattr(item, "lora_path", None)
        found.append((str(name), str(path)))
    return found


def _server_arg(name: str) -> Any:
    """One of the SGLang server's arguments, where this SGLang publishes them (None if
    not: a backend made outside a server, an SGLang without the runtime context)."""
    try:
        from sglang.srt.runtime_context import get_server_args
        return getattr(get_server_args(), name, None)
    except Exception:  # (not published: not under a server; an older SGLang)
        return None


class KVStoreHiCacheStorage(HiCacheStorage):
    """HiCache storage in a kvstore daemon.

    Extra-config keys: ``endpoint``, ``tenant``, ``token``, ``timeout`` (seconds),
    ``model_name``, ``model_revision``, ``model_path``, ``salt``, ``kv_cache_dtype``
    (``check_extra``: a value of the wrong type, or a misspelt key, is refused).
    """

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self._extra = dict(storage_config.extra_config or {})
        check_extra(self._extra)  # before any connect: a refused config leaves no session
        self._link = DaemonLink(DaemonSettings.from_extra(self._extra, timeout=10.0))
        try:
            self._link.connect()  # a refused tenant or token fails here, not at every call
        except UnavailableError as exc:
            # a daemon not up (yet: a sidecar started after the engine): SGLang starts,
            # and every call is a miss until a connect made in the background gets
            # through (tried again after the link's back-off), as vLLM's connector does;
            # this failed SGLang's start before
            logger.warning("kvstore HiCache storage: %s; starting without the daemon, "
                           "connecting in the background", exc)
            self._link.connect_in_background()
        # HiCache calls from its backup and prefetch threads; the link (one client, one
        # socket) is not thread-safe, so one thread at a time uses it
        self._lock = threading.RLock()
        self._identity: Identity | None = None
        self._staging: torch.Tensor | None = None  # one page, for v1 loads

    # -- set-up ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._identity = page_identity(self.storage_config, mem_pool_host,
                                       self._link.settings.tenant, self._extra)
        ns = self._link.namespace("pages", self._page_identity)
        logger.info("kvstore HiCache storage: %r at %s", ns, self._link.endpoint)

    def _page_identity(self) -> Identity:
        if self._identity is None:
            raise RuntimeError("register_mem_pool_host() must run before storage I/O: the "
                               "KV format of the pages comes from the host pool")
        return self._identity

    def _namespace(self) -> Namespace | None:
        """The pages' namespace; None while the daemon is failing (every call a miss)."""
        self._page_identity()
        return self._link.namespace("pages", self._page_identity)

    # -- exists -----------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        with self._lock:
            ns = self._namespace()
            if ns is None:
                return 0
            try:
                return ns.lookup([page_key(k) for k in keys]).blocks
            except KVStoreError as exc:
                self._link.failed("HiCache lookup", exc)
                return 0

    # -- reads ------------------------------------------------------------------------------
    def _read(self, keys: list[str], copy: Callable[[int, memoryview], None]) -> int:
        """Copy out the longest cached prefix of ``keys`` (``copy(i, slot)``); how many.

        In pieces, each pinned, copied and released before the next: pages on SSD are
        pinned in DRAM, and a batch of more than DRAM has room for was refused whole (its
        pages counted by ``batch_exists``, none loaded); a piece refused for room is
        asked again half as large."""
        with self._lock:
            ns = self._namespace()
            if ns is None:
                return 0
            wanted = [page_key(k) for k in keys]
            per, done = blocks_per_request(ns), 0
            while done < len(wanted):
                piece = wanted[done:done + per]
                loaded = read_blocks(ns, piece, functools.partial(_shifted, copy, done))
                done += loaded.blocks
                if (isinstance(loaded.error, CapacityError) and not loaded.blocks
                        and len(piece) > 1):
                    per = len(piece) // 2
                    continue
                if loaded.error is not None:
                    self._link.failed("HiCache get", loaded.error)
                if loaded.blocks < len(piece):
                    break
            return done

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(keys)

        def copy(i: int, slot: memoryview) -> None:
            target = target_locations[i] if target_locations else None
            if target is None:
                target = self.mem_pool_host.get_dummy_flat_data_page()
            _copy_into(target, slot)
            out[i] = target

        self._read(keys, copy)
        return out

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        host = self.mem_pool_host
        if self._staging is None:
            self._staging = host.get_dummy_flat_data_page()
        staging = self._staging

        step = _index_step(host)

        def copy(i: int, slot: memoryview) -> None:
            _copy_into(staging, slot)
            host.set_from_flat_data_page(int(host_indices[i * step]), staging)

        loaded = self._read(keys, copy)
        return [True] * loaded + [False] * (len(keys) - loaded)

    # -- writes -----------------------------------------------------------------------------
    def _store(self, keys: list[str], pages: Sequence[torch.Tensor],
               parent_key: str | None = None) -> list[bool]:
        """Store pages under keys, skipping the leading ones already cached."""

        def fill(slots: Sequence[memoryview], first: int) -> None:
            for slot, page in zip(slots, pages[first:]):
                slot[:] = _page_bytes(page)

        with self._lock:
            ns = self._namespace()
            if ns is None:
                return [False] * len(keys)
            stored = store_missing(ns, [page_key(k) for k in keys], fill,
                                   parent=page_key(parent_key) if parent_key else None)
            if stored.error is not None:
                self._link.failed("HiCache set", stored.error)
        return [True] * stored.present + [False] * (len(keys) - stored.present)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._store(keys, list(values)))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        host = self.mem_pool_host
        step = _index_step(host)
        pages = [host.get_data_page(int(host_indices[i * step]), flat=True)
                 for i in range(len(keys))]
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self._store(keys, pages, prefix[-1] if prefix else None)

    # -- the rest -------------------------------------------------------------------------
    def clear(self) -> None:
        with self._lock:
            ns = self._namespace()
            if ns is None:
                return
            try:
                ns.drop()
            except KVStoreError as exc:
                self._link.failed("HiCache clear", exc)

    def close(self) -> None:
        with self._lock:
            self._link.close()

    def __repr__(self) -> str:
        return f"KVStoreHiCacheStorage({self._identity!r}, {self._link!r})"


def _page_bytes(page: torch.Tensor) -> memoryview:
    flat = page.detach().reshape(-1).contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().data

def _index_step(host: Any) -> int:
    """How many of ``host_indices`` a page spans: SGLang's cache controller passes one
    index per token of a logical page, which under decode context parallelism
    (``dcp_size`` > 1) is ``dcp_size`` physical pages wide (its pool's ``page_size``); a
    page's data is read and written at its logical start (stepping by the physical size
    named the middle of a logical page, which the pool refuses)."""
    logical = getattr(host, "logical_page_size", None)  # (SGLang's pools since DCP)
    return int(logical or host.page_size * getattr(host, "dcp_size", 1))


def _shifted(copy: Callable[[int, memoryview], None], first: int, i: int,
             slot: memoryview) -> None:
    copy(first + i, slot)


def _copy_into(target: torch.Tensor, slot: memoryview) -> None:
    """Copy a slot's bytes into a page tensor (a flat CPU tensor of the page's bytes)."""
    dst = target.view(-1).view(torch.uint8).numpy()
    if dst.nbytes != slot.nbytes:
        raise ValueError(f"a page buffer of {dst.nbytes} bytes for a {slot.nbytes}-byte page")
    np.copyto(dst, np.frombuffer(slot, dtype=np.uint8))
