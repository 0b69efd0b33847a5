"""The scheduler side of kvstore's vLLM connector: its book of requests (their keys,
lookups, offers and planned saves) and the metadata it hands the worker.

Apart from ``kvstore.integrations.vllm`` so that the connector class stays a thin
facade over its two sides (this one, and the worker's loads and saves there), each
small enough to read in one sitting.  The connector's docstring tells the protocol.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.client import LookupResult, Namespace
from kvstore.errors import KVStoreError
from kvstore.identity import Identity
from kvstore.integrations.daemon_link import DaemonLink, LoadRates, post_rates
from kvstore.integrations.pipeline import LoadWorth, wait_all
from kvstore.integrations.vllm_chains import KnownChains
from kvstore.integrations.vllm_identity import (
    AdapterRevisions,
    Group,
    RequestVariant,
    request_variant,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SAVED_LATELY = 16384  # first-group keys of the last saves kept (``_missed_key``)
# How long a request whose lookup missed a block that a finished request's save is still
# sending waits for it, a scheduler step at a time, before it computes the block itself
SAVE_WAIT_SECONDS = 2.0
UNSENT_MOST = 4096  # finished requests whose saves are awaited, kept at most

# ========================================================================================
# metadata: scheduler -> worker
# ========================================================================================

class Transfer(msgspec.Struct, frozen=True):
    """Blocks of one request and KV cache group to load or save: ``keys[i]`` lives in
    vLLM block ``block_ids[i]``; ``parent`` is the key before ``keys[0]`` (None: root)."""

    req_id: str
    group: int
    variant: RequestVariant
    keys: list[bytes]
    block_ids: list[int]
    parent: bytes | None = None


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # requests whose pages went back


# ========================================================================================
# scheduler-side request state
# ========================================================================================

@dataclass
class RequestState:
    request: Request
    variant: RequestVariant
    cacheable: bool
    keys: dict[int, list[bytes]] = field(default_factory=dict)  # per group, block order
    block_ids: list[list[int]] = field(default_factory=list)   # per group index
    saved_blocks: int = 0       # leading blocks known to be in the daemon
    offer: tuple[int, int] | None = None  # (first block, blocks) offered as external
    cached: tuple[int, list[str]] | None = None  # the lookup: leading blocks, their tiers
    saving: bool = False        # saves were planned: the worker reports when they end
    planned: list[bytes] = field(default_factory=list)  # first group's keys it saves
    lookups: list[Callable[[], LookupResult]] | None = None  # sent on arrival, not read
    waits_since: float | None = None  # since when it waits for a save in flight


def count_tiers(stats: dict[str, int], tiers: Sequence[str], block_tokens: int) -> None:
    """Count the tokens of blocks offered from each tier (``hit_tokens_<tier>``), as
    the lookup found them (a prefetch may have moved them up since)."""
    for tier in tiers:
        stats[f"hit_tokens_{tier}"] = stats.get(f"hit_tokens_{tier}", 0) + block_tokens


def plain_namespaces(groups: Sequence[Group],
                     tp_size: int) -> dict[Hashable, Callable[[], Identity]]:
    """The namespaces of requests with no adapter and no salt, keyed as the connector's
    ``_namespace`` keys them: every group's, for every rank."""
    plain = RequestVariant()
    return {(g.index, plain, rank): functools.partial(g.identity_for, plain, rank, tp_size)
            for g in groups for rank in range(tp_size)}


LookupTarget = tuple[Callable[[], "Namespace | None"], list[bytes]]
NamespaceOf = Callable[[Group, RequestVariant, int], "Namespace | None"]


def send_lookups(targets: Sequence[LookupTarget],
                 link: DaemonLink) -> list[Callable[[], LookupResult]] | None:
    """One lookup per (namespace, keys) sent, none waited for: the calls that wait for
    each; None when a namespace cannot be opened or the daemon failed (the lookups
    already sent are read then, so that no reply is left behind)."""
    waits: list[Callable[[], LookupResult]] = []
    try:
        for namespace, keys in targets:
            ns = namespace()
            if ns is None:
                break
            waits.append(ns._send_lookup(keys))
        else:
            return waits
    except KVStoreError as exc:
        link.failed("lookup", exc)
    settle(waits)
    return None


