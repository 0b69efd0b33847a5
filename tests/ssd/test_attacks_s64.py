"""The SSD tier's restarts attacked as an unlucky operator would: real daemon processes
on real files, restarted with records the new start cannot take back.

A warm restart dropped the records of a namespace whose identity record it could not
read (missing, or written by a kvstore that encodes identities otherwise) without a
word: a restart that brought back 8 of 16 blocks logged only "8 blocks restored", and
the operator had no way to tell the other 8 had been thrown away, nor why.  Only
orphans were logged; records outside the layout, overlapping ones, those sized for
another configuration and those of no readable namespace went silently.  Now one line
says how many went, for each reason.

A daemon started under a file size limit (``ulimit -f``, ``LimitFSIZE=`` in its unit)
lower than ``ssd.capacity`` refused to start with "SSD tier directory ...: a file
cannot be opened ([Errno 27] File too large)": no word of the limit, and the file
opened fine.  Now the error names the limit and the capacity, before anything is made.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess, refused_under_file_size_limit
from kvtest import make_identity

from kvstore import Client
from kvstore.tiers.ssd import SSDStore

MiB = 1 << 20
KEPT = make_identity(model="kept", num_layers=4, num_kv_heads=4, head_dim=16)  # 16 KiB
LOST = make_identity(model="lost", num_layers=4, num_kv_heads=4, head_dim=16)
CHAIN = 8


def _content(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def _on_ssd(client: Client, blocks: int) -> None:
    deadline = time.monotonic() + 20
    while client.stats()["tiers"]["ssd"]["committed_slots"] < blocks:
        assert time.monotonic() < deadline, "write-through did not reach the ssd"
        time.sleep(0.05)


def test_a_restart_says_what_it_dropped_and_why(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(dram_capacity="4MiB", ssd_capacity="16MiB",
                       extra=["--ssd-write-policy", "write-through", "--log-level", "info"])
    keys = {}
    with Client(d.endpoint, tenant="acme") as client:
        for ident in (KEPT, LOST):
            ns = client.namespace(ident)
            keys[ident.model] = ns.keys(range(CHAIN * ident.block_tokens))
            ns.put(keys[ident.model],
                   [_content(k, ident.block_bytes) for k in keys[ident.model]])
        _on_ssd(client, 2 * CHAIN)
    assert d.stop() == 0
    # the namespace record of LOST as another kvstore might have written it
    ssd = d.workdir / "ssd"
    with SSDStore(ssd, 16 * MiB, slab_bytes=16 * MiB) as engine:
        assert set(engine.namespaces()) == {KEPT.namespace_id, LOST.namespace_id}
        engine.put_namespace(LOST.namespace_id, b"\xc1not an identity")

    d.start()
    with Client(d.endpoint, tenant="acme") as client:
        assert client.stats()["tiers"]["ssd"]["committed_slots"] == CHAIN
        ns = client.namespace(KEPT)
        got = ns.get(keys[KEPT.model])
        assert got == [_content(k, KEPT.block_bytes) for k in keys[KEPT.model]]
        assert client.namespace(LOST).lookup(keys[LOST.model]).blocks == 0
    log = d.log()
    assert f"ssd tier: {CHAIN} blocks restored" in log
    dropped = [line for line in log.splitlines() if "dropped at restore" in line]
    assert len(dropped) == 1, log
    assert f"{CHAIN} blocks" in dropped[0] and "namespace" in dropped[0], dropped


def test_a_file_size_limit_below_the_capacity_is_named(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "daemon", dram_capacity="4MiB", ssd_capacity="16MiB")
    message = refused_under_file_size_limit(d, 8 * MiB)
    assert "file size limit" in message and str(8 * MiB) in message, message
    assert not (tmp_path / "daemon" / "ssd" / "blocks.dat").exists()  # nothing made
