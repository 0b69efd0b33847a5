"""kvstore as a vLLM KV connector (``KVConnectorBase_V1`` with ``SupportsHMA``).

Load it with::

    LLM(..., kv_transfer_config=KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"endpoint": "ipc:///run/kvstore.sock", "tenant": "acme"}))

Scheduler side: connects to the daemon (and opens the namespaces of requests with no
adapter or salt) on a thread from its construction, so no request waits for a connect;
until it is done, or while a daemon that is down is tried again, lookups are misses. For
a new request, ``get_num_new_matched_tokens`` looks the prompt's full blocks up in the
daemon once (sent by ``on_new_request`` as it arrives, the reply read here; from the
first block, so blocks the store already holds are never saved again; the result is kept
for the request's later scheduling steps, but sent again once where the first block it
missed is one this engine saved since: a request that waited in the queue), has the
daemon bring blocks found on SSD or remote up to DRAM (``prefetch``), and offers the
cached prefix as external tokens; ``update_state_after_alloc`` records where they load;
``build_connector_meta`` hands the worker this step's loads and the blocks that become
complete (to save).  That side's bookkeeping is ``RequestBook``
(``kvstore.integrations.vllm_requests``); the connector hands vLLM's calls to it.

Worker side: ``handle_preemptions``, the step's first call, sends one acquire per
namespace for every request's blocks of the step, without waiting; ``start_load_kv``
waits for the pins (the round trip overlapped with vLLM preparing the step's inputs) and
copies the blocks into vLLM's pages before the forward pass (or, with ``copy_ahead`` and
pages in host memory, a thread started in ``handle_preemptions`` pins and copies them
meanwhile), or layer by layer (``layerwise``: ``wait_for_layer_load`` waits for just its
layer, a thread copying the rest meanwhile).  ``wait_for_save`` hands the completed
blocks to a background sender (``async_saves``, the default), which starts them at the
next step's ``handle_preemptions``: the step never waits for the daemon, nor, for pages
in host memory, for their copy (the sender copies them straight into the daemon's
slots; on a GPU the copy out is queued on the stream in the step), and the sender's
Python does not contend with the end of the step for the interpreter.  The scheduler
hashes only the blocks no earlier request in the engine hashed (``KnownChains``).  A
request with saves in flight stays held (``request_finished`` returns True) until
``get_finished`` reports them done; one preempted meanwhile has ``handle_preemptions``
wait for them before vLLM may write its pages (for at most the daemon's ``timeout``:
then they are given up, later misses).  A block that
cannot be loaded — evicted since the lookup, daemon gone — is reported by
``get_block_ids_with_load_errors``, so vLLM recomputes it (policy ``recompute``) or
fails the request (``fail``) instead of serving wrong KV; and no block of that request
is saved from then on until it finishes: the step that failed to load computed its
later tokens on pages never filled, and a block those completed, stored, was served
wrong to every later request that loaded it.  Nor is any other block that step
completed: a request scheduled after the failed one in that step may share its pages
(vLLM's prefix cache holds them from their allocation) and computed on them too; vLLM
has it compute that step again, but its saves were sent.  Saves are best-effort: one
that fails, or finds the sender's queue full, is a later cache miss.

Roles: ``kv_producer`` engines look up (to skip what the store holds) and save, never
load; ``kv_consumer`` engines load, never save; ``kv_both`` do both.

Identity: model (``model_name`` extra config, else the model as loaded, never the
served name: an alias two deployments of different weights may share), revision
(``model_revision``, else the model config's, else the hub commit of its config, else a
fingerprint of the local checkpoint; marked ``+dummy`` under dummy weights),
KV format from the KV cache group (layers, KV heads, head dim, dtype, block size),
RoPE parameters; per request the LoRA adapter (name and path) and vLLM's
``cache_salt``, so different adapters or salts never share a block.  The daemon
session's tenant is the ``tenant`` extra config (else ``KVSTORE_TENANT``).  Tensor
parallel ranks each store their own head shard in their own namespace.

Blocks are stored in kvstore's canonical page layout ``[layers, 2, T, H, D]``; caches
laid out otherwise (vLLM's CPU backend keeps ``[B, H, 2, T, D]`` per layer) go through
a staging copy.  Requests with multimodal inputs or prompt embeddings are neither
looked up nor saved: their token ids do not identify their KV.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvstore.client import Namespace
from kvstore.integrations.daemon_link import (
    REFRESH_RATES_S,
    DaemonLink,
    DaemonSettings,
    LoadRates,
)
from kvstore.integrations.engine_side import (
    EnginePages,
    Loaded,
    store_missing,
)
from kvstore.integrations.pipeline import (
    InPages,
    LoadItem,
    LoadWorth,
    SaveJob,
    SaveSender,
    SettledLoads,
    StepLoads,
    fill_rows,
)
from kvstore.integrations.vllm_chains import KnownChains
from kvstore.integrations.vllm_identity import Group, RequestVariant, kv_groups
from kvstore.integrations.vllm_options import (  # (check_values: imported from here too)
    ConnectorOptions,
    check_values,
)
from kvstore.integrations.vllm_requests import (
    BookRoles,
    KVStoreConnectorMetadata,
    RequestBook,
    Transfer,
    plain_namespaces,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# ========================================================================================
# worker side: vLLM's KV tensors seen as kvstore pages
# ========================================================================================

def engine_pages(tensors: Sequence[torch.Tensor], group: Group) -> EnginePages:
    """One group's layer tensors as kvstore pages: straight between vLLM's pages and the
    daemon's slots where each page is contiguous as ``[2, T, H, D]`` (or K and V each
    as ``[T, H, D]``), otherwise through a staging copy."""
    t, h, d = group.block_tokens, group.num_kv_heads, group.head_dim
    shape = tuple(tensors[0].shape)
    if len(shape) == 5 and shape[1:] == (2, t, h, d):
        return EnginePages.direct(list(tensors), "per_layer")
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (t, h, d):
        return EnginePages.direct([(x[0], x[1]) for x in tensors], "per_layer_kv_split")
    if len(shape) == 4 and shape[1:] == (h, t, 2 * d):
        # vLLM's CPU backend: per block and head, K as [T, D] then V as [T, D].
        return EnginePages.staged(
            [x.view(shape[0], h, 2, t, d).permute(0, 2, 3, 1, 4) for x in tensors])
    raise ValueError(
        f"KVStoreConnector does not know the KV cache layout of shape {shape} "
        f"(block {t} tokens, {h} KV heads, head dim {d})")


# ========================================================================================
# the connector
# ========================================================================================

STATS = ("lookups", "hit_tokens", "prefetches", "offers", "offers_declined",
         "declined_tokens",
         "capped_tokens",                    # cached, not offered: more than DRAM can pin
         "rate_refreshes", "loaded_blocks", "load_failed_blocks",
         "load_calls", "saves", "saved_blocks", "save_failures", "save_dropped",
         "saves_after_failed_load",          # saves not sent: their request's load failed
         "lookup_us", "load_us", "save_us",  # time in the engine's steps, and of load_us
         "acquire_wait_us",                  # the time spent waiting for pins
         "save_waits",                       # steps a request waited for a save in flight
         "layerwise_steps")                  # steps whose loads went layer by layer


def plan_loads(transfers: Sequence[Transfer], layers: dict[int, EnginePages],
               namespace: Callable[[int, RequestVariant], Namespace | None],
               copier: Executor | None = None) -> StepLoads:
    """A step's loads, by group and request variant, each from ``namespace(group,
    variant)`` (None: it cannot be opened, and its transfers get no item); copied on
    ``copier``'s thread where they go on one."""
    loads = StepLoads(copier)
    by_ns = dict[tuple[int, RequestVariant], list[Transfer]]()
    for t in transfers:
        by_ns.setdefault((t.group, t.variant), []).append(t)
    for (index, variant), items in by_ns.items():
        ns = namespace(index, variant)
        if ns is not None:
            loads.add(ns, layers[index], [LoadItem(f"{t.req_id}/{t.group}", t.keys,
                                                   t.block_ids) for t in items])
    return loads


