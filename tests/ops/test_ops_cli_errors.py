"""Hostile arguments to ``python -m kvstore``: each a one-line error and a non-zero exit,
never a traceback, a hang, or a file written where it was not asked for."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest


def kvstore_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def assert_refused(run: subprocess.CompletedProcess[str], *words: str) -> None:
    assert run.returncode != 0, run.stdout
    assert "Traceback" not in run.stderr, run.stderr
    for word in words:
        assert word in run.stderr, run.stderr


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret.hex"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("kind", ["not utf-8", "directory", "endless device"])
def test_config_check_of_an_unreadable_file_says_why(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "kvstore.toml"
    if kind == "not utf-8":
        path.write_bytes(b"\xff\xfe\x00garbage")
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/zero")  # read up to the bound, not for ever
    run = kvstore_cli("config", "check", str(path), timeout=20)
    assert_refused(run, "configuration error", str(path))
    assert run.returncode == 2


@pytest.mark.parametrize("how", ["fifo", "stdin"])
def test_a_config_given_through_a_pipe_is_read(tmp_path: Path, how: str) -> None:
    # ``--config <(...)`` and ``/dev/stdin`` are pipes: read at start-up and by a check
    # (only a SIGHUP's reload refuses one, which would wait on the daemon's loop)
    text = "[server]\nlease_seconds = 12\n"
    if how == "stdin":
        run = subprocess.run([sys.executable, "-m", "kvstore", "config", "check",
                              "/dev/stdin"], input=text, capture_output=True, text=True,
                             timeout=30)
    else:
        fifo = tmp_path / "kvstore.toml"
        os.mkfifo(fifo)
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "config", "check",
                                 str(fifo)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        fifo.write_text(text)  # (opening it waits for the reader)
        out, err = proc.communicate(timeout=30)
        run = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert run.returncode == 0, run.stderr
    assert "ok" in run.stdout


@pytest.mark.parametrize("ttl", ["nan", "inf", "1e300", "-100", "0", "abc",
                                 str(400 * 86400)])
def test_a_token_ttl_must_be_finite_positive_and_bounded(secret_file: Path,
                                                         ttl: str) -> None:
    run = kvstore_cli("token", "--secret-file", str(secret_file), "--tenant", "acme",
                      "--ttl", ttl)
    assert_refused(run, "--ttl")
    assert run.returncode == 2 and not run.stdout


@pytest.mark.parametrize("tenant", ["", "a" * 600, "é" * 200])
def test_a_token_for_no_valid_tenant_is_refused(secret_file: Path, tenant: str) -> None:
    run = kvstore_cli("token", "--secret-file", str(secret_file), "--tenant", tenant)
    assert_refused(run, "--tenant")
    assert run.returncode == 2 and not run.stdout


def test_a_good_token_is_still_issued(secret_file: Path) -> None:
    from kvstore.auth import verify_token

    run = kvstore_cli("token", "--secret-file", str(secret_file), "--tenant", "acme",
                      "--ttl", "60")
    assert run.returncode == 0, run.stderr
    secret = bytes.fromhex(secret_file.read_text().strip())
    assert verify_token(secret, run.stdout.strip()) == "acme"


def test_keygen_secret_in_a_missing_directory_says_so(tmp_path: Path) -> None:
    run = kvstore_cli("keygen", "--secret", str(tmp_path / "no" / "such" / "secret"))
    assert_refused(run, "cannot write", "No such file or directory")


def test_keygen_in_a_directory_that_cannot_be_made_says_so() -> None:
    run = kvstore_cli("keygen", "/proc/kvstore-forbidden", "--name", "acme")
    assert_refused(run, "cannot write the key pair in /proc/kvstore-forbidden")


@pytest.mark.parametrize("name", ["../../escape", "sub/acme", "..", ".hidden", "",
                                  "a" * 600])
def test_keygen_names_no_path_and_only_a_tenant(tmp_path: Path, name: str) -> None:
    keys = tmp_path / "deep" / "keys"
    run = kvstore_cli("keygen", str(keys), "--name", name)
    assert_refused(run)
    assert run.returncode == 2
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [], written  # nothing in DIR, nothing outside it


def test_keygen_takes_a_tenant_with_a_label(tmp_path: Path) -> None:
    run = kvstore_cli("keygen", str(tmp_path), "--name", "acme.laptop")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "acme.laptop.key").exists()
    assert (tmp_path / "acme.laptop.key_secret").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("verb", ["drop-namespace", "route"])
@pytest.mark.parametrize("kind", ["missing", "not utf-8", "directory"])
def test_an_unreadable_identity_file_says_why(tmp_path: Path, verb: str, kind: str) -> None:
    path = tmp_path / "identity.json"
    if kind == "not utf-8":
        path.write_bytes(b'{"model": "caf\xe9"}')
    elif kind == "directory":
        path.mkdir()
    args = ["--identity", f"@{path}"]
    if verb == "route":
        tokens = tmp_path / "tokens"
        tokens.write_text("1 2 3")
        args += ["--endpoints", f"ipc://{tmp_path / 'none.sock'}", "--tokens", str(tokens)]
    else:
        args += ["--endpoint", f"ipc://{tmp_path / 'none.sock'}", "--timeout", "1"]
    run = kvstore_cli(verb, *args)
    assert_refused(run, "--identity", str(path))
    assert run.returncode == 2


@pytest.mark.parametrize("verb, flag, value", [
    ("ping", "--timeout", "nan"), ("ping", "--timeout", "-1"), ("ping", "--timeout", "0"),
    ("stats", "--timeout", "inf"), ("stats", "--watch", "-1"), ("stats", "--watch", "nan"),
    ("stats", "--watch", "1e300"),
    ("drop-namespace", "--timeout", "-1"),
    ("route", "--deadline", "nan"), ("route", "--deadline", "-1"),
    ("route", "--prefill-rate", "nan"), ("route", "--prefill-rate", "0"),
    ("bench", "--timeout", "nan"),
])
def test_a_number_of_seconds_must_be_finite_and_positive(tmp_path: Path, verb: str,
                                                         flag: str, value: str) -> None:
    """A negative ping timeout waited for ever (the client's "no timeout"); nan was a
    ValueError's traceback; each is now refused before anything connects."""
    endpoint = f"ipc://{tmp_path / 'none.sock'}"
    args = {"ping": ["--endpoint", endpoint], "stats": ["--endpoint", endpoint],
            "drop-namespace": ["--endpoint", endpoint, "--identity", "{}"],
            "route": ["--endpoints", endpoint, "--tokens", "-", "--identity", "{}"],
            "bench": []}[verb]
    run = kvstore_cli(verb, *args, flag, value, timeout=20)
    assert_refused(run, flag)
    assert run.returncode == 2


@pytest.mark.parametrize("value", ["0", "0.01", "-1", "nan", "inf"])
def test_the_remote_generation_check_needs_a_sensible_interval(tmp_path: Path,
                                                               value: str) -> None:
    """A check every few milliseconds would be a round trip to the remote store each
    loop turn or so; none at all never notices a store that lost what it held."""
    config = tmp_path / "kvstore.toml"
    config.write_text(f"[remote]\ncheck_seconds = {value}\n")
    assert_refused(kvstore_cli("config", "check", str(config)),
                   "remote.check_seconds")
