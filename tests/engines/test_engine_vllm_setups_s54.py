"""vLLM on the CPU with kvstore's connector under more set-ups: two LoRA adapters and
the base model on one daemon, chunked prefill of prompts shorter than a block, exactly
blocks long and many blocks long, a prompt longer than the daemon's DRAM (its blocks on
SSD), engines of other block sizes and dtypes beside them, requests cut by
``max_tokens=1`` or a stop token, aborted mid-prefill and mid-decode, preempted (a KV
cache of 16 blocks), and an engine shut down with requests running.

Greedy outputs are compared with the engine without kvstore (or, where the engine is of
another set-up, with its own run that computed them); after each phase the daemon holds
no pin or reservation.

Before: a request whose cached prefix was longer than the daemon's DRAM arena was
offered it all; the load, pinning more blocks than DRAM holds, failed whole, and the
request recomputed every block, each time it came.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import in_lanes_on, run_spec

BLOCK = 32
SHORT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73, 77, 81]
EXACT = [(3 * i) % 500 + 3 for i in range(4 * BLOCK)]
LONG = [(7 * i + 11) % 500 + 3 for i in range(300)]   # 9 blocks, 5 chunks of 64
MID = [(13 * i + 1) % 490 + 7 for i in range(70)]
LONG2 = [(11 * i + 2) % 490 + 7 for i in range(300)]
P = [(7 * i) % 500 + 3 for i in range(150)]             # 4 reusable blocks
PRE = [[(3 + 2 * k) * i % 500 + 3 + k for i in range(100 + 7 * k)] for k in range(6)]
HUGE = [(5 * i + 3) % 497 + 3 for i in range(1000)]     # 2 MB of a 4-layer model's KV
R = {"reset_prefix_cache": True}  # vLLM's own prefix cache emptied: hits are kvstore's


def lora(name: str | None) -> list[dict[str, Any]]:
    return [{"tokens": P, **({"lora": name} if name else {})}]


# (one adapter or the base model a batch: the CPU build's LoRA gives a request of the
# base model batched with the second adapter's a wrong answer, with no kvstore at all)
PHASES: list[dict[str, Any]] = [
    {"prompts": [SHORT, EXACT, LONG]},                              # 0: computed, saved
    {"prompts": [SHORT, EXACT, LONG], **R},                         # 1: loaded
    {"prompts": [MID], "max_tokens": 1, **R},                       # 2: one token
    {"prompts": [P], "stop_token_ids": [47], **R},                  # 3: a stop token
    {"prompts": [MID, LONG2], "abort_after_steps": 3, **R},         # 4: mid-prefill
    {"prompts": [MID, LONG2], "abort_after_steps": 7, **R},         # 5: mid-decode
    {"prompts": [MID, LONG2], **R},                                 # 6: loaded
    {"prompts": lora("a"), **R},                                    # 7: adapter a
    {"prompts": lora("b"), **R},                                    # 8: not a's blocks
    {"prompts": lora("a"), **R},                                    # 9: a's own
    {"prompts": lora("b"), **R},                                    # 10: b's own
    {"prompts": lora(None), "max_tokens": 80},                      # 11: base (P, PRE's
    {"prompts": PRE, "max_tokens": 80},                             # 12: answers)
]
ENGINE = {"block_size": BLOCK, "max_num_batched_tokens": 2 * BLOCK, "loras": ["a", "b"]}
SMALL = {"dram_capacity": "1MiB", "ssd_capacity": "64MiB", "extra": ["--slab-size", "1MiB"]}


engine = functools.partial(run_spec, "vllm_mixed_run.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-setups-more")
    daemon = DaemonProcess(tmp / "daemon", dram_capacity="64MiB",
                           extra=["--slab-size", "4MiB"]).start()
    small = DaemonProcess(tmp / "small", **SMALL).start()  # type: ignore[arg-type]
    tenant = f"more-{uuid.uuid4().hex[:8]}"
    conn = {"extra": {"endpoint": daemon.endpoint, "tenant": tenant}}
    out: dict[str, Any] = {}

    def plain() -> None:
        out["plain"] = engine(tmp, "plain", {"engine": ENGINE, "phases": PHASES})
        out["deep"] = engine(tmp, "deep", {  # 4 layers: 2 MB of KV, the DRAM 1 MB
            "engine": {"block_size": BLOCK, "layers": 4, "max_model_len": 1024},
            "phases": [{"prompts": [HUGE]}, {"prompts": [HUGE], **R}],
            "connector": {"extra": {"endpoint": small.endpoint, "tenant": tenant}}})
        out["preempted"] = engine(tmp, "preempted", {
            # (the small daemon: nothing else runs on it meanwhile to pin blocks)
            "engine": {"kv_cache_mib": 0.5, "max_model_len": 256},
            "connector": {"extra": {"endpoint": small.endpoint, "tenant": tenant}},
            "phases": [{"prompts": PRE, "max_tokens": 80},
                       {"prompts": PRE, "max_tokens": 80, "abort_after_steps": 3, **R}],
            "shutdown": True})

    def stored() -> None:
        out["kvstore"] = engine(tmp, "kvstore", {"engine": ENGINE, "phases": PHASES,
                                                 "connector": conn})
        # the same prompts, after the engine above saved them: another block size,
        # another dtype
        twice = [{"prompts": [P, EXACT]}, {"prompts": [P, EXACT], **R}]
        out["block64"] = engine(tmp, "block64", {"engine": {"block_size": 64},
                                                 "phases": twice, "connector": conn})
        out["bf16"] = engine(tmp, "bf16", {"engine": {"dtype": "bfloat16"},
                                           "phases": twice, "connector": conn})

    in_lanes_on([daemon, small], plain, stored)
    return out


def outputs(run: dict[str, Any], phase: int) -> list[Any]:
    return [r and r["outputs"] for r in run["phases"][phase]["results"]]


def held(run: dict[str, Any]) -> list[tuple[int, int]]:
    """Each phase's pinned and reserved DRAM blocks in the daemon, once it ended."""
    return [(p["daemon"]["pinned_blocks"], p["daemon"]["reserved_slots"])
            for p in run["phases"] if "daemon" in p]


