"""A daemon without credentials labels its metrics by the tenants clients name, the
first 256 of them: a script's hellos under 300 made-up names took every label, and the
tenants the configuration names (weights, grants) were counted as ``other``.  Real
daemon, real clients, real HTTP."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess, free_port
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client
from kvstore.metrics import OTHER_TENANT


def requests_by_tenant(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvstore_requests_total" and s.labels.get("verb") == "ping":
                out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0) + s.value
    return out


def test_configured_tenants_keep_their_labels_after_a_flood_of_names(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    port = free_port()
    config = tmp_path / "kvstore.toml"
    config.write_text('[server]\ntenant_weights = { acme = 2.0 }\n'
                      '[auth]\nshared_tenants = { globex = ["initech"] }\n')
    d = daemon_factory(extra=["--config", str(config), "--metrics-port", str(port)])
    for i in range(300):
        with Client(d.endpoint, tenant=f"made-up-{i}") as c:
            c.ping()
    for tenant in ("acme", "globex", "initech"):
        with Client(d.endpoint, tenant=tenant) as c:
            c.ping()
    counts = requests_by_tenant(port)
    assert counts.get("acme") == 1 and counts.get("globex") == 1, counts
    assert counts.get("initech") == 1, counts
    assert counts.get(OTHER_TENANT, 0) >= 300 - 256, counts
