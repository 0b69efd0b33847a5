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

The next five are shapes that public serving traces show and the five above lack
(``benchmarks/policy_sweep.py`` sweeps them as it does the others):

- ``bursty_chat``: chat as public conversation traces show it.  Arrivals come in bursts
  (a calm and a busy state, as the Azure LLM inference traces' arrivals are burstier than
  Poisson); a conversation's turn count is heavy-tailed (most one or two, a few dozens,
  as in ShareGPT and LMSYS-Chat); each turn resends the whole history *in tokens*: the
  user's message and the model's answer (log-normal lengths, a few pasted documents)
  are appended, so a turn adds no full block, or one, or many.
- ``coding_agents``: agentic coding sessions.  A session reads a large repository
  context (tools and instructions, then a Zipf-popular repository's files: tens of
  thousands of tokens) and works on its task in steps (a tool call's output appended
  each); now and then it samples several short branches from one point (retries,
  best-of-n) and goes on from one of them.  Repositories change now and then: a new
  version keeps the repository's head and rewrites its last files.
- ``rag_drift``: retrieval-augmented QA whose document popularity drifts: a few
  application prompts, then one or two retrieved documents (Zipf over a ranking that new
  trending documents enter near the top of, pushing the others down) and a question.
- ``tenant_mix``: three tenants of different reuse sharing the cache: a chat tenant
  (conversations, recency), a batch tenant (long one-time documents behind one shared
  instruction, in jobs) and an API tenant (few-shot templates, Zipf: frequency).
- ``diurnal``: a day's shift from one popular set of prefixes to another (two regions'
  or products' prompt sets; the share of the second follows a sinusoid over the trace),
  each request a prompt of its set's Zipf and a short message of its own.
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


def _context_request(rng: random.Random, now: float, ids: list[int],
                     partial: int) -> Request:
    """A request of ``ids`` full blocks and ``partial`` (1..511) tokens more."""
    return (int(now), len(ids) * BLOCK_TOKENS + max(1, partial), rng.randint(16, 512), ids)


def _tokens(rng: random.Random, median: float, sigma: float, most: int) -> int:
    """A log-normal count of tokens, at least 1 and at most ``most``."""
    return max(1, min(most, int(rng.lognormvariate(math.log(median), sigma))))


class _Bursts:
    """Arrival times of a two-state Markov-modulated Poisson process: a calm state and a
    busy one ``factor`` times as fast, each lasting an exponential time (means
    ``calm_ms`` and ``busy_ms``), with ``every_ms`` the mean gap over both."""

    def __init__(self, rng: random.Random, every_ms: float, factor: float,
                 calm_ms: float, busy_ms: float) -> None:
        # rate_calm * (calm + factor * busy) / (calm + busy) = 1 / every_ms
        self._calm_gap = every_ms * (calm_ms + factor * busy_ms) / (calm_ms + busy_ms)
        self._rng, self._factor = rng, factor
        self._means = (calm_ms, busy_ms)
        self._busy = False
        self._now = 0.0
        self._switch = rng.expovariate(1 / calm_ms)

    def __call__(self) -> float:
        while True:
            gap = self._calm_gap / (self._factor if self._busy else 1.0)
            step = self._rng.expovariate(1 / gap)
            if self._now + step < self._switch:
                self._now += step
                return self._now
            # memoryless: the state changes first, the next arrival drawn afresh
            self._now = self._switch
            self._busy = not self._busy
            self._switch += self._rng.expovariate(1 / self._means[self._busy])


