"""Values a Redis backend read as corrupt, deleted only while they are still the value read.

A read that finds a value corrupt (torn, foreign, a bit flipped, something else under
the key) takes it as a miss, and the daemon deletes it: left, the store's EXISTS kept
reporting it to every lookup.  Between the read and the delete another daemon sharing
the store may write a good value under the key; a plain UNLINK deleted that one, and
every key of the batch that read as a miss went too, missing ones another daemon wrote
since included.  Now only the keys read as corrupt are deleted, each by a small script
that deletes it only if the key still holds what the read found: the same bytes (their
SHA-1), the same wrong length (a value not read whole), or still no string.  A server
that does not let the store's user delete (an ACL without DEL) refuses the script: that
is logged and counted (``deletes_refused``; ``corrupt_changed``: those another value
had replaced, kept), and is no failure of the store, which
serves reads and writes as before.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import redis.exceptions

from .base import BackendCounters

log = logging.getLogger("kvstore.remote")

# values read as corrupt remembered until the daemon deletes them, at most (the oldest
# forgotten past it: not deleted, a later read finds them again)
REMEMBERED_MOST = 4096

# ARGV[1]: what the read found; ARGV[2]: its SHA-1 (hex), or its length
_DELETE_IF_SAME = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if ARGV[1] == 'type' then
  if kind ~= 'string' and kind ~= 'none' then return redis.call('DEL', KEYS[1]) end
  return 0
end
if kind ~= 'string' then return 0 end
if ARGV[1] == 'len' then
  if redis.call('STRLEN', KEYS[1]) == tonumber(ARGV[2]) then
    return redis.call('DEL', KEYS[1])
  end
  return 0
end
if redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

Found = tuple[str, str]  # (what the read found: "sha1", "len" or "type"; its value)


def same_bytes(*parts: bytes | bytearray | memoryview) -> Found:
    """A value read whole: its bytes (header, payload)."""
    digest = hashlib.sha1()
    for part in parts:
        digest.update(part)
    return ("sha1", digest.hexdigest())


def same_length(length: int) -> Found:
    """A value of the wrong length, not read."""
    return ("len", str(length))


NOT_A_STRING: Found = ("type", "")


class CorruptValues:
    """The values one backend read as corrupt, by Redis key, until they are deleted."""

    def __init__(self, counters: BackendCounters) -> None:
        self._found: dict[bytes, Found] = {}
        self._script: Any = None
        self.counters = counters

    def __len__(self) -> int:
        return len(self._found)

    def found(self, name: bytes, what: Found) -> None:
        """A read found the value under ``name`` corrupt (``what`` tells it again)."""
        self._found.pop(name, None)
        self._found[name] = what
        while len(self._found) > REMEMBERED_MOST:
            del self._found[next(iter(self._found))]

    async def delete(self, client: Any, names: Sequence[bytes]) -> int:
        """Delete those of ``names`` read as corrupt, each only if still the value read;
        how many were deleted.  Raises redis-py's errors but a refused delete."""
        if self._script is None:
            self._script = client.register_script(_DELETE_IF_SAME)
        deleted = 0
        for name in names:
            what = self._found.pop(name, None)
            if what is None:  # (a miss, not corrupt: nothing to delete)
                continue
            try:
                gone = await self._script(keys=[name], args=list(what))
            except redis.exceptions.ResponseError as exc:
                if not refused(exc):
                    raise
                self.counters.deletes_refused += 1
                log.warning("the remote store refused to delete a value found corrupt "
                            "(%s): it stays, and reads of it miss; allow its user DEL (and "
                            "EVALSHA), or delete it there", exc)
                continue
            if gone:
                deleted += 1
            else:
                self.counters.corrupt_changed += 1
        return deleted


def refused(exc: redis.exceptions.ResponseError) -> bool:
    """Whether the server refused a command for the user's permissions (its ACL): NOPERM,
    or, from within a script, "can't run this command"."""
    return (isinstance(exc, redis.exceptions.NoPermissionError)
            or "NOPERM" in str(exc) or "can't run this command" in str(exc))
