"""The engine integrations' shared steps (kvstore.integrations.engine_side) against a real
daemon, with CPU torch tensors as an engine's paged cache."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import numpy as np
import torch
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client, Identity
from kvstore.client import Namespace
from kvstore.errors import (
    CapacityError,
    ForbiddenError,
    LeaseExpiredError,
    LimitExceededError,
    NoSessionError,
    UnavailableError,
    error_from_code,
)
from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings
from kvstore.integrations.engine_side import (
    EnginePages,
    Loaded,
    Stored,
    acquire_prefix,
    acquire_runs,
    offload_missing,
    read_blocks,
    release_all,
    reload_prefix,
    store_missing,
)
from kvstore.keys import chain_keys

LAYERS, TOKENS, HEADS, DIM = 2, 16, 2, 8
PAGES = 8


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half()


def make_pages(kind: str, seed: int) -> tuple[EnginePages, Callable[[int], bytes]]:
    """An engine cache of ``kind`` as EnginePages, and the canonical bytes of a page."""
    if kind == "per_layer":
        layers = [rand(PAGES, 2, TOKENS, HEADS, DIM, seed=seed + i) for i in range(LAYERS)]
        return EnginePages.direct(layers, "per_layer"), lambda page: b"".join(
            _bytes(t[page]) for t in layers)
    if kind == "per_layer_kv_split":
        pairs = [(rand(PAGES, TOKENS, HEADS, DIM, seed=seed + 2 * i),
                  rand(PAGES, TOKENS, HEADS, DIM, seed=seed + 2 * i + 1))
                 for i in range(LAYERS)]
        return EnginePages.direct(pairs, "per_layer_kv_split"), lambda page: b"".join(
            _bytes(torch.stack([k[page], v[page]])) for k, v in pairs)
    if kind == "all_layer":
        cache = rand(PAGES, LAYERS, 2, TOKENS, HEADS, DIM, seed=seed)
        return EnginePages.direct(cache, "all_layer"), lambda page: _bytes(cache[page])
    # staged: vLLM's CPU layout, [pages, H, T, 2*D] per layer (K then V per head)
    raw = [rand(PAGES, HEADS, TOKENS, 2 * DIM, seed=seed + i) for i in range(LAYERS)]
    views = [x.view(PAGES, HEADS, TOKENS, 2, DIM).permute(0, 3, 2, 1, 4) for x in raw]
    return EnginePages.staged(views), lambda page: b"".join(_bytes(v[page]) for v in views)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def identity(layout: str = "paged") -> Identity:
    return make_identity(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                         block_tokens=TOKENS, layout=layout)


def lookups(client: Client) -> int:
    return int(client.stats()["tiers"]["dram"]["lookups"])


KINDS = ["per_layer", "per_layer_kv_split", "all_layer", "staged"]


@pytest.mark.parametrize("kind", KINDS)
def test_offload_then_reload_restores_the_bytes(daemon: DaemonProcess, kind: str) -> None:
    with Client(daemon.endpoint, tenant="acme") as a, Client(daemon.endpoint, tenant="acme") as b:
        ns_a, ns_b = a.namespace(identity(kind)), b.namespace(identity(kind))
        source, source_page = make_pages(kind, seed=1)
        keys = ns_a.keys(range(TOKENS * 4))
        stored = offload_missing(ns_a, source, [6, 1, 4, 0], keys)
        assert stored == (4, 4, None)
        assert offload_missing(ns_a, source, [6, 1, 4, 0], keys) == (4, 0, None)
        target, target_page = make_pages(kind, seed=50)
        assert reload_prefix(ns_b, keys, target, [2, 3, 7, 5]) == Loaded(4)
        for src, dst in zip([6, 1, 4, 0], [2, 3, 7, 5]):
            assert target_page(dst) == source_page(src)


@pytest.mark.parametrize("kind", ["per_layer", "staged"])
def test_a_partly_cached_prefix_loads_only_the_cached_part(daemon: DaemonProcess,
                                                           kind: str) -> None:
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity(kind))
        source, source_page = make_pages(kind, seed=1)
        keys = ns.keys(range(TOKENS * 4))
        assert offload_missing(ns, source, [0, 1], keys[:2]).present == 2
        target, target_page = make_pages(kind, seed=50)
        untouched = [target_page(p) for p in range(PAGES)]
        assert reload_prefix(ns, keys, target, [4, 5, 6, 7]) == Loaded(2)
        assert [target_page(4), target_page(5)] == [source_page(0), source_page(1)]
        assert [target_page(p) for p in (0, 1, 2, 3, 6, 7)] == [
            untouched[p] for p in (0, 1, 2, 3, 6, 7)]
        # The rest of the chain goes in after its cached head, with one lookup.
        before = lookups(client)
        assert offload_missing(ns, source, [0, 1, 2, 3], keys) == (4, 2, None)
        assert lookups(client) - before == 1


def test_one_lookup_per_offload_through_staging(daemon: DaemonProcess) -> None:
    """vLLM's CPU caches go through staging; the save looks the chain up once."""
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("staged"))
        pages, _ = make_pages("staged", seed=1)
        keys = ns.keys(range(TOKENS * 6))
        for chunk, parent in ((slice(0, 3), None), (slice(3, 6), keys[2])):
            before = lookups(client)
            stored = offload_missing(ns, pages, list(range(6))[chunk], keys[chunk],
                                     parent=parent)
            assert stored == (3, 3, None)
            assert lookups(client) - before == 1
        before = lookups(client)
        assert offload_missing(ns, pages, list(range(6)), keys) == (6, 0, None)
        assert lookups(client) - before == 1


