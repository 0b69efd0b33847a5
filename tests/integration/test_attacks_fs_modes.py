"""The ``fs`` remote store holds every tenant's blocks as files.  Made 0644 in 0755
directories (the umask's), any user of the host read them there, past the daemon's
isolation of tenants (KV blocks tell much of the prompts they came from): the daemon's
user alone may read what it writes."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

from kvtest import make_identity

from kvstore import Client

IDENT = make_identity(num_layers=2, num_kv_heads=2, head_dim=64, tenant="acme")


def test_fs_store_files_and_directories_are_the_daemons_alone(
        daemon_factory: Any, tmp_path: Path) -> None:
    root = tmp_path / "shared"
    old = os.umask(0o022)   # the common default, whatever the test runner's
    try:
        d = daemon_factory(extra=["--remote", f"fs://{root}"])
    finally:
        os.umask(old)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(16 * 2))
        ns.put(keys, [b"\x33" * IDENT.block_bytes] * 2)
        deadline = time.monotonic() + 15
        while c.stats()["remote"]["writes"] < 2:
            assert time.monotonic() < deadline, "no write-through"
            time.sleep(0.05)
    made = [p for p in root.rglob("*")]
    # the two blocks, and the store's generation token (``FsBackend.generation``)
    assert sum(p.is_file() and p.name != "generation" for p in made) == 2
    assert (root / "generation").is_file()
    for p in made:
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, (p, oct(p.stat().st_mode))
