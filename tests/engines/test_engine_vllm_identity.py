"""Two vLLM engines of different weights never load each other's blocks: not when both
serve one name (an alias: a canary, an A/B test), not when the weights at one path are
replaced.  Real engines (the CPU build), a real daemon; the connector works out the
identity itself (no ``model_name``/``model_revision`` in its settings).

Before: the identity took the served name for the model, and a checkpoint with no
revision was ``unversioned``: the second engine loaded the first's blocks and its
outputs were another model's.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env

PROMPTS = [{"prompt": list(range(3, 103))}, {"prompt": [(7 * i) % 500 + 3 for i in range(150)]}]


def engine(tmp: Path, name: str, model: Path, endpoint: str, tenant: str,
           *args: str) -> list[int]:
    """Run the prompts; the tokens each request loaded from the daemon."""
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(PROMPTS))
    argv = [str(HERE / "vllm_run.py"), "--model", str(model), "--requests", str(spec),
            "--endpoint", endpoint, "--tenant", tenant, "--own-identity", *args]
    out: dict[str, Any] = last_json(run_in_env("vllm", argv, timeout=240, cwd=tmp).stdout)
    return [r["external_tokens"] for r in out["results"]]


def test_engines_of_other_weights_share_no_blocks(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "daemon", dram_capacity="128MiB",
                           extra=["--slab-size", "16MiB"]).start()
    tenant = f"ids-{uuid.uuid4().hex[:8]}"
    first, other = tmp_path / "first", tmp_path / "other"
    try:
        chat = ("--served-name", "chat")
        assert engine(tmp_path, "a1", first, daemon.endpoint, tenant, *chat) == [0, 0]
        # other weights, the same served name: nothing of the first's
        assert engine(tmp_path, "b", other, daemon.endpoint, tenant, *chat,
                      "--weights-seed", "99") == [0, 0]
        # the same weights again: their blocks (so the misses above are the identity's)
        loaded = engine(tmp_path, "a2", first, daemon.endpoint, tenant, *chat)
        assert all(n > 0 for n in loaded), loaded
        # the weights at the first's path replaced in place: nothing of the old ones'
        shutil.copy(other / "model.safetensors", first / "model.safetensors")
        assert engine(tmp_path, "a3", first, daemon.endpoint, tenant, *chat) == [0, 0]
    finally:
        daemon.stop()
        log = daemon.log()
        assert "invariant violated" not in log, log
