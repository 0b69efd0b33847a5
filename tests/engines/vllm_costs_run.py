"""Checks of the vLLM connector's per-request costs cut from a first token's path, as
behaviour (no timing): a namespace id hashed once per group and request variant; a
staged cache's block size right; a step that loads starts no held save (they start at
the next step).  Run in the vLLM test environment (the connector module imports vLLM)
by test_vllm_connector_costs.py; no engine is started.  Prints one JSON object: each
check's name and "ok" or its failure."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

# This checkout's kvstore (a script's directory, not the working one, starts sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvstore.identity import Identity
from kvstore.integrations.engine_side import EnginePages
from kvstore.integrations.pipeline import SettledLoads
from kvstore.integrations.vllm import (
    KVStoreConnector,
    KVStoreConnectorMetadata,
    NamespaceIds,
    Transfer,
)
from kvstore.integrations.vllm_identity import Group, RequestVariant

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
    """What handle_preemptions asks of the background sender."""

    gos: int = 0
    waited: list[set[str]] = field(default_factory=list)

    def go(self) -> None:
        self.gos += 1

    def wait_for(self, tags: set[str], timeout: float | None) -> bool:
        self.waited.append(tags)
        self.go()
        return True


@dataclass
class OptionsStub:
    post_loads: bool = False
    copy_ahead: bool = False


def worker(sender: SenderStub) -> KVStoreConnector:
    """A worker-side connector with just what handle_preemptions reads."""
    connector = KVStoreConnector.__new__(KVStoreConnector)
    connector.stats = {"load_us": 0, "save_us": 0}
    connector._settled = SettledLoads()
    connector._sender = sender  # type: ignore[assignment]
    connector._saving = set()
    connector._opts = OptionsStub()  # type: ignore[assignment]
    return connector


def load(req_id: str) -> Transfer:
    return Transfer(req_id, 0, RequestVariant(), [b"k" * 16], [7])


def check_a_step_that_loads_starts_no_held_save() -> None:
    sender = SenderStub()
    connector = worker(sender)
    connector.handle_preemptions(KVStoreConnectorMetadata(loads=[load("r1")]))
    assert sender.gos == 0            # the first token of r1 waits on this step
    connector.handle_preemptions(KVStoreConnectorMetadata())
    assert sender.gos == 1            # the next step lets them go
    connector.handle_preemptions(KVStoreConnectorMetadata(saves=[load("r2")]))
    assert sender.gos == 2


def check_a_preempted_request_saves_are_still_waited_for_in_a_step_that_loads() -> None:
    sender = SenderStub()
    connector = worker(sender)
    connector._saving = {"old"}
    connector._link = type("Link", (), {"settings": type("S", (), {"timeout": 1.0})})()  # type: ignore[assignment]
    connector.handle_preemptions(KVStoreConnectorMetadata(loads=[load("r1")],
                                                          preempted={"old"}))
    assert sender.waited == [{"old"}]  # its pages are vLLM's again: its saves end first
    assert sender.gos == 1             # (wait_for lets every held save go)


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
