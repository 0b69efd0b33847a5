"""A shared writer's block under a grantee's first key hides nothing of the grantee's.

``auth.shared_writers`` lets acme write into public's namespaces, which globex also
sees.  acme commits into public's namespace a block under globex's first key (keys of
its own making); globex then caches its own chain.  The map of first blocks holds both
namespaces for that key, and the probe took the first one its session may see, in the
order they were added: public's, so globex's router was told of acme's one block and
not of globex's own chain of eight (or of any chain acme cared to plant).  A session's
own namespaces come first now, then those shared with it.  A real daemon process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.auth import issue_token, read_secret

PUBLIC = make_identity(tenant="public", num_layers=4, num_kv_heads=4, head_dim=64)
GLOBEX = make_identity(tenant="globex", num_layers=4, num_kv_heads=4, head_dim=64)


def test_a_shared_writers_block_under_my_first_key_hides_nothing_of_mine(
        daemon_factory: Any, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "kvstore", "keygen", "--secret", str(secret)],
                   check=True, capture_output=True, timeout=60)
    config = tmp_path / "grants.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret}"\n'
                      '[auth.shared_tenants]\npublic = ["acme", "globex"]\n'
                      '[auth.shared_writers]\npublic = ["acme"]\n')
    d = daemon_factory(extra=["--config", str(config)])

    def connect(tenant: str) -> Client:
        return Client(d.endpoint, token=issue_token(read_secret(secret), tenant, 3600.0))

    with connect("acme") as acme, connect("globex") as globex:
        mine = globex.namespace(GLOBEX)
        keys = mine.keys(range(8 * GLOBEX.block_tokens))
        planted = acme.namespace(PUBLIC)  # public's namespace, written by acme
        planted.put(keys[:1], [os.urandom(PUBLIC.block_bytes)])
        mine.put(keys, [os.urandom(GLOBEX.block_bytes) for _ in keys])
        assert globex.probe(keys).tier_runs == [("dram", 8)], "my chain hidden"
        assert acme.probe(keys).tier_runs == [("dram", 1)]  # (public's, as acme sees it)
