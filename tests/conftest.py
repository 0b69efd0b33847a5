from __future__ import annotations

import compileall
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

# No per-example deadline: an example's time says nothing about the property, and on a
# loaded machine a slow one failed a run (DeadlineExceeded, then Flaky on its replay)
settings.register_profile("kvstore", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvstore")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project's sources once, before any test starts a process.  Where
    ``PYTHONDONTWRITEBYTECODE`` is set (as in many CI images), no process writes its
    bytecode, so every daemon, command and worker a test starts compiled each module it
    imports again: about half of a daemon's start, hundreds of starts a run.  The
    bytecode is a cache beside the sources (ignored by git) and changes no behaviour."""
    root = Path(__file__).resolve().parent.parent
    for folder in ("kvstore", "scheduler", "tiers", "kernels", "plugins", "tests"):
        compileall.compile_dir(root / folder, quiet=2)

from daemon_proc import DaemonProcess  # noqa: E402
from redis_servers import (  # noqa: E402
    RedisClusterServers,
    RedisServer,
    redis_cli_binary,
    redis_server_binary,
)

from kvtest import make_identity  # noqa: E402

from kvstore import Identity  # noqa: E402


@pytest.fixture
def identity() -> Identity:
    return make_identity()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(**kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path / f"daemon{len(started)}", **kwargs)
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.stop()
        assert "invariant violated" not in d.log(), d.log()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    return daemon_factory(tcp=True)


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon (as ``daemon``'s) for a module's tests that each keep to names of their
    own and read no daemon-wide figure: a start is most of such a test's time.  Checked
    for invariant violations when the module ends."""
    d = DaemonProcess(tmp_path_factory.mktemp("module-daemon") / "daemon", tcp=True)
    try:
        yield d.start()
    finally:
        d.stop()
        assert "invariant violated" not in d.log(), d.log()


def _require_redis() -> None:
    if redis_server_binary() is None:
        pytest.fail("redis-server is not installed (set $KVSTORE_REDIS_SERVER)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone redis-server for the whole session; tests use their own namespaces."""
    _require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A 3-master Redis Cluster for the whole session."""
    _require_redis()
    if redis_cli_binary() is None:
        pytest.fail("redis-cli is not installed; it is needed to create a cluster")
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def fresh_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A standalone server of the test's own, free to pause, kill and restart."""
    _require_redis()
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (needs root and mount rights: the test fails without them)."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if result.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the disk-full test: "
                    f"{result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)
