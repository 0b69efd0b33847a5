"""What an operator meets running the daemon: the SSD tier's directory removed or
replaced under it (a disk cleaned, a tmpfiles or cleanup job), and relative paths in a
config file (``systemd`` starts the daemon in ``/``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess, error_records, free_port
from kvtest import make_identity

from kvstore import Client

IDENT = make_identity(head_dim=256)  # 64 KiB blocks


def _content(key: bytes, size: int) -> bytes:
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def _ssd_daemon(tmp_path: Path, name: str = "daemon") -> DaemonProcess:
    """4 MiB of DRAM (64 blocks) over a 16 MiB SSD tier in write-back, 1 MiB slabs."""
    conf = tmp_path / f"{name}.toml"
    conf.write_text('[ssd]\nslab_size = "1MiB"\n')
    return DaemonProcess(tmp_path / name, dram_capacity="4MiB", ssd_capacity="16MiB",
                         extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-back",
                                "--config", str(conf)])


def _put(d: DaemonProcess, first: int, chains: int) -> list[list[bytes]]:
    """``chains`` chains of 8 blocks each, numbered from ``first``; their keys."""
    out = []
    with Client(d.endpoint, tenant=IDENT.tenant) as c:
        ns = c.namespace(IDENT)
        for chain in range(first, first + chains):
            keys = ns.keys(list(range(chain * 1000, chain * 1000 + 8 * 16)))
            ns.put(keys, [_content(k, ns.block_bytes) for k in keys])
            out.append(keys)
    return out


def _stats(d: DaemonProcess) -> dict[str, Any]:
    with Client(d.endpoint, tenant=IDENT.tenant) as c:
        return c.stats()


def _until_off(d: DaemonProcess, at_most: float = 6.0) -> dict[str, Any]:
    deadline = time.monotonic() + at_most
    while True:
        stats = _stats(d)
        if stats["ssd_io"].get("healthy", 1) == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _served_exact(d: DaemonProcess, chains: list[list[bytes]]) -> int:
    """The leading blocks of each chain found, each read back bit-exact."""
    found = 0
    with Client(d.endpoint, tenant=IDENT.tenant) as c:
        ns = c.namespace(IDENT)
        for keys in chains:
            hit = ns.lookup(keys).blocks
            if hit:
                assert ns.get(keys[:hit]) == [_content(k, ns.block_bytes)
                                              for k in keys[:hit]]
            found += hit
    return found


def test_ssd_directory_removed_under_the_daemon_turns_the_tier_off(tmp_path: Path) -> None:
    """``rm -rf`` of the SSD tier's directory under a running daemon: before, it went on
    writing into the deleted files with no word, ``stats`` still counted the blocks there
    (none of which a restart finds), and the lock went with the directory.  Now within a
    few seconds it logs an error naming the path, turns the tier off (health 0 in stats
    and metrics), drops its copies, and serves from DRAM bit-exact, never a wrong byte."""
    d = _ssd_daemon(tmp_path).start()
    try:
        first = _put(d, 0, 20)  # 160 blocks, 64 fit DRAM: the rest demoted
        before = _stats(d)
        assert before["tiers"]["ssd"]["blocks"] > 50, before["tiers"]["ssd"]
        shutil.rmtree(d.workdir / "ssd")
        stats = _until_off(d)
        # (before: 96 blocks still counted after 6 s, and no word in the log)
        assert stats["tiers"]["ssd"]["blocks"] == 0, stats["tiers"]["ssd"]
        errors = error_records(d.log())
        assert any(str(d.workdir / "ssd") in e and "removed" in e for e in errors), errors
        assert stats["ssd_io"]["records"] == 0
        assert stats["ssd_io"]["healthy"] == 0, stats["ssd_io"]
        assert stats["tiers"]["ssd"]["healthy"] == 0
        assert _served_exact(d, first[:4]) == 0  # the oldest were on SSD only: gone
        second = _put(d, 100, 15)  # DRAM pressure with no SSD below: evicts, serves on
        assert 0 < _served_exact(d, second) <= 64
        assert _stats(d)["tiers"]["ssd"]["blocks"] == 0
        assert not (d.workdir / "ssd").exists()  # nothing made there again
        assert d.alive()
    finally:
        assert d.stop() == 0
    assert not [e for e in error_records(d.log()) if "removed" not in e], d.log()


def test_ssd_directory_replaced_under_the_daemon_is_left_to_the_new_owner(
        tmp_path: Path) -> None:
    """The directory moved aside and a second daemon started on the path (the lock file
    went with the old directory, so nothing keeps it off): before, the first daemon kept
    writing into the moved directory and counting its blocks; now it turns its tier off,
    and the second daemon's blocks there survive the first's stop."""
    d = _ssd_daemon(tmp_path).start()
    other = None
    try:
        _put(d, 0, 20)
        (d.workdir / "ssd").rename(d.workdir / "ssd.old")
        stats = _until_off(d)
        assert stats["tiers"]["ssd"]["blocks"] == 0, stats["tiers"]["ssd"]
        assert stats["ssd_io"]["healthy"] == 0, stats["ssd_io"]
        assert any("replaced" in e or "removed" in e for e in error_records(d.log()))
        other = _ssd_daemon(tmp_path, "other")
        other.args[other.args.index("--ssd-path") + 1] = str(d.workdir / "ssd")
        other.start()
        keys = _put(other, 200, 20)
        assert _stats(other)["tiers"]["ssd"]["blocks"] > 50
        _put(d, 300, 15)  # the first daemon under pressure: never writes there
        assert d.stop() == 0
        assert other.stop() == 0
        other.start()
        assert _served_exact(other, keys) == 160
    finally:
        d.stop()
        if other is not None:
            other.stop()


ROOT = Path(__file__).resolve().parents[2]


def _serve_in(cwd: Path, config: Path, *flags: str) -> tuple[Any, list[str]]:
    """``kvstore serve --config CONFIG`` run in ``cwd`` (systemd runs it in ``/``), until
    it serves or ends; the process and its output lines."""
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ENDPOINT"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(config),
         "--dram-capacity", "64MiB", "--log-level", "info", *flags],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    for raw in proc.stdout:
        out.append(raw.decode(errors="replace"))
        if "serving on" in out[-1] or time.monotonic() > deadline:
            break
    return proc, out


def _end(proc: Any) -> None:
    proc.terminate()
    proc.communicate(timeout=20)  # (its output read to the end, the pipe closed)


def test_relative_paths_in_a_config_file_follow_the_file_not_the_working_directory(
        tmp_path: Path) -> None:
    """A config file beside its token file and SSD directory, named relatively, read by a
    daemon started elsewhere (systemd: in ``/``): before, each was looked for in the
    working directory (the token not found, the daemon refused to start; the SSD tier
    made in ``/rel/ssd`` or wherever it ran); now they are the file's neighbours, and
    ``config show`` prints them absolute, ``config check`` says what it resolved."""
    etc, elsewhere = tmp_path / "etc", tmp_path / "cwd"
    etc.mkdir()
    elsewhere.mkdir()
    token = "t" * 32
    (etc / "metrics.token").write_text(token + "\n")
    port = free_port()
    config = etc / "kvstore.toml"
    config.write_text(
        f'[server]\nendpoint = "ipc://kvstore.sock"\nmetrics_port = {port}\n'
        'metrics_token_file = "metrics.token"\n'
        '[ssd]\npath = "rel/ssd"\ncapacity = "8MiB"\nslab_size = "1MiB"\n')
    proc, out = _serve_in(elsewhere, config)
    try:
        assert proc.poll() is None, "".join(out)  # (before: metrics.token not found)
        assert (etc / "rel" / "ssd" / "blocks.dat").exists(), "".join(out)
        assert not (elsewhere / "rel").exists()
        assert (etc / "kvstore.sock").exists(), "".join(out)
        with Client(f"ipc://{etc / 'kvstore.sock'}", tenant=IDENT.tenant) as c:
            assert c.stats()["tiers"]["ssd"]["capacity"] == 8 << 20
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200
    finally:
        _end(proc)
    shown = subprocess.run(
        [sys.executable, "-m", "kvstore", "config", "show", str(config)], cwd=elsewhere,
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert f'path = "{etc / "rel" / "ssd"}"' in shown.stdout, shown.stdout + shown.stderr
    assert f'metrics_token_file = "{etc / "metrics.token"}"' in shown.stdout
    checked = subprocess.run(
        [sys.executable, "-m", "kvstore", "config", "check", str(config)], cwd=elsewhere,
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert checked.returncode == 0, checked.stderr
    assert f"ssd.path: 'rel/ssd' -> '{etc / 'rel' / 'ssd'}'" in checked.stdout, checked.stdout


def test_relative_paths_given_as_flags_stay_relative_to_the_working_directory(
        tmp_path: Path) -> None:
    """A flag typed in a shell means what the shell's directory says: ``--ssd-path``
    relative to where the daemon runs, even with a config file elsewhere."""
    etc, elsewhere = tmp_path / "etc", tmp_path / "cwd"
    etc.mkdir()
    elsewhere.mkdir()
    config = etc / "kvstore.toml"
    config.write_text('[ssd]\npath = "rel/ssd"\nslab_size = "1MiB"\n')
    proc, out = _serve_in(elsewhere, config, "--ssd-path", "flag/ssd", "--ssd-capacity",
                          "8MiB", "--endpoint", f"ipc://{tmp_path / 'k.sock'}")
    try:
        assert proc.poll() is None, "".join(out)
        assert (elsewhere / "flag" / "ssd" / "blocks.dat").exists(), "".join(out)
        assert not (etc / "rel").exists()
    finally:
        _end(proc)


def test_which_config_paths_are_resolved(tmp_path: Path) -> None:
    """ipc paths (one or a list) resolved; tcp, ``~`` and an absolute path left;
    environment overrides stay as typed.  An abstract or wildcard ipc endpoint is left
    unresolved, and refused by name: it has no socket file whose mode keeps other users
    out (it stopped the daemon at start with a traceback)."""
    import pytest

    from kvstore.config import load_config
    from kvstore.config_paths import resolve_relative
    from kvstore.errors import ConfigError

    data = {"server": {"endpoint": "ipc://@kv", "extra_endpoints": ["ipc://*"]}}
    resolve_relative(data, tmp_path / "kvstore.toml")
    assert data == {"server": {"endpoint": "ipc://@kv", "extra_endpoints": ["ipc://*"]}}
    config = tmp_path / "kvstore.toml"
    for endpoint in ("ipc://@kv", "ipc://*"):
        for section in ("server", "events"):
            config.write_text(f'[{section}]\nendpoint = "{endpoint}"\n')
            with pytest.raises(ConfigError, match=f"{section}.endpoint: .*names no socket"):
                load_config(config, env={})
    config.write_text(
        '[server]\nendpoint = "ipc:///run/kv.sock"\n'
        'extra_endpoints = ["ipc://run/k.sock", "tcp://127.0.0.1:5555"]\n'
        '[ssd]\npath = "~/ssd"\n[remote]\ntag_secret_file = "../tag"\n')
    c = load_config(config, env={"KVSTORE_AUTH_SECRET_FILE": "env/secret"})
    assert c.server.endpoint == "ipc:///run/kv.sock"
    assert c.server.extra_endpoints == [f"ipc://{tmp_path}/run/k.sock",
                                        "tcp://127.0.0.1:5555"]
    assert c.ssd.path == "~/ssd"
    assert c.remote.tag_secret_file == str(tmp_path.parent / "tag")
    assert c.auth.secret_file == "env/secret"
