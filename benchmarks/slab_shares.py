"""Two or more models of different block sizes sharing one DRAM tier: hit rates with
slabs handed between the sizes (``kvstore.slab_moves``), with slabs kept by the size
that took them first (the code before), and with one LRU over bytes (no slabs at all:
the limit a slab allocator approaches).

    python benchmarks/slab_shares.py                       # two synthetic models
    python benchmarks/slab_shares.py --model chat=TRACE.jsonl:64 --model agent=agents:16:600000

Each ``--model NAME=SOURCE:BLOCK_KIB[:START_MS]`` is a stream of requests (a JSON-lines
trace in the shared traces' format, or a generator of ``benchmarks/workloads.py``) for
a model whose blocks are BLOCK_KIB each, starting START_MS into the run; the streams are
merged by timestamp.  Default: a chat model of 64 KiB blocks whose traffic stops two
thirds of the way through, and an agent model of 16 KiB blocks that arrives a third of
the way in, once the chat model has filled the tier.  Each request is replayed through
the store in-process (``BlockStore``: its slab pool, its eviction orders, its room
making) as the daemon serves it: the longest cached prefix is hit, the rest reserved
and committed; a request refused for room counts its blocks as refused.

Printed: per model and per third of the run, the block hit rate of each arm, the blocks
refused, and the slabs each model's size holds at the end of each third; the arms' CPU
per request.  ``--json`` for the figures; ``--plot FILE.png`` draws the hit rates per
model and third, one bar per arm (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads  # noqa: E402

from kvstore.bench.replay import cacheable, load_trace  # noqa: E402
from kvstore.errors import CapacityError  # noqa: E402
from kvstore.identity import Identity  # noqa: E402
from kvstore.keys import chain_keys  # noqa: E402
from kvstore.store import BlockStore, Namespace  # noqa: E402

GENERATORS = {"conversations": workloads.conversations, "agents": workloads.agents,
              "documents": workloads.documents, "tenants": workloads.tenants,
              "scan": workloads.scan}
ARMS = ("moves", "first-come", "bytes-lru")


@dataclass
class Model:
    name: str
    block_bytes: int
    requests: list[tuple[int, list[int]]]  # (timestamp ms, block ids)
    identity: Identity = field(init=False)

    def __post_init__(self) -> None:
        # a geometry whose blocks are ``block_bytes``: 2 layers of K and V, fp16, 16
        # tokens a block, the head size chosen to fit
        head_dim = self.block_bytes // (2 * 2 * 2 * 2 * 16)  # K and V, layers, heads, fp16
        self.identity = Identity(model=self.name, model_revision="r", tenant="bench",
                                 kv_dtype="float16", num_layers=2, num_kv_heads=2,
                                 head_dim=head_dim, block_tokens=16)
        assert self.identity.block_bytes == self.block_bytes, "block size not reachable"


def parse_model(text: str, requests: int) -> Model:
    """``NAME=SOURCE:BLOCK_KIB[:START_MS]``."""
    try:
        name, rest = text.split("=", 1)
        parts = rest.split(":")
        source, kib = parts[0], int(parts[1])
        start = int(parts[2]) if len(parts) > 2 else 0
    except (ValueError, IndexError):
        raise SystemExit(f"--model {text!r}: expected NAME=SOURCE:BLOCK_KIB[:START_MS]")
    if kib <= 0 or kib * 1024 % 256:
        raise SystemExit(f"--model {text!r}: BLOCK_KIB must be a positive number of KiB")
    if source in GENERATORS:
        reqs = [(t, ids) for t, _, _, ids in GENERATORS[source](requests)]
    else:
        path = Path(source)
        if not path.is_file():
            raise SystemExit(f"--model {text!r}: {source} is neither a workload "
                             f"({', '.join(GENERATORS)}) nor a file")
        trace = cacheable(load_trace(path))[:requests]
        reqs = [(r.timestamp, list(r.hash_ids)) for r in trace]
    if not reqs:
        raise SystemExit(f"--model {text!r}: no requests")
    t0 = reqs[0][0]
    return Model(name, kib * 1024, [(t - t0 + start, ids) for t, ids in reqs if ids])


def merged(models: Sequence[Model], until: dict[str, int]) -> list[tuple[int, int, list[int]]]:
    """Every model's requests by timestamp: (time, model index, ids)."""
    out = [(t, i, ids) for i, m in enumerate(models) for t, ids in m.requests
           if t <= until.get(m.name, 1 << 62)]
    out.sort(key=lambda r: (r[0], r[1]))
    return out