def settle(waits: Sequence[Callable[[], object]]) -> None:
    """Read and drop the replies of requests sent (their errors too)."""
    try:
        wait_all(waits)
    except KVStoreError as exc:
        logger.debug("kvstore: a lookup nobody waits for failed: %s", exc)


class NamespaceIds:
    """Rank 0's namespace id of each group and request variant, hashed once (it took
    ~20 us each time a request's new blocks were hashed); ``limit`` kept at most (salts
    may be many: past it, ids are hashed each time)."""

    def __init__(self, tp_size: int, limit: int = 4096) -> None:
        self._tp_size = tp_size
        self._limit = limit
        self._ids: dict[tuple[int, RequestVariant], bytes] = {}

    def of(self, group: Group, variant: RequestVariant) -> bytes:
        found = self._ids.get((group.index, variant))
        if found is None:
            found = group.identity_for(variant, 0, self._tp_size).namespace_id
            if len(self._ids) < self._limit:
                self._ids[(group.index, variant)] = found
        return found


# ========================================================================================
# the scheduler side
# ========================================================================================

@dataclass(frozen=True)
class BookRoles:
    """What the scheduler side does for its engine: looks up and offers (``consumer``),
    plans saves (``producer``), prefetches from below DRAM, holds requests with saves
    in flight (``async_saves``)."""

    producer: bool
    consumer: bool
    prefetch: bool
    async_saves: bool


