"""Requests a tenant may send that are well formed but ask for more than the daemon's
limits allow: each is refused with a typed error before any work that grows with it."""

from __future__ import annotations

import os

from daemon_proc import DaemonProcess
from test_attacks import ask
from test_protocol_abuse import Raw, error_code, hello

from kvstore import protocol as p


def test_a_probe_of_more_keys_than_a_request_may_name_is_refused(
        daemon: DaemonProcess) -> None:
    raw = Raw(daemon.endpoint)
    try:
        limit = hello(raw).max_keys
        keys = [os.urandom(16) for _ in range(limit + 1)]
        assert error_code(ask(raw, p.Probe(2, keys))) == "too_large"
        assert isinstance(ask(raw, p.Probe(3, keys[:limit])), p.ProbeReply)
    finally:
        raw.close()
    assert daemon.alive()
