"""Synthetic serving traces with prefix-block ids, in the format of the shared traces.

    python benchmarks/workloads.py conversations [--requests N] [--seed S] > trace.jsonl

Each generator returns requests as ``(timestamp_ms, input_length, output_length,
hash_ids)``: one id per 512-token block, prefix-chained (two requests share an id at
position ``i`` only if they share every block up to ``i``), and ``input_length`` ends in
a partial block, so every id is a full block.  They exist to check that an eviction
policy tuned on one trace does not lose on workloads of another shape
(``benchmarks/replay.py --workload NAME``):

- ``conversations``: multi-turn chats.  Each starts with one of a few shared system
  prompts (Zipf-popular), half of them attach a document drawn from a Zipf-popular
  library, then a user message; a conversation continues (its whole history plus one
  more exchange) with decreasing probability, after a heavy-tailed think time
  (log-normal: median 20 s, one in ten over about 2.5 min), so sessions end, most
  after a turn or two and a few after many.
- ``agents``: tool-calling loops.  Every loop starts from one long shared prefix (a
  system prompt with tool definitions, 24 blocks) and a short task, then extends its
  own context by a tool result and a step every second or so (log-normal), for a
  Pareto-distributed number of steps (most loops short, a few very long).
- ``tenants``: single-shot requests of many tenants, each with its own system prompt
  (4 to 16 blocks, tenants Zipf-popular), a short user message and no history: the
  shared heads are worth keeping, the one-off tails are not.
- ``scan``: a hot set of short chains (Zipf-popular, a shared root) hit over and over,
  interleaved with long one-time requests (a batch job scanning documents), so a
  policy that lets a scan flush the hot set loses.
- ``documents``: question answering over Zipf-popular documents with no history: an
  independent-reference workload where frequency, not recency, is the signal.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import sys
from collections.abc import Callable, Hashable, Sequence

BLOCK_TOKENS = 512

Request = tuple[int, int, int, list[int]]  # timestamp ms, input tokens, output tokens, ids


class _Chains:
    """Interns block contents into prefix-chained ids: ``(parent id, content) -> id``."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}

    def extend(self, prefix: Sequence[int], contents: Sequence[Hashable]) -> list[int]:
        ids = list(prefix)
        parent = ids[-1] if ids else -1
        for content in contents:
            parent = self._ids.setdefault((parent, content), len(self._ids))
            ids.append(parent)
        return ids


class _Zipf:
    """Ranks 0..n-1 drawn with probability proportional to ``1 / (rank + 1) ** s``."""

    def __init__(self, n: int, s: float, rng: random.Random) -> None:
        self._cdf = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
        self._rng = rng

    def __call__(self) -> int:
        return bisect.bisect_left(self._cdf, self._rng.random() * self._cdf[-1])


def _request(rng: random.Random, now: float, ids: list[int]) -> Request:
    partial = rng.randint(1, BLOCK_TOKENS - 1)
    return (int(now), len(ids) * BLOCK_TOKENS + partial, rng.randint(16, 512), ids)


