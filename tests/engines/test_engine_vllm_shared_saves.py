"""Two vLLM engines on the CPU, on one daemon, prefilling the same long prefixes at once
(two data-parallel ranks, or two replicas behind a router that sent them the same
system prompt): both compute the prefixes and both save them.  The daemon's DRAM is
nearly full of another tenant's cold blocks.  A save of keys the daemon holds already
takes no slot (the reserve's ``skip_held``): the daemon evicts no more of the other
tenant's blocks than the new blocks need, however many times they were sent, and counts
each block sent again as a duplicate.

The engines start on their own, then wait at a pause (``a.ready``, ``b.ready``) until
the test has read the daemon's figures, and get their prompts at once; after their first
step (every prompt scheduled: looked up, a miss) they wait for each other again, so that
neither finds the other's saves.  A third engine without kvstore gives the outputs to
match.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import in_lanes, run_spec

from kvstore import Client, Identity

BLOCK = 32                     # vLLM's block size (vllm_run.py's tiny Llama)
BLOCK_BYTES = 32 << 10         # its KV: 2 layers, 2 heads of 32, float32, 32 tokens
PREFIX = [(11 * i + 5) % 500 + 3 for i in range(12 * BLOCK)]   # 12 blocks shared
# each prompt: the prefix, 2 blocks of its own and 5 tokens (the 12 tokens generated
# stay in that last partial block: only the prompts' full blocks are saved)
PROMPTS = [PREFIX + [(7 * i + 13 * p) % 480 + 9 for i in range(2 * BLOCK + 5)]
           for p in range(1, 5)]
NEW_BLOCKS = 12 + 2 * len(PROMPTS)   # the distinct full blocks of the prompts
FREE_SLOTS = 4                       # DRAM slots left free by the cold tenant
ENGINE = {"block_size": BLOCK, "enable_prefix_caching": False}  # every reuse is kvstore's
COLD = Identity(model="cold", model_revision="r", tenant="cold", kv_dtype="float32",
                num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=BLOCK)


engine = functools.partial(run_spec, "vllm_s55_run.py")


def fill_with_cold_blocks(endpoint: str) -> int:
    """Commit another tenant's blocks until FREE_SLOTS slots are left: how many."""
    with Client(endpoint, tenant="cold") as client:
        ns = client.namespace(COLD)
        free = client.stats()["tiers"]["dram"]["free"] // BLOCK_BYTES
        cold = free - FREE_SLOTS
        for start in range(0, cold, 128):
            ns.reserve([os.urandom(16) for _ in range(min(128, cold - start))]).commit()
        return cold


def dram(endpoint: str) -> dict[str, Any]:
    with Client(endpoint, tenant="reader") as client:
        figures: dict[str, Any] = client.stats()["tiers"]["dram"]
        return figures


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-shared-saves")
    daemon = DaemonProcess(tmp / "daemon", dram_capacity="64MiB",
                           extra=["--slab-size", "4MiB"]).start()
    conn = {"extra": {"endpoint": daemon.endpoint, "tenant": f"dp-{uuid.uuid4().hex[:8]}"}}
    out: dict[str, Any] = {"cold": fill_with_cold_blocks(daemon.endpoint)}
    phase = {"prompts": PROMPTS}

    def rank(name: str) -> None:
        out[name] = engine(tmp, name, {"engine": ENGINE, "connector": conn, "phases": [
            {**phase, "pause": name, "step_pause": {"after": 1, "name": f"{name}1"}}]})

    def plain() -> None:
        out["plain"] = engine(tmp, "plain", {"engine": ENGINE, "phases": [phase]})

    def both_at(pause: str) -> bool:
        """Whether both ranks came to ``pause`` (False: one ended without it: its run's
        failure says why)."""
        deadline = time.monotonic() + 280
        while not all((tmp / f"{n}{pause}.ready").exists() for n in "ab"):
            if time.monotonic() > deadline or any(n in out for n in "ab"):
                return False
            time.sleep(0.05)
        return True

    def start_both() -> None:
        """Both ranks waiting: the figures before, then both go; again after their
        lookups."""
        if both_at(""):
            out["before"] = dram(daemon.endpoint)
            for n in "ab":
                (tmp / f"{n}.go").write_text("")
        if both_at("1"):
            for n in "ab":
                (tmp / f"{n}1.go").write_text("")

    try:
        in_lanes(lambda: rank("a"), lambda: rank("b"), start_both, plain, workers=4)
        out["after"] = dram(daemon.endpoint)
    finally:
        daemon.stop()
        log = daemon.log()
    assert "invariant violated" not in log, log
    return out


def results(run: dict[str, Any], field: str) -> list[Any]:
    return [r[field] for r in run["phases"][0]["results"]]


def sent(run: dict[str, Any]) -> int:
    """The blocks a rank sent the daemon: each distinct full block of its prompts once
    (the connector saves a block its earlier requests saved no more), less those it
    loaded (the other rank's saves came first)."""
    loaded = {tuple(p[:(i + 1) * BLOCK])
              for p, cached in zip(PROMPTS, results(run, "num_cached_tokens"))
              for i in range(cached // BLOCK)}
    return NEW_BLOCKS - len(loaded)


def test_both_ranks_outputs_match_the_engine_without_kvstore(runs: dict[str, Any]) -> None:
    for rank in "ab":
        assert results(runs[rank], "outputs") == results(runs["plain"], "outputs"), rank


def test_the_daemon_evicts_no_more_than_the_new_blocks_need(runs: dict[str, Any]) -> None:
    before, after = runs["before"], runs["after"]
    assert before["free"] // BLOCK_BYTES == FREE_SLOTS
    assert after["commits"] - before["commits"] == NEW_BLOCKS
    # the blocks both ranks saved evict the other tenant's blocks for the new ones only
    assert after["evictions"] - before["evictions"] == NEW_BLOCKS - FREE_SLOTS
    assert after["blocks"] == runs["cold"] + FREE_SLOTS
    assert (after["pinned_blocks"], after["reserved_slots"]) == (0, 0)


def test_every_block_sent_again_is_counted_a_duplicate(runs: dict[str, Any]) -> None:
    before, after = runs["before"], runs["after"]
    for rank in "ab":  # both looked up before either saved: both computed every block
        assert results(runs[rank], "num_cached_tokens") == [0] * len(PROMPTS)
    both = sent(runs["a"]) + sent(runs["b"])
    assert both == 2 * NEW_BLOCKS
    assert after["duplicates"] - before["duplicates"] == both - NEW_BLOCKS
    assert runs["a"]["worker"]["saved_blocks"] + runs["b"]["worker"]["saved_blocks"] == (
        NEW_BLOCKS)
    for rank in "ab":
        worker = runs[rank]["worker"]
        assert (worker.get("save_failures", 0), worker["load_failed_blocks"]) == (0, 0), worker
        assert runs[rank]["warnings"] == 0, runs[rank]["warning_texts"]
