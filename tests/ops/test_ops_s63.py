"""What an operator meets running the daemon: signals during start-up, the socket
directory's permissions, reloads, the command line against a daemon that does not
answer."""

from __future__ import annotations

import grp
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from daemon_proc import DaemonProcess, free_port
from kvtest import make_identity
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client

ROOT = Path(__file__).resolve().parents[2]


def _caught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` catches (or ignores) ``sig`` now."""
    fields = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    mask = int(fields["SigCgt"], 16) | int(fields["SigIgn"], 16)
    return bool(mask & (1 << (sig - 1)))


def _lines(proc: subprocess.Popen[bytes], into: list[str]) -> threading.Thread:
    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            into.append(line.decode(errors="replace"))
    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def test_sighup_during_start_up_is_applied_once_up_never_fatal(tmp_path: Path) -> None:
    """A SIGHUP sent as soon as the daemon's interpreter runs, again and again until it
    serves (a config tool reloading right after a start), ended the daemon (the signal's
    default action) until its event loop took the signal, after every import and the
    arena's population; now it is taken from the first import of kvstore on, and one
    reload runs once the daemon serves."""
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction_policy = "lru"\n')
    sock = tmp_path / "kvstore.sock"
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ENDPOINT"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(config),
         "--endpoint", f"ipc://{sock}", "--dram-capacity", "256MiB", "--ssd-capacity", "0",
         "--ssd-path", str(tmp_path / "ssd"), "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out: list[str] = []
    reader = _lines(proc, out)
    try:
        # the interpreter's own start (before any of kvstore's code runs) cannot take
        # a signal: wait until it has set up its SIGINT handler, then for kvstore's
        # (or at most 0.3 s more, where it set none, still importing)
        deadline = time.monotonic() + 30
        while not _caught(proc.pid, signal.SIGINT) and time.monotonic() < deadline:
            time.sleep(0.001)
        began = time.monotonic()
        while not _caught(proc.pid, signal.SIGHUP) and time.monotonic() < began + 0.3:
            time.sleep(0.001)
        config.write_text('[dram]\neviction_policy = "arc"\n')
        sent = 0
        while not any("serving on" in line for line in out):
            assert proc.poll() is None, f"the daemon ended ({proc.returncode}) after " \
                                        f"{sent} SIGHUPs:\n{''.join(out)}"
            assert time.monotonic() < deadline, "the daemon did not come up"
            proc.send_signal(signal.SIGHUP)
            sent += 1
            time.sleep(0.005)
        assert sent > 10
        with Client(f"ipc://{sock}") as client:
            deadline = time.monotonic() + 10
            while client.stats()["eviction_policies"]["dram"] != "arc":
                assert time.monotonic() < deadline, client.stats()["eviction_policies"]
                time.sleep(0.05)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(20)
        reader.join(5)
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == 0, "".join(out)
    assert "reloaded the configuration" in "".join(out)


def test_sighup_is_left_alone_in_a_process_that_is_not_the_daemon() -> None:
    """An engine importing the client keeps SIGHUP's default action."""
    code = "import signal, kvstore; print(signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)"
    out = subprocess.run([sys.executable, "-c", code, "serve"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.strip() == "True"


def _another_group() -> grp.struct_group:
    """A group of this host other than the test's own."""
    return next(g for g in grp.getgrall() if g.gr_gid != os.getgid())


def _mode_and_group(path: Path) -> tuple[int, int]:
    info = os.stat(path)
    return stat.S_IMODE(info.st_mode), info.st_gid


def test_socket_group_leaves_a_shared_directory_as_it_is(tmp_path: Path) -> None:
    """With ``server.socket_group``, the socket's directory became 0750 of that group
    whatever it was, as long as the daemon's user owned it and others could not write
    it: a directory it shares with other programs (/run, for a daemon run as root; a
    state directory; a home) lost its group's access and others'.  Now only a directory
    that holds the daemon's sockets alone changes; elsewhere, where the socket's group
    cannot enter, the log says what to do."""
    group = _another_group()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o750)  # (its group's, root's here, to enter)
    (shared / "other-service.pid").write_text("1\n")
    before = _mode_and_group(shared)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[server]\nsocket_group = "{group.gr_name}"\n')
    daemon = DaemonProcess(tmp_path / "d", extra=["--config", str(config)])
    daemon.endpoint = f"ipc://{shared / 'kvstore.sock'}"
    daemon.args[daemon.args.index("--endpoint") + 1] = daemon.endpoint
    daemon.start()
    try:
        with Client(daemon.endpoint) as client:
            client.ping()
        assert _mode_and_group(shared) == before
        sock = os.stat(shared / "kvstore.sock")
        assert (stat.S_IMODE(sock.st_mode), sock.st_gid) == (0o660, group.gr_gid)
        log = daemon.log()  # what to do, as the socket's group cannot enter
        assert f"chgrp {group.gr_name} {shared}" in log, log
    finally:
        daemon.stop()
    assert _mode_and_group(shared) == before


def test_socket_group_still_opens_a_directory_of_the_daemons_sockets(
        tmp_path: Path) -> None:
    """A directory the daemon makes for its socket, or one holding nothing but its
    sockets (systemd's RuntimeDirectory, or one kept from an earlier run), is still
    made 0750 of the socket group."""
    group = _another_group()
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[server]\nsocket_group = "{group.gr_name}"\n')
    kept = tmp_path / "kept"
    kept.mkdir(mode=0o700)
    for run in (tmp_path / "made" / "run", kept):
        daemon = DaemonProcess(tmp_path / f"d-{run.name}", extra=["--config", str(config)])
        daemon.endpoint = f"ipc://{run / 'kvstore.sock'}"
        daemon.args[daemon.args.index("--endpoint") + 1] = daemon.endpoint
        daemon.start()
        try:
            assert _mode_and_group(run) == (0o750, group.gr_gid)
        finally:
            daemon.stop()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


def _evictions(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
               ) -> dict[str, float]:
    """``kvstore_evictions_total`` of the DRAM tier by capacity, by policy label."""
    return {dict(labels)["policy"]: v for (name, labels), v in samples.items()
            if name == "kvstore_evictions_total" and dict(labels)["tier"] == "dram"
            and dict(labels)["cause"] == "capacity"}


def test_eviction_counts_stay_with_their_policy_across_a_reload(tmp_path: Path) -> None:
    """``kvstore_evictions_total{policy=...}`` showed the tier's whole count under the
    policy in charge at the scrape: after a SIGHUP from lru to arc, the lru series was
    gone and arc's held every eviction lru had made (and back to lru, lru's jumped by
    what arc evicted).  Now each policy's series counts the evictions made while it was
    in charge, and stays."""
    ident = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB blocks
    port = free_port()
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction_policy = "lru"\n')
    daemon = DaemonProcess(tmp_path / "d", dram_capacity=str(8 * ident.block_bytes),
                           extra=["--config", str(config), "--metrics-port", str(port),
                                  "--slab-size", str(8 * ident.block_bytes),
                                  "--log-level", "info"]).start()

    def reload_to(policy: str) -> None:
        config.write_text(f'[dram]\neviction_policy = "{policy}"\n')
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while client.stats()["eviction_policies"]["dram"] != policy:
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.02)

    def fill(start: int, blocks: int) -> None:
        keys = ns.keys(range(start, start + 16 * blocks))
        ns.put(keys, [bytes(ns.block_bytes)] * blocks)

    try:
        with Client(daemon.endpoint, tenant="acme") as client:
            ns = client.namespace(ident)
            fill(0, 8)
            fill(100_000, 3)  # 3 evicted under lru
            assert _evictions(_scrape(port)) == {"lru": 3}
            reload_to("arc")
            assert _evictions(_scrape(port)) == {"lru": 3, "arc": 0}
            fill(200_000, 2)  # 2 under arc
            assert _evictions(_scrape(port)) == {"lru": 3, "arc": 2}
            reload_to("lru")
            fill(300_000, 4)  # 4 more under lru
            assert _evictions(_scrape(port)) == {"lru": 7, "arc": 2}
    finally:
        daemon.stop()


def test_route_says_so_and_fails_when_no_daemon_answers(tmp_path: Path) -> None:
    """``kvstore route`` over daemons that are down, stopped (SIGSTOP) or at a wrong
    endpoint printed its table, every row "no answer within the deadline", and exited
    0, as if a route had been found: a script taking its first row sent prompts to a
    daemon that was not there.  Now it says on stderr that none answered and exits 1;
    with one answering, 0."""
    ident = make_identity()
    identity = tmp_path / "identity.json"
    identity.write_text(json.dumps({f: getattr(ident, f) for f in ident.__struct_fields__}))
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(list(range(64))))
    daemon = DaemonProcess(tmp_path / "d").start()

    def route(*endpoints: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvstore", "route", "--endpoints", *endpoints,
             "--tokens", str(tokens), "--identity", f"@{identity}", "--deadline", "0.5"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    try:
        down = f"ipc://{tmp_path / 'none.sock'}"
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            done = route(down, daemon.endpoint)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert done.returncode == 1, done
        assert "no daemon answered" in done.stderr, done
        assert "no answer within the deadline" in done.stdout, done
        done = route(down, daemon.endpoint)
        assert done.returncode == 0, done
        assert "0/4" in done.stdout, done
    finally:
        daemon.stop()