def count_loads(transfers: Sequence[Transfer], outcome: dict[str, Loaded],
                stats: dict[str, int], link: DaemonLink,
                failed_requests: set[str] | None = None) -> set[int]:
    """Count a step's loads as ``StepLoads.pin`` left them (a daemon error goes to
    ``link``); the pages of the blocks that could not be loaded (their requests added
    to ``failed_requests``)."""
    not_loaded: set[int] = set()
    for t in transfers:
        loaded = outcome.get(f"{t.req_id}/{t.group}")
        blocks = loaded.blocks if loaded is not None else 0
        if loaded is not None and loaded.error is not None:
            link.failed(f"load for request {t.req_id}", loaded.error)
        failed = t.block_ids[blocks:]
        if failed:
            logger.warning("kvstore: %d of %d blocks of request %s could not be loaded",
                           len(failed), len(t.block_ids), t.req_id)
            not_loaded.update(failed)
            if failed_requests is not None:
                failed_requests.add(t.req_id)
        stats["loaded_blocks"] += blocks
        stats["load_failed_blocks"] += len(failed)
    return not_loaded


def save_job(t: Transfer, group: Group, pages: EnginePages, tp_rank: int,
             tp_size: int) -> SaveJob:
    """The background sender's job for a save.  Pages in host memory are copied by the
    sender, straight into the daemon's slots, while vLLM holds them (request_finished,
    handle_preemptions); a GPU's copy is queued on the stream now, before any later
    write to them."""
    source = (pages.stage(t.block_ids) if pages.device.type == "cuda"
              else InPages(pages, list(t.block_ids)))
    identity = functools.partial(group.identity_for, t.variant, tp_rank, tp_size)
    return SaveJob(t.req_id, (t.group, t.variant, tp_rank), identity, t.keys, t.parent,
                   source)


