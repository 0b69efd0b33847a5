"""``kvstore bench --against lmcache``: LMCache's multiprocess server, started from the
LMCache test environment and driven through LMCache's own client, measured beside kvstore
with the same definitions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine_envs import engine_python


def test_bench_against_lmcache_measures_both_sides(tmp_path: Path) -> None:
    python = engine_python("lmcache")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "--quick", "--repeat", "2", "--json",
         "--against", "lmcache", "--lmcache-python", str(python), "--plot",
         str(tmp_path), "control"],
        check=False, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert "lmcache" not in doc["skipped"], doc["skipped"]
    rows = {row["name"]: row for row in doc["rows"] if row["section"] == "lmcache"}
    assert set(rows) == {"lookup 64 keys", "store 256KiB x16", "load 256KiB x16",
                         "store 2MiB x16", "load 2MiB x16"}
    for row in rows.values():
        assert row["kvstore"] > 0 and row["peer"] > 0, row
        assert row["peer_name"] == "LMCache 0.5.6 MP server"
    theirs = doc["against"]["lmcache"]
    assert theirs["version"] == "0.5.6" and theirs["python"] == str(python)
    assert theirs["lookup_64_us"] == rows["lookup 64 keys"]["peer"]
    assert theirs["kvstore"]["lookup_64_us"] == rows["lookup 64 keys"]["kvstore"]
    assert sorted(Path(p).name for p in doc["plots"]) == ["against_lmcache.png",
                                                          "ratio_to_limit.png"]
