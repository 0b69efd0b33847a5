"""Finding backends by name: entry points in ``kvstore.backends``, and the built-ins.

A third-party package registers its :class:`StorageBackend` subclass in its
pyproject.toml::

    [project.entry-points."kvstore.backends"]
    mystore = "mystore_kvstore:MyStoreBackend"

and the daemon loads it with ``load_backend("mystore", options)``.  The built-ins are
registered the same way and, so that they work from a source checkout that was never
installed, also listed in ``BUILTIN_BACKENDS``.  Everything that can be wrong with a
backend's name, code or options is a ``ConfigError`` from ``load_backend``, before use.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

from kvstore.errors import ConfigError

from .base import BackendCounters, GuardedBackend, StorageBackend

ENTRY_POINT_GROUP = "kvstore.backends"
BUILTIN_BACKENDS: dict[str, str] = {
    "memory": "kvstore.plugins.memory_backend:MemoryBackend",
    "fs": "kvstore.plugins.fs_backend:FsBackend",
    "redis": "kvstore.plugins.redis_backend:RedisBackend",
}
DEFAULT_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 3600.0


def available_backends() -> dict[str, list[str]]:
    """Every backend name, with the ``module:object`` (and where from) that provides it."""
    return {
        name: [f"{entry.value} ({origin})" for entry, origin in providers]
        for name, providers in _providers().items()
    }


def _providers() -> dict[str, list[tuple[importlib.metadata.EntryPoint, str]]]:
    """Name -> the distinct entry points that provide it, each with where it comes from."""
    found: dict[str, list[tuple[importlib.metadata.EntryPoint, str]]] = {}
    for name, target in BUILTIN_BACKENDS.items():
        entry = importlib.metadata.EntryPoint(name, target, ENTRY_POINT_GROUP)
        found[name] = [(entry, "built-in")]
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        providers = found.setdefault(entry.name, [])
        # kvstore's own entry points repeat the built-ins; a path listed twice on
        # sys.path repeats a distribution: the same target is one provider.
        if any(known.value == entry.value for known, _ in providers):
            continue
        origin = f"from {entry.dist.name}" if entry.dist is not None else "entry point"
        providers.append((entry, origin))
    return found


def load_backend(name: str, options: Mapping[str, object] | None = None) -> GuardedBackend:
    """Import, configure and guard the backend called ``name``.

    ``options`` are the backend's own, plus ``timeout_s`` (default 5): the bound on
    every operation.  Raises ``ConfigError`` for an unknown name, a name that two
    packages claim, a plugin that fails to import or is no StorageBackend, or bad options.
    """
    options = dict(options or {})
    timeout_s = _timeout_option(name, options.pop("timeout_s", DEFAULT_TIMEOUT_S))
    backend_class = _backend_class(name)
    try:
        backend = backend_class.from_options(options, timeout_s=timeout_s)
    except ConfigError:
        raise
    except Exception as exc:  # a plugin's own validation may raise anything
        raise ConfigError(f"backend {name!r}: bad options: {exc}") from exc
    if not isinstance(backend, StorageBackend):
        raise ConfigError(
            f"backend {name!r}: from_options returned {type(backend).__name__}, "
            "not a StorageBackend"
        )
    if not isinstance(getattr(backend, "counters", None), BackendCounters):
        raise ConfigError(
            f"backend {name!r}: {type(backend).__name__}.__init__ must call super().__init__()"
        )
    return GuardedBackend(backend, name=name, timeout_s=timeout_s)


def _backend_class(name: str) -> type[StorageBackend]:
    providers = _providers()
    if name not in providers:
        known = ", ".join(sorted(providers)) or "none"
        raise ConfigError(f"unknown storage backend {name!r}; installed backends: {known}")
    if len(providers[name]) > 1:
        listed = "; ".join(f"{entry.value} ({origin})" for entry, origin in providers[name])
        raise ConfigError(
            f"storage backend {name!r} is provided more than once: {listed}. "
            "Uninstall all but one."
        )
    entry = providers[name][0][0]
    try:
        loaded = entry.load()
    except Exception as exc:  # any error while importing a plugin is a configuration problem
        raise ConfigError(
            f"storage backend {name!r} ({entry.value}) failed to import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(loaded, type) and issubclass(loaded, StorageBackend)):
        raise ConfigError(
            f"storage backend {name!r} ({entry.value}) is {loaded!r}, "
            "not a StorageBackend subclass"
        )
    return loaded


def _timeout_option(name: str, value: object) -> float:
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= MAX_TIMEOUT_S
    ):
        return float(value)
    raise ConfigError(
        f"backend {name!r}: timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
        f"got {value!r}"
    )


def parse_remote_url(url: str) -> tuple[str, dict[str, object]]:
    """The backend name and options for the daemon's ``--remote URL``.

    ``redis://HOST:PORT/DB``, ``rediss://``, ``unix://``,
    ``redis+cluster://HOST:PORT[,HOST:PORT]`` and their ``valkey`` spellings give
    ``("redis", {"url": url})``; ``fs:///path`` gives ``("fs", {"path": "/path"})``;
    ``memory://`` gives ``("memory", {})``.  Any other ``scheme://...`` gives
    ``(scheme, {"url": url})``, for a plugin of that name.
    """
    scheme, separator, _ = url.partition("://")
    scheme = scheme.lower()
    if not separator or not scheme:
        raise ConfigError(f"remote {url!r} is not a URL; expected e.g. redis://HOST:PORT/0")
    if scheme.partition("+")[0] in ("redis", "rediss", "valkey", "valkeys", "unix"):
        return "redis", {"url": url}
    if scheme == "fs":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path or parts.query:
            raise ConfigError(f"remote {url!r}: expected fs:///absolute/path")
        return "fs", {"path": unquote(parts.path)}
    if scheme == "memory":
        return "memory", {}
    return scheme, {"url": url}