def save_now(ns: Namespace | None, t: Transfer, rows: torch.Tensor, stats: dict[str, int],
             link: DaemonLink) -> None:
    """Store a save's staged rows on the caller's thread (no background sender)."""
    if ns is None:
        stats["save_failures"] += 1
        return
    stored = store_missing(ns, t.keys, fill_rows(rows), parent=t.parent, lookup=False)
    stats["saves"] += 1
    stats["saved_blocks"] += stored.created
    if stored.error is not None:
        stats["save_failures"] += 1
        link.failed(f"save for request {t.req_id}", stored.error)


def wait_or_give_up(sender: SaveSender, tags: set[str], timeout: float) -> None:
    """Wait for the saves of ``tags`` (requests preempted, whose pages vLLM may write
    now) for ``timeout`` seconds at most (negative: the daemon timeout's "no limit"),
    then give them up: they are later misses."""
    if not sender.wait_for(tags, None if timeout < 0 else timeout):
        logger.warning("kvstore: saves of preempted requests %s not done in %.1f s: "
                       "given up", sorted(tags), timeout)
        sender.give_up(tags)


def _group_of(groups: Sequence[Group], index: int) -> Group:
    return next(g for g in groups if g.index == index)


_told_fail: list[bool] = []  # whether kv_load_failure_policy "fail" was warned of


