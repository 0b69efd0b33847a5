"""A hostile tenant against a daemon with credentials (a token secret, a tcp endpoint)
and an SSD tier: what it does to the daemon's stop leaves other tenants' blocks where
their shares keep them.  Real daemon processes, raw ZeroMQ sockets."""

from __future__ import annotations

from pathlib import Path

from daemon_proc import DaemonProcess
from kvtest import make_identity
from test_attacks_s53 import ask_frames, connect
from test_tenant_isolation import cli

from kvstore import protocol as p
from kvstore.auth import read_secret


def keys_from(base: int, count: int) -> list[bytes]:
    return [(base + i).to_bytes(16, "big") for i in range(count)]


def put(d: DaemonProcess, secret: bytes, tenant: str, keys: list[bytes]) -> None:
    raw, _ = connect(d, secret, tenant)
    try:
        opened = raw.ask(p.OpenNamespace(2, make_identity(tenant=tenant)))
        assert isinstance(opened, p.NamespaceReply), opened
        put = ask_frames(raw, p.Put(3, opened.ns, keys),
                         *[b"\1" * opened.block_bytes] * len(keys))
        assert isinstance(put, p.PutReply) and put.created == len(keys), put
    finally:
        raw.close()


def found(d: DaemonProcess, secret: bytes, tenant: str,
          keys: list[bytes]) -> p.LookupReply:
    raw, _ = connect(d, secret, tenant)
    try:
        opened = raw.ask(p.OpenNamespace(2, make_identity(tenant=tenant)))
        assert isinstance(opened, p.NamespaceReply), opened
        looked = raw.ask(p.Lookup(3, opened.ns, keys))
        assert isinstance(looked, p.LookupReply), looked
        return looked
    finally:
        raw.close()


def test_a_tenant_full_of_dram_on_the_way_out_keeps_to_its_share_of_ssd(
        tmp_path: Path) -> None:
    """Under write-back the stop writes what only DRAM holds to the SSD tier, in place
    of its coldest leaves where it is full: any tenant's.  A tenant that filled its
    arena before a stop pushed every other tenant's copies off the tier (here 16 of a
    512-slot tier, far within a half share: all lost on restart), where its demotions
    while serving take its own copies first.  Now the flush trades only its own
    tenant's copies, or those of a tenant over its weighted share."""
    secret_file = tmp_path / "secret"
    cli("keygen", "--secret", str(secret_file))
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n'
                      '[ssd]\ndirect_io = false\nslab_size = "1MiB"\n')
    secret = read_secret(secret_file)

    def daemon() -> DaemonProcess:
        return DaemonProcess(tmp_path / "d", tcp=True, dram_capacity="8MiB",
                             ssd_capacity="4MiB",
                             extra=["--config", str(config), "--slab-size", "1MiB"]).start()

    quiet, loud = keys_from(1000, 16), keys_from(5000, 900)  # 8 KiB blocks: 512 fit
    d = daemon()
    try:
        put(d, secret, "globex", quiet)
        assert d.stop() == 0  # (its blocks written to the ssd tier on the way out)
        d = daemon()
        assert found(d, secret, "globex", quiet).tier_runs == [("ssd", 16)]
        put(d, secret, "acme", loud)  # its arena nearly full, the ssd tier's room less
        assert d.stop() == 0
        d = daemon()
        assert found(d, secret, "globex", quiet).tier_runs == [("ssd", 16)]
        kept = found(d, secret, "acme", loud)
        assert 0 < kept.blocks <= 512 - 16, kept  # what room there was
    finally:
        d.stop()
    assert "invariant violated" not in d.log(), d.log()
