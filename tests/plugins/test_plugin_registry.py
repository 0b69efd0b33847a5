"""Finding and loading backends by name, and the daemon's --remote URLs."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any, Self

import pytest

from kvstore.errors import ConfigError
from kvstore.plugins import (
    ENTRY_POINT_GROUP,
    GuardedBackend,
    available_backends,
    load_backend,
    parse_remote_url,
    registry,
)
from kvstore.plugins.fs_backend import FsBackend
from kvstore.plugins.memory_backend import MemoryBackend
from kvstore.plugins.redis_backend import RedisBackend


class RaisesOnOptions(MemoryBackend):
    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        raise TypeError("wants an int")


class ReturnsSomethingElse(MemoryBackend):
    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Any:
        return object()


class ForgetsSuperInit(MemoryBackend):
    def __init__(self) -> None:  # no super().__init__(): counters missing
        pass

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        return cls()


NOT_A_BACKEND = 42


def use_entry_points(monkeypatch: pytest.MonkeyPatch, *entries: tuple[str, str]) -> None:
    points = importlib.metadata.EntryPoints(
        importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in entries
    )

    def entry_points(**selection: Any) -> importlib.metadata.EntryPoints:
        return points.select(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_builtins_load_without_any_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(monkeypatch)
    assert sorted(available_backends()) == ["fs", "memory", "redis"]
    memory = load_backend("memory")
    assert isinstance(memory, GuardedBackend) and isinstance(memory.inner, MemoryBackend)
    assert memory.timeout_s == registry.DEFAULT_TIMEOUT_S
    assert isinstance(load_backend("fs", {"path": "blocks"}).inner, FsBackend)
    redis = load_backend("redis", {"url": "redis://127.0.0.1:1/0", "timeout_s": 0.5})
    assert isinstance(redis.inner, RedisBackend) and redis.timeout_s == 0.5


def test_kvstores_own_entry_points_are_not_a_conflict(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(monkeypatch, *registry.BUILTIN_BACKENDS.items())
    assert all(len(providers) == 1 for providers in available_backends().values())
    assert isinstance(load_backend("memory").inner, MemoryBackend)


def test_entry_points_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(monkeypatch, ("other", "kvstore.plugins.memory_backend:MemoryBackend"))
    assert isinstance(load_backend("other").inner, MemoryBackend)


def test_a_name_claimed_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(monkeypatch, ("redis", "someone_else:RedisBackend"))
    with pytest.raises(ConfigError, match="'redis' is provided more than once.*someone_else"):
        load_backend("redis", {"url": "redis://localhost"})


def test_an_unknown_name_lists_the_installed_ones() -> None:
    with pytest.raises(ConfigError, match="unknown storage backend 'nope'.*fs, memory, redis"):
        load_backend("nope", {})


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_module_for_kvstore_tests:Backend", "failed to import: ModuleNotFoundError"),
        ("kvstore.plugins.memory_backend:NoSuchClass", "failed to import: AttributeError"),
        ("test_plugin_registry:NOT_A_BACKEND", "is 42, not a StorageBackend subclass"),
        ("test_plugin_registry:RaisesOnOptions", "bad options.*wants an int"),
        ("test_plugin_registry:ReturnsSomethingElse", "returned object, not a StorageBackend"),
        ("test_plugin_registry:ForgetsSuperInit", r"must call super\(\).__init__"),
    ],
)
def test_broken_plugins_fail_at_load_time(
    monkeypatch: pytest.MonkeyPatch, target: str, message: str
) -> None:
    use_entry_points(monkeypatch, ("broken", target))
    with pytest.raises(ConfigError, match=message):
        load_backend("broken", {})


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("memory", {"max_bytes": -1}, r"max_bytes"),
        ("memory", {"max_byte": 1}, "unknown field `max_byte`"),
        ("fs", {}, "missing required field `path`"),
        ("fs", {"path": "x", "threads": 0}, "threads"),
        ("redis", {}, "missing required field `url`"),
        ("redis", {"url": "http://example.com"}, "expected one of redis://"),
        ("redis", {"url": "redis://host:port/0"}, "Port could not be cast"),
        ("redis", {"url": "redis://h/0?socket_timeout=soon"}, "socket_timeout"),
        ("redis", {"url": "redis+cluster://h:1/3"}, "only database 0"),
        ("redis", {"url": "redis+cluster://h:x"}, "url"),
        ("redis", {"url": "redis+cluster://h:1?ssl=1"}, "no query"),
        ("redis", {"url": "redis://h", "connections": 0}, "connections"),
        ("memory", {"timeout_s": 0}, "timeout_s must be"),
        ("memory", {"timeout_s": "5"}, "timeout_s must be"),
        ("memory", {"timeout_s": True}, "timeout_s must be"),
        ("memory", {"timeout_s": float("nan")}, "timeout_s must be"),
    ],
)
def test_bad_options_fail_at_load_time(
    name: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_backend(name, options)


def test_messages_do_not_show_passwords() -> None:
    with pytest.raises(ConfigError) as caught:
        load_backend("redis", {"url": "redis://user:hunter2@h:port/0"})
    assert "hunter2" not in str(caught.value) and "user:***@" in str(caught.value)
    backend = load_backend("redis", {"url": "redis+cluster://u:hunter2@h1:7000,h2:7001"})
    assert "hunter2" not in repr(backend.inner)


def test_cluster_urls_take_several_startup_nodes() -> None:
    backend = load_backend("redis", {"url": "redis+cluster://a:7000,[::1]:7001,b"})
    inner = backend.inner
    assert isinstance(inner, RedisBackend) and inner.cluster
    nodes = sorted(inner._client.nodes_manager.startup_nodes)  # type: ignore[union-attr]
    assert nodes == ["::1:7001", "a:7000", "b:6379"]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://10.0.0.5:6379/2", ("redis", {"url": "redis://10.0.0.5:6379/2"})),
        ("rediss://h:6380/0", ("redis", {"url": "rediss://h:6380/0"})),
        ("redis+cluster://h:7000", ("redis", {"url": "redis+cluster://h:7000"})),
        ("valkey://h:6379/0", ("redis", {"url": "valkey://h:6379/0"})),
        ("unix:///run/redis.sock?db=1", ("redis", {"url": "unix:///run/redis.sock?db=1"})),
        ("fs:///mnt/shared/kv", ("fs", {"path": "/mnt/shared/kv"})),
        ("fs://localhost/mnt/a%20b", ("fs", {"path": "/mnt/a b"})),
        ("memory://", ("memory", {})),
        ("s3://bucket/prefix", ("s3", {"url": "s3://bucket/prefix"})),
    ],
)
def test_parse_remote_url(url: str, expected: tuple[str, dict[str, object]]) -> None:
    assert parse_remote_url(url) == expected


@pytest.mark.parametrize("url", ["localhost:6379", "", "fs://host/path", "fs://", "://x"])
def test_parse_remote_url_refuses(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_remote_url(url)


def test_remote_urls_load() -> None:
    for url in ("redis://127.0.0.1:6379/0", "redis+cluster://127.0.0.1:7000", "memory://"):
        name, options = parse_remote_url(url)
        assert isinstance(load_backend(name, options), GuardedBackend)
