"""A request vLLM preempts (its KV cache full) reloads the blocks it saved before, rather
than compute them again.  Real engines (the CPU build), a real daemon, a KV cache of 16
blocks for six requests of about seven blocks each.

Before: a request kept the lookup made when it arrived (nothing cached yet) for good,
so after its preemption it recomputed every block it had saved meanwhile.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env

PROMPTS = [[(3 + 2 * k) * i % 500 + 3 + k for i in range(100 + 7 * k)] for k in range(6)]


def engine(tmp: Path, name: str, model: Path, *args: str) -> dict[str, Any]:
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps([{"prompts": PROMPTS}]))
    argv = [str(HERE / "vllm_run.py"), "--model", str(model), "--requests", str(spec),
            "--kv-cache-mib", "0.5", "--max-model-len", "256", "--max-tokens", "80", *args]
    out: dict[str, Any] = last_json(run_in_env("vllm", argv, timeout=240, cwd=tmp).stdout)
    return out


def test_a_preempted_request_reloads_what_it_saved(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    daemon = DaemonProcess(tmp_path / "daemon", dram_capacity="128MiB",
                           extra=["--slab-size", "16MiB"]).start()
    try:
        plain = engine(tmp_path, "plain", model)
        stored = engine(tmp_path, "kvstore", model, "--endpoint", daemon.endpoint,
                        "--tenant", f"preempt-{uuid.uuid4().hex[:8]}")
    finally:
        daemon.stop()
    assert plain["preemptions"] > 0 and stored["preemptions"] > 0  # the cache was full
    outputs = [o["output"] for o in stored["results"][0]["outputs"]]
    assert outputs == [o["output"] for o in plain["results"][0]["outputs"]]
    # nothing was in the daemon when the requests came: what was loaded, each preempted
    # request had saved itself
    assert stored["worker"]["loaded_blocks"] > 0, stored["worker"]
    assert stored["worker"]["load_failed_blocks"] == 0