def bursty_chat(requests: int = 4000, seed: int = 6, *, every_ms: float = 400,
                burst: float = 6.0, turns_median: float = 2.5, turns_sigma: float = 1.0,
                user_tokens: float = 200, answer_tokens: float = 300,
                think_ms: float = 30_000) -> list[Request]:
    """Multi-turn chats with bursty arrivals and token-level growth of the history.

    Parameters: new chats arrive every ``every_ms`` on average, in a calm state and a
    busy one ``burst`` times as fast (about 40 s calm, 10 s busy); a chat's turn count is
    log-normal (median ``turns_median``, shape ``turns_sigma``, at most 64); each turn
    appends a user message (log-normal, median ``user_tokens``, shape 1.5: some pasted
    documents, at most 16k) and, once answered, the answer (median ``answer_tokens``,
    shape 0.8, at most 4k) to the history the next turn resends, after a log-normal
    think time (median ``think_ms``, shape 1.2).  A chat opens with one of 6 system
    prompts of 1 to 6 blocks (Zipf 1.1).  A block's id is its conversation and place, so
    a turn adds as many new full blocks as its tokens complete.
    """
    rng = random.Random(seed)
    chains = _Chains()
    prompts = [rng.randint(1, 6) for _ in range(6)]
    prompt_of = _Zipf(len(prompts), 1.1, rng)
    arrive = _Bursts(rng, every_ms, burst, 40_000, 10_000)
    # (due, seq, chat, prompt, tokens so far, turns left)
    pending: list[tuple[float, int, int, int, int, int]] = []
    seq = itertools.count()
    out: list[Request] = []

    def turn(now: float, chat: int, prompt: int, tokens: int, left: int) -> None:
        tokens += _tokens(rng, user_tokens, 1.5, 16_384)
        head = [("prompt", prompt, j) for j in range(prompts[prompt])]
        ids = chains.extend([], [*head, *(("chat", chat, j)
                                          for j in range(tokens // BLOCK_TOKENS))])
        out.append(_context_request(rng, now, ids, tokens % BLOCK_TOKENS))
        if left > 1:
            tokens += _tokens(rng, answer_tokens, 0.8, 4096)
            due = now + rng.lognormvariate(math.log(think_ms), 1.2)
            heapq.heappush(pending, (due, next(seq), chat, prompt, tokens, left - 1))

    while len(out) < requests:
        now = arrive()
        while pending and pending[0][0] <= now and len(out) < requests:
            due, _, chat, prompt, tokens, left = heapq.heappop(pending)
            turn(due, chat, prompt, tokens, left)
        if len(out) >= requests:
            break
        turns = min(64, max(1, round(rng.lognormvariate(math.log(turns_median),
                                                        turns_sigma))))
        turn(now, next(seq), prompt_of(), 0, turns)
    return out


def coding_agents(requests: int = 4000, seed: int = 7, *, every_ms: float = 6_000,
                  repositories: int = 12, repo_skew: float = 1.0, repo_blocks: int = 64,
                  steps_median: float = 20, branch: float = 0.15, fan_out: int = 4,
                  step_ms: float = 4_000, churn: float = 0.1) -> list[Request]:
    """Agentic coding sessions over large shared repository contexts, with branches.

    Parameters: a session every ``every_ms`` on average (exponential) on one of
    ``repositories`` (Zipf ``repo_skew``) whose context is 8 blocks of tools and
    instructions then 24 to ``repo_blocks`` blocks of files; a session runs a log-normal
    number of steps (median ``steps_median``, shape 0.8, at most 200), one every
    ``step_ms`` (log-normal median, shape 0.7), each appending a tool's output and the
    next action (log-normal, median 600 tokens, shape 1.0, at most 8k); at a step, with
    probability ``branch``, 2 to ``fan_out`` branches of 1 to 3 steps each are sampled
    from the same context at once (retries, best-of-n: requests that share all but their
    tails) and the session goes on from one of them.  A session starting on a
    repository makes a new version of it with probability ``churn`` (its last 1 to 16
    blocks of files rewritten; later sessions read the new version).
    """
    rng = random.Random(seed)
    chains = _Chains()
    tools = [("tools", j) for j in range(8)]
    sizes = [rng.randint(24, max(24, repo_blocks)) for _ in range(repositories)]
    versions = [0] * repositories
    kept = list(sizes)  # per repository, its blocks the latest version shares with the first
    repo_of = _Zipf(repositories, repo_skew, rng)
    # (due, seq, context ids, partial tokens, steps left)
    pending: list[tuple[float, int, list[int], int, int]] = []
    seq = itertools.count()
    now = 0.0
    out: list[Request] = []

    def step(at: float, context: list[int], partial: int) -> tuple[list[int], int]:
        tokens = partial + _tokens(rng, 600, 1.0, 8192)
        ids = chains.extend(context, [("step", next(seq), j)
                                      for j in range(tokens // BLOCK_TOKENS)])
        out.append(_context_request(rng, at, ids, tokens % BLOCK_TOKENS))
        return ids, tokens % BLOCK_TOKENS

    while len(out) < requests:
        now += rng.expovariate(1 / every_ms)
        while pending and pending[0][0] <= now and len(out) < requests:
            due, _, context, partial, left = heapq.heappop(pending)
            if rng.random() < branch:
                ends = []
                for _ in range(rng.randint(2, fan_out)):
                    ids, part = context, partial
                    for _ in range(rng.randint(1, 3)):
                        ids, part = step(due, ids, part)
                    ends.append((ids, part))
                context, partial = rng.choice(ends)
            else:
                context, partial = step(due, context, partial)
            if left > 1:
                later = due + rng.lognormvariate(math.log(step_ms), 0.7)
                heapq.heappush(pending, (later, next(seq), context, partial, left - 1))
        if len(out) >= requests:
            break
        r = repo_of()
        if rng.random() < churn:
            versions[r] += 1
            kept[r] = max(1, sizes[r] - rng.randint(1, 16))
        files = [("repo", r, 0, j) for j in range(kept[r])]
        files += [("repo", r, versions[r], j) for j in range(kept[r], sizes[r])]
        task = _tokens(rng, 400, 0.8, 4096)
        context = chains.extend([], [*tools, *files, *(("task", next(seq), j)
                                                      for j in range(task // BLOCK_TOKENS))])
        out.append(_context_request(rng, now, context, task % BLOCK_TOKENS))
        steps = min(200, max(1, round(rng.lognormvariate(math.log(steps_median), 0.8))))
        if steps > 1:
            later = now + rng.lognormvariate(math.log(step_ms), 0.7)
            heapq.heappush(pending, (later, next(seq), context, task % BLOCK_TOKENS,
                                     steps - 1))
    return out[:requests]


def rag_drift(requests: int = 4000, seed: int = 8, *, corpus: int = 4000,
              skew: float = 1.0, trending: float = 0.02, hot_rank: int = 20,
              longest: int = 12, second: float = 0.5) -> list[Request]:
    """Retrieval-augmented questions over documents whose popularity drifts.

    Parameters: a request every 100 ms on average opens with one of 3 application
    prompts (2 to 4 blocks, Zipf 1.2), then the retrieved document drawn by rank, Zipf
    ``skew`` over a ranking of ``corpus`` documents (1 to ``longest`` blocks), and with
    probability ``second`` a second one drawn alike, then a one-block question of its
    own.  Before each request, with probability ``trending``, a new document enters the
    ranking at a uniform rank among the first ``hot_rank``, pushing the rest down one
    (the last falls off): what was popular drifts down as news comes.
    """
    rng = random.Random(seed)
    chains = _Chains()
    apps = [rng.randint(2, 4) for _ in range(3)]
    app_of = _Zipf(len(apps), 1.2, rng)
    ranking = list(range(corpus))
    sizes = [rng.randint(1, longest) for _ in range(corpus)]
    rank_of = _Zipf(corpus, skew, rng)
    out: list[Request] = []
    now = 0.0
    for q in range(requests):
        now += rng.expovariate(1 / 100)
        if rng.random() < trending:
            sizes.append(rng.randint(1, longest))
            ranking.insert(rng.randrange(hot_rank), len(sizes) - 1)
            ranking.pop()
        a = app_of()
        contents: list[Hashable] = [("app", a, j) for j in range(apps[a])]
        for _ in range(1 + (rng.random() < second)):
            d = ranking[rank_of()]
            contents += [("doc", d, j) for j in range(sizes[d])]
        contents.append(("question", q))
        out.append(_request(rng, now, chains.extend([], contents)))
    return out


def tenant_mix(requests: int = 4000, seed: int = 9, *, chat_share: float = 0.4,
               batch_share: float = 0.3, templates: int = 40,
               template_skew: float = 1.1) -> list[Request]:
    """Three tenants of different reuse in one cache: chat, batch jobs and an API.

    Parameters: of the new work (its requests, counting a batch job's documents, one
    every 100 ms on average), a share ``chat_share`` opens conversations of the chat
    tenant (3 shared system blocks and 1 to 3 of its own; their later turns come on top:
    1 to 3 blocks more each, think time log-normal median 20 s, shape 1.3, a chance of
    going on that falls as in ``conversations``), ``batch_share`` is the batch tenant's
    (jobs of 5 to 40 one-time documents of 8 to 60 blocks behind a one-block
    instruction shared by every job, all at once) and the rest the API tenant's (one of
    ``templates`` few-shot templates of 4 to 20 blocks, Zipf ``template_skew``, and a
    one-block input of its own).
    """
    rng = random.Random(seed)
    chains = _Chains()
    shapes = [rng.randint(4, 20) for _ in range(templates)]
    template_of = _Zipf(templates, template_skew, rng)
    pending: list[tuple[float, int, list[int], int]] = []  # (due, seq, history, turn)
    seq = itertools.count()
    batch_rate = batch_share / 22.5  # jobs of 22.5 documents on average
    out: list[Request] = []
    now = 0.0
    while len(out) < requests:
        now += rng.expovariate(1 / 100)
        while pending and pending[0][0] <= now and len(out) < requests:
            due, _, history, turn = heapq.heappop(pending)
            ids = chains.extend(history, [("turn", next(seq), j)
                                          for j in range(rng.randint(1, 3))])
            out.append(_request(rng, due, ids))
            _follow(rng, pending, seq, due, ids, turn + 1)
        pick = rng.random() * (chat_share + batch_rate + (1 - chat_share - batch_share))
        if pick < chat_share:
            chat = next(seq)
            ids = chains.extend([], [*(("chat-system", j) for j in range(3)),
                                     *(("chat", chat, j) for j in range(rng.randint(1, 3)))])
            out.append(_request(rng, now, ids))
            _follow(rng, pending, seq, now, ids, 1)
        elif pick < chat_share + batch_rate:
            for _ in range(rng.randint(5, 40)):
                doc = next(seq)
                ids = chains.extend([], [("instruction",), *(("batch", doc, j)
                                                            for j in range(rng.randint(8, 60)))])
                out.append(_request(rng, now, ids))
        else:
            t = template_of()
            ids = chains.extend([], [*(("template", t, j) for j in range(shapes[t])),
                                     ("input", next(seq))])
            out.append(_request(rng, now, ids))
    return out[:requests]


def _follow(rng: random.Random, pending: list[tuple[float, int, list[int], int]],
            seq: itertools.count[int], now: float, history: list[int], turn: int) -> None:
    """A chat's next turn, with a chance that falls as it goes on (``tenant_mix``)."""
    if rng.random() < 0.75 / (1 + 0.15 * turn):
        due = now + rng.lognormvariate(math.log(20_000), 1.3)
        heapq.heappush(pending, (due, next(seq), history, turn))


def diurnal(requests: int = 4000, seed: int = 10, *, prefixes: int = 300,
            skew: float = 1.0, days: float = 1.0, overlap: float = 0.1,
            longest: int = 24) -> list[Request]:
    """A day's shift from one popular set of prompts to another and back.

    Parameters: two sets of ``prefixes`` prompts (4 to ``longest`` blocks; a share
    ``overlap`` of the ranks hold the same prompt in both sets), Zipf ``skew`` within a
    set; a request every 100 ms on average draws from the second set with probability
    ``(1 - cos(2 pi days t / T)) / 2`` at time t of the trace's T (the first set all
    at the start, the second at mid-day), then adds a 1 to 3 block message of its own.
    """
    rng = random.Random(seed)
    chains = _Chains()
    lengths = [rng.randint(4, longest) for _ in range(2 * prefixes)]
    shared = set(rng.sample(range(prefixes), int(overlap * prefixes)))
    prompt_of = _Zipf(prefixes, skew, rng)
    span = requests * 100.0  # the trace's expected length
    out: list[Request] = []
    now = 0.0
    for q in range(requests):
        now += rng.expovariate(1 / 100)
        second = rng.random() < (1 - math.cos(2 * math.pi * days * now / span)) / 2
        rank = prompt_of()
        p = rank if rank in shared or not second else prefixes + rank
        contents: list[Hashable] = [("prompt", p, j) for j in range(lengths[p])]
        contents += [("message", q, j) for j in range(rng.randint(1, 3))]
        out.append(_request(rng, now, chains.extend([], contents)))
    return out


WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    "conversations": conversations,
    "agents": agents,
    "tenants": tenants,
    "scan": scan,
    "documents": documents,
    "bursty_chat": bursty_chat,
    "coding_agents": coding_agents,
    "rag_drift": rag_drift,
    "tenant_mix": tenant_mix,
    "diurnal": diurnal,
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
