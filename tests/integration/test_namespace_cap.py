"""``server.max_namespaces_per_tenant`` against a real daemon: a namespace over the cap is
refused with a typed error and leaves nothing (no namespace, no SSD record); reopening one
the tenant has is never refused; a drop that empties one frees its place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import LimitExceededError

A, B, C = (make_identity(model=f"m{i}") for i in range(3))


def namespaces(client: Client) -> int:
    return int(client.stats()["namespaces"])


def test_the_cap_refuses_without_a_trace_and_a_drop_frees_a_place(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text("[server]\nmax_namespaces_per_tenant = 2\n")
    daemon = daemon_factory(dram_capacity="8MiB", ssd_capacity="4MiB",
                            extra=["--config", str(config), "--slab-size", "1MiB"])
    with Client(daemon.endpoint, tenant="acme") as client:
        a = client.namespace(A)
        client.namespace(B)
        with pytest.raises(LimitExceededError, match="max_namespaces_per_tenant"):
            client.namespace(C)
        assert namespaces(client) == 2
        assert client.namespace(A).id == a.id  # reopening is never refused
    with Client(daemon.endpoint, tenant="other") as client:
        client.namespace(make_identity(tenant="other"))  # another tenant's own cap
        assert namespaces(client) == 3
    daemon.stop()
    daemon.start()  # the SSD index brings back every namespace it recorded: not C
    with Client(daemon.endpoint, tenant="acme") as client:
        assert namespaces(client) == 3
        with pytest.raises(LimitExceededError):
            client.namespace(C)
        a = client.namespace(A)
        keys = a.keys(range(2 * A.block_tokens))
        a.put(keys, [b"\1" * A.block_bytes] * 2)
        assert a.drop() == 2
        assert namespaces(client) == 2  # emptied: its place is free
        c = client.namespace(C)
        c.put(c.keys(range(C.block_tokens)), [b"\2" * C.block_bytes])
        with pytest.raises(LimitExceededError):
            a.lookup(keys)  # dropped: back only within the cap
        assert namespaces(client) == 3
        assert client.stats()["invariant_violations"] == 0
