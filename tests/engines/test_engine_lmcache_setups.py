"""kvstore's LMCache L2 adapter under LMCache users' set-ups, against a real daemon, run in
the LMCache environment (``lmcache_setups_checks.py``): chunk sizes whose slot has no
exact shape within an identity's bounds, more chunks than the daemon's DRAM holds with
the rest on its SSD tier, tasks submitted while the adapter closes or chunks locked when
it does, its health through daemon failures, store results popped while others are
published, and more cache salts than a session may open namespaces."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, ROOT, last_json, run_in_env


def check(name: str, daemon: DaemonProcess) -> Any:
    """Run one check of ``lmcache_setups_checks.py``; its JSON report."""
    proc = run_in_env("lmcache", [str(HERE / "lmcache_setups_checks.py"), name,
                                  daemon.endpoint, f"lmcache-{uuid.uuid4().hex[:8]}",
                                  str(daemon.proc.pid if daemon.proc else 0)],
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


def test_a_lookup_past_dram_locks_what_fits(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # 400 chunks of 256 KiB, 32 MiB of DRAM (124 of them), the rest on SSD; a lookup of
    # 300 asked DRAM for them all in one acquire, which was refused whole: nothing was
    # locked, nothing loaded.
    out = check("past_dram", daemon_factory(dram_capacity="32MiB", ssd_capacity="256MiB",
                                            extra=["--slab-size", "8MiB"]))
    assert all(out["stored"]), out
    assert out["found"] >= 64 and out["found_a_prefix"], out
    assert out["pinned_after_lookup"] == out["found"], out
    assert out["loaded_locked"] == out["found"] and out["same_bytes"], out
    assert out["pinned_after_unlock"] == 0, out
    assert out["loaded_all"] >= 64 and out["same_bytes_all"], out
    assert out["pinned_at_end"] == 0, out


def test_tasks_submitted_while_closing_or_after_are_answered(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # close() queued its stop behind the tasks already queued, and tasks submitted
    # after it were queued behind the stop with no thread to run them: never answered,
    # a prefetch of LMCache's waited for them for good.
    out = check("closing", daemon_factory())
    assert out["stored"] == [True] and out["tasks"] > 1, out
    assert out["unanswered_lookups"] == 0 and out["unanswered_loads"] == 0, out
    assert out["unanswered_stores"] == 0 and out["after_close_failed"] == [True], out
    assert not out["healthy"] and out["pinned_at_end"] == 0, out


def test_closing_with_chunks_locked_leaves_none_pinned(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # A client that holds pins sends no goodbye at close, so the locks left stayed
    # pinned for the daemon's lease (30 s here), past the adapter's end.
    out = check("close_with_locks", daemon_factory())
    assert out["stored"] == [True] and out["found"] == 8, out
    assert out["pinned_after_lookup"] == 8 and out["pinned_after_close"] == 0, out


def test_health_follows_the_daemon_failures_taken_as_misses(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # A daemon that stopped answering, or that cannot hold the objects, made every store
    # fail and every lookup miss while report_status said healthy, with no error.
    out = check("health", daemon_factory())
    healthy = {"is_healthy": True, "last_error": ""}
    assert out["stored"] == [True] and out["at_start"] == healthy, out
    assert out["stored_stopped"] == [False] and out["found_stopped"] == 0, out
    assert out["after_store_stopped"]["is_healthy"] is False, out
    assert out["after_store_stopped"]["last_error"].startswith("L2 store: Unavailable"), out
    assert out["after_lookup_stopped"]["is_healthy"] is False, out
    assert out["stored_back"] == [True] and out["found_back"] == 4, out
    assert out["after_lookup_back"]["is_healthy"] is True, out
    assert out["stored_too_big"] == [False], out
    assert out["after_too_big"] == {
        "is_healthy": False,
        "last_error": "L2 store: ValueError: an object of 8192 bytes exceeds object_bytes=4096"}
    assert out["stored_huge"] == [False] and out["after_huge"] == {"is_healthy": False}, out
    assert out["pinned_at_end"] == 0, out


def test_no_store_result_is_lost_to_a_pop(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # pop_completed_store_tasks swapped in a new dict while the store thread, holding the
    # old one, was about to publish into it: that result was never popped, and LMCache
    # kept the task's objects for a store that never completed.
    out = check("store_results", daemon_factory())
    assert out["lost"] == 0 and out["failed"] == 0, out


def test_more_salts_than_a_session_may_open_namespaces(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    # One namespace per cache salt, none ever closed: past the daemon's cap on a
    # session's open namespaces (1024 by default) every new salt's stores failed and its
    # lookups missed, for as long as the adapter lived.
    config = tmp_path / "kvstore.toml"
    config.write_text("[server]\nmax_namespaces_per_session = 8\n")
    out = check("many_salts", daemon_factory(extra=["--config", str(config)]))
    users = out["users"]
    assert out["stored"] == [True] * users, out
    assert out["found"] == [2] * users and out["loaded"] == [2] * users, out
    assert out["same_bytes"] and out["pinned_at_end"] == 0 and out["healthy"], out
    # a lookup holding pins when it meets the cap keeps its session and those pins, and
    # the link closes the least recently used namespace for the new salt: all are found
    assert out["found_across_cap"] == [0, 1, 2, 3] and out["pinned_across_cap"] == 4, out
    assert out["pinned_after_unlock"] == 0, out
