"""An SSD index cut short (a copy or a restore that stopped early, a full disk under a
tool): LMDB maps its file and read past the end, and the daemon died of SIGBUS at every
start, with nothing in its log.  It refuses to start with the reason, and starts cold
once the index is deleted, as the message says."""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import NotFoundError

IDENT = make_identity(num_layers=2, num_kv_heads=2, head_dim=64, tenant="acme")


def test_a_truncated_index_is_refused_with_its_reason_not_a_crash(
        daemon_factory: Any) -> None:
    d = daemon_factory(ssd_capacity="16MiB",
                       extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-through"])
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(16 * 40))
        ns.put(keys, [bytes([i]) * IDENT.block_bytes for i in range(40)])
    d.stop()
    index = d.workdir / "ssd" / "index"
    data = index / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(RuntimeError, match="shorter than its last commit"):
        d.start()
    assert d.proc is not None and d.proc.wait(10) != -signal.SIGBUS
    d.stop()
    shutil.rmtree(index)
    d.start()
    with Client(d.endpoint, tenant="acme") as c:
        with pytest.raises(NotFoundError):
            c.namespace(IDENT).get(keys[:1])
