"""Fixtures for the storage backend tests: real Redis servers, and one case per backend.

The Redis fixtures (``redis_server``, ``redis_cluster``, ``fresh_redis_server``) live in
``tests/conftest.py``, shared with the daemon's integration tests.
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
from redis_servers import RedisClusterServers, RedisServer


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
