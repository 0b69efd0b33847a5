"""Two models of different block sizes sharing one daemon's DRAM arena: once the first
fills it, the second is served (a slab emptied into the first's other slabs and handed
over), and every block of the first still reads its own bytes through the arena, with
and without an SSD tier under DRAM (where the first's blocks are written down before
they leave).  The SSD tier's slabs are not handed between sizes yet: one size
holding every SSD slab leaves the other's blocks nowhere to be written down."""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess, error_records
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import KVStoreError, NotFoundError

A = make_identity(model="model-a", head_dim=128)  # 32 KiB blocks
B = make_identity(model="model-b", head_dim=64)   # 16 KiB blocks


def content(key: bytes, size: int) -> bytes:
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def put_chains(ns: Any, first: int, chains: int, blocks: int = 1) -> list[bytes]:
    """``chains`` chains of ``blocks`` blocks each (from token ``first``, 1000 tokens
    apart), each block's bytes its key's; their keys."""
    size, tokens = ns.identity.block_bytes, ns.identity.block_tokens
    out: list[bytes] = []
    for i in range(chains):
        keys = ns.keys(list(range(first + i * 1000, first + i * 1000 + tokens * blocks)))
        ns.put(keys, [content(k, size) for k in keys])
        out += keys
    return out


@pytest.mark.parametrize("ssd", ["0", "8MiB"], ids=["dram", "dram+ssd"])
def test_a_second_block_size_is_served_in_an_arena_the_first_filled(
        tmp_path: Path, ssd: str) -> None:
    # (SSD slabs of 1 MiB: both sizes find room there; see the module's docstring)
    daemon = DaemonProcess(tmp_path, dram_capacity="1MiB", ssd_capacity=ssd,
                           extra=["--slab-size", "256KiB"],
                           env={"KVSTORE_SSD_SLAB_SIZE": "1MiB"}).start()
    try:
        with Client(daemon.endpoint, tenant="acme", timeout=20) as client:
            a, b = client.namespace(A), client.namespace(B)
            a_keys = put_chains(a, 0, 40)  # 40 blocks of 32 KiB in 1 MiB: every slab a's
            for k in a_keys[1::2]:  # every other one hit: the coldest lie in every slab
                a.lookup([k])
            # refused before ("0 evictable in the dram tier")
            b_keys = put_chains(b, 500_000, 4, blocks=2)
            assert b.lookup(b_keys).blocks == len(b_keys)
            assert b.get(b_keys) == [content(k, B.block_bytes) for k in b_keys]
            cached = [k for k in a_keys if a.lookup([k]).blocks]
            assert cached, "a lost every block"
            for i in range(0, len(cached), 8):  # (a get holds its blocks in DRAM at once)
                part = cached[i:i + 8]
                assert a.get(part) == [content(k, A.block_bytes) for k in part]
            stats = client.stats()
            dram = stats["tiers"]["dram"]
            assert dram["slab_moves"] >= 1, dram
            classes = {c["slot_bytes"]: c["slabs"] for c in stats["slab_classes"]["dram"]}
            assert classes[B.block_bytes] >= 1 and sum(classes.values()) == 4, classes
            view = subprocess.run(  # the terminal view names both sizes' slabs
                [sys.executable, "-m", "kvstore", "stats", "--endpoint", daemon.endpoint],
                capture_output=True, text=True, timeout=30, check=True).stdout
            assert "dram slabs by block size: " in view and "16KiB x" in view, view
            assert stats["invariant_violations"] == 0
            assert dram["reserved_slots"] == 0 and dram["pinned_blocks"] == 0
            if ssd != "0":  # what left DRAM was written down first: all of a still there
                assert len(cached) == len(a_keys)
    finally:
        daemon.stop()
    assert not error_records(daemon.log()), daemon.log()[-3000:]


