"""The SSD tier in the real daemon: real files, real LMDB, restarts and SIGKILL."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess, check_invariants_from_now
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import NotFoundError

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks
BLOCK = IDENT.block_bytes


def content(key: bytes, size: int = BLOCK) -> bytes:
    """Bytes that follow from the key, so any reader can check any block."""
    seed = hashlib.blake2b(key, digest_size=32).digest()
    reps = size // 32 + 1
    return (seed * reps)[:size]


def tier_stats(client: Client, tier: str) -> dict[str, Any]:
    stats = client.stats()
    assert stats["invariant_violations"] == 0
    t: dict[str, Any] = stats["tiers"][tier]
    return t


def start(factory: Any, workdir_daemon: DaemonProcess | None = None, **kw: Any) -> DaemonProcess:
    kw.setdefault("ssd_capacity", "64MiB")
    kw.setdefault("dram_capacity", "2MiB")
    kw.setdefault("extra", ["--slab-size", "1MiB"])
    return factory(**kw)


def restart(d: DaemonProcess, sig: int = signal.SIGTERM) -> int | None:
    code = d.stop(sig)
    d.start()
    return code


def put_chain(ns: Any, start_token: int, blocks: int) -> list[bytes]:
    keys: list[bytes] = ns.keys(range(start_token, start_token + 16 * blocks))
    ns.put(keys, [content(k) for k in keys])
    return keys


def test_write_through_blocks_survive_a_clean_restart(daemon_factory: Any) -> None:
    d = start(daemon_factory, extra=["--slab-size", "1MiB", "--ssd-write-policy",
                                     "write-through"])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        keys = put_chain(ns, 0, 12)
        deadline = time.monotonic() + 10
        while tier_stats(client, "ssd")["committed_slots"] < 12:
            assert time.monotonic() < deadline, "write-through did not reach the ssd"
            time.sleep(0.05)
    assert restart(d) == 0
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        hit = ns.lookup(keys)
        assert hit.blocks == 12 and set(hit.tiers) == {"ssd"}
        assert ns.get(keys) == [content(k) for k in keys]          # promoted on read
        assert ns.lookup(keys).tiers == ["dram"] * 12
        t = tier_stats(client, "dram")
        assert t["promotions"] == 12 and t["reserved_slots"] == 0


def test_write_back_blocks_only_dram_holds_survive_a_clean_restart(
        daemon_factory: Any) -> None:
    # Under write-back the SSD tier holds what DRAM evicted; a SIGTERM (systemctl
    # restart) dropped what DRAM alone held, and the restart found none of it.  Now the
    # drain writes it to the SSD tier's free room, parents first.
    d = start(daemon_factory, ssd_capacity="1MiB",  # room for 16 blocks, DRAM for 32
              extra=["--slab-size", "1MiB", "--log-level", "info"])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        chains = [put_chain(ns, 0, 12), put_chain(ns, 10_000, 12)]  # more than it takes
        assert tier_stats(client, "ssd")["committed_slots"] == 0  # nothing evicted yet
    assert restart(d) == 0
    assert "wrote 16 blocks to the ssd tier on the way out" in d.log()
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        found = [ns.lookup(keys) for keys in chains]
        # whole prefixes, as much as the SSD tier had room for: one chain and the
        # other's head
        assert sorted(hit.blocks for hit in found) == [4, 12]
        for keys, hit in zip(chains, found):
            assert set(hit.tiers) == {"ssd"}
            assert ns.get(keys[:hit.blocks]) == [content(k) for k in keys[:hit.blocks]]
        assert tier_stats(client, "ssd")["committed_slots"] == 16


def test_the_flush_on_a_clean_stop_trades_only_the_ssds_coldest_leaves(
        daemon_factory: Any) -> None:
    # A cache run long enough fills its SSD tier, where a flush into free room alone
    # writes nothing: the blocks only DRAM holds (the hottest) take the place of the SSD
    # tier's coldest copies, leaf first, never a parent (a restart must find every
    # parent of what it keeps) nor a block the flush writes itself.  Namespaces of two
    # block sizes are two slot classes drawing on the same empty slabs, counted once
    # (counted by each, the plan held twice the room there was).
    small = make_identity(model="small", num_layers=2, num_kv_heads=4, head_dim=64)
    d = start(daemon_factory, ssd_capacity="2MiB", env={"KVSTORE_SSD_SLAB_SIZE": "1MiB"},
              extra=["--slab-size", "1MiB", "--log-level", "info"])  # two SSD slabs
    with Client(d.endpoint, tenant="acme") as client:
        big_ns, small_ns = client.namespace(IDENT), client.namespace(small)
        big_ns.lookup(big_ns.keys(range(16)))  # opened first: its class plans first

        def put(ns: Any, ident: Any, first: int) -> list[bytes]:
            keys: list[bytes] = ns.keys(range(first, first + 16 * 16))
            ns.put(keys, [content(k, ident.block_bytes) for k in keys])
            return keys

        cold = put(small_ns, small, 0)
        second = put(small_ns, small, 100_000)
        big = put(big_ns, IDENT, 0)
        small_ns.lookup(second)
        big_ns.lookup(big)  # the first chain the coldest: the next put demotes it
        third = put(small_ns, small, 200_000)
        assert set(small_ns.lookup(cold).tiers) == {"ssd"}
        assert tier_stats(client, "ssd")["committed_slots"] == 16
    assert restart(d) == 0
    assert "wrote 48 blocks to the ssd tier on the way out" in d.log()
    assert "dropped at restore" not in d.log()  # no orphan: every parent kept
    with Client(d.endpoint, tenant="acme") as client:
        small_ns, big_ns = client.namespace(small), client.namespace(IDENT)
        # what DRAM alone held, all of it: a slab of big blocks, and the small class's
        # free half slab and the coldest chain's slots, leaf first
        assert big_ns.lookup(big).blocks == 16
        assert big_ns.get(big) == [content(k, IDENT.block_bytes) for k in big]
        for keys in (second, third):
            assert small_ns.lookup(keys).blocks == 16
            assert small_ns.get(keys) == [content(k, small.block_bytes) for k in keys]
        assert small_ns.lookup(cold).blocks == 0
        ssd = tier_stats(client, "ssd")
        assert ssd["committed_slots"] == 48  # (a slab of 16 big slots, one of 32 small)


def test_write_through_puts_back_to_back_wait_for_copies_instead_of_failing(
        daemon_factory: Any) -> None:
    """DRAM holds 32 slots; each put of 24 blocks needs room that only the copies of the
    put before it (pinned while written through) can free: the put waits, not fails."""
    d = start(daemon_factory, extra=["--slab-size", "1MiB", "--ssd-write-policy",
                                     "write-through"])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        chains = [put_chain(ns, 100_000 * i, 24) for i in range(8)]
        for keys in chains:
            assert ns.lookup(keys).blocks == 24
            assert ns.get(keys) == [content(k) for k in keys]
        deadline = time.monotonic() + 10
        while tier_stats(client, "ssd")["committed_slots"] < 8 * 24:  # the last copies
            assert time.monotonic() < deadline, "write-through did not finish"
            time.sleep(0.05)
        stats = client.stats()
        assert stats["invariant_violations"] == 0
        assert stats["scheduling"]["rejects"] == 0   # no request was refused (some waited)
        assert stats["tiers"]["ssd"]["committed_slots"] == 8 * 24


def test_dram_smaller_than_the_working_set_cycles_through_ssd(daemon_factory: Any) -> None:
    d = start(daemon_factory)                                    # write-back, 32 DRAM slots
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        chains = [put_chain(ns, 100_000 * i, 8) for i in range(12)]   # 96 blocks
        assert tier_stats(client, "ssd")["committed_slots"] >= 96 - 32
        for keys in chains:                                       # every block comes back
            assert ns.lookup(keys).blocks == 8
            assert ns.get(keys) == [content(k) for k in keys]
        for keys in reversed(chains):
            with ns.acquire(keys) as held:
                assert [bytes(b) for b in held.buffers] == [content(k) for k in keys]
        dram = tier_stats(client, "dram")
        ssd = tier_stats(client, "ssd")
        assert dram["reserved_slots"] == 0 and dram["pinned_blocks"] == 0
        assert ssd["writes"] >= 64 and dram["promotions"] >= 64   # written back, read back
        assert dram["dropped_on_eviction"] == 0
        assert ssd["writes"] <= 96, "a block already on disk was written again"


def test_corrupt_truncated_and_stale_blocks_are_misses(daemon_factory: Any) -> None:
    d = start(daemon_factory, extra=["--slab-size", "1MiB", "--ssd-write-policy",
                                     "write-through"])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        chains = [put_chain(ns, 1_000_000 * i, 2) for i in range(3)]
        deadline = time.monotonic() + 10
        while tier_stats(client, "ssd")["committed_slots"] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    d.stop()
    data = d.workdir / "ssd" / "blocks.dat"
    raw = bytearray(data.read_bytes())
    # find each chain's first block on disk by its content and damage it three ways
    at = [raw.find(content(keys[0])) for keys in chains]
    assert all(a >= 0 for a in at)
    raw[at[0] + 100] ^= 0xFF                                      # a flipped byte
    raw[at[2]:at[2] + BLOCK] = content(b"something else")         # stale: other bytes
    data.write_bytes(bytes(raw))
    os.truncate(data, at[1] + BLOCK // 2)                         # truncated mid-block
    d.start()
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        for keys in chains:
            with pytest.raises(NotFoundError):
                ns.get(keys)
            assert ns.lookup(keys).blocks == 0                    # the miss is remembered
        ssd = tier_stats(client, "ssd")
        assert ssd["checksum_failures"] >= 3
        fresh = put_chain(ns, 9_000_000, 4)                       # still serving
        assert ns.get(fresh) == [content(k) for k in fresh]


WRITER = r"""
import sys, hashlib
from kvstore import Client, Identity
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/.."]
from test_ssd_daemon import IDENT, content
with Client(sys.argv[1], tenant="acme") as c:
    ns = c.namespace(IDENT)
    base = int(sys.argv[2])
    for i in range(10_000):
        keys = ns.keys(range(base + i * 64, base + (i + 1) * 64))
        try:
            ns.put(keys, [content(k) for k in keys])
        except Exception as exc:
            print("error", exc, flush=True)
            break
        if i == 3:
            print("writing", flush=True)
