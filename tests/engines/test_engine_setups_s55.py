"""vLLM on the CPU with kvstore's connector under set-ups the other engine tests do not
take: blocks of 128 tokens filled by chunks of 32 (a block's loads and saves span four
steps), vLLM's own prefix cache off (every hit is kvstore's, no reset needed), prompts
exactly two blocks long and one token past, and requests asking for the prompt's
log-probabilities (vLLM reads no cached prefix for them: the connector's offer is
dropped, and the prompt is computed whole).

Two engine runs side by side: one without kvstore (the oracle: greedy outputs and
prompt log-probabilities), one with it on a real daemon.  After each phase the saves
are drained and the daemon holds no pin or reservation; kvstore logs no warning.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import in_lanes, run_spec

BLOCK = 128
LONG = [(7 * i + 11) % 500 + 3 for i in range(400)]     # 3 full blocks and 16 tokens
EXACT = [(3 * i) % 500 + 3 for i in range(2 * BLOCK)]   # two blocks exactly
PAST = [(13 * i + 1) % 490 + 7 for i in range(2 * BLOCK + 1)]  # one token past two
SHORT = [(5 * i + 2) % 490 + 7 for i in range(100)]     # under a block
ENGINE = {"block_size": BLOCK, "max_num_batched_tokens": 32, "enable_prefix_caching": False}
PHASES: list[dict[str, Any]] = [
    {"prompts": [LONG, EXACT, PAST, SHORT]},                        # 0: computed, saved
    {"prompts": [LONG, EXACT, PAST, SHORT]},                        # 1: loaded
    {"prompts": [LONG, PAST], "prompt_logprobs": 0},                # 2: computed whole
    {"prompts": [LONG]},                                            # 3: loaded again
]


engine = functools.partial(run_spec, "vllm_s55_run.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-setups-s55")
    daemon = DaemonProcess(tmp / "daemon", dram_capacity="64MiB",
                           extra=["--slab-size", "4MiB"]).start()
    conn = {"extra": {"endpoint": daemon.endpoint, "tenant": f"s55-{uuid.uuid4().hex[:8]}"}}
    out: dict[str, Any] = {}

    def plain() -> None:
        out["plain"] = engine(tmp, "plain", {"engine": ENGINE, "phases": PHASES})

    def stored() -> None:
        out["kvstore"] = engine(tmp, "kvstore", {"engine": ENGINE, "phases": PHASES,
                                                 "connector": conn})

    try:
        in_lanes(plain, stored)
    finally:
        daemon.stop()
        log = daemon.log()
    assert "invariant violated" not in log, log
    return out


def results(run: dict[str, Any], phase: int, field: str) -> list[Any]:
    return [r[field] for r in run["phases"][phase]["results"]]


def test_outputs_and_prompt_logprobs_match_the_engine_without_kvstore(
        runs: dict[str, Any]) -> None:
    plain, stored = runs["plain"], runs["kvstore"]
    for phase in range(len(PHASES)):
        assert results(stored, phase, "outputs") == results(plain, phase, "outputs"), phase
    logprobs = results(stored, 2, "prompt_logprobs")
    assert logprobs == results(plain, 2, "prompt_logprobs")
    assert [len(p) for p in logprobs] == [len(LONG), len(PAST)]


def test_hits_are_the_full_blocks_before_the_last_token(runs: dict[str, Any]) -> None:
    phases = runs["kvstore"]["phases"]
    assert phases[0]["external_tokens"] == 0
    # LONG: 3 blocks; EXACT: 1 of its 2 (vLLM computes the last token); PAST: 2; SHORT: 0
    assert results(runs["kvstore"], 1, "num_cached_tokens") == [384, 128, 256, 0]
    assert phases[2]["external_tokens"] == 0  # prompt log-probabilities: nothing read
    # and nothing offered (vLLM dropped the offers: counted, their blocks prefetched)
    assert [p["offers"] for p in phases] == [0, 3, 0, 1]
    assert results(runs["kvstore"], 3, "num_cached_tokens") == [384]
    assert runs["kvstore"]["worker"]["load_failed_blocks"] == 0


def test_nothing_is_left_held_or_warned_of(runs: dict[str, Any]) -> None:
    run = runs["kvstore"]
    for phase in run["phases"]:
        daemon = phase["daemon"]
        assert (daemon["pinned_blocks"], daemon["reserved_slots"]) == (0, 0), daemon
        assert phase["left_in_scheduler"] == 0
    assert run["scheduler_requests_left"] == 0
    assert run["warnings"] == 0, run["warning_texts"]