class StoreArm:
    """The store in-process; ``moves`` False: slabs stay with the size that took them."""

    def __init__(self, models: Sequence[Model], capacity: int, slab: int, policy: str,
                 moves: bool) -> None:
        self.store = BlockStore(capacity, slab, eviction_policy=policy)
        if not moves:
            self.store.room.slabs.make_way = lambda *a, **k: None  # type: ignore[method-assign]
        self.ns: list[Namespace] = [self.store.open_namespace(m.identity) for m in models]
        self.keys: list[dict[int, bytes]] = [{} for _ in models]

    def _keys(self, i: int, ids: list[int]) -> list[bytes]:
        known, ns = self.keys[i], self.ns[i]
        out: list[bytes] = []
        for h in ids:
            key = known.get(h)
            if key is None:
                key = known[h] = chain_keys(ns.id, list(range(h * 16, h * 16 + 16)), 16,
                                            parent=out[-1] if out else None)[0]
            out.append(key)
        return out

    def request(self, i: int, ids: list[int], now: float) -> tuple[int, int]:
        """(hits, refused) in blocks."""
        keys = self._keys(i, ids)
        ns, store = self.ns[i], self.store
        hits = len(store.lookup(ns, keys))
        if hits == len(keys):
            return hits, 0
        parent = keys[hits - 1] if hits else None
        try:
            r = store.reserve("bench", ns, keys[hits:], parent, now)
        except CapacityError:
            return hits, len(keys) - hits
        store.commit("bench", r.id, now)
        return hits, 0

    def slabs(self) -> list[int]:
        return [len(ns.cls.slabs) for ns in self.ns]