def test_a_second_block_size_is_written_to_an_ssd_tier_the_first_filled(
        tmp_path: Path) -> None:
    """Both tiers full of a's blocks (two SSD slabs); b keeps writing past what DRAM
    gives it, so its blocks are demoted: the SSD tier empties one of a's slabs for them,
    and b's blocks read back, from DRAM or SSD, bit-exact."""
    daemon = DaemonProcess(tmp_path, dram_capacity="1MiB", ssd_capacity="1MiB",
                           extra=["--slab-size", "256KiB"],
                           env={"KVSTORE_SSD_SLAB_SIZE": "512KiB"}).start()
    try:
        with Client(daemon.endpoint, tenant="acme", timeout=20) as client:
            a, b = client.namespace(A), client.namespace(B)
            put_chains(a, 0, 60)
            assert client.stats()["tiers"]["ssd"]["empty_slabs"] == 0
            b_keys = put_chains(b, 700_000, 48)
            stats = client.stats()
            ssd = stats["tiers"]["ssd"]
            assert ssd["slab_moves"] >= 1 and ssd["slab_dropped"] > 0, ssd
            assert stats["invariant_violations"] == 0
            found = [k for k in b_keys if b.lookup([k]).blocks]
            on_ssd = [k for k in found if b.lookup([k]).tiers == ["ssd"]]
            assert on_ssd, "none of b's blocks went to SSD"
            read = 0
            for k in on_ssd:  # (a read brings a block up, which may push others down)
                try:
                    got = b.get([k])
                except NotFoundError:
                    continue  # evicted from SSD by a read before it
                assert got == [content(k, B.block_bytes)]
                read += 1
            assert read
    finally:
        daemon.stop()
    assert not error_records(daemon.log()), daemon.log()[-3000:]


def test_a_put_short_of_several_slabs_is_served(tmp_path: Path) -> None:
    """A put whose blocks need three slabs of a tier another size filled: served, a
    slab a turn of the daemon's loop (two turns other clients had in between)."""
    daemon = DaemonProcess(tmp_path, dram_capacity="1MiB", extra=["--slab-size", "256KiB"]).start()
    try:
        with Client(daemon.endpoint, tenant="acme", timeout=20) as client:
            a, b = client.namespace(A), client.namespace(B)
            put_chains(a, 0, 32)
            keys = put_chains(b, 900_000, 1, blocks=40)  # 40 blocks: 3 slabs
            assert b.lookup(keys).blocks == 40
            stats = client.stats()
            assert stats["tiers"]["dram"]["slab_moves"] == 3
            assert stats["tiers"]["dram"]["slab_turns"] == 2
            assert stats["tiers"]["dram"]["empty_slabs"] == 0  # (none left set aside)
            assert stats["invariant_violations"] == 0
    finally:
        daemon.stop()
    assert not error_records(daemon.log()), daemon.log()[-3000:]


def test_a_token_plan_of_a_new_block_size_is_admitted_and_served(tmp_path: Path) -> None:
    """A ``reserve_batch`` of a size with no slab in a tier another size filled: its
    admission counts the slabs the other size can hand over (it counted the size's own
    free and evictable slots alone, 0, and refused the plan for good), and its three
    slabs come in turns, the first item's slab given back and set aside while the
    second waits for its second."""
    from kvstore.client_core import PlanItem

    daemon = DaemonProcess(tmp_path, dram_capacity="1MiB", extra=["--slab-size", "256KiB"]).start()
    try:
        with Client(daemon.endpoint, tenant="acme", timeout=20) as client:
            a, b = client.namespace(A), client.namespace(B)
            put_chains(a, 0, 32)
            bt = B.block_tokens
            plan = [PlanItem(0, 8 * bt, b.keys(range(900_000, 900_000 + 8 * bt))),
                    PlanItem(0, 36 * bt, b.keys(range(800_000, 800_000 + 36 * bt)))]
            result = b.reserve_batch(plan)
            assert result.admitted and result.blocks == [8, 36], result
            for item, r in zip(plan, result.reservations):
                for key, view in zip(item.keys, r.buffers):
                    view[:] = content(key, B.block_bytes)
                r.commit()
            keys = plan[0].keys + plan[1].keys
            assert b.lookup(plan[0].keys).blocks == 8 and b.lookup(plan[1].keys).blocks == 36
            assert b.get(keys) == [content(k, B.block_bytes) for k in keys]
            stats = client.stats()
            dram = stats["tiers"]["dram"]
            assert dram["slab_moves"] == 3 and dram["slab_turns"] >= 1, dram
            assert dram["empty_slabs"] == 0 and dram["reserved_slots"] == 0, dram
            assert stats["invariant_violations"] == 0
    finally:
        daemon.stop()
    assert not error_records(daemon.log()), daemon.log()[-3000:]