def test_read_blocks_copies_the_prefix_or_every_run(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity())
        blocks = [bytes([i]) * ns.block_bytes for i in range(5)]
        keys = [bytes([i]) * 16 for i in range(5)]
        for i in (0, 1, 3):  # unchained keys, 2 and 4 missing
            ns.put([keys[i]], [blocks[i]])
        seen: dict[int, bytes] = {}

        def copy(i: int, slot: memoryview) -> None:
            seen[i] = bytes(slot)

        assert read_blocks(ns, keys, copy) == Loaded(2)
        assert seen == {0: blocks[0], 1: blocks[1]}
        seen.clear()
        assert read_blocks(ns, keys, copy, runs=True) == Loaded(3)
        assert seen == {i: blocks[i] for i in (0, 1, 3)}
        runs = acquire_runs(ns, keys)  # (kept: a Held dropped is given back)
        assert [(start, len(held.keys)) for start, held in runs] == [(0, 2), (3, 1)]
        assert client.stats()["tiers"]["dram"]["pinned_blocks"] == 3  # runs still held


def few_keys_daemon(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path,
                    keys: int) -> DaemonProcess:
    """A daemon whose requests may name at most ``keys`` keys."""
    config = tmp_path / "few-keys.toml"
    config.write_text(f"[server]\nmax_keys_per_request = {keys}\n")
    return daemon_factory(extra=["--config", str(config)])


