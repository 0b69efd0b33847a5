"""Per-tenant arenas are sparse files that clients map and write in place: a page first
touched with the file system full raises SIGBUS in whichever process touches it.  A real
daemon whose arenas lie on a tmpfs smaller than ``dram.capacity`` (another program
filled the memory, or a size-limited tmpfs): each slab's memory is allocated before any
slot of it is handed out, so a tenant past the memory makes room among its own blocks,
one with none gets a typed CapacityError, and no process gets a signal."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity, tenants_daemon

from kvstore.client import Client
from kvstore.keys import chain_keys
from kvstore.plans import Plan
from kvstore.store import BlockStore
from kvstore.tiers.dram import Arenas

ROOT = Path(__file__).resolve().parents[2]
TMPFS_BYTES = 4 << 20

# A tenant's writer, in a process of its own (a SIGBUS ends it, not the test): ``puts``
# puts of 8 blocks of 32 KiB, written in place in the mapped arena; a line of JSON.
WRITER = """
import json, sys
from kvtest import make_identity
from kvstore.client import Client
from kvstore.errors import CapacityError
from kvstore.keys import chain_keys
endpoint, token, tenant, puts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
out = {"stored": 0, "refused": []}
c = Client(endpoint, token=token)
try:
    ns = c.namespace(make_identity(tenant=tenant, head_dim=128))
    block = ns.identity.block_bytes
    last = []
    for i in range(puts):
        keys = [chain_keys(ns.id, list(range(n * 16, n * 16 + 16)), 16)[0]
                for n in range(i * 8, i * 8 + 8)]
        try:
            ns.put(keys, [bytes([n % 251 + 1]) * block for n in range(8)])
            out["stored"] += 1
            last = keys
        except CapacityError as exc:
            out["refused"].append(str(exc))
    if last:  # the latest put reads back what was written
        got = ns.get(last)
        out["read_back"] = got == [bytes([n % 251 + 1]) * block for n in range(8)]
finally:
    c.close()
print(json.dumps(out))
"""


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of ``TMPFS_BYTES`` (root may mount one)."""
    where = tmp_path / "shm"
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=1777",
                           "none", str(where)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def write(d: DaemonProcess, token: str, tenant: str, puts: int) -> tuple[int, dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    done = subprocess.run([sys.executable, "-c", WRITER, d.endpoint, token, tenant,
                           str(puts)], capture_output=True, text=True, env=env, timeout=120)
    lines = done.stdout.strip().splitlines()
    return done.returncode, (json.loads(lines[-1]) if lines else {"stderr": done.stderr})


def test_arenas_past_the_memory_of_their_file_system_fail_typed_not_by_signal(
        daemon_factory: Callable[..., DaemonProcess], small_tmpfs: Path,
        tmp_path: Path) -> None:
    d, token = tenants_daemon(daemon_factory, tmp_path, "16MiB",
                              'slab_size = "1MiB"\narena_kind = "file"\n'
                              f'directory = "{small_tmpfs}"\n')
    assert d.proc is not None
    # a: 8 MiB of puts into 4 MiB of memory: past it, its own blocks make the room
    rc, a = write(d, token("a"), "a", 32)
    # (-7: SIGBUS, a page of the arena touched with no memory left)
    assert d.proc.poll() is None, (d.proc.returncode, d.log()[-2000:])
    assert rc == 0, (rc, a)
    assert a["stored"] == 32 and not a["refused"] and a["read_back"], a
    # b: none of the memory is left, and it has no blocks of its own: typed refusals
    rc, b = write(d, token("b"), "b", 4)
    assert rc == 0, (rc, b)
    refused = b["refused"]
    assert isinstance(refused, list) and len(refused) == 4 and b["stored"] == 0, b
    assert all("dram.directory is full" in r for r in refused), refused
    assert d.proc.poll() is None, d.log()  # the daemon lives on
    with Client(d.endpoint, token=token("ops")) as c:
        assert c.stats()["tiers"]["dram"]["budget_no_memory"] > 0
    used = os.statvfs(small_tmpfs)
    assert (used.f_blocks - used.f_bfree) * used.f_frsize <= TMPFS_BYTES


def test_a_request_waits_for_its_slabs_memory_in_one_wait_not_turn_by_turn() -> None:
    """A slab's memory is allocated on the arenas' thread (16-23 ms a 64 MiB slab here,
    after the release of another arena's, 17 ms): a request waiting for it was made
    again at every turn of the loop, thousands of times, near the bound on a call's
    turns; it waits for the thread's answer instead."""
    slab = 1 << 20

    async def main() -> None:
        store = BlockStore(8 * slab, slab, per_tenant=True)
        arenas = Arenas(8 * slab, "/dev/shm", populate=False, memfd=True,
                        budget=store.dram_budget)
        try:
            arenas.get("a")
            ns = store.open_namespace(make_identity(tenant="a", head_dim=128))
            keys = chain_keys(ns.id, list(range(16 * 64)), 16)  # two slabs' worth
            plan = store.reserve("a", ns, keys, None, 0.0)
            assert isinstance(plan, Plan) and plan.turn and plan.wait is not None
            await plan.wait()  # the thread's answers, not a turn
            plan.let_go()
            while isinstance(r := store.reserve("a", ns, keys, None, 0.0), Plan):
                assert r.wait is not None
                await r.wait()
                r.let_go()
            arena = arenas.by_name["a"]
            assert arena.allocated_bytes() >= 2 * slab  # its slabs' memory, before use
            for offset in r.offsets:
                arena.slot(offset, ns.block_bytes)[:] = b"\x01" * ns.block_bytes
            store.commit("a", r.id, 0.0)
            ns.dram.pool.check()
        finally:
            arenas.close()

    asyncio.run(main())
