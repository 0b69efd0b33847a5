"""Checks of the vLLM connector's per-request costs cut from a first token's path, as
behaviour (no timing): a namespace id hashed once per group and request variant; a
staged cache's block size right; a step that loads starts no held save (they start at
the next step).  Run in the vLLM test environment (the connector module imports vLLM)
by test_vllm_connector_costs.py; no engine is started.  Prints one JSON object: each
check's name and "ok" or its failure."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# This checkout's kvstore (a script's directory, not the working one, starts sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvstore.identity import Identity
from kvstore.integrations.engine_side import EnginePages, Loaded
from kvstore.integrations.pipeline import SettledLoads
from kvstore.integrations.vllm import (
    STATS,
    ConnectorOptions,
    KVStoreConnector,
    layerwise_fits,
    usable_cores,
)
from kvstore.integrations.vllm_identity import Group, RequestVariant
from kvstore.integrations.vllm_requests import (
    KVStoreConnectorMetadata,
    NamespaceIds,
    Transfer,
)

IDENTITY = Identity(model="m", model_revision="r", tenant="t", kv_dtype="float32",
                    num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4,
                    layout="paged")
GROUP, OTHER = Group(0, ("a",), 4, 2, 8, IDENTITY), Group(1, ("b",), 4, 2, 8, IDENTITY)


@contextmanager
def derived() -> Iterator[list[tuple[int, RequestVariant]]]:
    """Every identity derived from a group meanwhile: (group index, variant)."""
    calls: list[tuple[int, RequestVariant]] = []
    derive = Group.identity_for

    def counting(self: Group, variant: RequestVariant, rank: int, size: int) -> Identity:
        calls.append((self.index, variant))
        return derive(self, variant, rank, size)
    Group.identity_for = counting  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        Group.identity_for = derive  # type: ignore[method-assign]


def expected(group: Group, variant: RequestVariant, tp_size: int) -> bytes:
    return Group.identity_for(group, variant, 0, tp_size).namespace_id


def check_a_namespace_id_is_hashed_once_per_group_and_variant() -> None:
    ids = NamespaceIds(tp_size=2)
    plain, salted = RequestVariant(), RequestVariant(salt="s")
    with derived() as calls:
        got = [(ids.of(GROUP, plain), ids.of(GROUP, salted), ids.of(OTHER, salted))
               for _ in range(3)]
    assert sorted(calls, key=repr) == sorted([(0, plain), (0, salted), (1, salted)],
                                             key=repr), calls
    assert got == [(expected(GROUP, plain, 2), expected(GROUP, salted, 2),
                    expected(OTHER, salted, 2))] * 3
    assert len(set(got[0][:2])) == 2   # a salt is another namespace


def check_past_the_limit_ids_are_hashed_each_time_and_still_right() -> None:
    ids = NamespaceIds(tp_size=1, limit=1)
    first, second = RequestVariant(salt="a"), RequestVariant(salt="b")
    with derived() as calls:
        got = [(ids.of(GROUP, first), ids.of(GROUP, second)) for _ in range(3)]
    assert calls.count((0, first)) == 1, calls    # kept
    assert calls.count((0, second)) == 3, calls   # past the limit: hashed each time
    assert got == [(expected(GROUP, first, 1), expected(GROUP, second, 1))] * 3


def check_a_staged_cache_block_size_is_its_pages_bytes() -> None:
    # vLLM's CPU layout: per page and head, K as [T, D] then V as [T, D]
    caches = [torch.zeros(5, 2, 4, 16) for _ in range(3)]
    pages = EnginePages.staged([x.view(5, 2, 2, 4, 8).permute(0, 2, 3, 1, 4)
                                for x in caches])
    assert pages.block_bytes == 3 * 2 * 4 * 16 * 4
    rows = torch.arange(2 * pages.block_bytes, dtype=torch.uint8).view(2, -1)
    pages.scatter_rows(list(rows), [3, 1])
    back = torch.empty_like(rows)
    pages.copy_into([3, 1], list(back))
    assert torch.equal(back, rows)


@dataclass
class SenderStub:
    """What the worker asks of the background sender; ``order`` the calls seen."""

    order: list[str]
    waited: list[set[str]] = field(default_factory=list)

    def go(self) -> None:
        self.order.append("go")

    def wait_for(self, tags: set[str], timeout: float | None) -> bool:
        self.waited.append(tags)
        self.go()
        return True

    def submit(self, job: object, after_step: bool) -> None:
        self.order.append("submit")

    def take_finished(self, tags: set[str] | None = None) -> set[str]:
        return set()  # (no job ever ends here)

    @property
    def stats(self) -> dict[str, int]:
        return {}


@dataclass
class LoadsStub:
    """A step's loads (``StepLoads``) that copy nothing but say when they would."""

    order: list[str]
    calls: int = 0
    waited_s: float = 0.0
    started: bool = False

    def pinned(self) -> dict[str, Loaded]:
        self.order.append("pinned")
        return {}

    def copy_all(self) -> None:
        self.order.append("copied")

    def settle(self) -> None:
        pass

    def release(self) -> None:
        self.order.append("released")


