"""An engine's link to the daemon (kvstore.integrations.daemon_link) against a real daemon:
what it counts as a failure."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from test_engine_side import identity

from kvstore.client import Namespace
from kvstore.errors import ForbiddenError, LimitExceededError
from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings


def test_a_refusal_whose_confirming_ping_is_refused_counts_once(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """A bare ForbiddenError makes the link ask, with a ping, whether its session lives;
    a ping refused for a reason of its own (here the session's request rate) says it
    does: the client is kept, and the one failed step counts once."""
    config = tmp_path / "rate.toml"
    config.write_text("[server]\nmax_requests_per_second = 1\n")
    daemon = daemon_factory(extra=["--config", str(config)])
    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=5.0), map_arena=False)
    try:
        client = link.connect()
        assert isinstance(link.namespace("pages", identity), Namespace)  # the second's
        with pytest.raises(LimitExceededError):  # a request less than a second later
            client.ping()
        link.failed("lookup", ForbiddenError("namespace of another tenant"))
        assert link.failures == 1
        assert link.client() is client and "connected" in repr(link)
    finally:
        link.close()
