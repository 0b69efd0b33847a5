"""vLLM on the CPU with kvstore's connector: the per-tier load rates of its extra config
(``load_gbps``) are read as they are meant, or the engine is told.

Real engines (vLLM's CPU build, in the vLLM environment) on a real daemon, side by side:
one started with a rate for a tier the daemon has no such name for (``"DRAM"``), one
run with rates but no ``prefill_tokens_per_s`` (its first phase computes and saves a
prompt, its second loads it, vLLM's prefix cache emptied between them).

Before: a rate for ``"DRAM"`` (the daemon's tier is ``"dram"``) was ignored without a
word, the tier's default rate used: with a prefill rate that declines DRAM's blocks at
the rate given, the engine loaded them (64 tokens offered and loaded, none declined;
``"dram"`` declined them).  Now the engine's start is refused, naming ``load_gbps``,
the tier and the daemon's tiers.  Rates given without ``prefill_tokens_per_s`` (every
cached block offered, whatever they say) were ignored without a word too: now a
warning at the start names them.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import HERE, in_lanes_on, last_json, run_in_env, run_spec
from test_engine_vllm_s61 import START
from test_engine_vllm_s62 import VALUES  # (check_values over each extra config given)

BLOCK = 32
PROMPT = [(7 * i) % 500 + 3 for i in range(2 * BLOCK + 10)]   # 2 full blocks and 10 tokens
SLOW_DRAM = 1e-6   # GB/s: a block takes seconds to load, more than it takes to compute

UNKNOWN_TIERS = [{"DRAM": 1}, {"cpu": 2, "dram": 1}, {"local_disk": 0.5}, {"Remote": 1}]
KNOWN_TIERS = [{"gpu": 50, "dram": 10, "ssd": 1.5, "remote": "0.5"}]


engine = functools.partial(run_spec, "vllm_s57_run.py")


def test_a_rate_for_a_tier_the_daemon_does_not_have_is_refused_naming_it() -> None:
    extras = [{"load_gbps": rates} for rates in UNKNOWN_TIERS + KNOWN_TIERS]
    said = last_json(run_in_env("vllm", ["-c", VALUES, json.dumps(extras)],
                                timeout=120).stdout)
    for rates, answer in zip(UNKNOWN_TIERS, said):
        assert answer.startswith("ConfigError: KVStoreConnector") and "'load_gbps'" in answer
        for tier in set(rates) - {"dram"}:
            assert repr(tier) in answer, (rates, answer)
        assert "['dram', 'gpu', 'remote', 'ssd']" in answer, answer
    assert said[len(UNKNOWN_TIERS):] == ["taken"] * len(KNOWN_TIERS), said


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-s63")
    daemon = DaemonProcess(tmp / "daemon", dram_capacity="64MiB",
                           extra=["--slab-size", "4MiB"]).start()
    extra = {"endpoint": daemon.endpoint, "tenant": f"s63-{uuid.uuid4().hex[:8]}"}
    out: dict[str, Any] = {}

    def misnamed_tier() -> None:
        # a prefill rate at which a block loaded at the rate given for "DRAM" is not
        # worth loading; the configured rates only (no probe of the daemon's)
        conn = {"extra": {**extra, "prefill_tokens_per_s": 1000, "rates_refresh_s": 0,
                          "load_gbps": {"DRAM": SLOW_DRAM}}}
        proc = run_in_env("vllm", ["-c", START, str(HERE), json.dumps(conn)], timeout=300,
                          cwd=tmp)
        out["misnamed"] = last_json(proc.stdout)

    def rates_without_prefill_rate() -> None:
        out["no_prefill_rate"] = engine(tmp, "no-prefill-rate", {
            "connector": {"extra": {**extra, "load_gbps": {"dram": SLOW_DRAM}}},
            "phases": [{"prompts": [PROMPT]},
                       {"prompts": [PROMPT], "reset_prefix_cache": True}]})

    in_lanes_on([daemon], misnamed_tier, rates_without_prefill_rate)
    return out


def test_an_engine_given_a_rate_for_a_tier_misnamed_does_not_start(
        runs: dict[str, Any]) -> None:
    # (before: "started", and its requests loaded DRAM's blocks at its default rate)
    said = runs["misnamed"]
    assert said.startswith("ConfigError: KVStoreConnector"), said
    assert "'load_gbps'" in said and "['DRAM']" in said, said


def test_rates_without_a_prefill_rate_are_named_in_a_warning(runs: dict[str, Any]) -> None:
    run = runs["no_prefill_rate"]
    # every cached block offered, as before: the rates judge nothing without a prefill
    # rate, and the warning says so
    cached = [r["num_cached_tokens"] for phase in run["phases"] for r in phase["results"]]
    assert cached == [0, 2 * BLOCK]
    assert run["scheduler"]["offers_declined"] == 0
    outputs = [phase["results"][0]["outputs"] for phase in run["phases"]]
    assert outputs[0] == outputs[1]
    assert run["warnings"] == 1, run["warning_texts"]
    assert "['load_gbps']" in run["warning_texts"][0]
    assert "prefill_tokens_per_s" in run["warning_texts"][0]
    for phase in run["phases"]:
        assert phase["daemon"]["pinned_blocks"] == 0 and phase["daemon"]["reserved_slots"] == 0
