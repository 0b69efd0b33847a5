"""Loads from a lookup's pins (``lookup_pin``): the vLLM connector's scheduler side pins
what a request's lookup finds on the worker's session, and the worker's step loads from
those pins (``StepLoads.add_held``) with no acquire of its own.  Real daemon, CPU torch
tensors for an engine's paged cache (the layouts of test_engine_side)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from daemon_proc import DaemonProcess
from test_engine_pipeline import _stored_requests, copy
from test_engine_side import identity, make_pages

from kvstore import Client
from kvstore.integrations.engine_side import Loaded
from kvstore.integrations.pipeline import LoadItem, StepLoads


def until(check: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("kind", ["per_layer", "staged"])
def test_a_step_loads_from_a_lookups_pins_without_an_acquire(
        daemon: DaemonProcess, kind: str, layerwise: bool) -> None:
    """Blocks 2..3 of a request pinned by its lookup land in their pages; the step sends
    no acquire; its release lets every pin go (the leading blocks not loaded too)."""
    requests, source_page = _stored_requests(daemon, kind, 2)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity(kind))
        found, held = ns.lookup_pin(requests[1])
        assert found.blocks == 4 and held is not None and len(held.offsets) == 4
        target, target_page = make_pages(kind, seed=50)
        loads = StepLoads()
        loads.add_held(target, LoadItem("r1", requests[1][2:], [6, 4]), held, 2)
        assert loads.pin() == {"r1": Loaded(2)}
        assert loads.calls == 0  # no acquire went
        copy(loads, layerwise)
        assert [target_page(6), target_page(4)] == [source_page(3), source_page(4)]
        assert client.stats()["tiers"]["dram"]["pinned_blocks"] == 4
        loads.finish()
        until(lambda: client.stats()["tiers"]["dram"]["pinned_blocks"] == 0)


def test_pins_handed_over_and_never_loaded_are_released(daemon: DaemonProcess) -> None:
    """A step whose loads are given up before ``pin`` (vLLM never loaded it) still lets
    the pins it was handed go."""
    requests, _ = _stored_requests(daemon, "per_layer", 1)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("per_layer"))
        _, held = ns.lookup_pin(requests[0])
        assert held is not None
        target, _ = make_pages("per_layer", seed=50)
        loads = StepLoads()
        loads.add_held(target, LoadItem("r0", requests[0], [0, 1, 2, 3]), held, 0)
        assert client.stats()["tiers"]["dram"]["pinned_blocks"] == 4
        loads.release()
        until(lambda: client.stats()["tiers"]["dram"]["pinned_blocks"] == 0)
