"""kvstore's LMCache L2 adapter against a real daemon, run in the LMCache environment
(``lmcache_adapter_checks.py``): tasks of more keys than one request carries, the same
chunks of two models or two salts locked at once, pins held past the daemon's lease,
its health after a task that raised, and chunks stored again into a full DRAM."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, ROOT, last_json, run_in_env


def check(name: str, daemon: DaemonProcess) -> Any:
    """Run one check of ``lmcache_adapter_checks.py``; its JSON report."""
    # PYTHONPATH: this checkout's kvstore.  A script's own folder, not the working
    # directory, heads sys.path, so without it the environment's editable install
    # decides, which may be another checkout's.
    proc = run_in_env("lmcache", [str(HERE / "lmcache_adapter_checks.py"), name,
                                  daemon.endpoint, f"lmcache-{uuid.uuid4().hex[:8]}"],
                      timeout=180, PYTHONPATH=str(ROOT))
    return last_json(proc.stdout)


def test_lookups_and_loads_of_more_keys_than_a_request_carries(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # 5000 keys, past the daemon's 4096 a request: split, not refused whole (which
    # missed every key), each key's result its own across the split.
    out = check("many_keys", daemon_factory(dram_capacity="64MiB"))
    n = out["n"]
    assert out["stored"] == [True], out
    assert out["found_all_but_gap"] and out["pinned_after_lookup"] == n - 1, out
    assert out["loaded_all_but_gap"] and out["same_bytes"], out
    assert out["pinned_after_load"] == n - 1, out  # a load's own pins are released
    # A copy that raised in the second part: nothing loaded, its pins released.
    assert out["loaded_with_broken"] == 0 and out["pinned_after_broken_load"] == n - 1, out
    assert out["pinned_after_unlock"] == 0, out
    # A lookup that raised after its first part pinned: nothing locked, nothing pinned.
    assert out["acquire_calls_with_failure"] == 2, out
    assert out["found_with_failure"] == 0, out
    assert out["pinned_after_failed_lookup"] == 0, out
    assert out["pinned_keys_after_failed_lookup"] == 0, out
    # The session gone between the parts: the first part's pins went with it (4096 keys
    # were reported locked), and the next lookup connects again.
    assert out["found_with_session_gone"] == 0, out
    assert out["pinned_keys_after_session_gone"] == 0, out
    assert out["found_after_session_gone"] == n - 1, out


def test_unlocking_one_models_or_salts_chunks_keeps_the_others_locked(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # Two models' same chunks, and one model's under two salts, locked; one of each
    # pair unlocked, then DRAM filled twice over: the others, still locked, load.
    out = check("models_and_salts", daemon_factory(dram_capacity="32MiB",
                                                   extra=["--slab-size", "16MiB"]))
    n = out["n"]
    assert out["stored"] == [[True]] * 4, out
    assert out["found"] == {"a": n, "b": n, "a2": n, "salted": n}, out
    assert out["pinned_after_unlock"] == 2 * n and out["pinned_keys_after_unlock"] == 2 * n
    assert out["found_a_after_pressure"] == 0, out  # the pressure evicts what is unpinned
    assert out["loaded_b"] == n and out["same_bytes_b"], out
    assert out["loaded_salted"] == n and out["same_bytes_salted"], out
    assert out["pinned_at_end"] == 0, out
    # a lookup over both whose second namespace lost the session: neither is locked
    assert out["found_both"] == 2 * n, out
    assert out["found_both_session_gone"] == 0, out
    assert out["pinned_keys_both_session_gone"] == 0, out


def test_locked_blocks_stay_pinned_past_the_daemons_lease(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # A 2 s lease, the adapter's 10 s request timeout, 5 s idle with blocks locked: the
    # adapter's pings follow the lease, not its timeout.
    out = check("lease", daemon_factory(lease=2.0))
    n = out["n"]
    assert out["stored"] == [True] and out["found"] == n, out
    assert out["pinned_after_lookup"] == n, out
    assert out["pinned_after_idle"] == n, out
    assert out["loaded"] == n and out["same_bytes"], out
    assert out["pinned_after_unlock"] == 0 and out["healthy"], out


def test_health_comes_back_after_a_task_that_raised(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    out = check("health", daemon_factory())
    error = "RuntimeError: this object's bytes are gone"
    assert out["healthy_at_start"] == {"is_healthy": True, "last_error": ""}, out
    assert out["broken_store"] == [False], out
    assert out["after_broken_store"] == {"is_healthy": False, "last_error": error}, out
    assert out["store"] == [True], out
    assert out["after_store"] == {"is_healthy": True, "last_error": error}, out
    assert out["broken_load"] == 0, out
    assert out["after_broken_load"] == {"is_healthy": False, "last_error": error}, out
    assert out["load"] == 4 and out["same_bytes"], out
    assert out["after_load"] == {"is_healthy": True, "last_error": error}, out


def test_chunks_stored_again_take_no_slot_and_evict_nothing(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # The adapter stores without a lookup: chunks the daemon holds already, stored again
    # by another engine's adapter or the same one, are duplicates, and evict none of the
    # other chunks that fill DRAM.
    out = check("stored_again", daemon_factory(dram_capacity="32MiB",
                                               extra=["--slab-size", "16MiB"]))
    n = out["n"]
    assert out["free"] == 4 and out["stored"] == [[True]] * 3, out
    first = out["first"]  # (room is made a little ahead: a slot or so more)
    assert (first["commits"], first["duplicates"]) == (n, 0), out
    assert n - 4 <= first["evictions"] <= n, out
    for again in ("second", "again"):
        assert out[again] == {"evictions": 0, "duplicates": n, "commits": 0}, out
    assert out["loaded"] == n and out["same_bytes"], out
    assert out["pinned_at_end"] == 0, out
