"""vLLM on the CPU with kvstore's connector under set-ups the other engine tests do not
take: a ``load_gbps`` in the extra config whose rates are not numbers; requests of
one prompt under vLLM's ``cache_salt`` (the same salt shares blocks, another salt or
none does not); the daemon stopped and started again between two engines (the second
loads what the first saved, from the SSD tier the daemon wrote it to on its way out);
vLLM's n-gram speculative decoding (drafts verified in the step that saves; a
conversation's next turn loads the blocks its decode filled).

Real engines (vllm_s62_run.py, in the vLLM environment) on real daemons, a daemon per
lane.  An engine run's own first phase, computed whole, is the oracle of its later
phases that load (vLLM's prefix cache emptied between them); the speculative engine's
is an engine of the same settings without kvstore.  After each phase the daemon holds
no pin or reservation, and kvstore logs no warning.

Before: a ``load_gbps`` rate of "fast" (or null) stopped the engine's start with
float()'s bare error, which names no key (or a TypeError), and one of NaN or ``true``
was taken; now each is refused as the other keys' values are, naming ``load_gbps``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import HERE, in_lanes_on, last_json, run_in_env

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
BAD_RATES = [{"ssd": "fast"}, {"ssd": None}, {"ssd": float("nan")}, {"ssd": True},
             {"ssd": 0}, {"remote": -2}, "10", None]
GOOD_RATES = [{"ssd": 2.5, "remote": "0.5"}, {}]

BLOCK = 32                                               # vllm_run.BLOCK
P = [(7 * i) % 500 + 3 for i in range(150)]              # 4 full blocks and 22 tokens
Q = [(5 * i + 1) % 490 + 7 for i in range(4 * BLOCK)]    # 4 blocks exactly
R = {"reset_prefix_cache": True}  # vLLM's own prefix cache emptied: hits are kvstore's


def salted(salt: str | None, tokens: list[int] = P) -> dict[str, Any]:
    return {"tokens": tokens, **({"salt": salt} if salt else {})}


SALTS: list[dict[str, Any]] = [
    {"prompts": [salted("a"), salted("b"), Q]},                          # 0: computed
    {"prompts": [salted("a"), salted("c"), salted(None), Q], **R},       # 1: a, Q loaded
]
AFTER_RESTART: list[dict[str, Any]] = [{"prompts": [salted("a"), salted("b"), Q]}]
SPEC = {"llm_args": {"speculative_config": {
    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
    "prompt_lookup_min": 1}}}
DECODE: list[dict[str, Any]] = [
    {"prompts": [P, Q], "max_tokens": 48},                              # 0: computed
    {"prompts": [P, Q], "max_tokens": 48, **R},                         # 1: loaded
    {"follow": True, "max_tokens": 16, **R},                            # 2: next turn
]


def test_a_load_gbps_rate_that_is_not_a_number_above_zero_is_refused_naming_it() -> None:
    extras = [{"load_gbps": rates} for rates in BAD_RATES + GOOD_RATES]
    said = last_json(run_in_env("vllm", ["-c", VALUES, json.dumps(extras)],
                                timeout=120).stdout)
    for rates, answer in zip(BAD_RATES, said):
        assert answer.startswith("ConfigError: KVStoreConnector") and "'load_gbps'" in answer, (
            rates, answer)
    assert said[len(BAD_RATES):] == ["taken"] * len(GOOD_RATES), said


def engine(tmp: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    argv = [str(HERE / "vllm_s62_run.py"), "--model", str(tmp / f"tiny-llama-{name}"),
            "--spec", str(path)]
    proc = run_in_env("vllm", argv, timeout=300, cwd=tmp)
    out: dict[str, Any] = last_json(proc.stdout)
    out["tracebacks"] = proc.stderr.count("Traceback")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-s62")
    kept = DaemonProcess(tmp / "kept", dram_capacity="64MiB", ssd_capacity="64MiB",
                         extra=["--slab-size", "4MiB"]).start()
    spec = DaemonProcess(tmp / "spec", dram_capacity="64MiB",
                         extra=["--slab-size", "4MiB"]).start()
    tenant = f"s62-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {}

    def salts_then_restart() -> None:
        conn = {"extra": {"endpoint": kept.endpoint, "tenant": tenant}}
        out["salts"] = engine(tmp, "salts", {"connector": conn, "phases": SALTS})
        kept.stop()  # (SIGTERM: what DRAM holds is written to the SSD tier)
        kept.start()
        out["after"] = engine(tmp, "after", {"connector": conn, "phases": AFTER_RESTART})

    def speculative() -> None:
        out["spec"] = engine(tmp, "spec", {"engine": SPEC, "phases": DECODE, "connector": {
            "extra": {"endpoint": spec.endpoint, "tenant": tenant}}})

    def speculative_alone() -> None:
        out["spec_plain"] = engine(tmp, "spec-plain", {"engine": SPEC, "phases": DECODE})

    in_lanes_on([kept, spec], salts_then_restart, speculative, speculative_alone)
    return out


def outputs(run: dict[str, Any], phase: int) -> list[Any]:
    return [r and r["outputs"] for r in run["phases"][phase]["results"]]


def cached(run: dict[str, Any], phase: int) -> list[int]:
    return [r["num_cached_tokens"] for r in run["phases"][phase]["results"]]


def assert_clean(run: dict[str, Any]) -> None:
    """No pin or reservation left in the daemon, no request left, no warning."""
    for phase in run["phases"]:
        assert phase["daemon"]["pinned_blocks"] == 0, phase["daemon"]
        assert phase["daemon"]["reserved_slots"] == 0, phase["daemon"]
        assert phase["left_in_scheduler"] == 0
    assert run["scheduler_requests_left"] == 0
    assert run["warnings"] == 0, run["warning_texts"]
    assert run["tracebacks"] == 0


def test_the_same_cache_salt_shares_blocks_and_another_or_none_does_not(
        runs: dict[str, Any]) -> None:
    run = runs["salts"]
    assert cached(run, 0) == [0, 0, 0]
    # salt a: its 4 full blocks; salt c and no salt: none; Q: 3 of its 4 (vLLM computes
    # the last token)
    assert cached(run, 1) == [4 * BLOCK, 0, 0, 3 * BLOCK]
    p, _, q = outputs(run, 0)
    assert outputs(run, 1) == [p, p, p, q]
    assert_clean(run)


def test_a_daemon_started_again_serves_what_it_wrote_to_ssd_on_its_way_out(
        runs: dict[str, Any]) -> None:
    run = runs["after"]
    assert cached(run, 0) == [4 * BLOCK, 4 * BLOCK, 3 * BLOCK]
    assert outputs(run, 0) == outputs(runs["salts"], 0)
    assert run["scheduler"]["hit_tokens_ssd"] == 11 * BLOCK, run["scheduler"]
    assert run["worker"]["load_failed_blocks"] == 0
    assert_clean(run)


def test_speculative_decoding_saves_and_loads_what_vllm_alone_computes(
        runs: dict[str, Any]) -> None:
    run, plain = runs["spec"], runs["spec_plain"]
    for phase in range(3):
        assert outputs(run, phase) == outputs(plain, phase), phase
    assert cached(run, 0) == [0, 0]
    assert cached(run, 1) == [4 * BLOCK, 3 * BLOCK]
    # the next turn (prompt, 48 tokens out, then a new request of them all): the blocks
    # the decode filled, every one whose KV was computed (the last token's never is)
    assert cached(run, 2) == [(150 + 48 - 1) // BLOCK * BLOCK, (128 + 48 - 1) // BLOCK * BLOCK]
    assert run["drafts"] > 0 and plain["drafts"] > 0  # (vLLM drafted: its path was taken)
    assert run["worker"]["load_failed_blocks"] == 0
    assert_clean(run)

