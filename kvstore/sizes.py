"""Sizes in configuration: ``"256MiB"`` and the like, parsed and written back."""

from __future__ import annotations

import re

from kvstore.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_MOST = 1 << 60  # the largest size taken: far beyond any host, within a C long


def parse_size(value: str | int, field: str = "size") -> int:
    """``"256MiB"`` -> 268435456; plain integers are bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a size such as '256MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}: a size cannot be negative")
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{field}: {value!r} is not a size; use a number with an optional unit "
                f"(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size > _SIZE_MOST:
        # (larger ones crashed the daemon at start: a C long of ZeroMQ or mmap)
        raise ConfigError(f"{field}: {value!r} is more than any host holds (at most "
                          f"{format_size(_SIZE_MOST)})")
    return size


def parse_size_or_share(value: str | int, whole: int, field: str, of: str) -> int:
    """A size, or a percentage (``"25%"``) of ``whole`` (named ``of``; 0: not known, and
    a share of it is 0).  A share of a known ``whole`` that comes to less than a byte is
    a ConfigError: 0 means "none" (for ``remote.max_bytes_per_tenant``, no bound), which
    the tiny share given was not."""
    if not (isinstance(value, str) and value.strip().endswith("%")):
        return parse_size(value, field)
    try:
        share = float(value.strip()[:-1])
    except ValueError:
        share = -1.0
    if not 0 < share <= 100:
        raise ConfigError(f"{field}: {value!r}; a share of {of} is a percentage above 0, "
                          f"at most 100%")
    size = int(whole * share / 100)
    if whole and not size:
        raise ConfigError(f"{field}: {value!r} of {of} ({whole} bytes) is less than a byte; "
                          f"give a larger share, a size, or 0 for none")
    return size


def format_size(value: int) -> str:
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= factor and value % factor == 0:
            return f"{value // factor}{unit}"
    return f"{value}B"