"""


def test_sigkill_during_heavy_write_back_serves_only_good_blocks(daemon_factory: Any,
                                                                 tmp_path: Path) -> None:
    # (the invariant check, a walk of every block after each request, is turned on once
    # the thousands of blocks written are read back: run all along, it was 11 of the
    # test's 15 s)
    config = tmp_path / "kvstore.toml"
    config.write_text("[server]\ndebug_invariants = false\n")
    d = start(daemon_factory, lease=2.0, debug_invariants=False,
              extra=["--slab-size", "1MiB", "--config", str(config)])
    here = str(Path(__file__).parent)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, d.endpoint, str(10**8 * (i + 1)),
                                 here], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
               for i in range(3)]
    for w in writers:
        assert w.stdout is not None
        assert w.stdout.readline().startswith(b"writing")
    time.sleep(1.0)
    assert d.proc is not None
    d.proc.kill()                                                 # mid write-back
    d.proc.wait()
    for w in writers:                                             # clients die too
        w.kill()
        w.wait()
        assert w.stdout is not None
        w.stdout.close()
    d.stop()
    d.start()
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        ssd = tier_stats(client, "ssd")
        assert ssd["committed_slots"] > 0, "nothing reached the ssd before the kill"
        served = 0
        for i in range(3):
            base = 10**8 * (i + 1)
            misses = 0
            for j in range(0, 10_000):
                keys = ns.keys(range(base + j * 64, base + (j + 1) * 64))
                hit = ns.lookup(keys).blocks
                if hit == 0:
                    misses += 1
                    if misses > 600:          # well past the last chain written
                        break
                    continue
                misses = 0
                got = ns.get(keys[:hit])
                assert got == [content(k) for k in keys[:hit]], "a served block is wrong"
                served += hit
        assert served == ssd["committed_slots"]
        dram = tier_stats(client, "dram")
        assert dram["reserved_slots"] == 0 and dram["pinned_blocks"] == 0
        check_invariants_from_now(d, config, client)


def test_disk_full_keeps_dram_working(daemon_factory: Any, tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.fail("could not mount a small tmpfs for the disk-full test (needs root)")
    try:
        d = daemon_factory(dram_capacity="2MiB", ssd_capacity="6MiB",
                           extra=["--slab-size", "1MiB", "--ssd-path", str(mount / "ssd"),
                                  "--ssd-write-policy", "write-through"])
        with Client(d.endpoint, tenant="acme") as client:
            ns = client.namespace(IDENT)
            first = put_chain(ns, 0, 4)
            deadline = time.monotonic() + 10
            while tier_stats(client, "ssd")["committed_slots"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            filler = mount / "filler"
            with open(filler, "wb") as f:                        # fill the disk
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
            more = [put_chain(ns, 10_000 * (i + 1), 4) for i in range(6)]  # DRAM keeps going
            time.sleep(0.5)
            assert client.stats()["ssd_io"]["errors"] >= 1
            assert ns.get(more[-1]) == [content(k) for k in more[-1]]
            filler.unlink()
        d.stop()
        d.start()
        with Client(d.endpoint, tenant="acme") as client:
            ns = client.namespace(IDENT)
            assert ns.get(first) == [content(k) for k in first]   # nothing corrupt on disk
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_bad_ssd_directory_stops_the_daemon_with_a_clear_message(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", f"ipc://{tmp_path}/k.sock",
         "--dram-capacity", "8MiB", "--ssd-path", str(blocker / "ssd"),
         "--ssd-capacity", "64MiB"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert str(blocker) in result.stderr and "configuration error" in result.stderr
    huge = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", f"ipc://{tmp_path}/k.sock",
         "--dram-capacity", "8MiB", "--ssd-path", str(tmp_path / "ssd"),
         "--ssd-capacity", "900TiB"], capture_output=True, text=True, timeout=60)
    assert huge.returncode == 2 and "free" in huge.stderr.lower(), huge.stderr


def test_an_ssd_data_file_that_cannot_be_opened_is_a_one_line_error(tmp_path: Path) -> None:
    # a directory where the data file should be: a traceback and exit 1 before
    (tmp_path / "ssd" / "blocks.dat").mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", f"ipc://{tmp_path}/k.sock",
         "--dram-capacity", "8MiB", "--ssd-path", str(tmp_path / "ssd"),
         "--ssd-capacity", "64MiB"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "configuration error" in result.stderr and "blocks.dat" in result.stderr
