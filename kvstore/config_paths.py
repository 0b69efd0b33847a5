"""Relative paths in a config file, resolved against the file's directory.

Under systemd the daemon runs in ``/``, so ``ssd.path = "cache/ssd"`` read as the
operating system does (against the working directory) meant ``/cache/ssd``, not the
directory beside the file the operator wrote; a daemon started by hand elsewhere found
another directory again.  As Prometheus does for the files its configuration names (and
unlike redis, whose relative paths follow its working directory), a relative path in the
file is taken from the file's own directory; environment overrides and flags, typed in a
shell, stay relative to the working directory.  ``kvstore config show`` prints the
absolute paths and ``kvstore config check`` lists what it resolved.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

__all__ = ["ENDPOINT_FIELDS", "PATH_FIELDS", "check_ipc_path", "config_directory",
           "resolve_relative", "resolved_paths"]

# (section, field) of the settings that name a file or a directory
PATH_FIELDS = (("server", "metrics_token_file"), ("dram", "directory"), ("ssd", "path"),
               ("remote", "tag_secret_file"), ("auth", "secret_file"),
               ("auth", "curve_secret_key_file"), ("auth", "curve_clients_dir"))
# (section, field) of the endpoints (one, or a list), whose ipc:// paths are resolved
ENDPOINT_FIELDS = (("server", "endpoint"), ("server", "extra_endpoints"),
                   ("events", "endpoint"), ("events", "replay_endpoint"))


def _relative(value: str) -> bool:
    # "~": the daemon's home (expanded where it is used); "": the default
    return bool(value) and not value.startswith(("/", "~"))


def _endpoint(value: Any, base: str) -> Any:
    if not isinstance(value, str) or not value.startswith("ipc://"):
        return value
    path = value[len("ipc://"):]
    if path.startswith(("@", "*")) or not _relative(path):  # (abstract, a wildcard)
        return value
    return "ipc://" + os.path.normpath(os.path.join(base, path))


def config_directory(path: str | Path) -> str | None:
    """The directory relative paths in config file ``path`` are taken from: the file's
    (a symbolic link's own place, as the operator named it); None for a pipe or a device
    (``--config <(...)``), whose paths stay relative to the working directory."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    return os.path.dirname(os.path.abspath(path))


def resolve_relative(data: dict[str, Any], path: str | Path) -> list[str]:
    """Make the relative paths in ``data`` (a config file's parsed TOML, changed in
    place) absolute against the directory of the file at ``path``; one line for each,
    ``key: "was" -> "now"``, for ``config check``.  Values of the wrong type are left to
    the validation that follows."""
    base = config_directory(path)
    done: list[str] = []
    if base is None:
        return done
    for section, field in PATH_FIELDS + ENDPOINT_FIELDS:
        table = data.get(section)
        if not isinstance(table, dict) or field not in table:
            continue
        was = table[field]
        if (section, field) in ENDPOINT_FIELDS:
            now = ([_endpoint(v, base) for v in was] if isinstance(was, list)
                   else _endpoint(was, base))
        elif isinstance(was, str) and _relative(was):
            now = os.path.normpath(os.path.join(base, was))
        else:
            now = was
        if now != was:
            table[field] = now
            done.append(f"{section}.{field}: {was!r} -> {now!r} (relative to the config "
                        "file's directory)")
    return done


def resolved_paths(path: str | Path) -> list[str]:
    """What ``resolve_relative`` changes in the config file at ``path`` (read again; a
    file ``load_config`` took), for ``kvstore config check``; none for a pipe."""
    import tomllib

    if config_directory(path) is None:
        return []
    return resolve_relative(tomllib.loads(Path(path).read_text("utf-8")), path)


def check_ipc_path(setting: str, endpoint: str) -> None:
    """Refuse an ipc endpoint that names no socket file (ConfigError): the daemon's
    sockets and its event stream are guarded by their file's mode (0600) and
    directory.  An abstract socket (``ipc://@name``) has neither, so any local user
    could connect (read the stream: every tenant's keys and token ids), and a wildcard
    (``ipc://*``) binds a file of ZeroMQ's naming that nobody could be told of; both
    made the daemon stop at start with a traceback (``chmod`` of no such file)."""
    if endpoint.startswith(("ipc://@", "ipc://*")):
        raise ConfigError(f"{setting}: {endpoint!r} names no socket file (an abstract socket "
                          f"or a wildcard has no file mode to keep other users out): name "
                          f"a path, as ipc:///run/kvstore/kvstore.sock")
