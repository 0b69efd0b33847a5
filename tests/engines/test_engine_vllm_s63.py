"""vLLM on the CPU with kvstore's connector: the per-tier load rates of its extra config
(``load_gbps``) are read as they are meant, or the engine is told.

A real engine (vLLM's CPU build, in the vLLM environment) started with a rate for a tier
the daemon has no such name for (``"DRAM"``).

Before: a rate for ``"DRAM"`` (the daemon's tier is ``"dram"``) was ignored without a
word, the tier's default rate used: with a prefill rate that declines DRAM's blocks at
the rate given, the engine loaded them (64 tokens offered and loaded, none declined;
``"dram"`` declined them).  Now the engine's start is refused, naming ``load_gbps``,
the tier and the daemon's tiers.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import HERE, in_lanes_on, last_json, run_in_env
from test_engine_vllm_s61 import START

SLOW_DRAM = 1e-6   # GB/s: a block takes seconds to load, more than it takes to compute

VALUES = """
import json, sys
from kvstore.integrations.vllm import check_values
out = []
for extra in json.loads(sys.argv[1]):
    try:
        check_values(extra)
        out.append("taken")
    except Exception as exc:
        out.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(out))
"""
UNKNOWN_TIERS = [{"DRAM": 1}, {"cpu": 2, "dram": 1}, {"local_disk": 0.5}, {"Remote": 1}]
KNOWN_TIERS = [{"gpu": 50, "dram": 10, "ssd": 1.5, "remote": "0.5"}]


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

    in_lanes_on([daemon], misnamed_tier)
    return out


def test_an_engine_given_a_rate_for_a_tier_misnamed_does_not_start(
        runs: dict[str, Any]) -> None:
    # (before: "started", and its requests loaded DRAM's blocks at its default rate)
    said = runs["misnamed"]
    assert said.startswith("ConfigError: KVStoreConnector"), said
    assert "'load_gbps'" in said and "['DRAM']" in said, said
