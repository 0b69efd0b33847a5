"""``kvstore bench frames`` sets each put beside two peers: raw pyzmq, which drops the
frames (the goal's limit), and the same frames copied into shared memory before the ack
(what a put must have done before it answers); gets beside raw pyzmq."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_each_put_has_a_raw_and_a_copy_floor_row_from_the_same_samples() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = subprocess.run([sys.executable, "-m", "kvstore", "bench", "frames", "--quick",
                           "--json"], capture_output=True, text=True, timeout=240, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    peers: dict[str, list[str]] = {}
    for row in rows:
        assert row["section"] == "frames" and row["kvstore"] > 0 and row["peer"] > 0, row
        peers.setdefault(row["name"], []).append(row["peer_name"])
    for size in ("256KiB", "2MiB"):
        assert peers[f"frame put {size} x16"] == ["raw pyzmq", "pyzmq + copy into shm"]
        assert peers[f"frame get {size} x16"] == ["raw pyzmq"]
    puts = [row for row in rows if row["name"].startswith("frame put")]
    # one put figure beside both peers: their samples were taken in the same rounds
    assert puts[0]["kvstore"] == puts[1]["kvstore"] and puts[2]["kvstore"] == puts[3]["kvstore"]