class BytesLru:
    """One LRU over every model's blocks by bytes, leaves first (no slabs)."""

    def __init__(self, models: Sequence[Model], capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.sizes = [m.block_bytes for m in models]
        self.order: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.kids: dict[tuple[int, int], int] = {}
        self.parent: dict[tuple[int, int], tuple[int, int] | None] = {}

    def request(self, i: int, ids: list[int], now: float) -> tuple[int, int]:
        keys = [(i, h) for h in ids]
        hits = 0
        while hits < len(keys) and keys[hits] in self.kids:
            hits += 1
        for k in reversed(keys[:hits]):  # deepest first: parents end up warmer
            self.order.move_to_end(k)
        size = self.sizes[i]
        want = len(keys) - hits
        protect = set(keys[:hits])
        while self.used + want * size > self.capacity and self._evict(protect):
            pass
        fit = min(want, (self.capacity - self.used) // size)
        if fit < want:
            return hits, want
        for j in range(hits, len(keys)):
            k, p = keys[j], keys[j - 1] if j else None
            self.kids[k], self.parent[k] = 0, p
            if p is not None:
                self.kids[p] += 1
        for k in reversed(keys[hits:]):
            self.order[k] = None
        self.used += want * size
        return hits, 0

    def _evict(self, protect: set[tuple[int, int]]) -> bool:
        for k in self.order:  # coldest first; leaves only
            if self.kids[k] == 0 and k not in protect:
                del self.order[k]
                del self.kids[k]
                p = self.parent.pop(k)
                if p is not None:
                    self.kids[p] -= 1
                self.used -= self.sizes[k[0]]
                return True
        return False

    def slabs(self) -> list[int]:
        return []


def run(models: Sequence[Model], share: float, slabs: int, policy: str,
        progress: bool) -> dict[str, object]:
    stream = merged(models, {})
    unique = sum(len({h for _, ids in m.requests for h in ids}) * m.block_bytes
                 for m in models)
    capacity = int(unique * share)
    slab = max(1 << 16, capacity // slabs // 4096 * 4096)
    capacity = slab * slabs
    thirds = [stream[len(stream) * k // 3][0] for k in (1, 2)] + [1 << 62]
    out: dict[str, object] = {"capacity_bytes": capacity, "slab_bytes": slab,
                              "requests": len(stream), "unique_bytes": unique, "arms": {}}
    for arm in ARMS:
        cache: StoreArm | BytesLru = (
            BytesLru(models, capacity) if arm == "bytes-lru"
            else StoreArm(models, capacity, slab, policy, moves=arm == "moves"))
        hits = [[0, 0, 0] for _ in models]   # per model: per third
        asked = [[0, 0, 0] for _ in models]
        refused = [[0, 0, 0] for _ in models]
        slabs_at: list[list[int]] = []
        third = 0
        started = time.process_time()
        for n, (t, i, ids) in enumerate(stream):
            while t > thirds[third]:
                slabs_at.append(cache.slabs())
                third += 1
            h, r = cache.request(i, ids, t / 1000)
            hits[i][third] += h
            asked[i][third] += len(ids)
            refused[i][third] += r
            if progress and n % 2000 == 0:
                print(f"\r{arm}: {n}/{len(stream)}", end="", file=sys.stderr)
        while len(slabs_at) < 3:
            slabs_at.append(cache.slabs())
        cpu = time.process_time() - started
        moves = (cache.store.counters.slab_moves if isinstance(cache, StoreArm) else 0)
        out["arms"][arm] = {  # type: ignore[index]
            "hit_rate": [[h / a if a else None for h, a in zip(hs, as_)]
                         for hs, as_ in zip(hits, asked)],
            "whole": [sum(hs) / max(1, sum(as_)) for hs, as_ in zip(hits, asked)],
            "refused": refused, "slabs": slabs_at, "slab_moves": moves,
            "us_per_request": cpu / max(1, len(stream)) * 1e6}
        if progress:
            print("\r", end="", file=sys.stderr)
    return out


def table(models: Sequence[Model], result: dict[str, object]) -> str:
    arms = result["arms"]  # type: ignore[index]
    lines = [f"tier {result['capacity_bytes'] / 2**20:.1f} MiB in slabs of "
             f"{result['slab_bytes'] / 2**20:.2f} MiB; {result['requests']} requests",
             "", f"{'model':<10} {'arm':<11} {'third 1':>8} {'third 2':>8} {'third 3':>8}"
             f" {'whole':>7} {'refused':>8}  slabs at the end of each third"]
    for i, m in enumerate(models):
        for arm in ARMS:
            a = arms[arm]  # type: ignore[index]
            rates = " ".join(f"{r:8.3f}" if r is not None else f"{'-':>8}"
                             for r in a["hit_rate"][i])
            slabs = " / ".join(str(s[i]) if s else "-" for s in a["slabs"])
            lines.append(f"{m.name:<10} {arm:<11} {rates} {a['whole'][i]:7.3f} "
                         f"{sum(a['refused'][i]):8d}  {slabs}")
        lines.append("")
    for arm in ARMS:
        a = arms[arm]  # type: ignore[index]
        lines.append(f"{arm:<11} {a['us_per_request']:7.1f} us of CPU a request, "
                     f"{a['slab_moves']} slab moves")
    return "\n".join(lines)


def plot(models: Sequence[Model], result: dict[str, object], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot: matplotlib is not installed (pip install 'kvstore[plot]')")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["arms"]  # type: ignore[index]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    width = 0.8 / len(ARMS)
    for i, (m, ax) in enumerate(zip(models, axes[0])):
        for j, arm in enumerate(ARMS):
            rates = [r or 0.0 for r in arms[arm]["hit_rate"][i]]  # type: ignore[index]
            ax.bar([k + j * width for k in range(3)], rates, width, label=arm)
        ax.set_xticks([k + width for k in range(3)], ["first third", "second", "last"])
        ax.set_title(f"{m.name} ({m.block_bytes // 1024} KiB blocks)")
        ax.set_ylabel("block hit rate")
        ax.set_ylim(0, 1)
    axes[0][0].legend(loc="upper left", fontsize="small")
    fig.suptitle("one DRAM tier shared by two block sizes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", metavar="NAME=SOURCE:KIB[:START_MS]",
                        help="a model's requests (repeat; default: chat and agent)")
    parser.add_argument("--requests", type=int, default=4000,
                        help="requests per model (default 4000)")
    parser.add_argument("--capacity", type=float, default=0.10,
                        help="the DRAM tier as a share of every model's unique bytes")
    parser.add_argument("--slabs", type=int, default=32, help="slabs in the tier")
    parser.add_argument("--policy", default="lru", help="the DRAM eviction policy")
    parser.add_argument("--json", action="store_true", help="the figures as JSON")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="a PNG of the hit rates")
    args = parser.parse_args(argv)
    if not 0 < args.capacity <= 1 or args.slabs < 2 or args.requests < 1:
        parser.error("--capacity in (0, 1], --slabs at least 2, --requests at least 1")
    specs = args.model or ["chat=conversations:64", "agent=agents:16"]
    models = [parse_model(s, args.requests) for s in specs]
    if not args.model:  # the agent arrives a third in; the chat stops two thirds in
        span = max(t for t, _ in models[0].requests)
        models[1].requests = [(t + span // 3, ids) for t, ids in models[1].requests]
        models[0].requests = [(t, ids) for t, ids in models[0].requests if t <= 2 * span // 3]
    result = run(models, args.capacity, args.slabs, args.policy, sys.stderr.isatty())
    print(json.dumps(result, indent=1) if args.json else table(models, result))
    if args.plot:
        plot(models, result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
