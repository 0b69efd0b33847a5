"""vLLM on the CPU with kvstore's connector under set-ups the other engine tests do not
use: blocks of 64 tokens, chunked prefill (64 tokens a step, so long prompts take several
steps), prompts shorter than a block and exactly a multiple of it, requests aborted
mid-prefill, parallel sampling (n > 1), weights changed in place (an RL trainer's update:
vLLM resets its caches and the connector's), and a daemon restarted under the engine.

Two engine runs side by side (``in_lanes``), the same phases in each: one without
kvstore (the oracle: greedy outputs) and one with it, on a real daemon; then a third
with a daemon of its own, killed and started again between two phases.  After each
phase, saves drained and the engine stepped until it holds no request; at the end the
daemon's figures show no pin or reservation left behind.

Before: the connector did not implement ``reset_cache``, which vLLM took as done; after
a weight update the engine loaded the KV the old weights had computed, and answered
wrong.  The first background save after the daemon restarted met no session and was
lost (a later miss) instead of stored once the link connected again.  Each sample of a
prompt sent its blocks to the daemon again.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import in_lanes_on, last_json, run_in_env, run_spec

BLOCK = 64
SHORT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]        # under one block
EXACT = [(3 * i) % 500 + 3 for i in range(2 * BLOCK)]  # two blocks exactly
LONG = [(7 * i + 11) % 500 + 3 for i in range(400)]    # 6 reusable blocks, 7 chunks
MID = [(13 * i + 1) % 490 + 7 for i in range(200)]     # 3 reusable blocks
SAMPLED = [(17 * i + 5) % 480 + 11 for i in range(4 * BLOCK)]  # 4 blocks
RESET = {"reset_prefix_cache": True}  # vLLM's own prefix cache emptied: hits are kvstore's
PHASES: list[dict[str, Any]] = [
    {"prompts": [SHORT, EXACT, LONG]},                              # 0: computed, saved
    {"prompts": [SHORT, EXACT, LONG], **RESET},                     # 1: loaded
    {"prompts": [MID, LONG + [4, 5]], "abort_after_steps": 2, **RESET},  # 2: aborted
    {"prompts": [MID], "n": 3, "temperature": 0.8, "max_tokens": 8},  # 3: parallel sampling
    {"prompts": [LONG, MID], "update_weights": 99},                 # 4: new weights
    {"prompts": [LONG, MID], **RESET},                              # 5: loaded again
    {"prompts": [SAMPLED], "n": 4, "temperature": 0.8, "max_tokens": 8},  # 6: 4 samples
]
ENGINE = {"block_size": BLOCK, "max_num_batched_tokens": BLOCK}


engine = functools.partial(run_spec, "vllm_setups_run.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-setups")
    daemon = DaemonProcess(tmp / "daemon", dram_capacity="64MiB",
                           extra=["--slab-size", "4MiB"]).start()
    connector = {"extra": {"endpoint": daemon.endpoint,
                           "tenant": f"setups-{uuid.uuid4().hex[:8]}"}}
    out: dict[str, Any] = {}

    def plain() -> None:
        out["plain"] = engine(tmp, "plain", {"engine": ENGINE, "phases": PHASES})

    def stored() -> None:
        out["kvstore"] = engine(tmp, "kvstore", {"engine": ENGINE, "phases": PHASES,
                                                 "connector": connector})

    def restarted() -> None:
        # a daemon of its own, restarted (empty) between the first two phases
        other = DaemonProcess(tmp / "restarted", dram_capacity="64MiB",
                              extra=["--slab-size", "4MiB"]).start()
        daemons.append(other)
        watcher = threading.Thread(target=restart_when_asked, args=(tmp, other))
        watcher.start()
        try:
            out["restarted"] = engine(tmp, "restarted", {"engine": ENGINE, "phases": [
                {"prompts": [LONG]},                                # computed, saved
                {"prompts": [LONG], "pause": "restart", **RESET},   # the same, saved again
                {"prompts": [LONG], **RESET},                       # loaded
            ], "connector": {"extra": {**connector["extra"], "endpoint": other.endpoint}}})
        finally:
            (tmp / "restart.go").write_text("")  # (the watcher ends)
            watcher.join()

    daemons = [daemon]
    in_lanes_on(daemons, plain, stored, restarted)
    return out


def restart_when_asked(tmp: Path, daemon: DaemonProcess) -> None:
    """Restart ``daemon`` (killed: a crash) once the engine run asks (``pause``)."""
    while not (tmp / "restart.ready").exists() and not (tmp / "restart.go").exists():
        time.sleep(0.05)
    if (tmp / "restart.ready").exists():
        daemon.stop(signal.SIGKILL)
        (daemon.workdir / "kvstore.sock").unlink(missing_ok=True)
        daemon.start()
        (tmp / "restart.go").write_text("")


def outputs(run: dict[str, Any], phase: int) -> list[Any]:
    return [r and r["outputs"] for r in run["phases"][phase]["results"]]


def test_greedy_outputs_match_the_engine_without_kvstore(runs: dict[str, Any]) -> None:
    for phase in (0, 1, 4, 5):
        assert outputs(runs["kvstore"], phase) == outputs(runs["plain"], phase), phase


def test_hits_are_the_full_blocks_of_each_prompt(runs: dict[str, Any]) -> None:
    phases = runs["kvstore"]["phases"]
    assert phases[0]["external_tokens"] == 0
    # SHORT: none; EXACT: 1 of its 2 blocks (vLLM computes the last token); LONG: 6
    assert [r["num_cached_tokens"] for r in phases[1]["results"]] == [0, BLOCK, 6 * BLOCK]
    assert phases[1]["external_tokens"] == 7 * BLOCK
    # EXACT's second block, which its prompt fills, was saved in phase 0 and is not
    # offered (vLLM computes its last token), nor sent again (before: it was, a duplicate)
    assert phases[1]["duplicates"] == phases[0]["duplicates"]


def test_aborted_and_parallel_requests_finish_and_leave_nothing_held(
        runs: dict[str, Any]) -> None:
    run = runs["kvstore"]
    assert outputs(run, 2) == [None, None]  # aborted mid-prefill
    assert [len(o) for o in outputs(run, 3)[0]] == [8, 8, 8]
    assert all(p["left_in_scheduler"] == 0 for p in run["phases"])
    assert run["scheduler_requests_left"] == 0
    dram = run["daemon_dram"]
    assert dram["pinned_blocks"] == 0 and dram["reserved_slots"] == 0, dram
    assert run["worker"]["load_failed_blocks"] == 0


def test_parallel_samples_of_a_prompt_send_its_blocks_once(runs: dict[str, Any]) -> None:
    run = runs["kvstore"]
    assert [len(o) for o in outputs(run, 6)[0]] == [8] * 4
    # The samples after the first find its pages in vLLM's prefix cache; before, each
    # saved them again, and the daemon took 3 more copies of the prompt's 4 blocks in
    # reserved slots, to drop them as duplicates.
    assert run["phases"][6]["duplicates"] == run["phases"][5]["duplicates"]


def test_after_a_weight_update_no_block_of_the_old_weights_is_loaded(
        runs: dict[str, Any]) -> None:
    updated, again = runs["kvstore"]["phases"][4:6]
    assert updated["reset"] and runs["plain"]["phases"][4]["reset"]
    # LONG and MID were in the daemon, computed with the weights before: not offered
    # (before, 9 blocks were, and both answers were wrong)
    assert updated["external_tokens"] == 0
    # what the new weights computed is saved, and loaded again
    assert again["external_tokens"] == (6 + 3) * BLOCK


def test_a_save_after_the_daemon_restarted_is_stored_not_lost(runs: dict[str, Any]) -> None:
    run = runs["restarted"]
    want = outputs(runs["plain"], 0)[2]
    assert [outputs(run, phase) for phase in range(3)] == [[want]] * 3
    # The restarted daemon had nothing: the second phase computed LONG and saved it
    # (before: the save met no session, failed, and the third phase found nothing)
    assert run["phases"][1]["external_tokens"] == 0
    assert run["phases"][2]["external_tokens"] == 6 * BLOCK
    assert run["daemon_dram"]["pinned_blocks"] == 0


SWITCHES = """
import json
from kvstore.integrations.vllm import ConnectorOptions
out = {}
for value in (True, False, 1, 0, "true", "false", " False ", "no", "On", "maybe", 2, None):
    try:
        opts = ConnectorOptions.from_extra({"async_saves": value, "prefetch": value}, None)
        out[repr(value)] = [opts.async_saves, opts.prefetch]
    except ValueError as exc:
        out[repr(value)] = str(exc)