def test_greedy_outputs_match_the_engine_without_kvstore(runs: dict[str, Any]) -> None:
    plain, stored = runs["plain"], runs["kvstore"]
    for phase in (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12):
        assert outputs(stored, phase) == outputs(plain, phase), phase
    assert [len(o[0]) for o in outputs(stored, 2)] == [1]
    assert outputs(stored, 3)[0][0][-1] == 47 and len(outputs(stored, 3)[0][0]) < 12
    assert held(stored) == [(0, 0)] * len(PHASES)
    assert runs["kvstore"]["scheduler_requests_left"] == 0
    assert stored["worker"]["load_failed_blocks"] == 0


def test_chunked_prefill_saves_and_reloads_every_full_block(runs: dict[str, Any]) -> None:
    phases = runs["kvstore"]["phases"]
    assert phases[0]["external_tokens"] == 0
    # SHORT: none; EXACT: 3 of its 4 (vLLM computes the last token); LONG: 9
    assert [r["num_cached_tokens"] for r in phases[1]["results"]] == [0, 96, 288]
    # MID and LONG2 aborted, then loaded what was saved of them before
    assert phases[6]["external_tokens"] > 0


def test_adapters_share_no_blocks_and_reload_their_own(runs: dict[str, Any]) -> None:
    phases = runs["kvstore"]["phases"]
    # P was saved by the base model (phase 3), then adapter a (7): b finds neither
    assert [phases[i]["external_tokens"] for i in (7, 8, 9, 10)] == [0, 0, 128, 128]
    # the adapters answer differently: a block shared would have been a wrong answer
    assert len({str(outputs(runs["kvstore"], i)) for i in (7, 8, 11)}) == 3


def test_other_block_sizes_and_dtypes_load_none_of_each_others(runs: dict[str, Any]) -> None:
    for name in ("block64", "bf16"):
        run = runs[name]
        # the float32 engine of 32-token blocks saved P and EXACT before
        assert run["phases"][0]["external_tokens"] == 0, name
        assert run["phases"][1]["external_tokens"] > 0, name  # its own, loaded
        assert outputs(run, 1) == outputs(run, 0), name
        assert held(run) == [(0, 0), (0, 0)], name
    assert outputs(runs["block64"], 0)[0][0] == outputs(runs["plain"], 11)[0][0][:12]


def test_a_prefix_longer_than_the_dram_loads_what_dram_holds(runs: dict[str, Any]) -> None:
    run = runs["deep"]
    assert outputs(run, 1) == outputs(run, 0)
    # 31 blocks of 64 KiB cached, on SSD most; a DRAM of 16 slots: 16 offered and loaded
    # (before: all 31 offered, the load failed whole, all recomputed)
    assert run["worker"]["load_failed_blocks"] == 0, run["worker"]
    assert run["phases"][1]["external_tokens"] == 16 * BLOCK
    assert run["scheduler"]["capped_tokens"] == 15 * BLOCK
    assert held(run) == [(0, 0), (0, 0)]


def test_preempted_and_shut_down_engines_leave_nothing_held(runs: dict[str, Any]) -> None:
    run = runs["preempted"]
    assert run["preemptions"] > 0
    assert outputs(run, 0) == outputs(runs["plain"], 12)
    assert run["phases"][1]["running"] == len(PRE)  # shut down with them running
    dram = run["daemon_dram"]
    assert dram["pinned_blocks"] == 0 and dram["reserved_slots"] == 0, dram