class RequestBook:
    """The connector's scheduler side: each request's keys (hashed once, or taken over
    from an earlier request's chain), its lookup (sent as it arrives, read when vLLM
    asks), the cached prefix offered, the loads and saves handed to the worker."""

    def __init__(self, link: DaemonLink, groups: Sequence[Group], tp_size: int,
                 roles: BookRoles, rates: LoadRates[LoadWorth], known: KnownChains,
                 namespace: NamespaceOf, stats: dict[str, int]) -> None:
        self._link = link
        self._groups = list(groups)
        self._tp_size = tp_size
        self._roles = roles
        self._rates = rates
        self._known = known
        self._namespace = namespace
        self.stats = stats  # the connector's: counts kept in one place
        self._requests: dict[str, RequestState] = {}
        self._ns_ids = NamespaceIds(tp_size)
        self._pending_loads: list[Transfer] = []
        self._weights = ""  # the tag of the last reset (``RequestVariant.weights``)
        self._adapters = AdapterRevisions()  # LoRA adapters' revisions, kept
        # the first group's keys of the saves planned, with the live requests that
        # planned each: another request with the same prefix (a parallel sample) skips
        # them rather than send the same blocks again
        self._planned: dict[bytes, int] = {}
        # the first group's keys of the last saves planned (oldest first, bounded): a
        # request's lookup, sent as it came, that missed one of them is sent again
        self._saved_lately: dict[bytes, None] = {}
        # the first group's keys of finished requests whose saves the worker has not
        # reported done yet (``finished`` to ``saves_done``), per request and counted
        self._unsent: dict[str, list[bytes]] = {}
        self._unsent_keys: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            cacheable = not request.mm_features and request.prompt_embeds is None
            variant = request_variant(request, self._weights, self._adapters)
            state = RequestState(request, variant, cacheable)
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: RequestState, group: Group, blocks: int) -> list[bytes]:
        """The first ``blocks`` keys of the request's token chain in ``group``."""
        keys = state.keys.setdefault(group.index, [])  # in rank 0's namespace, every rank's
        self._known.extend((group.index, state.variant), state.request, keys, blocks,
                           group.block_tokens, lambda: self._ns_ids.of(group, state.variant))
        return keys[:blocks]

    # -- vLLM's scheduler calls, in the order it makes them ------------------------------
    def arrived(self, request: Request) -> None:
        """``on_new_request``: the request's lookups go out now; its scheduling (``offer``)
        reads their replies."""
        state = self._state(request)
        blocks = request.num_tokens // self._groups[0].block_tokens  # every full one
        if state.cacheable and blocks > 0 and self._link.available():
            started = time.perf_counter()  # the keys' hashes and the sends
            # the rates' refresh, when due, goes first: its reply is in by the offer's
            self._rates.ask(functools.partial(post_rates, self._link))
            state.lookups = send_lookups(self._lookup_targets(state, blocks), self._link)
            self.stats["lookup_us"] += int((time.perf_counter() - started) * 1e6)

    def offer(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: the tokens past ``num_computed_tokens`` that
        the store holds and are worth loading (blocks below DRAM prefetched)."""
        state = self._state(request)
        state.offer = None
        if not state.cacheable:
            return 0, False
        block = self._groups[0].block_tokens
        first = num_computed_tokens // block
        usable = (request.num_tokens - 1) // block  # vLLM computes at least one token
        # Looked up: every full block, the last one too where the prompt fills it (not
        # offered, but not saved again either when the store holds it)
        full = request.num_tokens // block
        if state.cached is not None and state.saved_blocks > state.cached[0]:
            # blocks of its own saved since its lookup: a request preempted and offered
            # again reloads what it computed, rather than compute it again
            state.cached = None
        if state.cached is None:
            if not self._link.available():
                return 0, False
            started = time.perf_counter()
            state.cached = self._lookup(state, full)
            missed = max(state.cached[0], first)  # (vLLM's own cache holds the first)
            if missed < full and self._missed_key(state, missed) in self._saved_lately:
                if state.waits_since is None:  # (else that lookup was just sent)
                    state.cached = self._lookup(state, full)
                    missed = max(state.cached[0], first)
                if missed < full and self._waits_for_save(state, missed):
                    state.cached = None
                    return None, False  # (vLLM asks again at its next step)
            self.stats["lookup_us"] += int((time.perf_counter() - started) * 1e6)
        cached, tiers = state.cached
        # Blocks the store holds are never saved again, loaded or not.
        state.saved_blocks = max(state.saved_blocks, min(cached, full))
        hit = min(cached, usable) - first
        # vLLM reads no cached prefix for a request that asks for its prompt's
        # log-probabilities: an offer would be dropped, its prefetch and count wasted
        skip = getattr(request, "skip_reading_prefix_cache", False)
        if not self._roles.consumer or hit <= 0 or skip:
            return 0, False
        rates = self._rates.current()  # (a refresh due is asked for, read at the next)
        self._rates.ask(functools.partial(post_rates, self._link))
        worth = rates.blocks(tiers[first:first + hit])
        self.stats["rate_refreshes"] = self._rates.refreshes
        if worth < hit:
            self.stats["offers_declined"] += 1
            self.stats["declined_tokens"] += (hit - worth) * block
            hit = worth
            if hit == 0:
                return 0, False
        most = self._pinnable(state)
        if hit > most:  # the rest is computed: a load of them all would fail whole
            self.stats["capped_tokens"] += (hit - most) * block
            hit = most
            if hit <= 0:
                return 0, False
        if self._roles.prefetch and any(t != "dram" for t in tiers[first:first + hit]):
            self._prefetch_blocks(state, first, first + hit)
        state.offer = (first, hit)
        self.stats["offers"] += 1
        tokens = (first + hit) * block - num_computed_tokens
        logger.debug("kvstore: request %s: %d tokens cached in the daemon",
                     request.request_id, tokens)
        return tokens, False

    def _missed_key(self, state: RequestState, missed: int) -> bytes:
        """The first group's key of the first block a request's lookup missed (and vLLM
        does not hold).  Where this engine saved it lately (``_saved_lately``), the
        lookup is sent again, once: it went out as the request came, and a request that
        waited in vLLM's queue behind others of its prefix (``max_num_seqs`` reached,
        its prefix cache off or evicted) found none of what they saved meanwhile, and
        computed it all again (and sent it again, a duplicate)."""
        return self._keys(state, self._groups[0], missed + 1)[missed]

    def _waits_for_save(self, state: RequestState, missed: int) -> bool:
        """Whether a request waits a step for the first block its lookup missed: one a
        finished request of this engine saves, the save still on its way to the daemon
        (the worker has not reported it done), for ``SAVE_WAIT_SECONDS`` at most.  A
        request queued behind another of its prefix (``max_num_seqs`` reached, vLLM's
        prefix cache off) was scheduled as that one ended, its saves sent off the step
        and, on a busy host, not yet committed: it computed the blocks again (and sent
        them again)."""
        if self._missed_key(state, missed) not in self._unsent_keys:
            return False
        now = time.monotonic()
        if state.waits_since is None:
            state.waits_since = now
        if now - state.waits_since > SAVE_WAIT_SECONDS:
            return False
        self.stats["save_waits"] += 1
        return True

    def saves_done(self, request_ids: Iterable[str]) -> None:
        """The worker reported these finished requests' saves done (committed or failed:
        a lookup tells which)."""
        for request_id in request_ids:
            for key in self._unsent.pop(request_id, ()):
                count = self._unsent_keys.pop(key) - 1
                if count:
                    self._unsent_keys[key] = count

    def _pinnable(self, state: RequestState) -> int:
        """The most blocks of a request one load may pin: its blocks of every group and
        rank are pinned at once in the daemon's DRAM arena, a load of more than that
        holds fails whole (a prefix longer than the DRAM, cached on SSD, was offered,
        failed and recomputed, every time)."""
        ns = self._namespace(self._groups[0], state.variant, 0)
        if ns is None or ns.slot_bytes <= 0:
            return 1 << 62  # (not opened: nothing is offered without a lookup)
        return ns.arena[1] // ns.slot_bytes // (len(self._groups) * self._tp_size)

    def _lookup_targets(self, state: RequestState, blocks: int) -> list[LookupTarget]:
        return [(functools.partial(self._namespace, group, state.variant, rank),
                 self._keys(state, group, blocks))
                for group in self._groups for rank in range(self._tp_size)]

    def _lookup(self, state: RequestState, blocks: int) -> tuple[int, list[str]]:
        """The request's leading blocks cached in every group and rank (one lookup each,
        from the first block: what the engine holds itself need not be saved again),
        with the tier of each (the first group's and rank's); the lookups sent when the
        request came, if they were."""
        waits, state.lookups = state.lookups, None
        waits = waits or send_lookups(self._lookup_targets(state, blocks), self._link)
        try:
            found = wait_all(waits or [])
        except KVStoreError as exc:
            self._link.failed("lookup", exc)
            return 0, []
        if not found:
            return 0, []
        self.stats["lookups"] += 1
        hit = min([blocks, *(f.blocks for f in found)])
        return hit, found[0].tiers[:hit]

    def _prefetch_blocks(self, state: RequestState, start: int, end: int) -> None:
        """Have the daemon bring blocks below DRAM up now, so the load finds them there."""
        for group in self._groups:
            keys = self._keys(state, group, end)[start:end]
            for rank in range(self._tp_size):
                ns = self._namespace(group, state.variant, rank)
                if ns is None:
                    return
                try:
                    ns.post_prefetch(keys)  # the step does not wait for its reply
                except KVStoreError as exc:
                    self._link.failed("prefetch", exc)
                    return
        self.stats["prefetches"] += 1

    def allocated(self, request: Request, blocks: KVCacheBlocks,
                  num_external_tokens: int) -> None:
        """``update_state_after_alloc``: where the offered blocks load."""
        state = self._state(request)
        offer, state.offer = state.offer, None
        if num_external_tokens <= 0 or offer is None:
            return
        first, _ = offer
        block = self._groups[0].block_tokens
        count = num_external_tokens // block
        block_ids = blocks.get_block_ids()
        for group in self._groups:
            keys = self._keys(state, group, first + count)
            self._pending_loads.append(Transfer(
                request.request_id, group.index, state.variant, keys[first:],
                list(block_ids[group.index][first:first + count])))
        state.saved_blocks = max(state.saved_blocks, first + count)
        self.stats["hit_tokens"] += num_external_tokens
        count_tiers(self.stats, (state.cached or (0, []))[1][first:first + count], block)

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        """``build_connector_meta``: this step's loads, and the blocks that become
        complete in it (to save)."""
        meta = KVStoreConnectorMetadata(
            loads=self._pending_loads, preempted=set(scheduler_output.preempted_req_ids or ()))
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_saves(state, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for ids, more in zip(state.block_ids, new_ids):
                    ids.extend(more)
            self._plan_saves(state, cached.num_computed_tokens[i] + scheduled[req_id], meta)
        return meta

    def _plan_saves(self, state: RequestState, computed_tokens: int,
                    meta: KVStoreConnectorMetadata) -> None:
        """Save the blocks whose every token has its KV computed by the end of this step."""
        if not self._roles.producer or not state.cacheable:
            return
        block = self._groups[0].block_tokens
        full = min(computed_tokens, len(state.request.all_token_ids)) // block
        start = state.saved_blocks
        if full <= start:
            return
        # Leading blocks a live request planned to save (the same prefix: n > 1
        # samples of one prompt, each finding the first's pages) are not sent again: the
        # step would copy their pages out for nothing, and while the first save is under
        # way (reserved, not committed) the daemon does not hold them yet, so they would
        # take slots of their own, to be found duplicates at the commit (keys it holds
        # take no slot and are not written).
        first = self._keys(state, self._groups[0], full)
        while start < full and first[start] in self._planned:
            start += 1
        state.saved_blocks = start
        if full <= start:
            return
        # Every group's blocks checked before any save is planned: a save planned whose
        # request is not marked ``saving`` would have its pages freed under the copy.
        if any(len(state.block_ids[g.index][start:full]) < full - start for g in self._groups):
            return  # blocks not allocated yet (cannot happen in vLLM's scheduler)
        for group in self._groups:
            keys = self._keys(state, group, full)
            meta.saves.append(Transfer(state.request.request_id, group.index, state.variant,
                                       keys[start:], state.block_ids[group.index][start:full],
                                       keys[start - 1] if start else None))
        state.saved_blocks = full
        state.saving = True
        for key in first[start:full]:
            self._planned[key] = self._planned.get(key, 0) + 1
            self._saved_lately[key] = None
            if len(self._saved_lately) > SAVED_LATELY:
                del self._saved_lately[next(iter(self._saved_lately))]
        state.planned.extend(first[start:full])

    def reset(self) -> None:
        """``reset_cache`` (vLLM's, as it loads new weights in place): no block stored
        before is offered from now on, nor one another engine stored (its weights may
        differ): later requests use namespaces of their own (a new ``weights`` tag).
        The requests the engine holds now are neither offered nor saved any more: their
        KV, or a part of it, came from the weights before."""
        self._weights = uuid.uuid4().hex
        for state in self._requests.values():
            if state.lookups:
                settle(state.lookups)
            state.lookups, state.cached, state.offer = None, None, None
            state.cacheable = False
        logger.info("kvstore: the engine's cache was reset: blocks stored before are "
                    "not loaded from now on")

    def finished(self, request: Request) -> bool:
        """``request_finished``: the request forgotten; True when its blocks stay held
        until the worker's ``get_finished`` reports its saves done (its bytes are in the
        store, or the save failed, by then)."""
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.lookups:  # never scheduled: read their replies
            settle(state.lookups)
        for key in state.planned if state is not None else ():
            count = self._planned.pop(key) - 1
            if count:
                self._planned[key] = count
        held = bool(state is not None and state.saving and self._roles.async_saves)
        if held and state is not None and state.planned:  # (until ``saves_done``)
            if len(self._unsent) >= UNSENT_MOST:  # (a report lost: the oldest let go)
                self.saves_done([next(iter(self._unsent))])
            self._unsent[request.request_id] = state.planned
            for key in state.planned:
                self._unsent_keys[key] = self._unsent_keys.get(key, 0) + 1
        return held
