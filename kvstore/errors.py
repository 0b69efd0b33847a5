"""The exceptions of kvstore, one short hierarchy.

Every error a client can see carries a stable ``code``; the daemon sends the code and a
message, and the client library raises the matching class.  Errors say what went wrong
and, where it helps, what to do about it.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every kvstore error."""

    code = "internal"


class MalformedError(KVStoreError, ValueError):
    """A request (or a value given to the library) is not well formed."""

    code = "malformed"


class VersionMismatchError(KVStoreError):
    """Client and daemon speak different protocol versions."""

    code = "version_mismatch"


class UnknownNamespaceError(KVStoreError):
    """The namespace was not opened in this session."""

    code = "unknown_namespace"


class CapacityError(KVStoreError):
    """No room for the request under the configured pressure policy.  ``cause`` says why,
    for metrics: full, pinned, quota or deadline (deferred, then out of time)."""

    code = "capacity"

    def __init__(self, message: str = "", cause: str = "full") -> None:
        super().__init__(message)
        self.cause = cause


class LeaseExpiredError(KVStoreError):
    """A reservation or pin outlived its lease and was rolled back."""

    code = "lease_expired"


class NotFoundError(KVStoreError, KeyError):
    """A key (or reservation, or pin) is not there."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return Exception.__str__(self)


class ForbiddenError(KVStoreError):
    """The session may not do this (wrong tenant, bad credentials)."""

    code = "forbidden"


class NoSessionError(ForbiddenError):
    """The daemon has no session for this connection (it restarted on the same endpoint,
    or the first request was not hello): connect again.  It travels as a ``forbidden``
    error whose message starts with ``PREFIX`` (an older client sees a plain
    ForbiddenError; an older daemon sends the same message)."""

    PREFIX = "no session"


class SessionExpiredError(LeaseExpiredError, NoSessionError):
    """The session's lease ran out (its client was silent for longer): its reservations and
    pins were rolled back and the daemon has no session for this client any more: open a
    new client.  Both a ``LeaseExpiredError`` and a ``NoSessionError``, so that one
    ``except NoSessionError`` reconnects after a restart and after a lease alike."""

    code = "lease_expired"
    PREFIX = "this session's lease ran out"


class TooLargeError(KVStoreError):
    """A request exceeds a configured limit on sizes or counts."""

    code = "too_large"


class LimitExceededError(KVStoreError):
    """A per-session or per-tenant cap (reservations, pins, rate) is reached."""

    code = "limit_exceeded"


class NamespaceInUseError(LimitExceededError):
    """A namespace the session has reservations open in is not closed: commit or abort
    them first.  It travels as a ``limit_exceeded`` error whose message holds ``MARK``
    (an older client sees a plain LimitExceededError; an older daemon sends the same
    message), so a caller tells it from a refusal for a rate or another limit."""

    MARK = "reservations open in the namespace"


class UnavailableError(KVStoreError):
    """The daemon (or a backend) did not answer in time or is shutting down."""

    code = "unavailable"


class CallTimeoutError(UnavailableError):
    """A backend call did not finish within its timeout (the store may be slow for this
    call's own load, or not answer at all: the remote tier tells which)."""


class BackendError(KVStoreError):
    """A storage backend (SSD, remote plugin) failed."""

    code = "backend"


class CorruptError(KVStoreError):
    """Bytes read do not match the checksum they were written with."""

    code = "corrupt"


class BufferInUseError(KVStoreError, BufferError):
    """A release, commit or abort refused while a view of one of the object's slots is
    exported (C code holding a buffer of it): the slot would be reused under the reader.
    The pin or slots stay held (its other views are let go): let the export go, then
    ask again.  (Client-side only: the daemon never sends it.)"""

    code = "buffer_in_use"


class ConfigError(KVStoreError, ValueError):
    """The configuration is invalid; the message names the field."""

    code = "config"


ERRORS_BY_CODE: dict[str, type[KVStoreError]] = {
    cls.code: cls
    for cls in (
        KVStoreError,
        MalformedError,
        VersionMismatchError,
        UnknownNamespaceError,
        CapacityError,
        LeaseExpiredError,
        NotFoundError,
        ForbiddenError,
        TooLargeError,
        LimitExceededError,
        UnavailableError,
        BackendError,
        CorruptError,
        ConfigError,
    )
}


def error_from_code(code: str, message: str) -> KVStoreError:
    """Build the exception a daemon's error reply stands for."""
    if code == ForbiddenError.code and message.startswith(NoSessionError.PREFIX):
        return NoSessionError(message)
    if code == LeaseExpiredError.code and message.startswith(SessionExpiredError.PREFIX):
        return SessionExpiredError(message)
    if code == LimitExceededError.code and NamespaceInUseError.MARK in message:
        return NamespaceInUseError(message)
    return ERRORS_BY_CODE.get(code, KVStoreError)(message)