def test_more_keys_than_a_request_may_name_go_in_several_requests(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    # a reserve or an acquire of more keys than a request may name was refused whole:
    # nothing stored, nothing loaded
    d = few_keys_daemon(daemon_factory, tmp_path, 4)
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(identity())
        keys = chain_keys(ns.id, list(range(10 * ns.identity.block_tokens)),
                          ns.identity.block_tokens)
        blocks = [bytes([i]) * ns.block_bytes for i in range(10)]

        def fill(slots: Any, first: int) -> None:
            for j, slot in enumerate(slots):
                slot[:] = blocks[first + j]

        assert store_missing(ns, keys[:3], fill) == Stored(3, 3)
        assert store_missing(ns, keys, fill) == Stored(10, 7)  # 3 cached, then 4 and 3
        seen: dict[int, bytes] = {}

        def copy(i: int, slot: memoryview) -> None:
            seen[i] = bytes(slot)

        assert read_blocks(ns, keys, copy) == Loaded(10)
        assert seen == dict(enumerate(blocks))
        ns.evict(keys[7:])  # the prefix path: 7 of 10 cached
        seen.clear()
        assert read_blocks(ns, keys, copy) == Loaded(7)
        assert seen == dict(enumerate(blocks[:7]))
        parts = acquire_prefix(ns, keys)
        assert [(start, len(held.keys)) for start, held in parts] == [(0, 4), (4, 3)]
        release_all(held for _, held in parts)
        runs = acquire_runs(ns, keys)
        assert [(start, len(held.keys)) for start, held in runs] == [(0, 4), (4, 3)]
        release_all(held for _, held in runs)
        assert client.stats()["tiers"]["dram"]["pinned_blocks"] == 0


def test_a_chain_longer_than_the_tier_stores_its_leading_blocks_that_fit(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Before, the whole chain's one reservation was refused and nothing was stored."""
    d = daemon_factory(dram_capacity="1MiB")  # (no SSD tier: evicted is gone)
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(identity())
        ns.put([b"s" * 16], [bytes(ns.block_bytes)])  # (to learn the slot's size)
        dram = client.stats()["tiers"]["dram"]
        slots = dram["capacity"] // (dram["committed"] // dram["committed_slots"])
        n = slots * 3 // 2
        keys = chain_keys(ns.id, list(range(n * TOKENS)), TOKENS)
        blocks = [i.to_bytes(4, "little") * (ns.block_bytes // 4) for i in range(n)]

        def fill(out: Any, first: int) -> None:
            for j, slot in enumerate(out):
                slot[:] = blocks[first + j]

        stored = store_missing(ns, keys, fill)
        assert isinstance(stored.error, CapacityError)
        assert stored.present == stored.created == slots  # (the first block evicted)
        cached = ns.lookup(keys).blocks
        assert cached == slots
        assert ns.get(keys[:cached]) == blocks[:cached]
        assert client.stats()["tiers"]["dram"]["reserved_slots"] == 0


def test_a_chain_longer_than_dram_goes_on_into_ssd_past_its_cached_head(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """With an SSD tier each reservation's room is made by demoting the one before: the
    whole chain is stored, in reservations no larger than DRAM; and a head cached past
    DRAM's size (on SSD) leaves the tail to store, not nothing."""
    d = daemon_factory(dram_capacity="1MiB", ssd_capacity="8MiB")
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(identity())
        slots = client.stats()["tiers"]["dram"]["capacity"] // 4096  # (2 KiB blocks)
        n = slots * 2
        keys = chain_keys(ns.id, list(range(n * TOKENS)), TOKENS)
        blocks = [i.to_bytes(4, "little") * (ns.block_bytes // 4) for i in range(n)]

        def fill(out: Any, first: int) -> None:
            for j, slot in enumerate(out):
                slot[:] = blocks[first + j]

        head = slots * 5 // 4
        assert store_missing(ns, keys[:head], fill) == Stored(head, head)
        assert ns.lookup(keys).blocks == head
        assert store_missing(ns, keys, fill) == Stored(n, n - head)
        hit = ns.lookup(keys)
        assert hit.blocks == n and "ssd" in hit.tiers
        for start in range(0, n, 64):  # (DRAM holds half of them)
            assert ns.get(keys[start:start + 64]) == blocks[start:start + 64]


def test_runs_pinned_before_a_daemon_error_are_released(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """The daemon refuses the second run's pin (one pin a session): the first run's
    pin goes with the error, rather than staying until the session's lease ends."""
    config = tmp_path / "pins.toml"
    config.write_text("[server]\nmax_pins_per_session = 1\n")
    daemon = daemon_factory(extra=["--config", str(config)])
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity())
        keys = [bytes([i]) * 16 for i in range(4)]
        for i in (0, 1, 3):  # unchained keys, runs (0, 1) and (3)
            ns.put([keys[i]], [bytes([i]) * ns.block_bytes])
        with pytest.raises(LimitExceededError):
            acquire_runs(ns, keys)
        assert client.stats()["tiers"]["dram"]["pinned_blocks"] == 0
        loaded = read_blocks(ns, keys, lambda i, slot: None, runs=True)
        assert loaded.blocks == 0 and isinstance(loaded.error, LimitExceededError)
        assert client.stats()["tiers"]["dram"]["pinned_blocks"] == 0
        with ns.acquire(keys[:2]) as held:  # the session's one pin is free
            assert held.acquired


def test_store_missing_starts_its_own_chain_when_the_parent_is_gone(
        daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity())
        # Chained as engines chain them (ns.keys would make the client remember keys[0]
        # as the parent, and name it in the reservation itself).
        keys = chain_keys(ns.id, range(TOKENS * 2), TOKENS)
        block = b"\x07" * ns.block_bytes

        def fill(slots: Any, first: int) -> None:
            for slot in slots:
                slot[:] = block

        assert store_missing(ns, keys[1:], fill, parent=keys[0]) == (1, 1, None)
        assert ns.get(keys[1:]) == [block]


def test_a_daemon_that_is_gone_is_a_miss_and_a_backoff(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory()
    now = [0.0]
    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=0.5),
                      backoff_s=10.0, clock=lambda: now[0])
    ns = link.namespace("pages", identity)
    assert isinstance(ns, Namespace)
    source, _ = make_pages("per_layer", seed=1)
    keys = ns.keys(range(TOKENS * 3))
    assert offload_missing(ns, source, [0, 1, 2], keys).present == 3
    target, target_page = make_pages("per_layer", seed=50)
    untouched = [target_page(p) for p in range(PAGES)]

    daemon.stop(signal.SIGKILL)
    loaded = reload_prefix(ns, keys, target, [3, 4, 5])
    assert loaded.blocks == 0 and isinstance(loaded.error, UnavailableError)
    assert [target_page(p) for p in range(PAGES)] == untouched  # nothing half-written
    link.failed("reload", loaded.error)
    assert not link.available() and "backing off" in repr(link)
    assert link.namespace("pages", identity) is None  # at once, no daemon call
    stored = offload_missing(ns, source, [0, 1, 2], keys)
    assert stored.present == 0 and stored.error is not None
    now[0] = 11.0  # past the back-off: a new attempt, which fails again cleanly
    assert link.namespace("pages", identity) is None
    assert link.failures == 2


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_link_connects_again_after_the_daemon_restarts(
        daemon_factory: Callable[..., DaemonProcess], sig: signal.Signals) -> None:
    """A daemon restarted on the same endpoint knows no session of the link's client
    (its socket connects again by itself): the call that finds out is a miss, the link
    connects again, and loads and saves go on, with the right bytes."""
    daemon = daemon_factory()
    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=2.0))
    try:
        ns = link.namespace("pages", identity)
        assert isinstance(ns, Namespace)
        source, source_page = make_pages("per_layer", seed=1)
        keys = ns.keys(range(TOKENS * 3))
        assert offload_missing(ns, source, [0, 1, 2], keys).present == 3
        daemon.stop(sig)
        daemon.start()
        target, target_page = make_pages("per_layer", seed=50)
        untouched = [target_page(p) for p in range(PAGES)]
        loaded = reload_prefix(ns, keys, target, [3, 4, 5])
        assert loaded.blocks == 0 and isinstance(loaded.error, ForbiddenError)
        assert [target_page(p) for p in range(PAGES)] == untouched
        link.failed("reload", loaded.error)
        assert link.available()  # not a daemon that failed to answer: no back-off
        again = link.namespace("pages", identity)
        assert isinstance(again, Namespace) and again is not ns
        assert reload_prefix(again, keys, target, [3, 4, 5]) == Loaded(0)  # a miss
        assert offload_missing(again, source, [0, 1, 2], keys).present == 3
        assert reload_prefix(again, keys, target, [3, 4, 5]) == Loaded(3)
        assert [target_page(p) for p in (3, 4, 5)] == [source_page(p) for p in (0, 1, 2)]
        assert link.failures == 1
        # A request the daemon refuses for itself keeps the session and its client.
        client = link.client()
        other = make_identity(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                              block_tokens=TOKENS, tenant="other")
        assert link.namespace("other", lambda: other) is None  # another tenant's: refused
        assert link.failures == 2 and link.client() is client
        assert link.namespace("pages", identity) is again
    finally:
        link.close()


def test_a_restart_under_many_requests_in_flight_is_no_back_off(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """The scheduler of a tensor-parallel engine sends one lookup per rank's namespace at
    once; after a restart the daemon answers only the first few messages of a peer with
    no session, and drops the rest.  Its refusal says "no session", so the link connects
    again without asking more; a bare ForbiddenError (an older daemon's) is confirmed
    with a short ping, whose silence means no session as well: no back-off either way."""
    daemon = daemon_factory()
    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=5.0))
    ranks = [lambda r=r: make_identity(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                                       block_tokens=TOKENS, layout=f"paged;tp={r}/8")
             for r in range(8)]
    try:
        for older in (False, True):
            spaces = [link.namespace(r, ranks[r]) for r in range(8)]
            assert all(isinstance(ns, Namespace) for ns in spaces)
            keys = spaces[0].keys(range(TOKENS * 3))
            daemon.stop(signal.SIGTERM)
            daemon.start()
            waits = [ns._send_lookup(keys) for ns in spaces if ns is not None]
            waits.append(spaces[-1]._send_lookup(keys))  # a 9th: dropped by the daemon
            with pytest.raises(NoSessionError) as refused:
                waits[0]()
            assert refused.value.code == ForbiddenError.code
            link.failed("lookup", ForbiddenError(str(refused.value)) if older
                        else refused.value)
            assert link.available() and "idle" in repr(link)
            again = link.namespace(0, ranks[0])
            assert isinstance(again, Namespace) and again.lookup(keys).blocks == 0
        assert link.failures == 2
    finally:
        link.close()


def test_no_session_travels_as_a_forbidden_error() -> None:
    """Older clients see a plain ForbiddenError; this one sees what it means."""
    gone = error_from_code("forbidden", "no session: the first request must be hello")
    assert isinstance(gone, NoSessionError) and isinstance(gone, ForbiddenError)
    other = error_from_code("forbidden", "namespace of another tenant")
    assert type(other) is ForbiddenError


def _wait_past_the_lease(watcher: Client, at_most: float = 3.0) -> None:
    """Until the daemon has ended the tenant's other session (seen held first), or
    ``at_most`` seconds: it ends a session idle for a lease, looking four times a lease
    (the watcher's own requests keep its session)."""
    deadline, held = time.monotonic() + at_most, False
    while time.monotonic() < deadline:
        sessions = watcher.stats()["sessions"]
        held = held or sessions > 1
        if held and sessions == 1:
            return
        time.sleep(0.02)


def test_a_link_idle_past_its_lease_connects_again(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """The daemon ends a session idle for a whole lease; the link finds out with a ping
    after half a lease idle and connects again, rather than failing every call after."""
    daemon = daemon_factory(lease=1.0)
    watcher = Client(daemon.endpoint, tenant="acme")
    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=2.0))
    try:
        ns = link.namespace("pages", identity)
        assert isinstance(ns, Namespace)
        keys = ns.keys(range(TOKENS * 2))
        assert ns.lookup(keys).blocks == 0
        _wait_past_the_lease(watcher)
        with pytest.raises(LeaseExpiredError):
            ns.lookup(keys)  # the old session is gone: what the link would have kept
        again = link.namespace("pages", identity)
        assert isinstance(again, Namespace) and again is not ns
        assert again.lookup(keys).blocks == 0
        assert link.failures == 0
        # A call that meets the ended session (no idle check between) drops it too.
        _wait_past_the_lease(watcher)
        with pytest.raises(LeaseExpiredError) as err:
            again.lookup(keys)
        link.failed("lookup", err.value)
        third = link.namespace("pages", identity)
        assert isinstance(third, Namespace) and third is not again
        assert third.lookup(keys).blocks == 0
    finally:
        link.close()
    # Connected in the background: idle from its connect, not from when it is taken over.
    apart = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=2.0), map_arena=False)
    try:
        apart.connect_in_background({"pages": identity})
        _wait_past_the_lease(watcher)  # connected, then idle past the lease before anyone
        # takes it over
        assert apart.namespace("pages", identity) is None  # ended: connecting again, apart
        assert apart.wait_connected(10)
        ns = apart.namespace("pages", identity)
        assert isinstance(ns, Namespace) and ns.lookup(keys).blocks == 0
        assert apart.failures == 0
    finally:
        apart.close()
        watcher.close()


