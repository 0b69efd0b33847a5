"""vLLM on the CPU with kvstore's connector as ``vllm serve`` runs it: the engine core
(scheduler and worker) in a process of its own, vLLM's default, which the other engine
tests turn off to reach into the scheduler (vllm_mp_run.py, in the vLLM environment).

Two engines, one after the other, on one daemon: the first computes and saves two
prompts, then loads them (its prefix cache emptied); the second, a new engine against
the daemon that kept them, loads them (from its first request, once connected).  Every answer is the
first's computed one; the daemon holds no pin or reservation after; kvstore logs
nothing and nothing raised.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env

from kvstore import Client

A = [(3 * i) % 500 + 3 for i in range(100)]        # 3 full blocks of 32
B = [(7 * i + 11) % 500 + 3 for i in range(150)]   # 4
PHASES = [{"prompts": [A, B]}, {"prompts": [A, B], "reset_prefix_cache": True}]


def engine(tmp: Path, name: str, endpoint: str, tenant: str) -> tuple[dict[str, Any], str]:
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps({"connector": {"extra": {"endpoint": endpoint, "tenant": tenant}},
                                "phases": PHASES}))
    proc = run_in_env("vllm", [str(HERE / "vllm_mp_run.py"), "--model", str(tmp / "tiny-llama"),
                               "--spec", str(spec)], timeout=300, cwd=tmp)
    out: dict[str, Any] = last_json(proc.stdout)
    return out, proc.stderr


def test_engines_with_their_own_core_process_save_and_load(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "daemon", dram_capacity="64MiB",
                           extra=["--slab-size", "4MiB"]).start()
    tenant = f"mp-{uuid.uuid4().hex[:8]}"
    try:
        first, first_log = engine(tmp_path, "first", daemon.endpoint, tenant)
        second, second_log = engine(tmp_path, "second", daemon.endpoint, tenant)
        deadline = time.monotonic() + 10
        while True:  # (the engines' sessions end with their processes)
            with Client(daemon.endpoint, tenant=tenant) as client:
                dram = client.stats()["tiers"]["dram"]
            if (dram["pinned_blocks"], dram["reserved_slots"]) == (0, 0) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        daemon.stop()
    assert "invariant violated" not in daemon.log()
    computed = first["phases"][0]
    assert computed["num_cached_tokens"] == [0, 0]
    for phase in (first["phases"][1], *second["phases"]):
        assert phase["outputs"] == computed["outputs"], (first, second)
    # every full block but the last token's, loaded; (the second engine's first requests
    # may come before its connection to the daemon, made on a thread as it starts, is
    # up: misses then, and computed, on a loaded host)
    for phase in (first["phases"][1], second["phases"][1]):
        assert phase["num_cached_tokens"] == [96, 128], (first, second)
    cached = second["phases"][0]["num_cached_tokens"]
    assert all(n in (0, full) for n, full in zip(cached, [96, 128])), second
    assert (dram["pinned_blocks"], dram["reserved_slots"]) == (0, 0), dram
    for log in (first_log, second_log):
        assert "Traceback" not in log
        assert not [line for line in log.splitlines()
                    if line.startswith(("kvstore", "KVStoreConnector"))], log[-2000:]
