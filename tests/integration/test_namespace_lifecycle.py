"""Namespaces in a real daemon: one that no session has open and that holds no block is
forgotten (memory and its SSD record), so a client that opens namespace after namespace
leaves nothing behind once its session ends; caps per session and per tenant refuse the
rest with a typed error and create nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client
from kvstore.config import load_config
from kvstore.errors import LimitExceededError
from kvstore.tiers.ssd import SSDStore

LEASE = 1.0  # sessions end this long after their client goes quiet


def namespaces(d: DaemonProcess) -> int:
    with Client(d.endpoint, tenant="audit") as client:
        stats = client.stats()
    assert stats["invariant_violations"] == 0
    count: int = stats["namespaces"]
    return count


def settled(d: DaemonProcess, want: int, timeout: float = 10 * LEASE) -> int:
    """The daemon's namespace count once it reaches ``want`` (or the last seen)."""
    deadline = time.monotonic() + timeout
    while (seen := namespaces(d)) != want and time.monotonic() < deadline:
        time.sleep(LEASE / 4)
    return seen


def ssd_has(client: Client, blocks: int) -> None:
    """Wait until the SSD tier holds ``blocks`` (written through)."""
    deadline = time.monotonic() + 10
    while client.stats()["tiers"]["ssd"]["committed_slots"] < blocks:
        assert time.monotonic() < deadline, "write-through did not reach the ssd"
        time.sleep(0.05)


def started(daemon_factory: Any, tmp_path: Path, toml: str = "", **kw: Any) -> DaemonProcess:
    config = tmp_path / "kvstore.toml"
    config.write_text(toml)
    d: DaemonProcess = daemon_factory(lease=LEASE, extra=["--config", str(config)], **kw)
    return d


def test_namespaces_a_session_left_empty_are_forgotten_when_it_ends(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = started(daemon_factory, tmp_path, '[ssd]\nwrite_policy = "write-through"\n',
                ssd_capacity="16MiB")
    kept = make_identity(tenant="acme", model="kept")
    with Client(d.endpoint, tenant="acme") as client:
        for i in range(200):
            client.namespace(make_identity(tenant="acme", model=f"flood-{i}"))
        ns = client.namespace(kept)
        keys = ns.keys(range(64))
        ns.put(keys, [bytes(kept.block_bytes)] * len(keys))
        assert namespaces(d) == 201
        ssd_has(client, len(keys))
    # the session ends with its lease: only the namespace with blocks stays
    assert settled(d, 1) == 1
    # and a restart does not bring the others back from the SSD tier's records
    d.stop()
    d.start()
    with Client(d.endpoint, tenant="acme") as client:
        assert client.namespace(kept).lookup(keys).blocks == len(keys)
        assert namespaces(d) == 1


def test_a_namespace_emptied_after_its_session_ended_is_forgotten_and_can_come_back(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = started(daemon_factory, tmp_path, ssd_capacity="16MiB",
                toml='[ssd]\nwrite_policy = "write-through"\n')
    ident = make_identity(tenant="acme", model="comes-back")
    payload = bytes(range(256)) * (ident.block_bytes // 256)
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        ns.put(ns.keys(range(32)), [payload] * 2)
        ssd_has(client, 2)  # (a block being written is pinned: a drop would keep it)
    time.sleep(2 * LEASE)  # its session ends; its blocks keep the namespace
    assert namespaces(d) == 1
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        assert ns.drop() == 2
    assert settled(d, 0) == 0  # empty, and that session ended too: forgotten
    # opened again: made anew, its record written again, so its blocks survive a restart
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        keys = ns.keys(range(48))
        ns.put(keys, [payload] * 3)
        ssd_has(client, 3)
    d.stop()
    d.start()
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        assert ns.lookup(keys).blocks == 3
        assert ns.get(keys) == [payload] * 3


def test_a_namespace_is_recorded_on_ssd_with_its_first_blocks_not_when_opened(
        daemon_factory: Any, tmp_path: Path) -> None:
    # an open wrote (and synced) the namespace's record on the loop: 0.3-1.1 ms a new
    # namespace here, every client stalled meanwhile, a disk's sync time on a slow one
    d = started(daemon_factory, tmp_path, ssd_capacity="16MiB",
                toml='[ssd]\nwrite_policy = "write-through"\n')
    empty, written = (make_identity(tenant="acme", model=m) for m in ("empty", "written"))
    payload = bytes(range(256)) * (written.block_bytes // 256)
    with Client(d.endpoint, tenant="acme") as client:
        client.namespace(empty)
        ns = client.namespace(written)
        keys = ns.keys(range(32))
        ns.put(keys, [payload] * 2)
        ssd_has(client, 2)
    d.stop()
    config = load_config(overrides={"ssd": {"path": str(d.workdir / "ssd"),
                                            "capacity": "16MiB"}})
    engine = SSDStore(config.ssd_path, config.ssd_capacity,
                      slab_bytes=config.ssd_slab_bytes, direct_io=False)
    try:
        assert set(engine.namespaces()) == {written.namespace_id}
    finally:
        engine.close()
    d.start()
    with Client(d.endpoint, tenant="acme") as client:
        assert client.namespace(written).get(keys) == [payload] * 2


def test_a_session_over_its_namespace_cap_is_refused_and_nothing_is_made(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = started(daemon_factory, tmp_path, "[server]\nmax_namespaces_per_session = 4\n")
    with Client(d.endpoint, tenant="acme") as client:
        opened = [client.namespace(make_identity(tenant="acme", model=f"m{i}"))
                  for i in range(4)]
        with pytest.raises(LimitExceededError, match="4 namespaces open"):
            client.namespace(make_identity(tenant="acme", model="one-more"))
        assert namespaces(d) == 4
        # one already open opens again, past the cap: it is the same namespace
        again = client.namespace(make_identity(tenant="acme", model="m0"))
        assert again.id == opened[0].id
        keys = again.keys(range(16))
        again.put(keys, [bytes(again.block_bytes)])
        assert again.lookup(keys).blocks == 1
    # another session of the tenant has its own four
    with Client(d.endpoint, tenant="acme") as other:
        for i in range(4):
            other.namespace(make_identity(tenant="acme", model=f"other-{i}"))


def test_a_tenant_over_its_namespace_cap_is_refused_until_its_unused_ones_go(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = started(daemon_factory, tmp_path, "[server]\nmax_namespaces_per_tenant = 3\n")
    with Client(d.endpoint, tenant="acme") as first:
        for i in range(3):
            first.namespace(make_identity(tenant="acme", model=f"m{i}"))
        with Client(d.endpoint, tenant="acme") as second:
            with pytest.raises(LimitExceededError, match="tenant 'acme' has 3 namespaces"):
                second.namespace(make_identity(tenant="acme", model="new"))
            # one the tenant has already passes: no new namespace is made
            second.namespace(make_identity(tenant="acme", model="m1"))
            # other tenants are not counted against it
            with Client(d.endpoint, tenant="globex") as third:
                third.namespace(make_identity(tenant="globex", model="m0"))
                assert namespaces(d) == 4
        # the third closed: its session ended at once (it said goodbye), and the
        # namespace nothing else uses with it
        assert settled(d, 3, timeout=5) == 3
    # both sessions ended and none of the tenant's namespaces holds a block
    assert settled(d, 0) == 0
    with Client(d.endpoint, tenant="acme") as client:
        for i in range(3):
            client.namespace(make_identity(tenant="acme", model=f"later-{i}"))
