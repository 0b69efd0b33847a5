"""A hostile tenant against the router-facing verbs of a running daemon (session 65):
paged snapshots, and what they hold.  Real daemon processes, raw ZeroMQ where a client
library would not send what is sent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq
from test_attacks_s63 import Peer, fill
from test_attacks_s63b import anon_mib

from kvstore import protocol as p
from kvstore.routing import SNAPSHOTS_A_TENANT


def first_page(peer: Peer, rid: int) -> int:
    """Begin a paged snapshot with a page of 3 entries (its namespace, its key map's
    shard, copied, and a block): its cursor."""
    page = peer.ask(p.Snapshot(rid, 0, 3))
    assert isinstance(page, p.SnapshotReply) and page.cursor, page
    return page.cursor


def test_paged_snapshots_never_finished_are_bounded_per_tenant(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A paged snapshot under way holds a copy of the shard of the key map it goes
    through (4096 entries of a namespace of 4096 blocks), and a session may keep 4 of
    them: 500 sessions of one tenant beginning 4 each with a page of 3 entries, never
    finished, grew the daemon by 63 MiB (a tenant may hold 4096 sessions: 0.5 GiB).  A
    tenant now keeps at most ``SNAPSHOTS_A_TENANT`` over all its sessions, the oldest
    ended (asked for again: not found, begin again), and another tenant's walk begun
    before the flood pages on to its end."""
    d = daemon_factory(dram_capacity="256MiB", debug_invariants=False)
    fill(d.endpoint, "acme", 4096)
    fill(d.endpoint, "globex", 100)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        honest = Peer(ctx, d.endpoint, "globex")
        honest_cursor = first_page(honest, 2)
        flooders = [Peer(ctx, d.endpoint, "acme") for _ in range(500)]
        time.sleep(0.3)
        before = anon_mib(d.proc.pid)
        cursors = []
        for peer in flooders:
            for rid in range(4):
                peer.send(p.Snapshot(10 + rid, 0, 3))
        for peer in flooders:
            pages = peer.replies(4, 60)
            assert len(pages) == 4 and all(isinstance(r, p.SnapshotReply) and r.cursor
                                           for r in pages), pages
            cursors.append(pages[-1].cursor)
        grown = anon_mib(d.proc.pid) - before
        assert grown < 16, (f"2000 paged snapshots of one tenant under way: the daemon "
                            f"grew by {grown:.0f} MiB")
        ended = flooders[0].ask(p.Snapshot(50, cursors[0], 3))
        assert isinstance(ended, p.ErrorReply) and ended.code == "not_found", ended
        assert "of its tenant" in ended.message, ended.message
        newest = flooders[-1].ask(p.Snapshot(51, first_page(flooders[-1], 60), 3))
        assert isinstance(newest, p.SnapshotReply), newest  # a new one always begins
        listed, cursor = 0, honest_cursor
        while cursor:
            page = honest.ask(p.Snapshot(52, cursor, 4096))
            assert isinstance(page, p.SnapshotReply), page
            cursor, listed = page.cursor, listed + len(page.blocks)
        assert listed >= 99  # (the first page's entries aside)
        assert SNAPSHOTS_A_TENANT < 2000
    finally:
        ctx.destroy(linger=0)
    assert d.alive()


def test_an_ipc_endpoint_with_no_socket_file_is_refused_by_name(tmp_path: Path) -> None:
    """An abstract ipc socket (``ipc://@name``) has no file, so no mode keeps other local
    users from connecting: the event stream there (every tenant's keys and token ids)
    would be anyone's to read on a daemon without credentials.  Such an endpoint, and a
    wildcard one, stopped the daemon at start with a traceback (``chmod`` of no such
    file); both are now refused by name, for the stream and the daemon's own socket."""
    import os
    import subprocess
    import sys

    sock = f"ipc://{tmp_path / 'k.sock'}"
    for env, setting in ((({"KVSTORE_EVENTS_ENDPOINT": "ipc://@kv-events-s65"}),
                          "events.endpoint"),
                         ({"KVSTORE_EVENTS_ENDPOINT": "ipc://*"}, "events.endpoint"),
                         ({"KVSTORE_ENDPOINT": "ipc://@kv-s65"}, "server.endpoint")):
        args = [sys.executable, "-m", "kvstore", "serve", "--dram-capacity", "16MiB",
                "--ssd-capacity", "0", "--ssd-path", str(tmp_path / "ssd")]
        if "KVSTORE_ENDPOINT" not in env:
            args += ["--endpoint", sock]
        done = subprocess.run(args, env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert done.returncode != 0, done
        assert "Traceback" not in done.stderr, done.stderr
        assert f"{setting}: " in done.stderr and "names no socket file" in done.stderr, (
            done.stderr)


def test_an_event_stream_open_to_other_hosts_without_credentials_is_warned_of(
        daemon_factory: Any) -> None:
    """The stream carries every tenant's keys and token ids (the prompts' tokens); on a
    daemon without credentials it has no gate of its own.  The daemon warned of its own
    tcp endpoints and of a metrics port open to other hosts, and said nothing of a stream
    bound on every address (as ``tcp://*:5557``): it now names it, and what to do.  A
    stream bound on a loopback address is not warned of."""
    from daemon_proc import free_port

    warning = "the KV event stream takes no credentials"
    open_to_all = daemon_factory(env={
        "KVSTORE_EVENTS_ENDPOINT": f"tcp://*:{free_port()}",
        "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://0.0.0.0:{free_port()}"})
    log = open_to_all.log()
    assert log.count(warning) == 2 and "events.readers" in log, log
    local = daemon_factory(env={
        "KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"})
    assert warning not in local.log(), local.log()


def test_a_snapshots_number_tells_a_tenant_not_reading_the_stream_nothing(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A snapshot is stamped with the number of the last batch of the event stream,
    which moves with every tenant's stores and evictions: a tenant polling snapshots of
    its own (empty) namespaces saw it move each time another tenant stored blocks, a
    daemon-wide figure that credentials otherwise keep from it (as the probe's queue).
    With credentials a tenant that may not read the stream (not in ``events.readers``)
    gets -1, which it could not use anyway; a reader gets the number, as before."""
    import subprocess
    import sys

    from daemon_proc import free_port
    from kvtest import make_identity

    from kvstore import Client
    from kvstore.auth import issue_token, read_secret

    secret_file = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "kvstore", "keygen", "--secret", str(secret_file)],
                   check=True, capture_output=True, timeout=60)
    config = tmp_path / "events.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n'
                      f'[events]\nendpoint = "tcp://127.0.0.1:{free_port()}"\n'
                      f'readers = ["router"]\n')
    d = daemon_factory(extra=["--config", str(config)])
    secret = read_secret(secret_file)
    with Client(d.endpoint, token=issue_token(secret, "alice", 600)) as alice, \
            Client(d.endpoint, token=issue_token(secret, "mallory", 600)) as mallory, \
            Client(d.endpoint, token=issue_token(secret, "router", 600)) as router:
        ns = alice.namespace(make_identity(tenant="alice"))
        seen, heard = [], []
        for i in range(3):
            keys = ns.keys(range(i * 1000, i * 1000 + 4 * ns.identity.block_tokens))
            ns.put(keys, [b"a" * ns.block_bytes] * 4)
            seen.append(mallory.snapshot().seq)
            heard.append(router.snapshot().seq)
        assert seen == [-1, -1, -1], seen
        assert heard == sorted(set(heard)) and heard[0] >= 0, heard
