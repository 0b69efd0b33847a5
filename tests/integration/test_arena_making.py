"""A tenant's own arena is made on a thread: other clients are served meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess

from kvstore.auth import issue_token, read_secret, write_secret
from kvstore.client import Client
from kvstore.errors import LimitExceededError


def tenant_daemon(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path,
                  capacity: str, extra: str = "") -> tuple[DaemonProcess, bytes]:
    """A daemon that takes tokens (so each tenant has an arena of its own)."""
    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    config = tmp_path / "tenants.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n{extra}')
    d = daemon_factory(dram_capacity=capacity, extra=["--config", str(config)])
    return d, read_secret(secret_file)


def test_another_tenants_first_hello_does_not_stall_a_client_being_served(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Before, a new tenant's arena (1 GiB: allocated, mapped, its pages faulted in) was
    made on the loop, and every other client waited for it: a ping as long as the new
    tenant's whole hello."""
    d, secret = tenant_daemon(daemon_factory, tmp_path, "1GiB")
    with Client(d.endpoint, token=issue_token(secret, "acme", 600.0)) as acme:
        acme.ping()
        hello: list[float] = []

        def new_tenant() -> None:
            started = time.perf_counter()
            with Client(d.endpoint, token=issue_token(secret, "globex", 600.0)) as globex:
                hello.append(time.perf_counter() - started)
                globex.ping()

        thread = threading.Thread(target=new_tenant)
        thread.start()
        pings = []
        while thread.is_alive():
            started = time.perf_counter()
            acme.ping()
            pings.append(time.perf_counter() - started)
        thread.join()
        assert hello and len(pings) >= 3, (hello, pings)
        assert max(pings) < hello[0] / 2, (max(pings), hello[0], len(pings))


def test_arenas_past_the_limit_are_refused_by_type_and_the_others_still_served(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    d, secret = tenant_daemon(daemon_factory, tmp_path, "64MiB", "[dram]\nmax_arenas = 2\n")
    with Client(d.endpoint, token=issue_token(secret, "a", 600.0)) as a, \
            Client(d.endpoint, token=issue_token(secret, "b", 600.0)) as b:
        with pytest.raises(LimitExceededError, match="max_arenas"):
            Client(d.endpoint, token=issue_token(secret, "c", 600.0), timeout=10.0)
        a.ping()
        b.ping()
        with Client(d.endpoint, token=issue_token(secret, "a", 600.0)) as again:
            again.ping()  # (a tenant's second session: its arena is there)
