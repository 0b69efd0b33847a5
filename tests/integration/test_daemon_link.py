"""An engine's link to the daemon (kvstore.integrations.daemon_link) against a real daemon:
how it backs off from a daemon that refused it, and what it counts as a failure."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity
from test_engine_side import TOKENS, identity

from kvstore.auth import issue_token, read_secret, write_secret
from kvstore.client import Client, Namespace
from kvstore.errors import (
    CapacityError,
    ForbiddenError,
    KVStoreError,
    LimitExceededError,
    MalformedError,
    NoSessionError,
    NotFoundError,
    UnavailableError,
)
from kvstore.identity import Identity
from kvstore.integrations import daemon_link
from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings


@pytest.fixture
def gated(daemon_factory: Callable[..., DaemonProcess],
          tmp_path: Path) -> tuple[DaemonProcess, bytes]:
    """A daemon that takes tokens (its ipc and tcp endpoints gated), and its secret."""
    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n')
    return (daemon_factory(tcp=True, extra=["--config", str(config)]),
            read_secret(secret_file))


@pytest.fixture
def handshakes(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The token of every client the links make (each one a handshake with the daemon)."""
    made: list[str | None] = []

    class Counted(Client):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(kwargs["token"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(daemon_link, "Client", Counted)
    return made


@pytest.mark.parametrize("over", ["ipc", "tcp"])
def test_a_refused_hello_backs_off_and_a_new_token_goes_at_once(
        gated: tuple[DaemonProcess, bytes], handshakes: list[str | None], over: str) -> None:
    """An expired token is refused (by the side socket on ipc, in the ZeroMQ handshake
    on tcp: both a ForbiddenError at once); the link does not say hello again with it
    until a back-off that doubles with each refusal in a row (1, 2, 4, then 4 s: the
    cap), and meanwhile ``connect`` raises the refusal at once and every step is a miss,
    with no handshake; a new token is tried at once."""
    d, secret = gated
    endpoint = d.endpoint if over == "ipc" else d.tcp_endpoint
    now = [0.0]
    expired, good = issue_token(secret, "acme", -1), issue_token(secret, "acme", 600)
    link = DaemonLink(DaemonSettings(endpoint, "", expired, timeout=60.0),
                      refused_s=(1.0, 4.0), clock=lambda: now[0], map_arena=False)
    try:
        with pytest.raises(ForbiddenError, match="expired"):
            link.connect()
        assert handshakes == [expired]
        for _ in range(3):  # each call: the refusal again, at once, not another hello
            with pytest.raises(ForbiddenError, match="refused 1 time"):
                link.connect()
            assert link.client() is None and link.namespace("pages", identity) is None
        assert not link.available() and "backing off from 1 refusal" in repr(link)
        assert handshakes == [expired] and link.failures == 0
        tries = []
        for t in (0.9, 1.0, 2.9, 3.0, 6.9, 7.0, 10.9, 11.0):
            now[0] = t
            assert link.client() is None
            tries.append(len(handshakes))
        assert tries == [1, 2, 2, 3, 3, 4, 4, 5]  # at 1, 3 (+2), 7 (+4), 11 (+4, capped)
        assert link.failures == 4  # each refused hello once
        link.use_token(good)  # still within the back-off: a new token goes at once
        assert link.available()
        ns = link.namespace("pages", identity)
        assert isinstance(ns, Namespace) and ns.lookup(ns.keys(range(TOKENS))).blocks == 0
        assert handshakes[-1] == good and len(handshakes) == 6
        assert "connected" in repr(link) and link.failures == 4
    finally:
        link.close()


def test_a_refused_background_connect_is_not_spawned_again_until_its_back_off_ends(
        gated: tuple[DaemonProcess, bytes], handshakes: list[str | None]) -> None:
    d, secret = gated
    now = [0.0]
    expired, good = issue_token(secret, "acme", -1), issue_token(secret, "acme", 600)
    link = DaemonLink(DaemonSettings(d.endpoint, "", expired, timeout=5.0),
                      refused_s=(1.0, 60.0), clock=lambda: now[0], map_arena=False)
    try:
        link.connect_in_background({"pages": identity})
        assert not link.wait_connected(10)
        assert link.failures == 1 and not link.available()
        for _ in range(3):  # no new connect thread, no handshake
            assert link.namespace("pages", identity) is None
            assert "connecting" not in repr(link)
        assert handshakes == [expired]
        now[0] = 1.0  # past the back-off: connecting again, apart, and refused again
        assert link.client() is None and not link.wait_connected(10)
        assert handshakes == [expired, expired] and link.failures == 2
        now[0] = 2.9  # the second back-off is 2 s
        assert link.client() is None and "connecting" not in repr(link)
        link.use_token(good)
        assert link.client() is None  # at once, on the connect thread
        assert link.wait_connected(10) and handshakes[-1] == good
        ns = link.namespace("pages", identity)
        assert isinstance(ns, Namespace) and link.failures == 2
    finally:
        link.close()


def test_a_link_without_a_token_setting_takes_kvstore_token(
        gated: tuple[DaemonProcess, bytes], handshakes: list[str | None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the client does: an engine's link whose configuration names no token connects
    with ``$KVSTORE_TOKEN``; a token in the configuration wins over it."""
    d, secret = gated
    expired, good = issue_token(secret, "acme", -1), issue_token(secret, "acme", 600)
    monkeypatch.setenv("KVSTORE_TOKEN", good)
    link = DaemonLink(DaemonSettings.from_extra({"endpoint": d.endpoint, "tenant": "acme"},
                                                timeout=5.0), map_arena=False)
    try:
        ns = link.namespace("pages", identity)
        assert isinstance(ns, Namespace) and link.failures == 0
    finally:
        link.close()
    link = DaemonLink(DaemonSettings.from_extra(
        {"endpoint": d.endpoint, "tenant": "acme", "token": expired}, timeout=5.0),
        map_arena=False)
    try:
        with pytest.raises(ForbiddenError, match="expired"):
            link.connect()
    finally:
        link.close()
    assert handshakes == [None, expired]  # None: the client reads $KVSTORE_TOKEN


def test_a_refusal_whose_confirming_ping_is_refused_counts_once(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """A bare ForbiddenError makes the link ask, with a ping, whether its session lives;
    a ping refused for a reason of its own (here the session's request rate) says it
    does: the client is kept, and the one failed step counts once."""
    config = tmp_path / "rate.toml"
    # below one request a second the session's bucket never holds a whole request: every
    # request past the hello (never limited) is refused, however slow the machine
    config.write_text("[server]\nmax_requests_per_second = 0.5\n")
    daemon = daemon_factory(extra=["--config", str(config)])
    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=5.0), map_arena=False)
    try:
        client = link.connect()
        with pytest.raises(LimitExceededError):
            client.ping()
        link.failed("lookup", ForbiddenError("namespace of another tenant"))
        assert link.failures == 1
        assert link.client() is client and "connected" in repr(link)
    finally:
        link.close()


def test_an_endpoint_zeromq_cannot_connect_to_is_a_refusal(handshakes: list[str | None]) -> None:
    """Not an error of ZeroMQ's escaping into the engine's step: a typed one, counted once,
    and backed off from like any refusal."""
    now = [0.0]
    link = DaemonLink(DaemonSettings("tcp://no-host:no-port", "acme"), clock=lambda: now[0],
                      map_arena=False)
    assert link.client() is None and link.namespace("pages", identity) is None
    with pytest.raises(MalformedError, match="cannot connect to the endpoint"):
        link.connect()
    assert len(handshakes) == 1 and link.failures == 1 and not link.available()
    link.close()


@pytest.mark.parametrize("refusal", [CapacityError("no room for a session", cause="quota"),
                                     NotFoundError("no tenant acme")],
                         ids=lambda e: type(e).__name__)
def test_a_refusal_raised_again_keeps_its_type_fields_and_origin(
        monkeypatch: pytest.MonkeyPatch, refusal: KVStoreError) -> None:
    """During the back-off ``connect`` raises the refusal again: the same type with the
    same fields (a CapacityError's cause), the back-off said after its message (a
    NotFoundError's unquoted), and chained to the refusal itself."""
    class Refusing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise refusal

    monkeypatch.setattr(daemon_link, "Client", Refusing)
    link = DaemonLink(DaemonSettings("tcp://127.0.0.1:1", "acme"), clock=lambda: 0.0,
                      map_arena=False)
    with pytest.raises(type(refusal)):
        link.connect()
    with pytest.raises(type(refusal)) as again:
        link.connect()
    assert again.value is not refusal and again.value.__cause__ is refusal
    assert vars(again.value) == vars(refusal)
    assert str(again.value) == (f"{refusal.args[0]} (refused 1 time(s) in a row; not tried "
                                "again for 1.0s unless the settings change)")
    link.close()


def test_a_background_connect_that_ends_after_the_link_closed_closes_its_client(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """``close`` waits for a connect thread only so long: a thread that ends later (here
    its namespace's identity comes late) closes the client it made (its context, I/O
    thread and session), which nobody takes any more."""
    made: list[Client] = []

    class Kept(Client):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(daemon_link, "Client", Kept)
    late = threading.Event()

    def late_identity() -> Any:
        late.wait(60)
        return identity()

    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme", timeout=0.2), map_arena=False)
    link.connect_in_background({"pages": late_identity})
    assert link._connecting is not None
    thread = link._connecting[0]
    link.close()  # waits for the thread 1.2 s, in vain
    assert thread.is_alive() and link._client is None
    late.set()
    thread.join(60)
    assert not thread.is_alive() and len(made) == 1
    assert made[0]._sock is None  # closed by the thread
    assert link._client is None and not link.connecting()


def test_another_links_answer_ends_a_back_off_from_silence_once_a_back_off(
        daemon: DaemonProcess, handshakes: list[str | None]) -> None:
    """The worker's link backed off after the daemon failed to answer it (a hiccup);
    the scheduler's lookup, answered, offers blocks to load: the worker's link ends
    its back-off (after ``EARLY_END_S``), connects, and loads, rather than miss for the
    rest of the 10 s.  At most once a back-off's length; a refusal's back-off stands."""
    now = [100.0]
    link = DaemonLink(DaemonSettings(daemon.endpoint, "acme"), clock=lambda: now[0])
    assert link.namespace("k", identity) is not None and len(handshakes) == 1
    link.failed("acquire", UnavailableError("the daemon did not answer within 5.0s"))
    assert not link.available() and link.namespace("k", identity) is None
    link.answered_elsewhere()  # too soon after the failure: the back-off stands
    assert not link.available()
    now[0] += daemon_link.EARLY_END_S
    link.answered_elsewhere()
    assert link.available()
    assert link.namespace("k", identity) is not None and len(handshakes) == 2
    # failing again at once: no second early end within the back-off's length
    link.failed("acquire", UnavailableError("the daemon did not answer within 5.0s"))
    now[0] += daemon_link.EARLY_END_S
    link.answered_elsewhere()
    assert not link.available()
    now[0] += daemon_link.BACKOFF_S - daemon_link.EARLY_END_S
    assert link.available()  # (its own end)
    link.failed("acquire", UnavailableError("the daemon did not answer within 5.0s"))
    now[0] += daemon_link.EARLY_END_S
    link.answered_elsewhere()  # a back-off's length since the last early end
    assert link.available()
    link.close()


def test_a_namespace_the_daemon_cannot_hold_is_asked_for_once_a_client(
        daemon_factory: Callable[..., DaemonProcess], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A page larger than the daemon's slabs: each call for it was an open refused again
    and a warning (SGLang asks at every exists, get and set); now one error a client, the
    calls misses at once, and the other namespaces of the link unaffected."""
    d = daemon_factory()
    opens: list[Identity] = []
    opened = Client.namespace

    def counted(self: Client, ident: Identity) -> Namespace:
        opens.append(ident)
        return opened(self, ident)

    monkeypatch.setattr(Client, "namespace", counted)
    huge = make_identity(num_layers=64, num_kv_heads=64, head_dim=256, block_tokens=64)
    link = DaemonLink(DaemonSettings(endpoint=d.endpoint, tenant=huge.tenant, timeout=5.0))
    try:
        with caplog.at_level("WARNING", logger=daemon_link.__name__):
            assert [link.namespace("huge", lambda: huge) for _ in range(5)] == [None] * 5
        assert len(opens) == 1
        assert len([r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]) == 1
        assert "cannot hold" in caplog.text and "does not fit" in caplog.text
        assert link.available() and link.failures == 1
        ns = link.namespace("small", identity)
        assert ns is not None and ns.lookup([b"k" * 16]).blocks == 0
        link.close()  # a new client (a daemon restarted, maybe reconfigured) is asked again
        assert link.namespace("huge", lambda: huge) is None and len(opens) == 3
    finally:
        link.close()


def test_a_background_link_whose_daemon_restarted_connects_again_at_once(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory()
    link = DaemonLink(DaemonSettings(d.endpoint, "acme", timeout=5.0), map_arena=False)
    try:
        link.connect_in_background({"pages": identity})
        assert link.wait_connected(10)
        ns = link.namespace("pages", identity)
        assert ns is not None
        d.stop(signal.SIGKILL)  # a crash, and a new daemon on the endpoint
        (d.workdir / "kvstore.sock").unlink(missing_ok=True)
        d.start()
        with pytest.raises(NoSessionError) as lost:
            ns.lookup([bytes(range(16))])
        link.failed("lookup", lost.value)
        # The connect starts now, not at the link's next call (which missed, and so did
        # the engine's next request while it was under way)
        assert link.wait_connected(10)
        again = link.namespace("pages", identity)
        assert again is not None and again.lookup([bytes(range(16))]).blocks == 0
    finally:
        link.close()


def test_a_background_connect_that_failed_long_ago_backs_off_from_then(
        tmp_path: Path) -> None:
    # A daemon not up when the engine started, and started later: the engine's next
    # request takes the outcome of a connect that failed while it was down.  Before, the
    # back-off ran from then, and the daemon up meanwhile was left alone 10 s more (in a
    # vLLM engine run, every request of those 10 s a miss).
    now = [0.0]
    late = DaemonProcess(tmp_path / "late")
    link = DaemonLink(DaemonSettings(late.endpoint, "acme", timeout=0.5), backoff_s=10.0,
                      clock=lambda: now[0], map_arena=False)
    try:
        link.connect_in_background({"pages": identity})
        assert not link.wait_connected(10) and not link.available()
        now[0] = 20.0  # past the back-off: the next call connects again, apart: down still
        assert link.client() is None
        for thread in threading.enumerate():
            if thread.name == "kvstore-connect":
                thread.join(10)
        late.start()
        now[0] = 50.0  # (the failed connect's outcome is taken at this call)
        assert link.client() is None and link.available()
        assert link.wait_connected(10) and link.namespace("pages", identity) is not None
    finally:
        link.close()
        late.stop()
