"""vLLM on the CPU with kvstore's connector, against a real daemon.

Three engine processes (each ~10 s) share one daemon: a baseline without the connector,
a first engine that computes and saves the prompts, and a second engine that gets them
back from the daemon; the baseline (and an engine whose daemon is not up) run beside the
first and second (``in_lanes``).  The model is a tiny Llama with seeded random weights
made on the spot (no downloads, no tokenizer: prompts are token ids), greedy decoding.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import HERE, in_lanes, last_json, run_in_env

from kvstore import Client

BLOCK = 32                                        # tokens per block (vllm_run.BLOCK)
PROMPT_P = list(range(3, 103))                    # 100 tokens: 3 reusable blocks
PROMPT_Q = [(7 * i) % 500 + 3 for i in range(150)]  # 150 tokens: 4 reusable blocks
PROMPT_S = [(11 * i) % 480 + 5 for i in range(128)]  # 128 tokens: 4 blocks
PROMPT_ST = PROMPT_S + [(13 * i) % 470 + 9 for i in range(100)]  # 228: 7 blocks


def engine_run(tmp: Path, name: str, model: Path, requests: list[dict[str, Any]],
               endpoint: str = "", tenant: str = "", *args: str) -> dict[str, Any]:
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(requests))
    argv = [str(HERE / "vllm_run.py"), "--model", str(model), "--requests", str(spec), *args]
    if endpoint:
        argv += ["--endpoint", endpoint, "--tenant", tenant]
    return last_json(run_in_env("vllm", argv, timeout=240, cwd=tmp).stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "tiny-llama"
    daemon = DaemonProcess(tmp / "daemon", dram_capacity="128MiB",
                           extra=["--slab-size", "16MiB"]).start()
    tenant = f"vllm-{uuid.uuid4().hex[:8]}"  # nothing from an earlier run can match
    out: dict[str, Any] = {}

    def saved_then_loaded() -> None:
        out["first"] = engine_run(tmp, "first", model, [{"prompt": PROMPT_P},
                                                        {"prompt": PROMPT_Q}],
                                  daemon.endpoint, tenant)
        with Client(daemon.endpoint, tenant=tenant) as client:
            out["first"]["daemon_lookups"] = client.stats()["tiers"]["dram"]["lookups"]
        out["second"] = engine_run(tmp, "second", model, [
            {"prompt": PROMPT_P},
            {"prompt": PROMPT_P, "cache_salt": "another-user"},
            {"prompt": PROMPT_P, "lora": True},
            {"prompt": PROMPT_Q, "evict_before_load": True},
        ], daemon.endpoint, tenant)
        # A load that fails in a step that completes later blocks of its request: those
        # were computed on pages never filled, and stored they were served wrong to the
        # next request that loaded them.  S's 4 blocks are saved; S+T's load of them fails
        # (evicted after the lookup) in the step that computes T's 3 blocks; S is saved
        # again; then S+T loads what the daemon holds.
        reset = {"reset_prefix_cache": True}
        out["poison"] = engine_run(tmp, "poison", model, [
            {"prompt": PROMPT_S},
            {"prompt": PROMPT_ST, "evict_before_load": True, **reset},
            {"prompt": PROMPT_S, **reset},
            {"prompt": PROMPT_ST, **reset},
        ], daemon.endpoint, tenant)

    def without_a_daemon() -> None:
        # (a model of its own: the lanes run side by side, and each writes its model
        # on first use; the seeded weights are the same)
        own = tmp / "tiny-llama-b"
        out["baseline"] = engine_run(tmp, "baseline", own, [{"prompt": PROMPT_P},
                                                             {"prompt": PROMPT_Q},
                                                             {"prompt": PROMPT_ST}])
        # A daemon that is not up when the engine starts: the engine starts, serves (no
        # hit) and gives the same outputs.
        late = DaemonProcess(tmp / "late")
        out["no_daemon"] = engine_run(tmp, "no_daemon", own, [{"prompt": PROMPT_P}],
                                      late.endpoint, tenant,
                                      "--extra", json.dumps({"timeout": 1}))

    try:
        in_lanes(saved_then_loaded, without_a_daemon)
        yield out
    finally:
        daemon.stop()
        log = daemon.log()
        assert "invariant violated" not in log, log


def test_first_engine_computes_and_saves(runs: dict[str, Any]) -> None:
    first, baseline = runs["first"], runs["baseline"]
    assert [r["external_tokens"] for r in first["results"]] == [0, 0]
    assert [r["output"] for r in first["results"]] == [
        r["output"] for r in baseline["results"][:2]]
    # P: 100 prompt + 12 generated tokens fill 3 blocks; Q: 150 + 12 fill 5.
    assert first["worker"]["saved_blocks"] == 3 + 5
    assert first["worker"]["save_failures"] == 0


def test_saves_look_nothing_up(runs: dict[str, Any]) -> None:
    # The daemon's lookups are the scheduler's, one per new request: it knows from that
    # lookup what the store holds, so the worker's saves only reserve and commit.
    first = runs["first"]
    assert first["worker"]["saves"] > 0
    assert first["daemon_lookups"] == first["scheduler"]["lookups"] == 2


def test_second_engine_loads_the_prefix_and_matches(runs: dict[str, Any]) -> None:
    hit = runs["second"]["results"][0]
    assert hit["external_tokens"] == 3 * BLOCK  # all full blocks but the last token's
    assert hit["num_cached_tokens"] == 3 * BLOCK  # vLLM's own count: fewer computed
    assert hit["output"] == runs["baseline"]["results"][0]["output"]
    assert runs["second"]["worker"]["loaded_blocks"] >= 3


def test_other_cache_salt_or_adapter_gets_no_hit(runs: dict[str, Any]) -> None:
    salted, adapted = runs["second"]["results"][1:3]
    assert salted["external_tokens"] == 0 and salted["num_cached_tokens"] == 0
    assert salted["output"] == runs["baseline"]["results"][0]["output"]
    assert adapted["external_tokens"] == 0 and adapted["num_cached_tokens"] == 0
    # The adapter changes the model, so the output differs: a hit would have been wrong.
    assert adapted["output"] != runs["baseline"]["results"][0]["output"]


def test_blocks_lost_before_the_load_are_reported_and_recomputed(
        runs: dict[str, Any]) -> None:
    lost = runs["second"]["results"][3]
    assert lost["external_tokens"] == 4 * BLOCK  # offered by the lookup...
    assert runs["second"]["worker"]["load_failed_blocks"] == 4  # ...gone by the load
    assert lost["output"] == runs["baseline"]["results"][1]["output"]  # vLLM recomputed


def test_blocks_computed_past_a_failed_load_are_never_saved(runs: dict[str, Any]) -> None:
    saved, failed, again, loaded = runs["poison"]["results"]
    want = runs["baseline"]["results"][2]["output"]
    assert saved["external_tokens"] == 0
    assert failed["external_tokens"] == 4 * BLOCK  # S offered, gone by the load
    assert failed["output"] == want  # vLLM recomputed the step
    # S's blocks alone were in the daemon: T's, computed past the failed load, were not
    # saved (before, all 7 were offered and the answer came from T's wrong KV)
    assert loaded["external_tokens"] == 4 * BLOCK
    assert loaded["output"] == want
    assert runs["poison"]["worker"]["saves_after_failed_load"] >= 1


def test_the_scheduler_connects_at_start_and_a_daemon_not_up_fails_no_start(
        runs: dict[str, Any]) -> None:
    assert runs["first"]["scheduler_connected"]  # before the first request came
    run = runs["no_daemon"]
    assert not run["scheduler_connected"]
    assert run["results"][0]["output"] == runs["baseline"]["results"][0]["output"]
    assert run["results"][0]["external_tokens"] == 0
    assert run["scheduler"]["lookups"] == 0  # misses at once, no daemon call
