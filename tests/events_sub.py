"""A subscriber of the daemon's KV event stream for tests, and the index it rebuilds.

``Subscriber`` reads batches off the PUB socket, fills gaps (and the start it missed)
through the replay socket, and keeps every batch's raw payload; ``EventIndex`` applies
decoded events, knowing nothing of the daemon but the stream, and answers lookups the
way the daemon does (the leading keys cached in any tier, each with its fastest tier).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

END = -1

# (medium, locality) -> the daemon's tier name; fastest first
TIERS = {("GPU", None): "gpu", ("CPU", None): "dram", ("STORAGE", "LOCAL"): "ssd",
         ("STORAGE", "REMOTE"): "remote"}
ORDER = ["gpu", "dram", "ssd", "remote"]


class EventIndex:
    """Every block's tiers and parent, from events alone (plain dicts, as decoded)."""

    def __init__(self) -> None:
        self.tiers: dict[bytes, set[str]] = {}
        self.parents: dict[bytes, bytes | None] = {}
        self.tokens: dict[bytes, list[int]] = {}

    def apply(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            kind = e["type"]
            if kind == "AllBlocksCleared":
                self.tiers.clear()
                self.parents.clear()
                continue
            tier = TIERS[(e["medium"], e.get("locality"))]
            if kind == "BlockStored":
                parent = e["parent_block_hash"]
                size = e["block_size"]
                tokens = e["token_ids"]
                for i, key in enumerate(e["block_hashes"]):
                    self.tiers.setdefault(key, set()).add(tier)
                    self.parents[key] = parent
                    if tokens:
                        self.tokens[key] = tokens[i * size:(i + 1) * size]
                    parent = key
            else:
                assert kind == "BlockRemoved", kind
                for key in e["block_hashes"]:
                    held = self.tiers.get(key)
                    assert held is not None and tier in held, (
                        f"removed from {tier} without being stored there")
                    held.discard(tier)
                    if not held:
                        del self.tiers[key]

    def lookup(self, keys: list[bytes]) -> list[str]:
        out = []
        for key in keys:
            held = self.tiers.get(key)
            if not held or held == {"remote"}:
                break
            out.append(next(t for t in ORDER if t in held))
        return out

    def entries(self) -> set[tuple[bytes, bytes | None, str]]:
        return {(k, self.parents[k], t) for k, ts in self.tiers.items() for t in ts}


def as_dicts(event: Any) -> dict[str, Any]:
    """An event decoded with no schema: maps as they are, arrays by vLLM's field order."""
    if isinstance(event, dict):
        return event
    kind, *values = event
    names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size",
                             "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                             "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                             "locality"],
             "BlockRemoved": ["block_hashes", "medium", "group_idx", "locality"],
             "AllBlocksCleared": []}[kind]
    out = dict(zip(names, values))
    out["type"] = kind
    return out


