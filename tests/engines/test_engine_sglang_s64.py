"""An SGLang server's LoRA adapters replaced in place (a new fine-tune at the same path)
never load the pages the old weights computed (sglang_s64_run.py, in the SGLang
environment, against a real daemon).

Before: SGLang seeds an adapter's page hashes with its ``lora_id``, which for an adapter
given with ``--lora-paths`` is made of its name and path alone; the namespace's
revision named the base checkpoint only, so a server restarted on the replaced adapter
found and loaded the old adapter's pages.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env


def test_an_adapter_replaced_in_place_loads_none_of_the_old_pages(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    proc = run_in_env("sglang", [str(HERE / "sglang_s64_run.py"), "--endpoint", daemon.endpoint,
                                 "--tenant", f"sglang-{uuid.uuid4().hex[:8]}",
                                 "--scratch", str(tmp_path)], timeout=180)
    out = last_json(proc.stdout)
    every = {"stored": True, "found": 4, "loaded": 4, "got_the_others_bytes": True}
    nothing = {"stored": True, "found": 0, "loaded": 0, "got_the_others_bytes": False}
    assert out["same_adapter"] == every
    assert out["replaced_in_place"] == nothing
    assert out["no_adapters"] == nothing
    assert out["another_added"] == nothing
    assert "Traceback" not in proc.stderr
