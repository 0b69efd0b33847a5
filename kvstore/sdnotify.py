"""systemd's notify protocol (``sd_notify``) without a systemd library.

Under ``Type=notify`` systemd passes a datagram socket in ``NOTIFY_SOCKET`` (a
filesystem path, or ``@name`` in the abstract namespace); the service sends it
newline-separated ``KEY=value`` assignments: ``READY=1`` once it serves,
``STATUS=...`` for ``systemctl status``, ``WATCHDOG=1`` as a keep-alive and
``STOPPING=1`` when it begins to shut down.  Outside systemd every call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("kvstore.sdnotify")


def _address(env: Mapping[str, str]) -> str | None:
    path = env.get("NOTIFY_SOCKET", "")
    if path.startswith("@"):
        return "\0" + path[1:]
    if path.startswith("/"):
        return path
    return None  # unset, or a kind this daemon does not speak (vsock:...)


def notify(state: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd; whether it was sent.

    False without ``NOTIFY_SOCKET`` or when the send fails (logged): the daemon keeps
    serving either way.  Never blocks.
    """
    address = _address(env)
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # A listener that stopped reading fills its queue; a blocking send would then
            # stall the event loop that serves every client.
            sock.sendto(state.encode(), socket.MSG_DONTWAIT, address)
    except OSError as exc:
        log.warning("sd_notify to %r failed: %s", env.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between watchdog pings: half of ``WATCHDOG_USEC``, as systemd advises.

    None when no watchdog is asked for, or when ``WATCHDOG_PID`` names another process.
    """
    raw = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    try:
        usec = int(raw)
        if pid and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 2 / 1e6


class Notifier:
    """The daemon's side of the notify protocol, bound to one environment."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env: Mapping[str, str] = dict(os.environ if env is None else env)
        self.watchdog_interval = watchdog_interval(self.env)

    def __repr__(self) -> str:
        return (f"Notifier(socket={self.env.get('NOTIFY_SOCKET')!r}, "
                f"watchdog_interval={self.watchdog_interval})")

    @property
    def enabled(self) -> bool:
        """Whether systemd is listening."""
        return _address(self.env) is not None

    def _send(self, *assignments: str) -> bool:
        return notify("\n".join(assignments), self.env)

    def ready(self, status: str = "") -> bool:
        """The daemon serves: systemd marks the unit started."""
        return self._send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """A one-line status for ``systemctl status``."""
        return self._send(f"STATUS={text}")

    def reloading(self) -> bool:
        """A reload (SIGHUP) began; send ``ready()`` again when it is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self._send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        """Shutdown began (draining); systemd waits up to TimeoutStopSec."""
        return self._send("STOPPING=1")

    def watchdog(self) -> bool:
        """Keep-alive: without one per ``WatchdogSec`` systemd kills and restarts us."""
        return self._send("WATCHDOG=1")

    def start_watchdog(
        self,
        loop: asyncio.AbstractEventLoop,
        healthy: Callable[[], bool] = lambda: True,
    ) -> Callable[[], None]:
        """Ping the watchdog from ``loop`` every interval while ``healthy()`` holds.

        The pings run as loop callbacks so that a stuck loop stops them and systemd
        restarts the daemon.  Returns a function that stops the pings; without a
        watchdog it does nothing.
        """
        interval = self.watchdog_interval
        handle: asyncio.TimerHandle | None = None
        if interval is None:
            return lambda: None

        def ping() -> None:
            nonlocal handle
            if healthy():
                self.watchdog()
            handle = loop.call_later(interval, ping)

        def stop() -> None:
            if handle is not None:
                handle.cancel()

        handle = loop.call_later(0, ping)
        return stop