def conversations(requests: int = 4000, seed: int = 1, *, every_ms: float = 250,
                  think_ms: float = 20_000, think_sigma: float = 1.5, follow: float = 0.75,
                  prompt_skew: float = 1.2, document_skew: float = 0.9) -> list[Request]:
    """Multi-turn chats over shared system prompts and Zipf-popular documents.

    Parameters (the defaults are the workload's): a new chat every ``every_ms`` on
    average; think times log-normal with median ``think_ms`` and shape ``think_sigma``
    (the tail); a chat's next turn comes with probability ``follow / (1 + 0.15 * turn)``
    (session length); Zipf exponents of the prompts and the documents (skew).  Variants
    check that a policy tuned on one shape holds on its neighbours.
    """
    rng = random.Random(seed)
    chains = _Chains()
    prompts = [rng.randint(2, 8) for _ in range(8)]
    prompt_of = _Zipf(len(prompts), prompt_skew, rng)
    documents = [rng.randint(4, 40) for _ in range(3000)]
    document_of = _Zipf(len(documents), document_skew, rng)
    shape = (think_ms, think_sigma, follow)
    pending: list[tuple[float, int, list[int], int]] = []  # (due, seq, history, turn)
    seq = itertools.count()
    now = 0.0
    out: list[Request] = []
    while len(out) < requests:
        now += rng.expovariate(1 / every_ms)  # a new chat every 250 ms by default
        while pending and pending[0][0] <= now and len(out) < requests:
            due, _, history, turn = pending.pop(0)
            ids = chains.extend(history, [("turn", turn, j)
                                          for j in range(rng.randint(1, 3))])
            out.append(_request(rng, due, ids))
            _follow_up(rng, pending, seq, due, ids, turn + 1, *shape)
        if len(out) >= requests:
            break
        p = prompt_of()
        contents: list[Hashable] = [("prompt", p, j) for j in range(prompts[p])]
        if rng.random() < 0.5:
            d = document_of()
            contents += [("doc", d, j) for j in range(documents[d])]
        chat = next(seq)
        contents += [("chat", chat, j) for j in range(rng.randint(1, 3))]
        ids = chains.extend([], contents)
        out.append(_request(rng, now, ids))
        _follow_up(rng, pending, seq, now, ids, 1, *shape)
    return out


def _follow_up(
    rng: random.Random,
    pending: list[tuple[float, int, list[int], int]],
    seq: itertools.count[int],
    now: float,
    history: list[int],
    turn: int,
    think_ms: float = 20_000,
    think_sigma: float = 1.5,
    follow: float = 0.75,
) -> None:
    """Schedule the conversation's next turn, with a chance that falls as it goes on."""
    if rng.random() < follow / (1 + 0.15 * turn):
        due = now + rng.lognormvariate(math.log(think_ms), think_sigma)  # median 20 s
        bisect.insort(pending, (due, next(seq), history, turn))


def scan(requests: int = 4000, seed: int = 2, *, hot_chains: int = 1500,
         hot_skew: float = 0.8, hot_blocks: int = 12, scan_share: float = 0.03,
         scan_blocks: int = 40) -> list[Request]:
    """A Zipf-popular hot set under shared roots, interleaved with bursts of one-time scans.

    Parameters: ``hot_chains`` hot chains of 2 shared root blocks and 2 to
    ``hot_blocks`` of their own, Zipf exponent ``hot_skew``; a request every 100 ms on
    average, which with probability ``scan_share`` is a burst of 10 to 30 one-time
    documents of 10 to ``scan_blocks`` blocks each.
    """
    rng = random.Random(seed)
    chains = _Chains()
    hot = [chains.extend([], [*(("root", h % 8, j) for j in range(2)),
                              *(("hot", h, j) for j in range(rng.randint(2, hot_blocks)))])
           for h in range(hot_chains)]
    hot_of = _Zipf(len(hot), hot_skew, rng)
    out: list[Request] = []
    scans = itertools.count()
    now = 0.0
    while len(out) < requests:
        now += rng.expovariate(1 / 100)
        if rng.random() < scan_share:
            # A batch job: a burst of long one-time documents.
            for _ in range(rng.randint(10, 30)):
                s = next(scans)
                ids = chains.extend([], [("scan", s, j)
                                         for j in range(rng.randint(10, scan_blocks))])
                out.append(_request(rng, now, ids))
        else:
            out.append(_request(rng, now, hot[hot_of()]))
    return out[:requests]


