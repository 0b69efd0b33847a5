"""kvstore's LMCache L2 adapter for engines whose model is a checkpoint directory: its
weights replaced in place, the objects the old weights computed are not loaded
(lmcache_s57_checks.py, in the LMCache environment, against a real daemon).

Before: every object's revision was "unversioned" unless the adapter's parameters named
one, and an engine restarted on a new fine-tune at the same path loaded the old one's KV.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess
from engine_envs import HERE, ROOT, last_json, run_in_env


def test_objects_of_weights_replaced_in_place_are_not_loaded(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    proc = run_in_env("lmcache", [str(HERE / "lmcache_s57_checks.py"), daemon.endpoint,
                                  f"lmcache-{uuid.uuid4().hex[:8]}", str(tmp_path)],
                      timeout=180, PYTHONPATH=str(ROOT))
    out = last_json(proc.stdout)
    assert out["stored_old"] and out["stored_given"], out
    assert out["same_weights"] == [3, 3, True]  # a restart on the same weights: shared
    assert out["replaced_weights"][:2] == [0, 0], out  # (before: [3, 3], the old KV)
    assert out["given"] == [3, 3, True]
    assert out["pinned_at_end"] == 0
    assert "Traceback" not in proc.stderr