@dataclass
class OptionsStub:
    post_loads: bool = False
    copy_ahead: bool = False
    layerwise: bool | None = False


def worker(order: list[str]) -> tuple[KVStoreConnector, SenderStub]:
    """A worker-side connector with just what a step's calls read, its sender a stub
    and its loads ``LoadsStub``s."""
    connector = KVStoreConnector.__new__(KVStoreConnector)
    connector.stats = dict.fromkeys(STATS, 0)
    connector._settled = SettledLoads()
    connector._step_loads = None
    connector._posted_loads = None
    connector._load_errors = set()
    connector._loads_failed = set()
    connector._unsent = set()
    connector._layer_index = {}
    sender = SenderStub(order)
    connector._sender = sender  # type: ignore[assignment]
    connector._saving = set()
    connector._finished_saving = set()
    connector._opts = OptionsStub()  # type: ignore[assignment]
    link = type("Link", (), {"settings": type("Settings", (), {"timeout": 1.0})})()
    connector._link = link
    connector._plan_loads = lambda transfers: LoadsStub(order)  # type: ignore
    return connector, sender


def load(req_id: str) -> Transfer:
    return Transfer(req_id, 0, RequestVariant(), [b"k" * 16], [7])


def step(connector: KVStoreConnector, meta: KVStoreConnectorMetadata) -> None:
    """A step's calls, as vLLM's model runner makes them, up to the forward."""
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)  # type: ignore[arg-type]


def check_a_step_that_loads_starts_held_saves_once_its_blocks_are_copied() -> None:
    order: list[str] = []
    connector, _ = worker(order)
    step(connector, KVStoreConnectorMetadata(loads=[load("r1")]))
    assert order == ["pinned", "copied", "go"], order  # not beside the copy
    order.clear()
    step(connector, KVStoreConnectorMetadata())
    assert order == ["released", "go"], order  # the last step's pins; held saves at once


def check_a_preempted_request_saves_are_still_waited_for_in_a_step_that_loads() -> None:
    order: list[str] = []
    connector, sender = worker(order)
    connector._saving = {"old"}
    step(connector, KVStoreConnectorMetadata(loads=[load("r1")], preempted={"old"}))
    assert sender.waited == [{"old"}]  # its pages are vLLM's again: its saves end first
    assert order == ["go", "pinned", "copied", "go"], order  # wait_for lets them go

def check_a_request_whose_load_failed_sends_no_save_and_is_let_go_at_its_end() -> None:
    # its later blocks were computed on pages never filled; stored, every request that
    # loaded them was served wrong KV.  vLLM holds the request for the saves it planned:
    # with none sent, it is let go as it finishes
    order: list[str] = []
    connector, _ = worker(order)
    step(connector, KVStoreConnectorMetadata(loads=[load("r1")]))  # nothing pinned: failed
    assert connector.get_block_ids_with_load_errors() == {7}
    connector.bind_connector_metadata(KVStoreConnectorMetadata(saves=[load("r1")]))
    order.clear()
    connector.wait_for_save()
    assert "submit" not in order and connector.stats["saves_after_failed_load"] == 1
    assert connector.get_finished(set()) == (None, None)  # still running: held
    assert connector.get_finished({"r1"}) == ({"r1"}, None)
    assert connector.get_finished({"r1"}) == (None, None)  # once
    assert not connector._loads_failed and not connector._unsent


def check_layerwise_is_true_false_or_auto() -> None:
    def parse(value: object) -> bool | None:
        return ConnectorOptions.from_extra({"layerwise": value}, None).layerwise

    assert ConnectorOptions.from_extra({}, None).layerwise is None  # "auto", the default
    assert [parse(v) for v in (True, False, "auto", "TRUE", "false", 1, 0)] == [
        True, False, None, True, False, True, False]
    try:
        parse("sometimes")
    except ValueError as exc:
        assert "layerwise" in str(exc) and "sometimes" in str(exc), exc
    else:
        raise AssertionError("a layerwise of 'sometimes' was taken")


