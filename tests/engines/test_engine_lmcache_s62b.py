"""kvstore's LMCache L2 adapter keeps the objects of engines whose KV caches differ in
dtype or shape apart, though they are as many bytes (lmcache_s62b_checks.py, in the
LMCache environment, against a real daemon).

Before: an object's namespace named its model, salt, tenant and revision, not its
layout; a bf16 engine (or an fp16 one of other shapes) of the model found the fp16
engine's objects and loaded their bytes as its own KV (wrong outputs), and its own
stores of those chunks were taken as already there.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from daemon_proc import DaemonProcess
from engine_envs import HERE, ROOT, last_json, run_in_env


def test_engines_of_other_kv_dtypes_share_no_objects(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    proc = run_in_env("lmcache", [str(HERE / "lmcache_s62b_checks.py"), daemon.endpoint,
                                  f"lmcache-{uuid.uuid4().hex[:8]}"],
                      timeout=180, PYTHONPATH=str(ROOT))
    out = last_json(proc.stdout)
    assert out["stored_fp16"] and out["stored_bf16"], out
    # [found, loaded, its own bytes, the fp16 engine's bytes]
    assert out["before_bf16_stored/fp16"] == [3, 3, True, True], out
    assert out["before_bf16_stored/bf16"] == [0, 0, False, False], out  # (before: 3, 3)
    assert out["before_bf16_stored/fp16_other_shape"] == [0, 0, False, False], out
    assert out["after_bf16_stored/fp16"] == [3, 3, True, True], out
    assert out["after_bf16_stored/bf16"] == [3, 3, True, False], out
    assert out["after_bf16_stored/fp16_other_shape"] == [0, 0, False, False], out
    # Serialized by LMCache (its serde): stored and loaded as bytes, looked up by the
    # engine's layout, all in the serializer's namespace.  Before this was found, every
    # lookup missed (its namespace the layout's, the objects' the bytes').
    assert out["serde"] == [3, 3, True], out
    assert out["pinned_at_end"] == 0, out
    assert "Traceback" not in proc.stderr
