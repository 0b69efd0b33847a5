"""kvstore's LMCache L2 adapter under LMCache users' set-ups, against a real daemon, run in
the LMCache environment (``lmcache_setups_checks.py``): chunk sizes whose slot has no
exact shape within an identity's bounds."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, ROOT, last_json, run_in_env


def check(name: str, daemon: DaemonProcess) -> Any:
    """Run one check of ``lmcache_setups_checks.py``; its JSON report."""
    proc = run_in_env("lmcache", [str(HERE / "lmcache_setups_checks.py"), name,
                                  daemon.endpoint, f"lmcache-{uuid.uuid4().hex[:8]}"],
                      timeout=180, PYTHONPATH=str(ROOT))
    return last_json(proc.stdout)


def test_chunks_whose_slot_has_no_exact_identity_shape_are_stored_and_loaded(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # A DeepSeek-V3 chunk of 256 tokens: its namespace was an invalid identity, so every
    # store failed and every lookup missed.
    out = check("large_chunk", daemon_factory(dram_capacity="128MiB",
                                              extra=["--slab-size", "32MiB"]))
    n = out["n"]
    assert out["stored"] == [True], out
    assert out["found"] == n and out["loaded"] == n and out["same_bytes"], out
    assert out["pinned_at_end"] == 0 and out["last_error"] == "", out