def test_a_background_connect_never_waits_and_is_tried_again_once_the_daemon_is_up(
        tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "late")  # not started yet
    now = [0.0]
    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=0.5),
                      backoff_s=10.0, clock=lambda: now[0], map_arena=False)
    link.connect_in_background({"pages": identity})
    started = time.perf_counter()
    assert link.client() is None and link.namespace("pages", identity) is None
    assert time.perf_counter() - started < 0.2  # a miss at once, not a connect
    assert "connecting" in repr(link)
    assert not link.wait_connected(10)  # the hello timed out: a failed connect, a back-off
    assert link.failures == 1 and not link.available()
    try:
        daemon.start()
        now[0] = 11.0
        assert link.client() is None  # past the back-off: connecting again, apart
        assert link.wait_connected(10)
        assert "connected" in repr(link) and "namespaces=1" in repr(link)
        ns = link.namespace("pages", identity)  # opened by the connect thread
        assert isinstance(ns, Namespace) and ns.lookup(ns.keys(range(TOKENS))).blocks == 0
        assert link.failures == 1
    finally:
        link.close()
        daemon.stop()


def test_a_checkpoint_fingerprint_tells_weights_of_one_shape_apart(tmp_path: Path) -> None:
    """A checkpoint with no revision is told apart by its content: weights replaced in
    place by others of the same names and sizes (a fine-tune) change it, as a changed
    setting does; the same files read alike; a hub id (no directory) has none."""
    from kvstore.integrations.engine_side import checkpoint_fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    (model / "model.safetensors").write_bytes(weights.tobytes())
    first = checkpoint_fingerprint(str(model))
    assert first is not None and first == checkpoint_fingerprint(str(model))
    tuned = weights.copy()
    tuned[len(tuned) // 3:] += 1e-3  # the same size; only later tensors differ
    (model / "model.safetensors").write_bytes(tuned.tobytes())
    second = checkpoint_fingerprint(str(model))
    assert second != first
    (model / "config.json").write_text('{"hidden_size": 65}')
    assert checkpoint_fingerprint(str(model)) not in (first, second)
    assert checkpoint_fingerprint("meta-llama/Llama-3-8B") is None


def test_a_checkpoint_fingerprint_reads_only_settings_and_weights(tmp_path: Path) -> None:
    """Logs, lock files and hidden files beside the checkpoint do not change it (each of
    an engine's ranks computes it, perhaps while another writes a log there)."""
    from kvstore.integrations.engine_side import checkpoint_fingerprint

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 4096)
    first = checkpoint_fingerprint(str(tmp_path))
    (tmp_path / "run.log").write_text("started")
    (tmp_path / ".lock").write_text("")
    assert checkpoint_fingerprint(str(tmp_path)) == first


def test_a_hub_id_resolves_to_its_commit_in_the_local_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id (no directory) is versioned by the commit its revision names in the
    local Hugging Face cache; a commit given as the revision is one; an id the cache
    lacks, and a path, have none."""
    from kvstore.integrations.engine_side import hub_commit

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    refs = tmp_path / "models--org--tiny" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40 + "\n")
    (refs / "v2").write_text("b" * 40)
    assert hub_commit("org/tiny") == "hub:" + "a" * 40
    assert hub_commit("org/tiny", "v2") == "hub:" + "b" * 40
    assert hub_commit("org/other", "c" * 40) == "hub:" + "c" * 40
    assert hub_commit("org/other") is None
    assert hub_commit("org/tiny", "v3") is None
    (refs / "main").write_text("not a commit")
    assert hub_commit("org/tiny") is None
    assert hub_commit(str(tmp_path)) is None
