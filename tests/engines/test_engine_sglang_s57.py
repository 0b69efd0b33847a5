"""SGLang servers whose arguments change one checkpoint's KV (its configuration
overridden, its weights quantized as they load) never load each other's pages through
kvstore (sglang_s57_run.py, in the SGLang environment, against a real daemon).

Before: the identity was the checkpoint's name and revision, and a server started with
``--json-model-override-args`` (RoPE scaling) or ``--quantization fp8`` found and loaded
the pages a server without had stored.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env


def test_servers_whose_arguments_change_the_kv_share_no_pages(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    proc = run_in_env("sglang", [str(HERE / "sglang_s57_run.py"), "--endpoint", daemon.endpoint,
                                 "--tenant", f"sglang-{uuid.uuid4().hex[:8]}"], timeout=180)
    out = last_json(proc.stdout)
    nothing = {"stored": True, "found": 0, "loaded": 0, "got_the_others_bytes": False}
    assert out["overridden"] == nothing
    assert out["quantized"] == nothing
    every = {"stored": True, "found": 4, "loaded": 4, "got_the_others_bytes": True}
    assert out["same_overrides"] == every
    assert out["empty_overrides"] == every
    assert "Traceback" not in proc.stderr
