"""Two vLLM engines on the CPU saving the same prefixes with both ranks' reservations
open at once (test_engine_vllm_shared_saves.py's set-up, each rank's first save held at
its commit until both have reserved): the second reserve of keys the first holds slots
for, not committed yet, takes no slot for them (``Reservation.awaited``), so the
daemon evicts no more of the other tenant's blocks than the new blocks need.  Before,
each rank took a slot for every key and the second commit threw its copy away: 36
evictions for 20 new blocks where 16 make room.

The rank that reserved second commits first (the test orders them by what each
reservation was given no slot for): its commit waits for the other's
(``commits_waited``), then stores its own blocks under the other's, none dropped
(``awaited_dropped`` 0; before the wait, that order dropped its own new blocks); every
new block is stored once; the outputs match.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import in_lanes
from test_engine_vllm_shared_saves import (
    ENGINE,
    FREE_SLOTS,
    NEW_BLOCKS,
    PROMPTS,
    dram,
    engine,
    fill_with_cold_blocks,
    results,
    sent,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-overlapping-saves")
    daemon = DaemonProcess(tmp / "daemon", dram_capacity="64MiB",
                           extra=["--slab-size", "4MiB"]).start()
    conn = {"extra": {"endpoint": daemon.endpoint, "tenant": f"dp-{uuid.uuid4().hex[:8]}"}}
    out: dict[str, Any] = {"cold": fill_with_cold_blocks(daemon.endpoint)}
    phase = {"prompts": PROMPTS}

    def rank(name: str) -> None:
        out[name] = engine(tmp, name, {
            "engine": ENGINE, "connector": conn, "commit_pause": f"{name}c",
            "phases": [{**phase, "pause": name,
                        "step_pause": {"after": 1, "name": f"{name}1"}}]})

    def both_at(pause: str) -> bool:
        """Whether both ranks came to ``pause`` (False: one ended without it)."""
        deadline = time.monotonic() + 280
        while not all((tmp / f"{n}{pause}.ready").exists() for n in "ab"):
            if time.monotonic() > deadline or any(n in out for n in "ab"):
                return False
            time.sleep(0.05)
        return True

    def go(pause: str) -> None:
        for n in "ab":
            (tmp / f"{n}{pause}.go").write_text("")

    def start_both() -> None:
        """Both ranks waiting: the figures before, then both go; again after their
        lookups; then, both ranks' first saves reserved and held at their commits, the
        figures while both are open, and both commit."""
        if both_at(""):
            out["before"] = dram(daemon.endpoint)
            go("")
        if both_at("1"):
            go("1")
        if both_at("c"):
            out["open"] = dram(daemon.endpoint)
            # the rank that reserved second (given no slot for the other's keys) commits
            # first: its commit waits for the other's (before the wait, that order
            # dropped its own new blocks); the other once it waits
            skipped = {n: int((tmp / f"{n}c.skipped").read_text()) for n in "ab"}
            second = max("ab", key=lambda n: skipped[n])
            out["second"] = (second, skipped)
            (tmp / f"{second}c.go").write_text("")
            waited = out["open"].get("commits_waited", 0)
            deadline = time.monotonic() + 60
            while (dram(daemon.endpoint).get("commits_waited", 0) <= waited
                   and time.monotonic() < deadline and second not in out):
                time.sleep(0.05)
            go("c")

    try:
        in_lanes(lambda: rank("a"), lambda: rank("b"), start_both, workers=3)
        out["after"] = dram(daemon.endpoint)
    finally:
        daemon.stop()
        log = daemon.log()
    assert "invariant violated" not in log, log
    return out


def test_both_ranks_reservations_were_open_at_once(runs: dict[str, Any]) -> None:
    before, open_ = runs["before"], runs["open"]
    assert open_["reserved_slots"] > 0, open_
    # the second rank's reserve gave the keys the first holds slots for none
    assert open_["awaited"] - before["awaited"] > 0, open_


def test_the_daemon_evicts_no_more_than_the_new_blocks_need(runs: dict[str, Any]) -> None:
    before, after = runs["before"], runs["after"]
    assert before["free"] // (32 << 10) == FREE_SLOTS
    assert after["commits"] - before["commits"] == NEW_BLOCKS
    assert after["evictions"] - before["evictions"] == NEW_BLOCKS - FREE_SLOTS
    assert after["blocks"] == runs["cold"] + FREE_SLOTS
    assert (after["pinned_blocks"], after["reserved_slots"]) == (0, 0)


def test_every_block_is_stored_once_and_the_outputs_match(runs: dict[str, Any]) -> None:
    before, after = runs["before"], runs["after"]
    for rank in "ab":
        assert results(runs[rank], "num_cached_tokens") == [0] * len(PROMPTS)
    both = sent(runs["a"]) + sent(runs["b"])
    assert both == 2 * NEW_BLOCKS
    # each block sent again is a duplicate: a commit that came first waited, none dropped
    assert after["commits_waited"] - before["commits_waited"] >= 1, (after, runs["second"])
    assert after["awaited_dropped"] - before["awaited_dropped"] == 0, after
    assert after["commit_wait_timeouts"] == 0, after
    assert after["duplicates"] - before["duplicates"] == both - NEW_BLOCKS
    assert runs["a"]["worker"]["saved_blocks"] + runs["b"]["worker"]["saved_blocks"] == (
        NEW_BLOCKS)
    assert results(runs["a"], "outputs") == results(runs["b"], "outputs")
    for rank in "ab":
        worker = runs[rank]["worker"]
        assert (worker.get("save_failures", 0), worker["load_failed_blocks"]) == (0, 0), worker
        assert runs[rank]["warnings"] == 0, runs[rank]["warning_texts"]