def usable_cores() -> int:
    """Physical cores this process may run on: the CPUs of its affinity, hyperthreads
    of one core counted once (``/sys``'s topology), at most its cgroup's CPU quota
    (``cpu.max``, rounded up)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as package, \
                    open(topology + "core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:  # no topology here: each CPU a core
            cores.add(("cpu", str(cpu)))
    count = len(cores)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def layerwise_fits(on_host: bool, threads: int, cores: int) -> bool:
    """Whether ``"layerwise": "auto"`` loads layer by layer (once vLLM is seen asking
    for every layer): pages in host memory, and more cores for the process than the
    engine's ``threads`` (``usable_cores``), so that a thread copies the later layers on
    a core of its own while the first ones compute.  Measured on the CPU build with one
    engine thread on 2 cores (``engine_e2e.py``, multi-round QA, seven runs): TTFT p50
    1.02-1.19x the ideal's (median 1.04x), copied whole 1.10-1.31x in four of them;
    memory left untouched for tens of ms costs about a microsecond a page to touch
    again on those VMs, which the thread pays beside the forward.  With no core to
    spare the thread slowed the forward more than it saved (TTFT 2.1 ms worse at a load
    average of 8-11).  On a GPU the layers' copies queue on the stream ahead of their
    attention: no thread, no gain; a step's loads go whole there.  (vLLM's CPU workers,
    bound by ``VLLM_CPU_OMP_THREADS_BIND``, run as many threads as the cores bound:
    whole copies, unless the binding leaves the process a core.)"""
    return on_host and cores > threads


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM KV connector backed by a kvstore daemon (its ``kv_connector_extra_config``
    keys: ``ConnectorOptions``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        # (warned, or refused, before anything starts: a connect)
        ConnectorOptions.check_keys(extra, scheduler=role == KVConnectorRole.SCHEDULER)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy == "fail" and self._kv_transfer_config.is_kv_consumer and not _told_fail:
            # vLLM's default: a block evicted between the lookup and the load (a daemon
            # under pressure, or restarted) fails the request, with an error, rather
            # than have it computed
            logger.warning("KVStoreConnector: kv_load_failure_policy is \"fail\" (vLLM's "
                           "default): a request whose cached blocks the daemon lets go "
                           "before they load ends with an error; \"recompute\" computes "
                           "them instead (kvstore's README says what each risks)")
            _told_fail.append(True)  # (once a process: its scheduler's and workers' alike)
        check_values(extra)
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("KVStoreConnector does not support pipeline parallelism yet")
        self._opts = ConnectorOptions.from_extra(extra, kv_cache_config)
        scheduler = role == KVConnectorRole.SCHEDULER  # its link reads no block
        self._link = DaemonLink(DaemonSettings.from_extra(extra, timeout=5.0),
                                map_arena=not scheduler)
        self._groups = kv_groups(vllm_config, kv_cache_config, self._link.settings.tenant,
                               extra)
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._rates = LoadRates(
            LoadWorth.from_extra(extra, sum(g.identity.block_bytes for g in self._groups),
                                 self._groups[0].block_tokens),
            refresh_s=float(extra.get("rates_refresh_s", REFRESH_RATES_S)))
        if scheduler:  # connected (hello, namespaces) now, never in a request's path
            self._link.connect_in_background(plain_namespaces(self._groups, self._tp_size))
        self._is_producer = self._kv_transfer_config.is_kv_producer
        self._is_consumer = self._kv_transfer_config.is_kv_consumer
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)
        # scheduler side
        self._book = RequestBook(
            self._link, self._groups, self._tp_size,
            BookRoles(producer=self._is_producer, consumer=self._is_consumer,
                      prefetch=self._opts.prefetch, async_saves=self._opts.async_saves),
            self._rates, KnownChains.of(vllm_config.cache_config, self._opts.known_chains),
            self._namespace, self.stats)
        # worker side
        self._tp_rank = 0
        self._layers: dict[int, EnginePages] = {}
        self._layer_index: dict[str, int] = {}
        # "auto": whether this engine's pages and cores suit layer by layer loads, and
        # the layers vLLM has not yet asked for (``wait_for_layer_load``): None once
        # all were, or where it need not be known
        self._layerwise_fits = False
        self._layers_unasked: set[str] | None = None
        self._load_errors: set[int] = set()
        # requests a load of failed, until they finish: none of their blocks is saved
        # (the step computed past the pages not loaded, on what those pages held)
        self._loads_failed: set[str] = set()
        # the step (its metadata) whose loads failed: none of its saves is sent, as any
        # request in it may have read those pages through vLLM's prefix cache
        self._failed_step: KVConnectorMetadata | None = None
        self._unsent: set[str] = set()  # ... whose saves vLLM planned were not sent
        self._step_loads: StepLoads | None = None
        # the thread that copies loads beside the step (pages in host memory), kept
        # across steps: one started per step had the step wait for it to run
        self._copier: ThreadPoolExecutor | None = None
        self._settled = SettledLoads()   # copies done, pins to release at the next step
        self._posted_loads: tuple[KVConnectorMetadata, StepLoads] | None = None
        self._sender: SaveSender | None = None
        self._saving: set[str] = set()          # requests with saves sent
        self._finished_saving: set[str] = set()  # ... that vLLM says are finished

    # -- daemon access ----------------------------------------------------------------
    def _namespace(self, group: Group, variant: RequestVariant,
                   tp_rank: int) -> Namespace | None:
        """A group's, request variant's and rank's namespace (None: ``DaemonLink``)."""
        return self._link.namespace(
            (group.index, variant, tp_rank),
            lambda: group.identity_for(variant, tp_rank, self._tp_size))

    # ==================================================================================
    # scheduler side: RequestBook
    # ==================================================================================
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._book.offer(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self._book.arrived(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._book.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._book.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # the finished requests whose saves the workers ended (``RequestBook.saves_done``)
        self._book.saves_done(connector_output.finished_sending or ())

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
            self, request: Request,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._book.finished(request), None

    def reset_cache(self) -> bool:
        """vLLM resets its caches (``reset_prefix_cache(reset_connector=True)``, and as it
        pauses to load new weights): no block stored before is loaded from now on
        (``RequestBook.reset``); those blocks stay in the daemon for the engines that
        still run the weights they came from, until evicted."""
        self._book.reset()
        return True

    # ==================================================================================
    # worker side
    # ==================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._tp_rank = get_tensor_model_parallel_rank() if self._tp_size > 1 else 0
        for group in self._groups:
            missing = [name for name in group.layer_names if name not in kv_caches]
            if missing:
                raise ValueError(f"KVStoreConnector: no KV cache for layers {missing}")
            pages = engine_pages([kv_caches[name] for name in group.layer_names], group)
            self._layers[group.index] = pages
            if len(pages.layer_targets()) == len(group.layer_names):
                self._layer_index.update((name, i) for i, name in enumerate(group.layer_names))
        on_host = all(p.device.type == "cpu" for p in self._layers.values())
        self._layerwise_fits = layerwise_fits(on_host, torch.get_num_threads(),
                                              usable_cores())
        if on_host and self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvstore-loads")
        if self._opts.layerwise is None and self._layerwise_fits and self._layer_index:
            self._layers_unasked = set(self._layer_index)
        self._link.client()  # connect and map the arena now, not in a request's step
        if self._opts.async_saves and self._is_producer:
            self._sender = SaveSender(self._link.settings,
                                      max_pending_bytes=self._opts.max_pending)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            self._start_load_kv()
        finally:
            self.stats["load_us"] += int((time.perf_counter() - started) * 1e6)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A step's first call, before vLLM prepares its inputs: the last loads' pins go.
        # Saves still to copy out of preempted requests' pages end first (or are given
        # up).  The loads' acquires go out; start_load_kv waits for them, then copies.
        meta, started = kv_connector_metadata, time.perf_counter()
        assert isinstance(meta, KVStoreConnectorMetadata), type(meta)
        if self._settled.release():
            self.stats["load_us"] += int((time.perf_counter() - started) * 1e6)
            started = time.perf_counter()
        if self._sender is not None and not meta.loads:  # the last step's saves start (in
            self._sender.go()  # a step that loads, once its blocks are in: start_load_kv)
        if meta.preempted & self._saving and self._sender is not None:
            wait_or_give_up(self._sender, meta.preempted & self._saving,
                            self._link.settings.timeout)
            self.stats["save_us"] += int((time.perf_counter() - started) * 1e6)
            started = time.perf_counter()
        if meta.loads and self._opts.post_loads:
            self._finish_loads()  # a step that never reached wait_for_save: its client use
            self._settled.release()  # ends, its pins go (before a copy-ahead thread starts)
            if self._posted_loads is not None:  # a step vLLM never loaded: its pins go
                self._posted_loads[1].finish()
            self._posted_loads = (meta, self._plan_loads(meta.loads))
            if not (self._opts.copy_ahead and self._posted_loads[1].start()):
                self._posted_loads[1].post()
            self.stats["load_us"] += int((time.perf_counter() - started) * 1e6)

    def _plan_loads(self, transfers: list[Transfer]) -> StepLoads:
        self._link.answered_elsewhere()  # (the scheduler's lookup offered these)
        return plan_loads(transfers, self._layers, lambda index, variant: self._namespace(
            _group_of(self._groups, index), variant, self._tp_rank), self._copier)

    def _start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata), type(meta)
        self._finish_loads()  # a step that never reached wait_for_save
        self._settled.release()
        posted, self._posted_loads = self._posted_loads, None
        if posted is not None and posted[0] is not meta:
            posted[1].finish()  # another step's (cannot happen in vLLM): let its pins go
            posted = None
        if not meta.loads:
            return
        loads = posted[1] if posted is not None else self._plan_loads(meta.loads)
        try:
            outcome = loads.pinned()
        except BaseException:
            loads.finish()  # a pin or copy-ahead error: the pins taken go now, not at lease end
            raise
        self.stats["load_calls"] += loads.calls
        self.stats["acquire_wait_us"] += int(loads.waited_s * 1e6)
        # vLLM recomputes the blocks not loaded (or fails their requests), never reads them
        not_loaded = count_loads(meta.loads, outcome, self.stats, self._link,
                                 self._loads_failed)
        self._load_errors |= not_loaded
        self._failed_step = meta if not_loaded else None
        if self._layer_index and self._layer_by_layer():
            loads.start_layers()
            self._step_loads = loads
            self.stats["layerwise_steps"] += 1
        else:
            try:
                if not loads.started:
                    loads.copy_all()
            except BaseException:
                loads.finish()
                raise
            self._settled.settle(loads)
        if self._sender is not None:  # held saves go beside the forward, not the copy
            self._sender.go()

    def _layer_by_layer(self) -> bool:
        """Whether this step's loads go layer by layer (``layerwise``; "auto":
        ``layerwise_fits``, once vLLM was seen asking for every layer: an attention
        backend that never asks would read pages still being copied)."""
        if self._opts.layerwise is not None:
            return self._opts.layerwise
        return self._layerwise_fits and self._layers_unasked is None

    def wait_for_layer_load(self, layer_name: str) -> None:
        unasked = self._layers_unasked
        if unasked is not None:  # "auto", until every layer was asked for
            unasked.discard(layer_name)
            if not unasked:
                self._layers_unasked = None
        loads = self._step_loads
        if loads is None:
            return
        layer = self._layer_index.get(layer_name)
        for i in range(loads.layers()) if layer is None else (layer,):
            loads.wait_layer(i)

    def _finish_loads(self) -> None:
        loads, self._step_loads = self._step_loads, None
        if loads is not None:
            self._settled.settle(loads)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # wait_for_save saves all layers of a block in one batched copy

    def wait_for_save(self) -> None:
        started = time.perf_counter()
        try:
            self._finish_loads()
            if self.has_connector_metadata():
                self._send_saves()
        finally:
            self.stats["save_us"] += int((time.perf_counter() - started) * 1e6)

    def _send_saves(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata), type(meta)
        failed_step, self._failed_step = self._failed_step is meta, None
        for t in meta.saves:
            if failed_step or t.req_id in self._loads_failed:  # on pages never filled
                self.stats["saves_after_failed_load"] += 1
                self._unsent.add(t.req_id)  # vLLM holds it for a save: none goes
                continue
            group, pages = _group_of(self._groups, t.group), self._layers[t.group]
            if self._sender is None:  # copied and stored now, in the step
                save_now(self._namespace(group, t.variant, self._tp_rank), t,
                         pages.stage(t.block_ids).rows, self.stats, self._link)
                continue
            self._saving.add(t.req_id)
            self._sender.submit(save_job(t, group, pages, self._tp_rank, self._tp_size),
                                after_step=self._opts.saves_after_step)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        self._loads_failed -= finished_req_ids
        unsent = self._unsent & finished_req_ids
        self._unsent -= unsent
        if self._sender is None:
            return None, None
        self._finished_saving |= finished_req_ids & self._saving
        done = self._sender.take_finished(self._finished_saving)
        self._finished_saving -= done
        self._saving -= done
        # held by vLLM for saves that were not sent (its load failed), none sent before:
        # nothing to wait for
        done |= unsent - self._saving - self._finished_saving
        self.stats.update(self._sender.stats)
        return done or None, None

    def drain_saves(self, timeout: float) -> bool:
        """Wait for every save sent (False: ``timeout`` seconds passed); stats updated."""
        done = self._sender is None or self._sender.drain(timeout)
        if self._sender is not None:
            self.stats.update(self._sender.stats)
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self) -> None:
        self._finish_loads()
        self._settled.release()
        if self._posted_loads is not None:
            self._posted_loads[1].finish()
        if self._copier is not None:
            self._copier.shutdown(wait=True)  # (its copies are done: finished above)
        if self._sender is not None:
            self._sender.close()
        self._link.close()

    def __repr__(self) -> str:
        return (f"KVStoreConnector({self.role.name}, groups={len(self._groups)}, "
                f"requests={len(self._book)}, stats={self.stats})")
