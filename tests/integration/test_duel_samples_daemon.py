"""A real daemon under ``auto``: a commit of thousands of blocks takes its share of the
duel's sampled references at once and leaves the rest for the loop's next turns
(``kvstore.scheduler.duel_samples``), which take them all, a slice a turn, while
requests go on being served; eviction by the duel goes on after them, every invariant
checked after every request."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.scheduler.duel_samples import A_TURN

TINY = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512 B blocks, 4 KiB slots


def _samples(client: Client) -> dict[str, int]:
    return client.stats()["eviction_samples"]  # type: ignore[no-any-return]


def _drained(client: Client) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while (samples := _samples(client))["waiting"]:
        assert time.monotonic() < deadline, samples
        time.sleep(0.02)
    return samples


def test_a_big_commits_samples_are_taken_in_later_turns(daemon_factory: Any,
                                                        tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction_policy = "auto"\n')
    d = daemon_factory(dram_capacity="16MiB", extra=["--config", str(config),
                                                     "--slab-size", "1MiB"])
    with Client(d.endpoint, tenant="acme", timeout=30) as client:
        ns = client.namespace(TINY)
        assert _samples(client) == {"waiting": 0, "taken_later": 0}
        first = ns.keys(range(16 * 3000))
        ns.put(first, [bytes(TINY.block_bytes)] * len(first))  # one commit of 3000
        samples = _drained(client)
        # one key in eight sampled (a cache of 4096 blocks), 375 or so: A_TURN at once
        assert 100 < samples["taken_later"] < 3000 // 8 * 2 - A_TURN, samples
        assert ns.lookup(first).blocks == len(first)
        # chains that overflow the arena: the duel picks victims, its backlogs drain
        for i in range(1, 6):
            keys = ns.keys(range(100_000 * i, 100_000 * i + 16 * 1500))
            ns.put(keys, [bytes(TINY.block_bytes)] * len(keys))
            assert ns.lookup(keys).blocks == len(keys)
        _drained(client)
        stats = client.stats()
        assert stats["tiers"]["dram"]["evictions"] >= 4000, stats["tiers"]["dram"]
        assert "AutoPolicy(" in stats["eviction_orders"][0]
        assert stats["invariant_violations"] == 0


def test_a_put_finished_after_a_demotion_takes_its_samples_without_another_request(
        daemon_factory: Any, tmp_path: Path) -> None:
    # DRAM full: each put waits on a plan (its victims written to SSD first) and is
    # answered from a task; what it kept is taken in the turns after, not when the
    # next request happens to come
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction_policy = "auto"\n')
    d = daemon_factory(dram_capacity="16MiB", ssd_capacity="256MiB",
                       extra=["--config", str(config), "--slab-size", "1MiB"],
                       debug_invariants=False)
    with Client(d.endpoint, tenant="acme", timeout=30) as client:
        ns = client.namespace(TINY)
        waiting = []
        for i in range(4):
            keys = ns.keys(range(10**6 * i, 10**6 * i + 16 * 3000))
            ns.put(keys, [bytes(TINY.block_bytes)] * len(keys))
            time.sleep(0.3)  # idle: the loop has every turn it wants
            waiting.append(_samples(client)["waiting"])
        stats = client.stats()
        assert stats["tiers"]["ssd"]["committed_slots"] > 0  # demoted: plans were made
        assert waiting == [0] * 4 and stats["eviction_samples"]["taken_later"] > 0


def test_sighup_switches_away_from_auto_and_back_while_its_samples_wait(
        daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction_policy = "auto"\n')
    d = daemon_factory(dram_capacity="16MiB", extra=["--config", str(config),
                                                     "--slab-size", "1MiB"],
                       debug_invariants=False)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            with Client(d.endpoint, tenant="acme", timeout=30) as c:
                ns = c.namespace(TINY)
                i = 0
                while not stop.is_set():
                    base = 10**7 * w + 10**5 * i
                    keys = ns.keys(range(base, base + 16 * 2000))
                    ns.put(keys, [bytes(TINY.block_bytes)] * len(keys))
                    ns.lookup(keys)
                    i += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    with Client(d.endpoint, tenant="acme", timeout=30) as client:
        try:
            for name in ["lru", "auto", "slru", "auto", "arc", "auto"]:
                time.sleep(0.4)
                config.write_text(f'[dram]\neviction_policy = "{name}"\n')
                assert d.proc is not None
                d.proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        deadline = time.monotonic() + 10
        while client.stats()["eviction_switch"]["under_way"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ns = client.namespace(TINY)
        keys = ns.keys(range(10**9, 10**9 + 16 * 3000))
        ns.put(keys, [bytes(TINY.block_bytes)] * len(keys))  # the duel in charge keeps some
        assert _drained(client)["taken_later"] > 0
        stats = client.stats()
        assert "AutoPolicy(" in stats["eviction_orders"][0]
        assert stats["invariant_violations"] == 0
    assert "Exception in callback" not in d.log() and "a slice failed" not in d.log()
