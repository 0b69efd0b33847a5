"""SGLang engines whose pages differ never load each other's through kvstore: context-
parallel ranks, decode-context-parallel shards, fp8 formats, and weights replaced in a
checkpoint SGLang names with its format tag appended (sglang_identity_run.py, in the
SGLang environment, against a real daemon)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env


def test_engines_whose_pages_differ_share_none(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    proc = run_in_env("sglang", [str(HERE / "sglang_identity_run.py"),
                                 "--endpoint", daemon.endpoint,
                                 "--tenant", f"sglang-{uuid.uuid4().hex[:8]}",
                                 "--checkpoint", str(tmp_path / "ckpt")], timeout=180)
    out = last_json(proc.stdout)
    nothing = {"stored": True, "found": 0, "loaded": 0, "got_the_others_bytes": False}
    # each rank or shard holds another slice of every page: none is another's
    assert out["cp"] == nothing
    assert out["dcp"] == nothing
    # fp8 pools hold bytes: the format is named, and the two formats share nothing
    assert out["fp8_dtypes"] == ["float8_e4m3fn", "float8_e5m2"]
    assert out["fp8"] == nothing
    assert out["fp8_same_format"] == {"stored": True, "found": 4, "loaded": 4,
                                      "got_the_others_bytes": True}
    assert "kv_cache_dtype" in out["fp8_unnamed"]  # refused, not guessed
    # the checkpoint found under the tagged name: new weights, a new revision
    old, new = out["revisions"]
    assert old.startswith("weights:") and new.startswith("weights:") and old != new
    assert out["replaced_weights"] == nothing
    assert out["same_weights"] == {"stored": True, "found": 4, "loaded": 4,
                                   "got_the_others_bytes": True}
