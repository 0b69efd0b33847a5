"""Users of a shared host, for tests that run the daemon and engines as different uids.

Tests run as root (as CI does): ``HostUsers`` creates a group and users with
``useradd`` and removes them afterwards; ``as_user`` runs a function in a forked child
that drops to a user's uid, gid and groups first.  Forking (rather than starting a new
interpreter as that user) keeps the interpreter and the modules already imported, so
the child needs no read access to where Python is installed (often under /root).
"""

from __future__ import annotations

import grp
import importlib
import multiprocessing
import os
import pkgutil
import pwd
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


class HostUsers:
    """A group and users made for one test; ``close()`` removes them."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("tests of several users run as root (CI does), to make them")
        self.tag = secrets.token_hex(3)
        self.group = f"kvt{self.tag}g"
        subprocess.run(["groupadd", self.group], check=True, capture_output=True)
        self.gid = grp.getgrnam(self.group).gr_gid
        self._users: list[str] = []

    def add(self, role: str, *, in_group: bool = True) -> User:
        name = f"kvt{self.tag}{role}"
        cmd = ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
        if in_group:
            cmd[1:1] = ["--groups", self.group]
        subprocess.run(cmd, check=True, capture_output=True)
        self._users.append(name)
        entry = pwd.getpwnam(name)
        groups = (self.gid,) if in_group else ()
        return User(name, entry.pw_uid, entry.pw_gid, groups)

    def close(self) -> None:
        for name in self._users:
            subprocess.run(["userdel", name], check=False, capture_output=True)
        subprocess.run(["groupdel", self.group], check=False, capture_output=True)


def _drop_and_run(user: User, conn: Connection, fn: Callable[..., Any],
                  args: tuple[Any, ...]) -> None:
    os.setgroups(list(user.groups))
    os.setgid(user.gid)
    os.setuid(user.uid)
    try:
        fn(conn, *args)
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _import_kvstore() -> None:
    """Import every module of kvstore (and so what they import) in this process, so a
    forked child as another user needs no read access to the checkout either (CI's may
    sit in a directory only root can enter); the engines' integrations are left out."""
    for package in ("kvstore", "kvstore.tiers", "kvstore.scheduler", "kvstore.kernels",
                    "kvstore.plugins"):  # the folders beside kvstore/ install under it
        path = importlib.import_module(package).__path__
        for module in pkgutil.walk_packages(path, package + "."):
            if module.name.startswith("kvstore.integrations") or module.name.endswith(
                    "__main__"):
                continue
            try:
                importlib.import_module(module.name)
            except Exception:
                pass  # an optional extra (cupy, matplotlib) that is not installed


def as_user(user: User, fn: Callable[..., Any], *args: Any
            ) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    """Start ``fn(conn, *args)`` in a forked child running as ``user``; the other end of
    ``conn`` is returned for talking to it."""
    _import_kvstore()
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=_drop_and_run, args=(user, theirs, fn, args), daemon=True)
    proc.start()
    theirs.close()
    return proc, ours
