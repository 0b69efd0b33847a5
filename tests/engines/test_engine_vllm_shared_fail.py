"""A load that fails saves nothing its step completed, for any request: another request
of that step may have read the pages never filled.  Real engines (the CPU build), a real
daemon, saves made in the step (``async_saves`` off: the copy is not raced by vLLM's
recompute of the step, as a background one may be).

X = A + T1 and Y = A + T2 come in one step.  X is offered A from the daemon, and vLLM
caches X's pages for A as it allocates them; Y, scheduled after X, finds A there and
computes T2 on those pages in the same step.  X's load fails (A evicted since the
lookup).  vLLM has both compute that step again.

Before: only X's saves were held back; Y's blocks of T2, computed on pages never filled,
were stored, and a later engine that loaded A + T2 answered Y wrong.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env

A = [(5 * i) % 500 + 3 for i in range(64)]             # 2 blocks
X = A + [(7 * i) % 480 + 5 for i in range(70)]         # 4 reusable blocks
Y = A + [(11 * i) % 470 + 9 for i in range(100)]       # 5 reusable blocks
RESET = {"reset_prefix_cache": True}


def engine(tmp: Path, name: str, model: Path, requests: list[dict[str, Any]],
           *args: str) -> dict[str, Any]:
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(requests))
    argv = [str(HERE / "vllm_run.py"), "--model", str(model), "--requests", str(spec), *args]
    out: dict[str, Any] = last_json(run_in_env("vllm", argv, timeout=240, cwd=tmp).stdout)
    return out


def test_a_failed_load_saves_no_block_its_step_completed(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    daemon = DaemonProcess(tmp_path / "daemon", dram_capacity="128MiB",
                           extra=["--slab-size", "16MiB"]).start()
    kv = ("--endpoint", daemon.endpoint, "--tenant", f"shared-{uuid.uuid4().hex[:8]}",
          "--extra", json.dumps({"async_saves": False}))
    try:
        plain = engine(tmp_path, "plain", model, [{"prompt": X, **RESET},
                                                  {"prompt": Y, **RESET}])
        engine(tmp_path, "first", model, [{"prompt": X}], *kv)
        failed = engine(tmp_path, "failed", model,
                        [{"prompts": [X, Y], "evict_before_load": True}], *kv)
        later = engine(tmp_path, "later", model, [{"prompt": X, **RESET},
                                                  {"prompt": Y, **RESET}], *kv)
    finally:
        daemon.stop()
        log = daemon.log()
    assert "invariant violated" not in log, log
    want = [r["output"] for r in plain["results"]]
    outputs = failed["results"][0]["outputs"]
    assert [o["num_cached_tokens"] for o in outputs] == [4 * 32, 2 * 32]  # Y: X's pages
    assert failed["worker"]["load_failed_blocks"] == 4
    assert [o["output"] for o in outputs] == want  # vLLM computed the step again
    # X saved A again; Y's T2 was not stored (before: its 3 blocks were, and loaded)
    assert [r["output"] for r in later["results"]] == want
    assert later["results"][1]["external_tokens"] == 2 * 32
    assert failed["worker"]["saves_after_failed_load"] >= 1  # Y's, of that step
