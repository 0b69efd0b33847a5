"""kvstore.plugins: remote and extra storage backends behind one small async interface.

Backends are found by name through the ``kvstore.backends`` entry-point group; the
built-ins are ``memory``, ``fs`` and ``redis``.  Use::

    name, options = parse_remote_url("redis://127.0.0.1:6379/0")
    backend = load_backend(name, {**options, "timeout_s": 2.0})

Backend modules (and their libraries, such as redis) are imported only when loaded.
"""

from .base import (
    BackendCounters,
    BackendHealth,
    BytesLike,
    GuardedBackend,
    StorageBackend,
    parse_options,
    run_bounded,
)
from .registry import (
    BUILTIN_BACKENDS,
    ENTRY_POINT_GROUP,
    available_backends,
    load_backend,
    parse_remote_url,
)

__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "BackendCounters",
    "BackendHealth",
    "BytesLike",
    "GuardedBackend",
    "StorageBackend",
    "available_backends",
    "load_backend",
    "parse_options",
    "parse_remote_url",
    "run_bounded",
]
