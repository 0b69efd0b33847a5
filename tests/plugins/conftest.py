"""Fixtures for the storage backend tests: real Redis servers, and one case per backend.

The Redis fixtures (``redis_server``, ``redis_cluster``) only use ``tests/redis_servers.py``
and can move to ``tests/conftest.py`` unchanged (then drop the sys.path line below).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.cluster

# The shared process helpers live one level up; pytest puts only this folder on sys.path.
sys.path.append(str(Path(__file__).resolve().parent.parent))
from plugin_cases import BackendCase, fs_case, memory_case, redis_case
from redis_servers import (
    RedisClusterServers,
    RedisServer,
    redis_cli_binary,
    redis_server_binary,
)


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


@pytest.fixture(params=["memory", "fs", "redis", "redis_cluster"])
def backend_case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendCase]:
    """Every built-in backend, each with raw access to what it stored."""
    kind = request.param
    if kind == "memory":
        yield memory_case()
    elif kind == "fs":
        yield fs_case(tmp_path / "blocks")
    elif kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        with server.client() as client:
            yield redis_case(server.url, client)
    else:
        cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
        port = cluster.servers[0].port
        with redis.cluster.RedisCluster(host="127.0.0.1", port=port, socket_timeout=5) as client:
            yield redis_case(cluster.url, client)
