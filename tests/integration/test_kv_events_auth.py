"""Who may read the KV event stream of a daemon that takes credentials.

The stream carries every tenant's keys and token ids: with credentials set (``[auth]``)
only ``events.readers`` (routers) read it and ask replays, by a token on tcp or a ticket
of the side socket on ipc; a tenant's own token, or none, gets nothing.  Real daemon
processes, real ZeroMQ sockets.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_proc import free_port
from kvtest import make_identity

from kvstore import Client
from kvstore.auth import issue_token, read_secret
from kvstore.client_wire import CurveKeys, event_socket
from kvstore.config import AuthConfig, Config, EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import decoder

IDENT = make_identity(tenant="acme")
TOPIC = b"kv@pod@model"


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, check=True, timeout=60).stdout


def secured_daemon(daemon_factory: Any, tmp_path: Path, pub: str,
                   replay: str) -> tuple[Any, bytes]:
    secret_file = tmp_path / "secret"
    cli("keygen", "--secret", str(secret_file))
    config = tmp_path / "events.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n'
                      f'[events]\nendpoint = "{pub}"\nreplay_endpoint = "{replay}"\n'
                      f'topic = "{TOPIC.decode()}"\nreaders = ["router"]\n')
    d = daemon_factory(extra=["--config", str(config)])
    return d, read_secret(secret_file)


def batches_heard(subs: dict[str, Any], client: Client, seconds: float = 3.0,
                  reader: str = "router") -> dict[str, int]:
    """Blocks put while every subscriber listens; how many batches each got: ``seconds``
    of puts, or longer if ``reader`` has not heard by then (its handshake may take that
    long on a loaded host), on until a second after it has (the others as long), 30 s
    at most."""
    heard = {name: 0 for name in subs}
    ns = client.namespace(IDENT)
    start = time.monotonic()
    deadline, last, first = start + seconds, start + 30, 0.0
    n = 0
    while (now := time.monotonic()) < deadline or (not heard[reader] and now < last):
        keys = ns.keys(range(n * 16, n * 16 + 16))
        ns.put(keys, [bytes([n % 251]) * ns.block_bytes])
        n += 1
        for name, sock in subs.items():
            while sock.poll(20):
                topic, seq, payload = sock.recv_multipart()
                assert topic == TOPIC and len(seq) == 8
                decoder().decode(payload)
                heard[name] += 1
        if heard[reader] and not first:
            first = time.monotonic()
            deadline = max(deadline, first + 1.0)
    return heard


def replay_answered(sock: Any, seconds: float = 3.0, answer: float = 1.5) -> bool:
    """Whether a replay from sequence 0 is answered (vLLM's request: an empty frame,
    then the first sequence number wanted): sent within ``seconds`` (the handshake),
    answered within ``answer`` more.  A peer that should be answered is given longer
    (a loaded host is slow to shake hands; the answer ends the wait)."""
    deadline = time.monotonic() + seconds
    while True:  # a refused handshake leaves no pipe to queue it on: never sent
        try:
            sock.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
            break
        except zmq.Again:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    return bool(sock.poll(int(answer * 1000)))


def test_only_readers_hear_the_stream_on_tcp(daemon_factory: Any, tmp_path: Path) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    d, secret = secured_daemon(daemon_factory, tmp_path, pub, replay)
    ctx = zmq.Context()
    try:
        subs = {
            "router": event_socket(ctx, zmq.SUB, pub, token=issue_token(secret, "router", 60)),
            "tenant": event_socket(ctx, zmq.SUB, pub, token=issue_token(secret, "acme", 60)),
            "forged": event_socket(ctx, zmq.SUB, pub, tenant="router", token="forged"),
            "nobody": event_socket(ctx, zmq.SUB, pub),
        }
        for sock in subs.values():
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        with Client(d.endpoint, token=issue_token(secret, "acme", 60)) as acme:
            heard = batches_heard(subs, acme)
        assert heard["router"] > 0, heard
        assert heard["tenant"] == heard["forged"] == heard["nobody"] == 0, heard
        router = event_socket(ctx, zmq.DEALER, replay, token=issue_token(secret, "router", 60))
        tenant = event_socket(ctx, zmq.DEALER, replay, token=issue_token(secret, "acme", 60))
        assert replay_answered(router, seconds=20.0, answer=10.0)
        assert not replay_answered(tenant)
    finally:
        ctx.destroy(linger=0)
    assert "Traceback" not in d.log()


def test_only_readers_hear_the_stream_on_ipc(daemon_factory: Any, tmp_path: Path) -> None:
    pub, replay = f"ipc://{tmp_path}/events.sock", f"ipc://{tmp_path}/replay.sock"
    d, secret = secured_daemon(daemon_factory, tmp_path, pub, replay)
    ctx = zmq.Context()
    try:
        # a ticket of the side socket beside the daemon's ipc endpoint, for the token
        subs = {name: event_socket(ctx, zmq.SUB, pub, daemon=d.endpoint,
                                   token=issue_token(secret, name, 60))
                for name in ("router", "acme")}
        subs["nobody"] = event_socket(ctx, zmq.SUB, pub)
        for sock in subs.values():
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        with Client(d.endpoint, token=issue_token(secret, "acme", 60)) as acme:
            heard = batches_heard(subs, acme)
        assert heard["router"] > 0, heard
        assert heard["acme"] == heard["nobody"] == 0, heard
        router = event_socket(ctx, zmq.DEALER, replay, daemon=d.endpoint,
                              token=issue_token(secret, "router", 60))
        assert replay_answered(router, seconds=20.0, answer=10.0)
    finally:
        ctx.destroy(linger=0)


def test_only_readers_keys_hear_the_stream_with_curve(daemon_factory: Any,
                                                       tmp_path: Path) -> None:
    keys_dir, clients_dir = tmp_path / "server", tmp_path / "clients"
    cli("keygen", str(keys_dir), "--name", "server")
    clients_dir.mkdir()
    for name in ("router", "acme"):
        cli("keygen", str(tmp_path / name), "--name", name)
        (clients_dir / f"{name}.key").write_bytes((tmp_path / name / f"{name}.key").read_bytes())
    cli("keygen", str(tmp_path / "stranger"), "--name", "stranger")
    pub = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "curve.toml"
    config.write_text(f'[auth]\ncurve_secret_key_file = "{keys_dir / "server.key_secret"}"\n'
                      f'curve_clients_dir = "{clients_dir}"\n'
                      f'[events]\nendpoint = "{pub}"\ntopic = "{TOPIC.decode()}"\n'
                      f'readers = ["router"]\n')
    d = daemon_factory(tcp=True, extra=["--config", str(config)])
    server_key = str(keys_dir / "server.key")

    def keys(name: str) -> CurveKeys:
        return CurveKeys.from_files(server_key, str(tmp_path / name / f"{name}.key_secret"))

    ctx = zmq.Context()
    try:
        subs = {name: event_socket(ctx, zmq.SUB, pub, curve=keys(name))
                for name in ("router", "acme", "stranger")}
        subs["nobody"] = event_socket(ctx, zmq.SUB, pub)
        for sock in subs.values():
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        assert d.tcp_endpoint is not None
        with Client(d.tcp_endpoint, curve=keys("acme"), tenant="acme") as acme:
            heard = batches_heard(subs, acme)
        assert heard["router"] > 0, heard
        assert heard["acme"] == heard["stranger"] == heard["nobody"] == 0, heard
    finally:
        ctx.destroy(linger=0)


def config_with(auth: AuthConfig, **events: Any) -> Config:
    return Config(auth=auth, events=EventsConfig(**events))


def test_credentials_without_readers_or_checkable_endpoints_are_refused(
        tmp_path: Path) -> None:
    tokens = AuthConfig(secret_file=str(tmp_path / "secret"))
    uids = AuthConfig(peer_tenants={"0": "acme"})
    with pytest.raises(ConfigError, match="events.readers: the event stream carries"):
        config_with(tokens, endpoint="tcp://127.0.0.1:5557").validate()
    with pytest.raises(ConfigError, match="auth.peer_tenants alone, bind it on ipc"):
        config_with(uids, endpoint="tcp://127.0.0.1:5557", readers=["router"]).validate()
    with pytest.raises(ConfigError, match="replay_endpoint: a tcp stream needs"):
        config_with(uids, endpoint=f"ipc://{tmp_path}/e.sock", readers=["router"],
                    replay_endpoint="tcp://127.0.0.1:5558").validate()
    # without credentials (a single-user host) the stream stays open, as it was
    config_with(AuthConfig(), endpoint="tcp://127.0.0.1:5557").validate()


def test_the_streams_ipc_socket_files_are_the_daemons_mode(daemon_factory: Any,
                                                          tmp_path: Path) -> None:
    """0600 as the daemon's own ipc socket (or its socket group's): a file left to the
    umask could be out of reach of a reader the daemon admits, or open to anyone."""
    import os
    import stat

    pub, replay = tmp_path / "events.sock", tmp_path / "replay.sock"
    d, _ = secured_daemon(daemon_factory, tmp_path, f"ipc://{pub}", f"ipc://{replay}")
    main = d.endpoint[len("ipc://"):]
    for path in (pub, replay):
        assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(main).st_mode) \
            == 0o600, path
