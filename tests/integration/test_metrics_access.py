"""Who may read the metrics port (``server.metrics_addr``, ``server.metrics_token_file``):
with credentials set, only scrapes that carry the bearer token, as Prometheus'
``authorization: credentials_file`` sends it; a daemon with credentials and a metrics
port but no token refuses to start.  Real daemons, real HTTP."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import free_port
from kvtest import make_identity

from kvstore import Client
from kvstore.auth import bearer_matches, read_metrics_token, read_secret
from kvstore.config import load_config
from kvstore.errors import ConfigError


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, timeout=60)


def scrape(url: str, authorization: str | None = None) -> tuple[int, str, str]:
    """(status, WWW-Authenticate, body) of one GET."""
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, "", response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("WWW-Authenticate", ""), exc.read().decode()


def secured(tmp_path: Path, addr: str = "") -> tuple[Path, Path, str, int]:
    """A config with a token secret, a metrics port and its token file (keygen's, with
    its trailing newline): (config, secret, token, port)."""
    secret, token_file = tmp_path / "secret", tmp_path / "metrics.token"
    assert cli("keygen", "--secret", str(secret)).returncode == 0
    assert cli("keygen", "--secret", str(token_file)).returncode == 0
    port = free_port()
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[server]\nmetrics_port = {port}\n'
                      f'metrics_token_file = "{token_file}"\n'
                      + (f'metrics_addr = "{addr}"\n' if addr else "")
                      + f'[auth]\nsecret_file = "{secret}"\n')
    return config, secret, token_file.read_text().strip(), port


def test_scrapes_need_the_bearer_token(daemon_factory: Any, tmp_path: Path) -> None:
    config, secret, token, port = secured(tmp_path)
    d = daemon_factory(extra=["--config", str(config)])
    tenant_token = cli("token", "--secret-file", str(secret), "--tenant",
                       "secret-customer").stdout.strip()
    with Client(d.endpoint, token=tenant_token) as c:
        c.namespace(make_identity(tenant="secret-customer")).lookup([b"\1" * 16])
    url = f"http://127.0.0.1:{port}/metrics"
    for refused in (None, "", "Bearer", f"Bearer {token[:-1]}", f"Bearer {token}x",
                    f"Basic {token}", token, f"Bearer {token[::-1]}"):
        status, challenge, body = scrape(url, refused)
        assert status == 401, refused
        assert challenge.startswith("Bearer") and "secret-customer" not in body
    for path in ("/", "/metrics?name[]=kvstore_sessions"):  # every path is behind it
        assert scrape(f"http://127.0.0.1:{port}{path}")[0] == 401
    status, _, body = scrape(url, f"Bearer {token}")
    assert status == 200 and 'tenant="secret-customer"' in body
    assert scrape(url, f"bearer  {token} ")[0] == 200  # the scheme in any case


def test_the_metrics_port_binds_the_address_given(daemon_factory: Any,
                                                  tmp_path: Path) -> None:
    config, _, token, port = secured(tmp_path, addr="127.0.0.2")  # loopback, not .1
    daemon_factory(extra=["--config", str(config)])
    assert scrape(f"http://127.0.0.2:{port}/metrics", f"Bearer {token}")[0] == 200
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_credentials_and_a_metrics_port_without_a_token_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    assert cli("keygen", "--secret", str(secret)).returncode == 0
    auth = {"auth": {"secret_file": str(secret)}}
    with pytest.raises(ConfigError, match="server.metrics_token_file"):
        load_config(env={}, overrides={**auth, "server": {"metrics_port": 9464}})
    load_config(env={}, overrides={**auth, "server": {"metrics_port": 0}})  # port off
    load_config(env={}, overrides={"server": {"metrics_port": 9464}})  # one user's host
    with pytest.raises(ConfigError, match="server.metrics_addr"):
        load_config(env={}, overrides={"server": {"metrics_addr": " "}})
    config = tmp_path / "open.toml"
    config.write_text(f'[server]\nmetrics_port = 9464\n[auth]\nsecret_file = "{secret}"\n')
    checked = cli("config", "check", str(config))
    assert checked.returncode == 2 and "server.metrics_token_file" in checked.stderr


@pytest.mark.parametrize("content, why", [
    (None, "cannot read"), ("short\n", "fewer than 16"), ("a token with spaces in it", "ASCII")])
def test_a_bad_token_file_stops_the_daemon_at_start(tmp_path: Path, content: str | None,
                                                   why: str) -> None:
    config, _, _, port = secured(tmp_path)
    token_file = tmp_path / "metrics.token"
    if content is None:
        token_file.unlink()
    else:
        token_file.write_text(content)
    with pytest.raises(ConfigError, match=why):
        read_metrics_token(token_file)
    served = cli("serve", "--config", str(config), "--endpoint",
                 f"ipc://{tmp_path / 'kv.sock'}", "--ssd-capacity", "0",
                 "--dram-capacity", "4MiB")
    assert served.returncode == 2, served.stderr
    assert "server.metrics_token_file" in served.stderr and why in served.stderr


def test_an_address_it_cannot_bind_stops_the_daemon_at_start(tmp_path: Path) -> None:
    config, _, _, _ = secured(tmp_path, addr="192.0.2.1")  # TEST-NET-1: no such address here
    served = cli("serve", "--config", str(config), "--endpoint",
                 f"ipc://{tmp_path / 'kv.sock'}", "--ssd-capacity", "0",
                 "--dram-capacity", "4MiB")
    assert served.returncode == 2 and "server.metrics_addr" in served.stderr, served.stderr


def test_bearer_matches_only_the_token() -> None:
    token = b"0123456789abcdef0123"
    assert bearer_matches("Bearer 0123456789abcdef0123", token)
    assert bearer_matches("BEARER 0123456789abcdef0123", token)
    for header in (None, "", "Bearer", "Bearer ", "Bearer 0123456789abcdef012",
                   "Basic 0123456789abcdef0123", "0123456789abcdef0123",
                   "Bearer 0123456789abcdef0123 extra", "Bearer é"):
        assert not bearer_matches(header, token), header


def test_half_sent_requests_hold_a_bounded_number_of_threads(daemon_factory: Any,
                                                             tmp_path: Path) -> None:
    """Each connection to the metrics port has a thread before any token check: a peer
    that sends half a request on many connections holds at most
    ``METRICS_MAX_CONNECTIONS`` of them (each one past them cuts the one waiting longest
    for its request), and a scrape gets in while the peer still holds all it can."""
    from kvstore.metrics import METRICS_MAX_CONNECTIONS

    config, _, token, port = secured(tmp_path)
    d = daemon_factory(extra=["--config", str(config)])
    assert d.proc is not None
    tasks = Path(f"/proc/{d.proc.pid}/task")
    before = len(list(tasks.iterdir()))
    held: list[socket.socket] = []
    try:
        for _ in range(METRICS_MAX_CONNECTIONS + 40):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            held.append(s)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
        cut = 0
        for s in held[:40]:  # the oldest: cut by those after them, nothing answered
            try:
                cut += s.recv(1) == b""
            except ConnectionResetError:
                cut += 1
        assert cut == 40
        # one thread a served connection (its deadline kept by one thread for all, made
        # with the server); a little room for a thread the daemon starts meanwhile
        assert len(list(tasks.iterdir())) <= before + METRICS_MAX_CONNECTIONS + 2
        # the peer still holds its 16: a scrape cuts the oldest of them and is served
        assert scrape(f"http://127.0.0.1:{port}/metrics", f"Bearer {token}")[0] == 200
        held[40].settimeout(10)
        assert held[40].recv(1) == b""
    finally:
        for s in held:
            s.close()


def scraped_once_free(port: int) -> None:
    """A scrape answered once the one slot is free again: when the handler's thread has
    ended (a moment after the server cut its peer off)."""
    for _ in range(100):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                assert r.status == 200
            return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    raise AssertionError("no scrape served after the slot's peer was cut off")


@contextlib.contextmanager
def one_slot_server(read_timeout: float) -> Iterator[int]:
    """An in-process metrics server of one connection at a time and a short read
    timeout; its port."""
    from kvstore.metrics import Metrics

    port = free_port()
    close = Metrics(lambda: {}).start_http_server(port, max_connections=1,
                                                  read_timeout=read_timeout)
    assert close is not None
    try:
        yield port
    finally:
        close()


def test_a_half_sent_request_is_dropped_after_the_read_timeout() -> None:
    """A peer that never finishes its request holds its thread no longer than the read
    timeout (in-process, with a short one)."""
    with one_slot_server(read_timeout=0.3) as port:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert s.recv(1) == b""  # the server gave up on it (else: the recv times out)
        s.close()
        scraped_once_free(port)


def test_a_request_trickled_in_is_dropped_after_the_read_timeout_in_all() -> None:
    """A peer sending a byte at a time, each within the read timeout, still has the
    whole request line and headers bounded by it (in-process, a short one)."""
    with one_slot_server(read_timeout=0.5) as port:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        s.settimeout(0.2)
        cut = False
        for _ in range(100):  # 20 s of a byte every 0.2 s, unless cut
            try:
                s.sendall(b"X")
                cut = s.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                cut = True
            if cut:
                break
        s.close()
        assert cut, "a trickled request held its slot past the read timeout"
        scraped_once_free(port)


@pytest.mark.parametrize("read, setting", [
    (read_metrics_token, "server.metrics_token_file"), (read_secret, "auth.secret_file")])
def test_secret_files_are_small_regular_files(tmp_path: Path, read: Any, setting: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A device (/dev/zero read to the end never ends), a FIFO (opening it waits for a
    writer) or a big file is refused at once; a file its group or others may read is
    used, with a warning."""
    with pytest.raises(ConfigError, match=f"{setting}.*not a regular file"):
        read("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        read(fifo)
    big = tmp_path / "big"
    big.write_text("ab" * 4096)
    big.chmod(0o600)
    with pytest.raises(ConfigError, match="more than 4096 bytes"):
        read(big)
    good = tmp_path / "good"
    assert cli("keygen", "--secret", str(good)).returncode == 0  # mode 600
    with caplog.at_level(logging.WARNING, logger="kvstore.auth"):
        assert read(good)
        assert not caplog.records
        good.chmod(0o644)
        assert read(good)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert setting in caplog.text and "group or others" in caplog.text


def test_an_open_metrics_port_off_loopback_is_warned_of(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Without credentials a metrics port without a token is allowed (one user's host),
    but bound off loopback anyone who reaches it reads every tenant's figures: warned."""
    token = tmp_path / "metrics.token"
    assert cli("keygen", "--secret", str(token)).returncode == 0
    quiet = [{"metrics_port": 9464}, {"metrics_port": 9464, "metrics_addr": "::1"},
             {"metrics_port": 9464, "metrics_addr": "localhost"},
             {"metrics_port": 9464, "metrics_addr": "127.0.0.2"},
             {"metrics_port": 0, "metrics_addr": "0.0.0.0"},
             {"metrics_port": 9464, "metrics_addr": "0.0.0.0",
              "metrics_token_file": str(token)}]
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        for server in quiet:
            load_config(env={}, overrides={"server": server})
        assert not caplog.records
        for addr in ("0.0.0.0", "::", "10.1.2.3", "metrics.example"):
            load_config(env={}, overrides={"server": {"metrics_port": 9464,
                                                      "metrics_addr": addr}})
    assert len(caplog.records) == 4
    assert "not a loopback address" in caplog.text and "metrics_token_file" in caplog.text