def documents(requests: int = 4000, seed: int = 3, *, library: int = 5000,
              skew: float = 0.9, longest: int = 30) -> list[Request]:
    """Independent questions about Zipf-popular documents (no conversation history).

    Parameters: ``library`` documents of 2 to ``longest`` blocks, Zipf exponent
    ``skew``; a question (one block of its own) every 100 ms on average.
    """
    rng = random.Random(seed)
    chains = _Chains()
    sizes = [rng.randint(2, longest) for _ in range(library)]
    document_of = _Zipf(len(sizes), skew, rng)
    out: list[Request] = []
    now = 0.0
    for q in range(requests):
        now += rng.expovariate(1 / 100)
        d = document_of()
        contents: list[Hashable] = [("doc", d, j) for j in range(sizes[d])]
        contents.append(("question", q))
        out.append(_request(rng, now, chains.extend([], contents)))
    return out


def agents(requests: int = 4000, seed: int = 4, *, every_ms: float = 2_000,
           step_ms: float = 1_500, steps_shape: float = 1.2,
           prefix_blocks: int = 24) -> list[Request]:
    """Tool-calling loops over one long shared prefix, each step a short continuation.

    Parameters: a new loop every ``every_ms`` on average (exponential); a loop runs a
    Pareto (shape ``steps_shape``: smaller, longer loops) number of steps, at least one;
    a step follows the previous one after a log-normal delay (median ``step_ms``) and
    adds 1 or 2 blocks (a tool result, a thought); the shared prefix is
    ``prefix_blocks`` long.
    """
    rng = random.Random(seed)
    chains = _Chains()
    prefix = [("tools", j) for j in range(prefix_blocks)]
    pending: list[tuple[float, int, list[int], int]] = []  # (due, seq, context, steps left)
    seq = itertools.count()
    now = 0.0
    out: list[Request] = []
    while len(out) < requests:
        now += rng.expovariate(1 / every_ms)
        while pending and pending[0][0] <= now and len(out) < requests:
            due, _, context, left = heapq.heappop(pending)
            ids = chains.extend(context, [("step", due, j) for j in range(rng.randint(1, 2))])
            out.append(_request(rng, due, ids))
            if left > 1:
                later = due + rng.lognormvariate(math.log(step_ms), 0.8)
                heapq.heappush(pending, (later, next(seq), ids, left - 1))
        if len(out) >= requests:
            break
        loop = next(seq)
        ids = chains.extend([], [*prefix, *(("task", loop, j) for j in range(rng.randint(1, 3)))])
        out.append(_request(rng, now, ids))
        steps = int(rng.paretovariate(steps_shape))
        if steps > 1:
            later = now + rng.lognormvariate(math.log(step_ms), 0.8)
            heapq.heappush(pending, (later, next(seq), ids, steps - 1))
    return out


def tenants(requests: int = 4000, seed: int = 5, *, count: int = 400, skew: float = 1.0,
            longest: int = 16) -> list[Request]:
    """Single-shot requests over per-tenant system prompts (Zipf-popular tenants).

    Parameters: ``count`` tenants, prompt lengths uniform in 4..``longest`` blocks,
    Zipf exponent ``skew``; a request every 100 ms on average, with a 1 to 4 block user
    message of its own.
    """
    rng = random.Random(seed)
    chains = _Chains()
    prompts = [rng.randint(4, longest) for _ in range(count)]
    tenant_of = _Zipf(len(prompts), skew, rng)
    out: list[Request] = []
    now = 0.0
    for q in range(requests):
        now += rng.expovariate(1 / 100)
        t = tenant_of()
        contents: list[Hashable] = [("system", t, j) for j in range(prompts[t])]
        contents += [("user", q, j) for j in range(rng.randint(1, 4))]
        out.append(_request(rng, now, chains.extend([], contents)))
    return out


WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    "conversations": conversations,
    "agents": agents,
    "tenants": tenants,
    "scan": scan,
    "documents": documents,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    generate = WORKLOADS[args.workload]
    trace = generate(args.requests) if args.seed is None else generate(args.requests, args.seed)
    for timestamp, input_length, output_length, ids in trace:
        record = {"timestamp": timestamp, "input_length": input_length,
                  "output_length": output_length, "hash_ids": ids}
        sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