import io, logging
warned = io.StringIO()
logging.getLogger("kvstore").addHandler(logging.StreamHandler(warned))
for extra in ({"endpoint": "ipc:///x", "model_revision": "v2", "async_saves": False},
              {"endpoint": "ipc:///x", "model_revison": "v2", "salt": "a"}):
    out[" ".join(extra)] = ConnectorOptions.check_keys(extra) or "taken"
out["warned"] = warned.getvalue()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def options() -> dict[str, Any]:
    """The connector's options as it reads them (no engine started)."""
    found: dict[str, Any] = last_json(run_in_env("vllm", ["-c", SWITCHES],
                                                 timeout=120).stdout)
    return found


def test_a_switch_given_as_text_is_read_as_written(options: dict[str, Any]) -> None:
    # Before: bool() of the value, so "false" (a configuration templated as text)
    # turned background saves and prefetches on, and any text at all was taken.
    found = options
    assert found["True"] == found["1"] == found["'true'"] == found["'On'"] == [True, True]
    assert found["False"] == found["0"] == found["'false'"] == found["' False '"] == found[
        "'no'"] == [False, False]
    for bad in ("'maybe'", "2", "None"):
        assert "async_saves is true or false" in found[bad], found[bad]


def test_a_key_the_connector_does_not_know_is_named(options: dict[str, Any]) -> None:
    # Before: ignored, its setting left at the default without a word (a misspelled
    # model_revision; a "salt" meant to keep a deployment's blocks apart); now warned
    found = options
    assert found["endpoint model_revision async_saves"] == "taken"
    assert found["endpoint model_revison salt"] == ["model_revison", "salt"]
    assert "unknown kv_connector_extra_config keys ['model_revison', 'salt']" in found["warned"]
