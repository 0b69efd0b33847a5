"""``kvstore bench``: the suite runs against a daemon it starts and a running one, its JSON
document has every documented key, bad arguments get clear errors, plots are PNGs."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from daemon_proc import DaemonProcess
from redis_servers import RedisServer

from kvstore import Client
from kvstore.bench.harness import Progress

TOP_KEYS = {"version", "kvstore", "daemon", "quick", "repeat", "sections", "rows", "sweeps",
            "skipped", "against", "plots"}
ROW_KEYS = {"section", "name", "unit", "kvstore", "peer", "peer_name", "ratio",
            "share_of_limit", "better", "goal"}
QUICK_ROWS = {
    "control": {"lookup 64 keys", "lookup after 40 ms idle", "reserve+commit 1",
                "reserve+commit 16",
                "pipelined lookups (32 in flight)"},
    "arena": {f"arena {op} {size} x16" for op in ("write", "read")
              for size in ("256KiB", "2MiB")},
    "frames": {f"frame {op} {size} x16" for op in ("put", "get")
               for size in ("256KiB", "2MiB")},
}


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run([sys.executable, "-m", "kvstore", "bench", *args], check=False,
                          capture_output=True, text=True, timeout=timeout, env=env)


def run_json(*args: str) -> dict[str, Any]:
    proc = bench(*args, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def check_rows(doc: dict[str, Any], expected: dict[str, set[str]]) -> None:
    """Every documented key, the rows asked for and no other, figures that mean something."""
    assert set(doc) == TOP_KEYS
    assert doc["version"] == 1 and doc["quick"] is True
    assert doc["sections"] == list(expected)
    got: dict[str, set[str]] = {}
    for row in doc["rows"]:
        assert set(row) == ROW_KEYS, row
        got.setdefault(row["section"], set()).add(row["name"])
        assert row["kvstore"] > 0 and row["peer"] > 0, row
        assert math.isclose(row["ratio"], row["kvstore"] / row["peer"]), row
        flipped = 1 / row["ratio"] if row["better"] == "lower" else row["ratio"]
        assert math.isclose(row["share_of_limit"], flipped), row
        assert row["better"] in ("lower", "higher")
    assert got == expected


def test_quick_json_against_a_daemon_it_starts_leaves_nothing_behind(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    doc = run_json("--quick", "--repeat", "2", "--dir", str(scratch))
    check_rows(doc, QUICK_ROWS)
    assert doc["daemon"] == "started" and doc["repeat"] == 2
    assert doc["plots"] == [] and doc["skipped"] == {} and doc["against"] == {}
    assert list(scratch.iterdir()) == [], "the temporary directory was not removed"


def test_quick_json_against_a_running_daemon_drops_what_it_wrote(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(dram_capacity="256MiB")
    doc = run_json("--quick", "--repeat", "2", "--endpoint", daemon.endpoint,
                   "--tenant", "bench-test", "control", "arena", "frames")
    check_rows(doc, QUICK_ROWS)
    assert doc["daemon"] == daemon.endpoint
    with Client(daemon.endpoint, tenant="probe") as client:
        stats = client.stats()
    assert stats["tiers"]["dram"]["committed"] == 0, stats["tiers"]["dram"]
    assert stats["invariant_violations"] == 0


def test_a_running_daemon_of_little_dram_is_measured_not_a_missing_key(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """The writes before the reads (four of 16 x 2 MiB, --quick) push the read chain out
    of a 96 MiB arena: the reads ended the run with "key N of 16 (...) is not cached"."""
    daemon = daemon_factory(dram_capacity="96MiB", extra=["--slab-size", "16MiB"])
    doc = run_json("--quick", "--endpoint", daemon.endpoint, "arena", "frames")
    check_rows(doc, {k: v for k, v in QUICK_ROWS.items() if k != "control"})


def test_the_table_on_a_pipe_has_plain_progress_lines_and_a_row_per_measure() -> None:
    proc = bench("--quick", "--repeat", "1", "control")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr  # not a terminal: no bar drawn in place
    assert "kvstore bench: [" in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:5] == ["section", "measure", "unit", "kvstore", "peer"]
    for name in QUICK_ROWS["control"]:
        assert any(line.startswith("control") and name in line for line in lines), name


@pytest.mark.parametrize(("args", "message"), [
    (["warp"], "unknown section(s) warp"),
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--trace", "/nonexistent/trace.jsonl"], "--trace: no such file"),
    (["--endpoint", "localhost:5555"], "--endpoint must be ipc://PATH or tcp://HOST:PORT"),
    (["--redis", "localhost:6379"], "--redis must be a redis:// URL"),
    (["--dir", "/nonexistent/dir"], "--dir: no such directory"),
    (["--timeout", "0"], "--timeout must be a finite number of seconds above 0"),
    (["--block-tokens", "0"], "--block-tokens must be at least 1"),
])
def test_bad_arguments_are_refused_before_anything_starts(
        args: list[str], message: str) -> None:
    proc = bench(*args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stdout == ""


def test_a_plot_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file.png"
    target.write_bytes(b"x")
    proc = bench("--plot", str(target), timeout=60)
    assert proc.returncode == 2
    assert "exists and is not a directory" in proc.stderr
    assert target.read_bytes() == b"x"


def test_an_endpoint_where_no_daemon_answers_is_a_clear_error(tmp_path: Path) -> None:
    proc = bench("--quick", "--endpoint", f"ipc://{tmp_path}/none.sock", "--timeout", "1",
                 "control", timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("kvstore: ")
    assert "Traceback" not in proc.stderr


def test_without_matplotlib_plot_says_which_extra_to_install(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['matplotlib'] = None; from kvstore.cli import main; "
            f"sys.exit(main(['bench', '--quick', '--plot', {str(tmp_path / 'p')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "pip install 'kvstore[plot]'" in proc.stderr
    assert not (tmp_path / "p").exists()


def test_plot_writes_the_charts_of_what_ran(tmp_path: Path) -> None:
    folder = tmp_path / "plots"
    doc = run_json("--quick", "--repeat", "1", "--plot", str(folder), "control", "sweeps")
    names = sorted(Path(p).name for p in doc["plots"])
    assert names == ["lookup_latency.png", "ratio_to_limit.png", "throughput.png"]
    for name in names:
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keys = [pt["keys"] for pt in doc["sweeps"]["lookup_latency"]]
    assert keys == [1, 4, 16, 64, 256, 1024, 4096]
    assert [pt["clients"] for pt in doc["sweeps"]["throughput"]] == [1, 4, 16, 64]
    for pt in doc["sweeps"]["throughput"]:
        assert pt["kvstore_rps"] > 0 and pt["echo_rps"] > 0


def _trace(path: Path) -> Path:
    """A small trace: 40 requests over 8 shared prefixes, each 3 to 6 blocks long."""
    lines = []
    for i in range(40):
        prefix = i % 8
        blocks = 3 + i % 4
        ids = [prefix * 100 + j for j in range(blocks)]
        lines.append(msgspec.json.encode({"timestamp": i, "input_length": 512 * blocks,
                                          "output_length": 1, "hash_ids": ids}))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_replay_ssd_and_remote_sections(tmp_path: Path, redis_server: RedisServer) -> None:
    trace = _trace(tmp_path / "trace.jsonl")
    doc = run_json("--quick", "--repeat", "1", "--trace", str(trace), "--redis",
                   redis_server.url, "ssd", "remote", "replay")
    assert doc["sections"] == ["ssd", "remote", "replay"]
    rows = {row["name"]: row for row in doc["rows"]}
    for size in ("256KiB", "2MiB"):
        for name in (f"write-back {size}", f"promotion {size}", f"remote put {size} x16",
                     f"remote get {size} x16"):
            assert rows[name]["kvstore"] > 0 and rows[name]["peer"] > 0, rows[name]
    curve = doc["sweeps"]["hit_rate"]
    assert [pt["capacity_share"] for pt in curve] == [0.05, 0.25]
    # 8 prefixes of up to 6 blocks: 40 requests, every prefix seen 5 times; the daemon
    # (64 blocks at least) holds them all, as the infinite cache does
    for pt in curve:
        assert pt["kvstore"] == pt["infinite"] == pt["policy_sim"] > 0.5, pt


def test_a_trace_that_is_no_trace_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": "soon"}\n')
    proc = bench("--quick", "--trace", str(bad), "replay", timeout=60)
    assert proc.returncode == 1
    assert "not a trace of prefix-block ids" in proc.stderr
    assert "Traceback" not in proc.stderr
    # lengths and ids that no block size fits: say so, and how to go on
    bad.write_text('{"timestamp": 0, "input_length": 100, "hash_ids": [1]}\n'
                   '{"timestamp": 1, "input_length": 100, "hash_ids": [1, 2, 3, 4, 5]}\n'
                   '{"timestamp": 2, "input_length": 100, "hash_ids": [1, 2, 3, 4, 5, 6]}\n'
                   * 3)
    proc = bench("--quick", "--trace", str(bad), "replay", timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "name the trace's block size" in proc.stderr


def test_against_lmcache_where_it_is_not_installed_says_so_and_runs_the_rest() -> None:
    # this environment has no LMCache (the engines' test environment has it)
    doc = run_json("--quick", "--repeat", "1", "--against", "lmcache", "control")
    assert "is not installed for" in doc["skipped"]["lmcache"]
    assert {row["section"] for row in doc["rows"]} == {"control"}
    assert doc["against"] == {}


def test_lmcache_python_without_against_is_refused() -> None:
    proc = bench("--lmcache-python", sys.executable, timeout=60)
    assert proc.returncode == 2
    assert "--lmcache-python goes with --against lmcache" in proc.stderr


def test_progress_draws_a_bar_in_place_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    progress = Progress(4, out)
    progress.step("control: lookup")
    progress.advance()
    progress.advance()
    progress.step("arena: 2MiB")
    progress.finish()
    text = out.getvalue()
    assert text.startswith("\r\x1b[K[" + "-" * Progress.WIDTH + "] 0/4 control: lookup")
    assert "\r\x1b[K[" + "#" * (Progress.WIDTH // 2) + "-" * (Progress.WIDTH // 2) \
        + "] 2/4 arena: 2MiB" in text
    assert "\n" not in text and text.endswith("\r\x1b[K")


def test_remote_without_a_redis_server_or_url_says_so_and_runs_the_rest(
        tmp_path: Path) -> None:
    # a PATH with no redis-server on it (this Python is named by its full path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PATH"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "kvstore", "bench", "--quick", "--repeat",
                           "1", "--json", "control", "remote"], check=False,
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["skipped"] == {"remote": "no redis-server installed and no --redis URL"}
    assert {row["section"] for row in doc["rows"]} == {"control"}
    assert "remote: skipped, no redis-server installed" in proc.stderr
