"""kvstore's LMCache L2 adapter under set-ups the other checks do not take, against a
daemon of the run's own (lmcache_s54_checks.py, in the LMCache environment): objects of
sizes that are no powers of two, several models and salts read by another adapter
instance, a key named twice in a lookup, unlocks of keys never locked, the daemon
killed and started again under the adapter, the adapter closed with tasks in flight."""

from __future__ import annotations

import uuid
from pathlib import Path

from engine_envs import HERE, ROOT, last_json, run_in_env


def test_set_ups_the_other_checks_do_not_take(tmp_path: Path) -> None:
    proc = run_in_env("lmcache", [str(HERE / "lmcache_s54_checks.py"), "all", str(tmp_path),
                                  f"lmcache-{uuid.uuid4().hex[:8]}"],
                      timeout=240, PYTHONPATH=str(ROOT))
    out = last_json(proc.stdout)
    assert all(got == [3, 3, True] for got in out["odd_sizes"].values()), out
    seen = out["models_salts_repeats"]
    for where in ("mA/", "mA/s1", "mB/", "mB/s1"):
        assert seen[where] == [3, 3, True], seen
    assert seen["ghost_lookup"] == 0 and seen["pinned_after_ghosts"] == 0
    # a key named twice is locked twice over one pin, released by the second unlock
    assert seen["twice_lookup"] == [0, 1] and seen["pinned_twice"] == 1
    assert seen["pinned_one_unlock"] == 1 and seen["pinned_two_unlocks"] == 0
    again = out["restarted"]
    assert again["stored"] == [True] and again["locked"] == 4
    # the locks went with the daemon: nothing loaded, nothing written to the buffers
    assert again["loaded_after"] == 0 and again["untouched"] and again["found_after"] == 0
    assert again["stored_again"] == [True] and again["found"] == 4 and again["loaded"] == 4
    assert again["same"] and again["pinned"] == 0
    assert again["answered_in_flight"] == [1, True, True]
    assert again["pinned_after_close"] == 0