def test_a_token_plan_the_other_sizes_slabs_cannot_hold_gets_a_clean_refusal(
        tmp_path: Path) -> None:
    """A pinned block in each of the first size's slabs: no slab can be handed over, so
    the plan its admission counted them for cannot be served; it is answered as its own
    size's slots answer it (not admitted, none fitting), as before they were counted, not
    with a capacity error, and leaves nothing reserved or set aside (a second reader's
    finding)."""
    from kvstore.client_core import PlanItem

    daemon = DaemonProcess(tmp_path, dram_capacity="1MiB", extra=["--slab-size", "256KiB"]).start()
    try:
        with Client(daemon.endpoint, tenant="acme", timeout=20) as client:
            a, b = client.namespace(A), client.namespace(B)
            a_keys = put_chains(a, 0, 32)
            held = a.acquire([a_keys[0], a_keys[8], a_keys[16], a_keys[24]])  # a slab each
            bt = B.block_tokens
            plan = [PlanItem(0, 8 * bt, b.keys(range(900_000, 900_000 + 8 * bt))),
                    PlanItem(0, 8 * bt, b.keys(range(800_000, 800_000 + 8 * bt)))]
            result = b.reserve_batch(plan)
            assert not result.admitted and result.blocks == [8, 8], result
            assert result.fitting == [] and result.reservations == []
            dram = client.stats()["tiers"]["dram"]
            assert dram["reserved_slots"] == 0 and dram["slab_moves"] == 0, dram
            held.release()
            result = b.reserve_batch(plan)  # the pins gone: served
            assert result.admitted, result
            for r in result.reservations:
                r.abort()
            assert client.stats()["invariant_violations"] == 0
    finally:
        daemon.stop()
    assert not error_records(daemon.log()), daemon.log()[-3000:]


class Deferred:
    """A daemon whose first size's blocks fill every slab, all pinned, and a put of the
    second size's 40 blocks (three slabs) in a thread, deferred (``defer_seconds``):
    its outcome ("served", or what it raised) once it has one."""

    def __init__(self, tmp: Path, defer_seconds: float, **daemon: Any) -> None:
        import threading

        config = tmp / "defer.toml"
        config.write_text(f"[dram]\ndefer_seconds = {defer_seconds}\n")
        self.daemon = DaemonProcess(tmp, dram_capacity="1MiB", **daemon,
                                    extra=["--slab-size", "256KiB", "--config", str(config)])
        self.daemon.start()
        self.client = Client(self.daemon.endpoint, tenant="acme", timeout=60)
        self.other = Client(self.daemon.endpoint, tenant="acme", timeout=60)
        self.a = self.client.namespace(A)
        self.a_keys = put_chains(self.a, 0, 32)  # every slab a's, 8 blocks each
        self.pins = [self.a.acquire(self.a_keys[i:i + 8]) for i in range(0, 32, 8)]
        self.b = self.other.namespace(B)
        self.keys = self.b.keys(list(range(900_000, 900_000 + 40 * B.block_tokens)))
        self.outcome: list[object] = []
        self.writer = threading.Thread(target=self._write)
        self.writer.start()
        self.wait(lambda: self.client.stats()["scheduling"]["defers"] >= 1)

    def _write(self) -> None:
        try:
            self.b.put(self.keys, [content(k, B.block_bytes) for k in self.keys])
            self.outcome.append("served")
        except Exception as exc:  # (what the put said, for the assertion)
            self.outcome.append(exc)

    def wait(self, done: Callable[[], bool]) -> None:
        """Until ``done``, the put still waiting."""
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline and not self.outcome, self.outcome
            time.sleep(0.02)

    def served(self) -> None:
        """Every pin let go: the put is served, and all is as it should be."""
        for pin in self.pins:
            pin.release()
        self.writer.join(20)
        assert self.outcome == ["served"], self.outcome
        assert self.b.get(self.keys[:4]) == [content(k, B.block_bytes) for k in self.keys[:4]]
        assert self.client.stats()["invariant_violations"] == 0

    def close(self) -> None:
        for pin in self.pins:
            with contextlib.suppress(KVStoreError):
                pin.release()
        self.writer.join(30)
        self.client.close()
        self.other.close()
        self.daemon.stop()
        assert not error_records(self.daemon.log()), self.daemon.log()[-3000:]


