"""An SSD index cut short (a copy or a restore that stopped early, a full disk under a
tool): LMDB maps its file and read past the end, and the daemon died of SIGBUS at every
start, with nothing in its log.  One with damaged pages made LMDB raise MDB_CORRUPTED,
a traceback and no daemon.  Either is refused with the reason, and the daemon starts
cold once the index is deleted, as the message says; one LMDB reads serves no wrong
bytes."""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import KVStoreError, NotFoundError

IDENT = make_identity(num_layers=2, num_kv_heads=2, head_dim=64, tenant="acme")


BLOCKS = [bytes([i]) * IDENT.block_bytes for i in range(40)]


def written(daemon_factory: Any) -> tuple[Any, list[bytes], Path]:
    """A daemon stopped after writing 40 blocks through to SSD; its index's data file."""
    d = daemon_factory(ssd_capacity="16MiB",
                       extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-through"])
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(16 * 40))
        ns.put(keys, BLOCKS)
    d.stop()
    return d, keys, d.workdir / "ssd" / "index" / "data.mdb"


def test_a_truncated_index_is_refused_with_its_reason_not_a_crash(
        daemon_factory: Any) -> None:
    d, keys, data = written(daemon_factory)
    index = data.parent
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


def test_damaged_index_pages_are_refused_or_read_never_a_crash(daemon_factory: Any) -> None:
    d, keys, data = written(daemon_factory)
    good = data.read_bytes()
    damages = [bytearray(good[:8192]) + bytes(len(good) - 8192)]  # every page but the metas
    for seed in range(1, 6):                                       # bytes here and there
        rng, damaged = random.Random(seed), bytearray(good)
        for _ in range(40):
            damaged[rng.randrange(8192, len(good))] = rng.randrange(256)
        damages.append(damaged)
    for damaged in damages:
        data.write_bytes(damaged)
        try:
            d.start()
        except RuntimeError as exc:
            assert "is damaged" in str(exc) and "Traceback" not in str(exc), str(exc)
            assert d.proc is not None and d.proc.wait(10) == 1
            d.stop()
            continue
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            for key, block in zip(keys, BLOCKS):
                try:
                    assert ns.get([key]) == [block]
                except KVStoreError:
                    pass                   # a miss: never another block's bytes
        d.stop()
