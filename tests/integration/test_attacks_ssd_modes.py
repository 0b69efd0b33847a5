"""The SSD tier's directory holds every tenant's blocks and an index of them (block
keys, which follow from the tokens, and namespaces' identities, tenants' names among
them).  The index was made 0644 in a 0755 directory (LMDB's default mode, the umask's):
any user of the host could read which prompts another tenant has cached, by key, past
the daemon's per-namespace lookups.  The daemon's user alone may read any of it."""

from __future__ import annotations

import os
import stat
from typing import Any

from kvtest import make_identity

from kvstore import Client

IDENT = make_identity(num_layers=2, num_kv_heads=2, head_dim=64, tenant="acme")


def test_ssd_tier_files_and_directories_are_the_daemons_alone(daemon_factory: Any) -> None:
    old = os.umask(0o022)   # the common default, whatever the test runner's
    try:
        d = daemon_factory(ssd_capacity="16MiB",
                           extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-through"])
    finally:
        os.umask(old)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(16 * 2))
        ns.put(keys, [b"\x44" * IDENT.block_bytes] * 2)
    d.stop()                  # everything written and synced
    root = d.workdir / "ssd"
    made = [root, *root.rglob("*")]
    assert any(p.name == "data.mdb" for p in made)
    for p in made:
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, (p, oct(p.stat().st_mode))