def check_auto_goes_layer_by_layer_once_every_layer_was_asked_for() -> None:
    connector, _ = worker([])
    connector._opts = OptionsStub(layerwise=None)  # type: ignore[assignment]
    connector._layer_index = {"l0": 0, "l1": 1}
    connector._layerwise_fits, connector._layers_unasked = True, {"l0", "l1"}
    assert not connector._layer_by_layer()  # an attention that never asks: whole
    connector.wait_for_layer_load("l0")
    connector.wait_for_layer_load("l0")
    assert not connector._layer_by_layer()
    connector.wait_for_layer_load("l1")
    assert connector._layer_by_layer()
    connector._layerwise_fits = False  # no CPU to spare
    assert not connector._layer_by_layer()
    connector._opts = OptionsStub(layerwise=True)  # type: ignore[assignment]
    assert connector._layer_by_layer()
    assert layerwise_fits(True, 1, 2) and not layerwise_fits(True, 2, 2)
    assert not layerwise_fits(False, 1, 64)  # a GPU's copies queue on its stream
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


def check_a_worker_on_host_pages_copies_every_steps_loads_on_one_kept_thread() -> None:
    # a thread started per step had the step wait for it to run (0.2-1.8 ms a step)
    connector = KVStoreConnector.__new__(KVStoreConnector)
    connector._groups, connector._tp_size, connector._layers = [GROUP], 1, {}
    connector._layer_index, connector._copier, connector._is_producer = {}, None, False
    connector._opts = ConnectorOptions.from_extra({}, None)
    link = type("Link", (), {"client": lambda self: None,
                             "answered_elsewhere": lambda self: None})()
    connector._link = link  # type: ignore[assignment]
    connector.register_kv_caches({"a": torch.zeros(5, 2, 4, 16)})  # vLLM's CPU layout
    steps = [connector._plan_loads([]) for _ in range(2)]
    assert connector._copier is not None
    assert all(loads._copier is connector._copier for loads in steps), steps
    connector._copier.shutdown()


def check_an_offer_never_waits_a_round_trip_for_the_daemons_rates() -> None:
    """A scheduler's offer with a rates' refresh due, against a daemon: the probe for
    them goes out with the request's lookups and its reply is read with theirs; no
    offer waits for a reply of its own (it took a blocking probe every 10 s)."""
    import subprocess
    import tempfile

    from kvstore.client import Client
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import engine_connector_cpu as bench
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    work = Path(tempfile.mkdtemp(prefix="kvrates-"))
    endpoint = f"ipc://{work / 'kvstore.sock'}"
    root = str(Path(__file__).resolve().parents[2])
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint,
         "--dram-capacity", "64MiB", "--ssd-capacity", "0", "--ssd-path", str(work / "ssd"),
         "--slab-size", "16MiB", "--log-level", "warning"], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": root})
    assert daemon.stdout is not None
    while line := daemon.stdout.readline():
        if b"serving on" in line:
            break
    waits: list[bool] = []  # per reply waited for in an offer: whether it was in already
    wait = Client._wait

    def counting(self: Client, rid: int) -> Any:
        waits.append(rid in self._early)
        return wait(self, rid)
    try:
        config, kv_cache_config = bench.vllm_config(endpoint)
        config.kv_transfer_config.kv_connector_extra_config["prefill_tokens_per_s"] = 1000
        sched = KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        assert sched._link.wait_connected(10.0)
        for n in range(2):
            req = bench.Request(f"r{n}", list(range(3, 3 + 4 * bench.BLOCK)))
            sched.on_new_request(req)  # type: ignore[arg-type]
            book = sched._book
            book._lookup(book._state(req), 4)  # (its lookups read: a miss, on this daemon)
            book._state(req).cached = (4, ["dram"] * 4)  # as if cached: an offer's rates
            Client._wait = counting  # type: ignore[method-assign]
            try:
                tokens, _ = sched.get_num_new_matched_tokens(req, 0)  # type: ignore
            finally:
                Client._wait = wait  # type: ignore[method-assign]
            assert tokens == 3 * bench.BLOCK, tokens
            assert all(waits), waits  # no reply waited for that was not in
            assert sched.stats["rate_refreshes"] == 1, sched.stats  # the daemon's, taken
        sched.shutdown()
    finally:
        daemon.terminate()
        daemon.wait()


CHECKS: dict[str, Callable[[], None]] = {
    name.removeprefix("check_"): fn for name, fn in globals().items()
    if name.startswith("check_") and callable(fn)}


def main() -> None:
    results = {}
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # reported, so that every check runs
            results[name] = traceback.format_exc(limit=3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