class Subscriber:
    """A SUB socket on the stream and a DEALER on its replay socket."""

    def __init__(self, endpoint: str, replay: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.topic = topic
        self.sub = self._connect()
        self.next_seq = 0           # the batch expected next
        self.payloads: list[tuple[int, bytes]] = []  # every batch applied, in order
        self.index = EventIndex()
        self.topics: set[bytes] = set()
        self.gaps = 0
        self.generation = 0         # daemon restarts seen (sequence numbers start over)

    def restart(self) -> None:
        """The daemon stopped and starts again: its numbers start at 0 again, and what
        its last life sent on the way out (its batch's all-cleared makes that moot) must
        not pass for the new one's: a new socket."""
        self.sub.close(linger=0)
        self.sub = self._connect()
        self.next_seq = 0
        self.generation += 1
        self.payloads.append((-1, b""))  # a marker: what follows is a new daemon's stream

    def _connect(self) -> zmq.Socket[bytes]:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        return sub

    def replay(self, first: int, timeout: float = 10.0) -> list[tuple[int, bytes]]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            out = []
            while True:
                if not sock.poll(int(timeout * 1000)):
                    raise TimeoutError("the replay socket did not answer")
                _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END:
                    assert payload == b""
                    return out
                out.append((seq, payload))
        finally:
            sock.close(linger=0)

    def _take(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # had it from a replay
        if seq > self.next_seq:
            self.gaps += 1
            for s, pl in self.replay(self.next_seq):
                if self.next_seq <= s < seq:
                    self._apply(s, pl)
            assert self.next_seq == seq, f"replay left a gap before {seq}"
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        ts, events = batch[0], batch[1]
        assert isinstance(ts, float) and ts > 0
        self.index.apply([as_dicts(e) for e in events])
        self.payloads.append((seq, payload))
        self.next_seq = seq + 1

    def until(self, seq: int, timeout: float = 10.0) -> None:
        """Read (and replay) until batch ``seq`` is applied."""
        if self.next_seq > seq:
            return
        deadline = time.monotonic() + timeout
        while self.next_seq <= seq:
            left = deadline - time.monotonic()
            if left <= 0:
                # nothing live came (a subscription made after the batch went): replay
                for s, pl in self.replay(self.next_seq):
                    self._take(s, pl)
                assert self.next_seq > seq, f"batch {seq} never came"
                return
            if self.sub.poll(int(min(left, 0.2) * 1000)):
                topic, seq_bytes, payload = self.sub.recv_multipart()
                self.topics.add(topic)
                self._take(int.from_bytes(seq_bytes, "big"), payload)
            else:
                for s, pl in self.replay(self.next_seq):
                    self._take(s, pl)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


class Mix:
    """A random mix of stores (put, reserve and commit), reads (promotions), evictions
    and restarts (SIGTERM or SIGKILL) against a daemon with events on, with a subscriber
    following; ``check`` compares the subscriber's index with the daemon."""

    def __init__(self, daemon: Any, sub: Subscriber, identity: Any, seed: int,
                 tenant: str) -> None:
        import random

        from kvstore import Client

        self.d = daemon
        self.sub = sub
        self.identity = identity
        self.bt = identity.block_tokens
        self.tenant = tenant
        self.rng = random.Random(seed)
        self.chains: list[list[bytes]] = []
        self.tokens: dict[bytes, list[int]] = {}
        self.restarts = 0
        self.client = Client(daemon.endpoint, tenant=tenant)
        self.ns = self.client.namespace(identity)

    def content(self, key: bytes) -> bytes:
        import hashlib

        size = self.identity.block_bytes
        seed = hashlib.blake2b(key, digest_size=32).digest()
        return (seed * (size // 32 + 1))[:size]

    def synced(self) -> Any:
        """The daemon's snapshot, with the subscriber caught up to it."""
        snap = self.client.snapshot()
        self.sub.until(snap.seq)
        return snap

    def check(self) -> Any:
        """The index from events equals the snapshot, and answers every chain's lookup
        as the daemon does (background writes to SSD may land between the two looks:
        look again then, a bounded number of times); the last snapshot."""
        for _ in range(20):
            snap = self.synced()
            if self.sub.next_seq != snap.seq + 1:
                continue  # a batch after the snapshot came in filling a gap: look again
            assert self.sub.index.entries() == set(snap.blocks)
            looked = [self.ns.lookup(keys).tiers for keys in self.chains]
            if self.synced().seq == snap.seq:  # nothing moved while looking
                assert [self.sub.index.lookup(keys) for keys in self.chains] == looked
                return snap
        raise AssertionError("the daemon never stood still long enough to compare")

    def step(self) -> str:
        rng, ns, bt = self.rng, self.ns, self.bt
        op = rng.random()
        if op < 0.55 or not self.chains:
            # a new chain, often sharing a prefix with an old one
            base: list[int] = []
            if self.chains and rng.random() < 0.5:
                old = rng.choice(self.chains)
                base = [t for k in old[:rng.randint(1, len(old))] for t in self.tokens[k]]
            ids = base + [rng.randrange(32000) for _ in range(bt * rng.randint(1, 6))]
            keys = ns.keys(ids)
            for i, k in enumerate(keys):
                self.tokens[k] = ids[i * bt:(i + 1) * bt]
            self.chains.append(keys)
            if rng.random() < 0.5:
                ns.put(keys, [self.content(k) for k in keys])
                return "put"
            have = ns.lookup(keys).blocks
            new = keys[have:]
            if new:
                with ns.reserve(new, keys[have - 1] if have else None) as r:
                    for buf, k in zip(r.buffers, new):
                        buf[:] = self.content(k)
                    r.commit()
            return "commit"
        if op < 0.75:
            keys = rng.choice(self.chains)  # read back: promotes what is only on SSD
            n = ns.lookup(keys).blocks
            if n:
                try:
                    ns.get(keys[:n])
                except Exception:  # noqa: BLE001 - evicted between lookup and get
                    pass
            return "get"
        if op < 0.9:
            keys = rng.choice(self.chains)
            ns.evict(keys[rng.randrange(len(keys)):])
            return "evict"
        self.restart(rng.choice([15, 9]))  # SIGTERM, SIGKILL
        return "restart"

    def restart(self, sig: int) -> None:
        from kvstore import Client

        self.synced()  # the old daemon's batches read before its numbers start over
        self.client.close()
        self.d.stop(sig)
        self.sub.restart()
        self.d.start()
        self.restarts += 1
        self.client = Client(self.d.endpoint, tenant=self.tenant)
        self.ns = self.client.namespace(self.identity)

    def close(self) -> None:
        self.client.close()