def test_a_deferred_request_that_takes_a_slab_a_turn_keeps_waiting_in_its_place(
        tmp_path: Path) -> None:
    """A put of three slabs deferred (every slab of the first size pinned); the pins of
    one slab go: it takes that slab, lets the loop have a turn, and finds no more room:
    it waits on in its deferral (the attempt after the turn ran as if never deferred,
    and the put was refused at once), and is served once the other pins go."""
    put = Deferred(tmp_path, 20)
    try:
        moves = put.client.stats()["tiers"]["dram"]["slab_moves"]
        put.pins.pop(0).release()  # one slab's blocks free: it goes to b, then no more
        put.wait(lambda: put.client.stats()["tiers"]["dram"]["slab_moves"] > moves)
        time.sleep(0.5)
        assert not put.outcome, put.outcome  # still waiting, not refused
        put.served()
    finally:
        put.close()


def test_a_deferred_request_is_not_refused_by_the_wake_ups_of_others(tmp_path: Path) -> None:
    """A deferred put woken again and again by what frees room elsewhere (1500 gets,
    each letting its blocks go) waits on to its deadline: each wake-up counted as one
    of a request's 1000 rounds, and it was refused in 0.17 s of a 30 s deferral, as
    "blocks kept moving" (a second reader's finding)."""
    put = Deferred(tmp_path, 30, debug_invariants=False)
    try:
        for _ in range(1500):  # each get's blocks let go: room freed, a wake-up
            put.a.get(put.a_keys[:1])
        time.sleep(0.2)
        assert not put.outcome, put.outcome  # still waiting in its deferral
        put.served()
    finally:
        put.close()


def test_a_big_commit_then_a_put_that_must_evict_all_of_it_is_served(tmp_path: Path) -> None:
    """A commit of thousands of blocks into an arena of 1 MiB slabs, then at once a put
    that must evict all but the few the arena has spare: served, every invariant
    checked after each request, nothing left pinned."""
    ident = make_identity(model="model-big", head_dim=16)  # 4 KiB blocks: 256 a slab
    daemon = DaemonProcess(tmp_path, dram_capacity="12MiB",
                           extra=["--slab-size", "1MiB"]).start()
    try:
        with Client(daemon.endpoint, tenant="acme", timeout=30) as client:
            ns = client.namespace(ident)
            blocks = 3 * 1024 - 8
            tokens = ident.block_tokens
            first = ns.keys(list(range(blocks * tokens)))
            ns.put(first, [content(k, ident.block_bytes) for k in first])
            second = ns.keys(list(range(10**7, 10**7 + blocks * tokens)))
            ns.put(second, [content(k, ident.block_bytes) for k in second])
            assert ns.lookup(second).blocks == blocks
            assert ns.lookup(first).blocks <= 8  # (the 8 slots left free: its head stays)
            assert ns.get(second[:64]) == [content(k, ident.block_bytes) for k in second[:64]]
            stats = client.stats()
            dram = stats["tiers"]["dram"]
            assert stats["invariant_violations"] == 0
            assert dram["pinned_blocks"] == 0 and dram["reserved_slots"] == 0, dram
            assert dram["evictions"] >= blocks - 8, dram
    finally:
        daemon.stop()
    assert not error_records(daemon.log()), daemon.log()[-3000:]
