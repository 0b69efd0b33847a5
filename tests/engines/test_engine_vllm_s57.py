"""vLLM on the CPU with kvstore's connector under set-ups the other engine tests do not
take: a LoRA adapter whose weights are replaced at the same path between two engines
(a new fine-tune of it, deployed in place), and an engine whose model configuration is
overridden (vLLM's ``hf_overrides``) beside one of the same checkpoint without.

Real engines (vllm_s57_run.py, in the vLLM environment) on a real daemon, two lanes side
by side.  Each engine run's own phases are the oracle where it computes and then loads
(vLLM's prefix cache emptied between them); after each phase the daemon holds no pin or
reservation, and kvstore logs no warning.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import HERE, in_lanes_on, last_json, run_in_env

P = [(7 * i) % 500 + 3 for i in range(150)]             # 4 full blocks of 32
A = [(3 * i) % 500 + 3 for i in range(100)]             # 3 full blocks of 32
OVERRIDES = {"hf_overrides": {"rms_norm_eps": 0.5}}   # every layer's keys and values change
R = {"reset_prefix_cache": True}  # vLLM's own prefix cache emptied: hits are kvstore's


def engine(tmp: Path, name: str, model: str, spec: dict[str, Any]) -> dict[str, Any]:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    argv = [str(HERE / "vllm_s57_run.py"), "--model", str(tmp / model), "--spec", str(path)]
    proc = run_in_env("vllm", argv, timeout=300, cwd=tmp)
    out: dict[str, Any] = last_json(proc.stdout)
    out["tracebacks"] = proc.stderr.count("Traceback")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-s57")
    # a daemon per lane: each phase's figures (pins, reservations) are its lane's alone
    daemon, other = (DaemonProcess(tmp / name, dram_capacity="64MiB",
                                   extra=["--slab-size", "4MiB"]).start()
                     for name in ("daemon", "other"))
    tenant = f"s57-{uuid.uuid4().hex[:8]}"
    conn = {"extra": {"endpoint": daemon.endpoint, "tenant": tenant}}
    conn_other = {"extra": {"endpoint": other.endpoint, "tenant": tenant}}
    out: dict[str, Any] = {}

    def adapters() -> None:
        # adapter a's prompt computed and saved; b (another adapter) computes it too
        out["before"] = engine(tmp, "before", "tiny-llama", {
            "engine": {"loras": ["a", "b"]}, "connector": conn,
            "phases": [{"prompts": [{"tokens": P, "lora": "a"}]},
                       {"prompts": [{"tokens": P, "lora": "b"}]}]})
        # a fine-tune deployed in place: b's weights at a's path, the same size
        lora = tmp / "tiny-llama-lora" / "adapter_model.safetensors"
        shutil.copy(tmp / "tiny-llama-lora-b" / "adapter_model.safetensors", lora)
        out["after"] = engine(tmp, "after", "tiny-llama", {
            "engine": {"loras": ["a"]}, "connector": conn,
            "phases": [{"prompts": [{"tokens": P, "lora": "a"}]}]})

    def overridden() -> None:
        # the checkpoint's own configuration computes A first; then one overridden
        out["base"] = engine(tmp, "base", "tiny-llama-o", {
            "connector": conn_other, "phases": [{"prompts": [A]}]})
        out["overridden"] = engine(tmp, "overridden", "tiny-llama-o", {
            "engine": {"llm_args": OVERRIDES}, "connector": conn_other,
            "phases": [{"prompts": [A]}, {"prompts": [A], **R}]})

    in_lanes_on([daemon, other], adapters, overridden)
    return out


def outputs(run: dict[str, Any], phase: int) -> list[Any]:
    return [r and r["outputs"] for r in run["phases"][phase]["results"]]


def held(run: dict[str, Any]) -> list[tuple[int, int]]:
    return [(p["daemon"]["pinned_blocks"], p["daemon"]["reserved_slots"])
            for p in run["phases"]]


def test_an_adapter_replaced_in_place_loads_none_of_the_old_ones_blocks(
        runs: dict[str, Any]) -> None:
    before, after = runs["before"], runs["after"]
    assert before["phases"][1]["external_tokens"] == 0  # b shares none of a's
    # The adapter at a's path is b's now: nothing a's old weights computed is loaded
    # (before: its 4 blocks were, and the answer was neither adapter's)
    assert after["phases"][0]["external_tokens"] == 0
    assert outputs(after, 0) == outputs(before, 1)
    for run in (before, after):
        assert held(run) == [(0, 0)] * len(run["phases"])
        assert run["warnings"] == 0, run["warning_texts"]
        assert run["tracebacks"] == 0


def test_an_engine_of_overridden_configuration_loads_only_its_own_blocks(
        runs: dict[str, Any]) -> None:
    base, overridden = runs["base"], runs["overridden"]
    # Before: it loaded the 3 blocks the checkpoint's own configuration computed (the
    # same model, the same revision) and answered as neither engine would
    assert overridden["phases"][0]["external_tokens"] == 0
    assert outputs(overridden, 0) != outputs(base, 0)  # the overrides change the answer
    # its own blocks, saved, are loaded again, and give its own answer
    assert overridden["phases"][1]["external_tokens"] == 96
    assert outputs(overridden, 1) == outputs(overridden, 0)
    for run in (base, overridden):
        assert held(run) == [(0, 0)] * len(run["phases"])
        assert run["warnings"] == 0, run["warning_texts"]
        assert run["tracebacks"] == 0
