"""End to end: a real vLLM engine serving with kvstore, against the alternatives.

    .engine-envs/vllm/bin/python benchmarks/engine_e2e.py [--workloads mrqa,zero]
        [--arms alone,ideal,kvstore,kvstore-ssd,vllm-offload,...] [--users 8]
        [--rounds 3] [--repeat 1] [--png ttft.png]

    python benchmarks/engine_e2e.py --gpu --modes seq    # on a lent GPU

The GPU variant wants an environment with vLLM's CUDA build (and LMCache, for its arm)
and this checkout installed; it runs a 24-layer, 2048-wide bf16 model on every
workload, where vLLM's CPU offloading can run too.

Every arm runs the same engine (vLLM's CPU build of the engine tests' environment, a
Llama of the ``--layers``/``--hidden`` shape with dummy weights, greedy, prefix caching
on) on the same workload, in a process of its own, one after the other:

- ``alone``: the engine and its own prefix cache, sized (``--engine-cache-mib``) to hold
  about two users' contexts, so reuse must come from outside it;
- ``ideal``: the same engine with a cache big enough for every context: the limit of
  reuse, which no store can beat;
- ``kvstore``: + kvstore's connector and a daemon with DRAM for everything;
- ``kvstore-ssd``: + kvstore with a DRAM tier too small, so hits come from SSD;
- ``kvstore-layerwise`` (not run unless named): ``kvstore`` loading layer by layer
  even where ``"layerwise": "auto"`` (the connector's default) would not;
- ``kvstore-whole`` (not run unless named): ``kvstore`` copying each step's loads whole
  before the forward (``"layerwise": false``), what ``auto`` does with no core to spare;
- ``kvstore-unposted`` (not run unless named): ``kvstore`` with each step's acquires sent
  in ``start_load_kv`` and waited for at once, not sent ahead in ``handle_preemptions``;
- ``kvstore-eager`` (not run unless named): ``kvstore`` with each step's saves started
  as the step hands them over, not at the next step (``saves_after_step``);
- ``kvstore-before`` (not run unless named): ``kvstore-eager`` hashing every request's
  keys itself (``known_chains`` off): the connector as it was before either;
- ``kvstore-ahead`` (not run unless named): ``kvstore`` with each step's loads pinned
  and copied on a thread from ``handle_preemptions`` (``copy_ahead``), not in
  ``start_load_kv``;
- ``vllm-offload``: + vLLM's own CPU offloading connector (``kv_offloading_size``:
  ``OffloadingConnector`` with its CPU backend);
- ``vllm-simple-offload``: + vLLM's ``SimpleCPUOffloadConnector``;
- ``lmcache``: + LMCache's in-process vLLM connector (``LMCacheConnectorV1``, LMCache's
  engine in the engine's process; ``LMCACHE_*`` settings: a DRAM cache of
  ``--store-mib``);
- ``lmcache-mp``: + LMCache's multiprocess connector (``LMCacheMPConnector``, what
  vLLM's ``kv_offloading_backend="lmcache"`` picks) and an ``lmcache server`` with
  ``--store-mib`` of DRAM, started per run like kvstore's daemon.

An arm that cannot run here prints the error why and the others go on: on the CPU
build, vLLM's two offloading connectors and LMCache's in-process one stop at their
CUDA-only parts (LMCache's would carry on recomputing everything, so the benchmark
stops it with the error LMCache logged).  LMCache's arms need an environment with
both vLLM and LMCache, which the engine tests keep apart: ``bash
tests/engines/setup_envs.sh vllm-lmcache`` (opt-in) makes ``.engine-envs/vllm-lmcache``,
to run this benchmark with.

Workloads, our own generators of the shapes the anchors publish:
- ``mrqa``: multi-round QA as in LMCache's benchmark: users x rounds, a shared system
  prompt (``--system-tokens``), a per-user history (``--history-tokens``) that grows by
  each round's question and answer; one request at a time (TTFT), then each round's
  requests at once (throughput);
- ``longdoc``: long-document QA as in LMCache's: ``--docs`` documents of
  ``--doc-tokens``, asked about in a 1:1 hit:miss pattern (every document twice);
- ``multiturn``: conversations with think time and a cap on active conversations, as
  vLLM's ``benchmarks/multi_turn``;
- ``zero``: distinct prompts, nothing to reuse (the connector's pure overhead).

Answers are the engine's own greedy tokens, appended to the history as a chat would.
TTFT is what a client of the in-process engine sees: from adding the request to the
step that returns its first token.  Reported per arm and workload: TTFT p50/p90/p99,
throughput (prompt + generated tokens per second of the run; for ``mrqa``'s rounds at
once, also of rounds 2 and later, those that can reuse), prompt tokens computed
vs found cached (local + loaded), tokens loaded from kvstore and bytes moved (kvstore's
arms), the connector's own time in the engine's steps per request (lookup, load,
save hand-off; and, for the requests of rounds 2 and later of ``mrqa``'s one at a time,
the median of each part up to the first token, beside the engine's own schedule,
execute and forward pass, and TTFT less the forward: the part a connector adds to, with
the forward's run-to-run noise taken out; with ``--spans``, the median time in each of
vLLM's and the connector's calls and the engine steps to the first token,
``engine_spans.py``), whether each arm's greedy answers are the ideal's, request by
request, and ratios against ``alone`` and ``ideal``; ``--png`` draws the TTFT
distributions (matplotlib; where the engine's environment lacks it, the TTFTs go to a
JSON file that ``--draw`` turns into the PNG with a Python that has it).

On a small, shared machine one run of an arm says little: ``--repeat N`` runs every
arm N times, the order rotated each repeat, and the ratios are the median over repeats
of the ratio within a repeat (arms run minutes apart, not a whole run apart).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_arms  # after the path: benchmarks/ is no package
import engine_spans

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["alone", "ideal", "kvstore", "kvstore-ssd", *engine_arms.ARMS]
WORKLOADS = ["mrqa", "longdoc", "multiturn", "zero"]
BLOCK = 32   # the CPU attention backend wants a multiple of 32
VOCAB = 4096


# ========================================================================================
# workloads
# ========================================================================================

@dataclass
class Conversation:
    """A chat: ``context`` grows by each turn's question and the engine's answer."""

    name: str
    context: list[int]
    questions: list[list[int]]
    turn: int = 0
    answers: list[list[int]] = field(default_factory=list)

    def prompt(self) -> list[int]:
        return self.context + self.questions[self.turn]

    def answered(self, answer: list[int]) -> None:
        self.context = self.prompt() + answer
        self.answers.append(answer)
        self.turn += 1

    @property
    def done(self) -> bool:
        return self.turn >= len(self.questions)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def mrqa(a: argparse.Namespace, rng: random.Random) -> list[Conversation]:
    system = tokens(rng, a.system_tokens)
    return [Conversation(f"user{u}", system + tokens(rng, a.history_tokens),
                         [tokens(rng, a.question_tokens) for _ in range(a.rounds)])
            for u in range(a.users)]


def longdoc(a: argparse.Namespace, rng: random.Random) -> list[Conversation]:
    docs = [tokens(rng, a.doc_tokens) for _ in range(a.docs)]
    # every document asked twice: the second time, after every other one (1:1 hit:miss)
    return [Conversation(f"doc{d}-{k}", docs[d], [tokens(rng, a.question_tokens)])
            for k in range(2) for d in range(a.docs)]


def zero(a: argparse.Namespace, rng: random.Random) -> list[Conversation]:
    return [Conversation(f"fresh{i}", tokens(rng, a.zero_tokens), [[3]])
            for i in range(a.zero_requests)]


# ========================================================================================
# the engine, driven request by request (one process per arm)
# ========================================================================================

def make_model(path: Path, a: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    heads, kv_heads, head_dim, ffn = a.hidden // 64, max(1, a.hidden // 256), 64, a.hidden * 3
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": a.hidden, "intermediate_size": ffn, "num_hidden_layers": a.layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": VOCAB, "max_position_embeddings": a.max_model_len,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(1234)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, a.hidden, generator=g),
               "model.norm.weight": torch.ones(a.hidden),
               "lm_head.weight": torch.randn(VOCAB, a.hidden, generator=g) / a.hidden ** .5}
    shapes = {"self_attn.q_proj": (heads * head_dim, a.hidden),
              "self_attn.k_proj": (kv_heads * head_dim, a.hidden),
              "self_attn.v_proj": (kv_heads * head_dim, a.hidden),
              "self_attn.o_proj": (a.hidden, heads * head_dim),
              "mlp.gate_proj": (ffn, a.hidden), "mlp.up_proj": (ffn, a.hidden),
              "mlp.down_proj": (a.hidden, ffn)}
    for i in range(a.layers):
        p = f"model.layers.{i}."
        for name, (rows, cols) in shapes.items():
            weights[p + name + ".weight"] = torch.randn(rows, cols, generator=g) / cols ** .5
        weights[p + "input_layernorm.weight"] = torch.ones(a.hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(a.hidden)
    save_file(weights, str(path / "model.safetensors"))


def layerwise(arm: str, forced: bool) -> bool | str:
    """A kvstore arm's ``layerwise``: the connector's default (``auto``) but where the
    arm is named for a way of loading, or measures the connector as it was (whole)."""
    if arm.endswith("layerwise"):
        return True
    if arm.endswith(("whole", "ahead", "before")):
        return False
    return True if forced else "auto"


def engine(arm: str, a: argparse.Namespace, endpoint: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig


    kwargs: dict[str, Any] = {}
    cache_mib = a.ideal_cache_mib if arm == "ideal" else a.engine_cache_mib
    if arm.startswith("kvstore"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"endpoint": endpoint, "tenant": "bench",
                                       "layerwise": layerwise(arm, a.layerwise),
                                       "post_loads": not arm.endswith("unposted"),
                                       "copy_ahead": arm.endswith("ahead"),
                                       "saves_after_step": not arm.endswith(("eager",
                                                                             "before")),
                                       "known_chains": not arm.endswith("before")})
    elif arm != "alone" and arm != "ideal":
        kwargs |= engine_arms.engine_kwargs(arm, a, endpoint)
    return LLM(model=a.model, skip_tokenizer_init=True, dtype=a.dtype, block_size=BLOCK,
               max_model_len=a.max_model_len, enforce_eager=True, seed=0,
               gpu_memory_utilization=0.5, kv_cache_memory_bytes=cache_mib << 20,
               enable_prefix_caching=True, max_num_batched_tokens=a.max_model_len,
               **kwargs)


class Driver:
    """Adds requests to the in-process engine and steps it, timing first tokens."""

    def __init__(self, llm: Any, answer_tokens: int,
                 clock: engine_spans.SpanClock | None = None) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.clock = clock
        self.conn_before: dict[str, dict[str, int]] = {}  # request -> counters at submit
        self.sampling = SamplingParams(temperature=0.0, max_tokens=answer_tokens,
                                       detokenize=False, ignore_eos=True)
        self.records: list[dict[str, Any]] = []
        self._live: dict[str, tuple[Conversation, float, float | None, int]] = {}
        self._conn: dict[str, dict[str, int]] = {}
        self._steps: dict[str, int] = {}  # request -> engine steps until its first token

    def submit(self, conv: Conversation) -> None:
        rid = uuid.uuid4().hex
        prompt = conv.prompt()
        self.conn_before[rid] = connector_stats(self.llm, drain=False)
        if self.clock is not None:
            self.conn_before[rid] |= {f"phase_{k}": v for k, v in self.clock.snapshot().items()}
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, self.sampling)
        self._live[rid] = (conv, time.perf_counter(), None, len(prompt))
        self._steps[rid] = 0

    def step(self) -> list[Conversation]:
        """One engine step; the conversations whose turn finished in it."""
        finished = []
        for rid, steps in self._steps.items():
            if self._live[rid][2] is None:
                self._steps[rid] = steps + 1
        for out in self.llm.llm_engine.step():
            conv, start, first, prompt_len = self._live[out.request_id]
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
                self._live[out.request_id] = (conv, start, first, prompt_len)
                # The connector's time up to the first token (one request at a time)
                before = self.conn_before.pop(out.request_id, {})
                after = connector_stats(self.llm, drain=False)
                if self.clock is not None:
                    after |= {f"phase_{k}": v for k, v in self.clock.snapshot().items()}
                self._conn[out.request_id] = {k: after[k] - before.get(k, 0)
                                              for k in after if k in before}
                self._conn[out.request_id]["steps"] = self._steps[out.request_id]
            if out.finished:
                del self._live[out.request_id]
                del self._steps[out.request_id]
                answer = list(out.outputs[0].token_ids)
                self.records.append({"ttft": (first or time.perf_counter()) - start,
                                     "prompt": prompt_len, "cached": out.num_cached_tokens,
                                     "generated": len(answer), "name": conv.name,
                                     "answer": answer,
                                     "conn": self._conn.pop(out.request_id, {})})
                conv.answered(answer)
                finished.append(conv)
        return finished

    @property
    def busy(self) -> bool:
        return bool(self._live)

    def one_at_a_time(self, order: list[Conversation]) -> None:
        for conv in order:
            self.submit(conv)
            while self.busy:
                self.step()

    def together(self, batch: list[Conversation]) -> None:
        for conv in batch:
            self.submit(conv)
        while self.busy:
            self.step()

    def think_time(self, convs: list[Conversation], cap: int, think_s: float) -> None:
        """Each conversation's next turn ``think_s`` after its answer; at most ``cap``
        conversations in progress, the next starting as one ends."""
        waiting, ready = list(convs), [(0.0, c) for c in convs[:cap]]
        del waiting[:cap]
        while ready or self.busy:
            now = time.perf_counter()
            for at, conv in [r for r in ready if r[0] <= now]:
                ready.remove((at, conv))
                self.submit(conv)
            if not self.busy:
                time.sleep(max(0.0, min(at for at, _ in ready) - now))
                continue
            for conv in self.step():
                if not conv.done:
                    ready.append((time.perf_counter() + think_s, conv))
                elif waiting:
                    ready.append((time.perf_counter(), waiting.pop(0)))


def run_arm(arm: str, a: argparse.Namespace) -> dict[str, Any]:
    """One arm's every workload, in this process; a JSON-able summary."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(ROOT))
    llm = engine(arm, a, a.endpoint)
    if reason := engine_arms.failure(llm):
        return {"error": reason}
    clock = engine_spans.SpanClock(llm, detailed=a.spans)
    warm = Driver(llm, 2)
    warm.one_at_a_time([Conversation("warm", tokens(random.Random(99), 300), [[3]])])
    import torch

    config = llm.llm_engine.vllm_config
    print(f"{arm}: async scheduling {config.scheduler_config.async_scheduling}, "
          f"{torch.get_num_threads()} torch threads, KV cache blocks "
          f"{config.cache_config.num_gpu_blocks}", file=sys.stderr)
    out: dict[str, Any] = {}
    for workload in a.workloads:
        for mode in (a.modes if workload == "mrqa" else ["seq"]):
            stats_before = connector_stats(llm)
            rng = random.Random(f"{workload}/{mode}")  # every arm gets the same prompts
            driver = Driver(llm, a.answer_tokens, clock)
            started = time.perf_counter()
            later: dict[str, float] = {}  # mrqa's rounds 2 and later: tokens, seconds
            if workload == "mrqa":
                convs = mrqa(a, rng)
                for n in range(a.rounds):
                    began, done = time.perf_counter(), len(driver.records)
                    if mode == "seq":
                        driver.one_at_a_time(convs)
                    else:
                        driver.together(convs)
                    if n:
                        later["tokens"] = later.get("tokens", 0) + sum(
                            x["prompt"] + x["generated"] for x in driver.records[done:])
                        later["elapsed"] = later.get("elapsed", 0) + time.perf_counter() - began
            elif workload == "longdoc":
                driver.one_at_a_time(longdoc(a, rng))
            elif workload == "multiturn":
                a_turns = argparse.Namespace(**{**vars(a), "users": a.conversations})
                driver.think_time(mrqa(a_turns, rng), a.active, a.think_s)
            else:
                driver.one_at_a_time(zero(a, rng))
            elapsed = time.perf_counter() - started
            moved = {k: v - stats_before.get(k, 0) if k != "block_bytes" else v
                     for k, v in connector_stats(llm).items()}
            out[f"{workload}/{mode}"] = {"records": driver.records, "elapsed": elapsed,
                                         "connector": moved, "later": later}
    return out


PER_REQUEST = ("s_lookup_us", "w_load_us", "w_acquire_wait_us", "w_save_us", "s_hit_tokens")
PHASES = tuple(f"phase_{k}" for k in engine_spans.PHASES)  # nanoseconds


def connector_stats(llm: Any, *, drain: bool = True) -> dict[str, int]:
    """kvstore's counters (scheduler and worker side) in this process, or the tokens
    the ``lmcache-mp`` arm's server logged it retrieved and stored; {} elsewhere.
    ``drain``: once the background saves are done."""
    core = llm.llm_engine.engine_core.engine_core
    connector = getattr(core.scheduler, "connector", None)
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    stats: dict[str, int] = {}
    if worker is not None and hasattr(worker, "drain_saves"):
        worker.drain_saves(30 if drain else 0)
        stats |= {f"w_{k}": v for k, v in worker.stats.items()}
        stats["block_bytes"] = worker._layers[0].block_bytes
    if connector is not None and hasattr(connector, "stats"):
        stats |= {f"s_{k}": v for k, v in connector.stats.items()}
    if drain:  # not per request: it reads a log
        stats |= engine_arms.server_tokens()
    return stats


# ========================================================================================
# the parent: daemons, one process per arm, the report
# ========================================================================================

def start_daemon(arm: str, a: argparse.Namespace, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    endpoint = f"ipc://{work / (arm + '.sock')}"
    shutil.rmtree(work / arm, ignore_errors=True)  # SSD contents outlive a daemon: a
    from_ssd = arm == "kvstore-ssd"                # run starts from an empty store
    dram = f"{a.ssd_dram_mib}MiB" if from_ssd else f"{a.store_mib}MiB"
    ssd = f"{a.store_mib * 2}MiB" if from_ssd else "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint,
         "--dram-capacity", dram, "--ssd-capacity", ssd, "--ssd-path", str(work / arm),
         "--slab-size", "16MiB", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if b"serving on" in line:
            return proc, endpoint
    raise RuntimeError(f"the daemon for {arm} did not start")


def child(arm: str, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    daemon: subprocess.Popen[bytes] | None = None
    endpoint = ""
    if arm.startswith("kvstore"):
        daemon, endpoint = start_daemon(arm, a, work)
    elif arm == "lmcache-mp":
        try:
            daemon, endpoint = engine_arms.start_server(a, work)
        except RuntimeError as e:
            return {"error": str(e)}
    args = [sys.executable, __file__, "--child", arm, "--endpoint", endpoint,
            *sys.argv[1:]]
    try:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if arm == "lmcache-mp":
            env[engine_arms.SERVER_LOG] = str(work / "lmcache-server.log")
        if a.threads:
            env["OMP_NUM_THREADS"] = str(a.threads)
        proc = subprocess.run(args, capture_output=True, text=True, cwd=work,
                              timeout=a.arm_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {a.arm_timeout} s"}
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = [line for line in proc.stderr.splitlines()
               if "Error" in line or "error" in line or "Exception:" in line]
        why = (err[-1] if err else proc.stderr[-400:]).strip()
        return {"error": why.removeprefix("[rank0]:").strip()[:400]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def merge(into: dict[str, Any], result: dict[str, Any]) -> None:
    """Add one run of an arm to its earlier runs: records pooled, times and counters
    summed."""
    if "error" in result:
        into.clear()
        into.update(result)
        return
    for key, r in result.items():
        have = into.setdefault(key, {"records": [], "elapsed": 0.0, "connector": {},
                                     "runs": []})
        have["records"] += r["records"]
        have["elapsed"] += r["elapsed"]
        later = r.get("later") or {}
        have["runs"].append({"p50": statistics.median(x["ttft"] for x in r["records"]),
                             "tput": sum(x["prompt"] + x["generated"] for x in r["records"])
                             / r["elapsed"],
                             "later_tput": (later["tokens"] / later["elapsed"]
                                            if later.get("elapsed") else float("nan"))})
        for k, v in r["connector"].items():
            have["connector"][k] = v if k == "block_bytes" else have["connector"].get(k, 0) + v


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(name: str, result: dict[str, Any]) -> dict[str, Any]:
    records, elapsed = result["records"], result["elapsed"]
    ttft = [r["ttft"] * 1000 for r in records]
    prompt = sum(r["prompt"] for r in records)
    cached = sum(r["cached"] for r in records)
    generated = sum(r["generated"] for r in records)
    c = result.get("connector", {})
    block_bytes = c.get("block_bytes", 0)
    return {"p50": statistics.median(ttft), "p90": pct(ttft, 0.9), "p99": pct(ttft, 0.99),
            "tput": (prompt + generated) / elapsed, "prompt": prompt,
            "computed": prompt - cached, "cached": cached,
            "loaded": c.get("s_hit_tokens", 0),
            "by_tier": " ".join(f"{k.removeprefix('s_hit_tokens_')}:{v}" for k, v in
                                sorted(c.items()) if k.startswith("s_hit_tokens_") and v),
            "moved_mib": (c.get("w_loaded_blocks", 0) + c.get("w_saved_blocks", 0))
            * block_bytes / (1 << 20), "n": len(records),
            "conn_ms": (c.get("s_lookup_us", 0) + c.get("w_load_us", 0)
                        + c.get("w_save_us", 0)) / 1000 / max(1, len(records)),
            "lookup_ms": c.get("s_lookup_us", 0) / 1000 / max(1, len(records)),
            "load_ms": c.get("w_load_us", 0) / 1000 / max(1, len(records)),
            "save_ms": c.get("w_save_us", 0) / 1000 / max(1, len(records)),
            "pin_wait_ms": c.get("w_acquire_wait_us", 0) / 1000 / max(1, len(records))}


def paired(runs: list[dict[str, float]], base: list[dict[str, float]] | None,
           what: str) -> float:
    """The median over repeats of one arm's figure over the base arm's in the same
    repeat (the arms ran one after the other in each: the machine's drift cancels)."""
    if not base:
        return float("nan")
    return statistics.median(r[what] / b[what] for r, b in zip(runs, base))


def report(results: dict[str, dict[str, Any]], a: argparse.Namespace) -> None:
    keys = sorted({k for r in results.values() if "error" not in r for k in r})
    for arm, r in results.items():
        if "error" in r:
            print(f"{arm:13} cannot run here: {r['error']}")
    for key in keys:
        print(f"\n== {key}  (TTFT ms over every run; /alone, /ideal: the median over "
              f"the {a.repeat} repeat(s) of the p50 ratio within a repeat; tput/alone "
              f"likewise)")
        print(f"{'arm':13} {'n':>3} {'p50':>8} {'p90':>8} {'p99':>8} {'tok/s':>8} "
              f"{'computed':>9} {'cached':>8} {'loaded':>8} {'MiB':>7} {'/alone':>7} "
              f"{'/ideal':>7} {'tput/alone':>10} {'conn ms':>8}  "
              f"lookup/load(pin wait)/save ms  loaded by tier")
        rows = {arm: summarise(key, r[key]) for arm, r in results.items()
                if "error" not in r and key in r}
        runs = {arm: r[key].get("runs", []) for arm, r in results.items()
                if "error" not in r and key in r}
        for arm, s in rows.items():
            alone = paired(runs[arm], runs.get("alone"), "p50")
            ideal = paired(runs[arm], runs.get("ideal"), "p50")
            tput = paired(runs[arm], runs.get("alone"), "tput")
            print(f"{arm:13} {s['n']:3d} {s['p50']:8.1f} {s['p90']:8.1f} {s['p99']:8.1f} "
                  f"{s['tput']:8.0f} {s['computed']:9d} {s['cached']:8d} {s['loaded']:8d} "
                  f"{s['moved_mib']:7.1f} {alone:7.2f} {ideal:7.2f} {tput:10.2f} "
                  f"{s['conn_ms']:8.2f}  {s['lookup_ms']:.2f}/{s['load_ms']:.2f}"
                  f"({s['pin_wait_ms']:.2f})/"
                  f"{s['save_ms']:.2f}  {s['by_tier']}")
            if a.repeat > 1:
                print(f"{'':13}     p50 per repeat: "
                      + " ".join(f"{r['p50'] * 1000:.1f}" for r in runs[arm]))
        token_costs(rows)
        same_answers(results, key)
        if key == "mrqa/seq":
            later_rounds(results, key, a)
        if key == "mrqa/batch":
            later_throughput(runs)
    if a.png:
        ttfts = {key: {arm: [x["ttft"] * 1000 for x in r[key]["records"]]
                       for arm, r in results.items() if "error" not in r and key in r}
                 for key in keys}
        draw(ttfts, a.png)


def later_throughput(runs: dict[str, list[dict[str, float]]]) -> None:
    """Each round's requests at once, rounds 2 and later (those that can reuse a
    history; every arm computes the first alike): prompt and generated tokens a second,
    and over the engine alone's (the median over repeats of the ratio within one)."""
    print("rounds 2+, each round's requests at once: tok/s (median over repeats), "
          "and over the engine alone's")
    for arm, r in runs.items():
        rates = [x["later_tput"] for x in r if x.get("later_tput") == x.get("later_tput")]
        if rates:
            ratio = paired(r, runs.get("alone"), "later_tput")
            print(f"{arm:13} {statistics.median(rates):8.0f}  "
                  + (f"{ratio:6.2f}x" if ratio == ratio else "(no alone arm)"))


def later_rounds(results: dict[str, dict[str, Any]], key: str, a: argparse.Namespace) -> None:
    """The requests of rounds 2 and later (the ones that reuse a history), one at a
    time: TTFT p50 and the connector's time up to each first token, per part (medians
    over those requests)."""
    per_run = a.users * a.rounds
    print(f"rounds 2+: TTFT p50 ms, and the connector's ms up to the first token; the "
          f"engine's schedule and execute (the model's forward within it), and TTFT less "
          f"the forward (medians per request)")
    for arm, r in results.items():
        if "error" in r or key not in r:
            continue
        later = [x for i, x in enumerate(r[key]["records"]) if i % per_run >= a.users]
        if not later:
            continue
        parts = {k: statistics.median(x.get("conn", {}).get(k, 0) for x in later) / 1000
                 for k in PER_REQUEST[:-1]}
        p50 = statistics.median(x["ttft"] for x in later) * 1000
        phases = {k: statistics.median(x.get("conn", {}).get(k, 0) for x in later) / 1e6
                  for k in PHASES}
        rest = statistics.median(x["ttft"] * 1000 - x.get("conn", {}).get("phase_forward", 0)
                                 / 1e6 for x in later)
        print(f"{arm:13} n {len(later):3d}  p50 {p50:6.1f}"
              f"  lookup {parts['s_lookup_us']:.2f}  load {parts['w_load_us']:.2f}"
              f" (pin wait {parts['w_acquire_wait_us']:.2f})  save {parts['w_save_us']:.2f}"
              f"  | schedule {phases['phase_schedule']:.2f}  execute "
              f"{phases['phase_execute']:.2f} (forward {phases['phase_forward']:.2f})"
              f"  TTFT less forward {rest:.2f}")
        spans = sorted({k for x in later for k in x.get("conn", {})
                        if k.startswith("phase_") and k not in PHASES})
        if spans:  # --spans: every timed call's median ms, then the steps to a first token
            ms = {k.removeprefix("phase_"): statistics.median(
                x["conn"].get(k, 0) for x in later) / 1e6 for k in spans}
            steps = statistics.median(x["conn"].get("steps", 0) for x in later)
            print(f"{'':13}   " + "  ".join(f"{k} {v:.3f}" for k, v in ms.items())
                  + f"  steps {steps:.0f}")


def same_answers(results: dict[str, dict[str, Any]], key: str) -> None:
    """Whether each arm's greedy answers are the ideal arm's, request by request (the
    same prompts in the same order in every run: a wrong KV block shows as another
    answer)."""
    ideal = results.get("ideal", {}).get(key)
    if ideal is None:
        return
    for arm, r in results.items():
        if arm == "ideal" or "error" in r or key not in r:
            continue
        pairs = list(zip(r[key]["records"], ideal["records"]))
        differ = sum(x.get("answer") != y.get("answer") for x, y in pairs)
        print(f"{arm:13} answers: {differ} of {len(pairs)} differ from the ideal's")


def token_costs(rows: dict[str, dict[str, Any]]) -> None:
    """What a loaded token costs against a recomputed one, from the p50s: the TTFT an
    arm adds over the ideal per token it loaded, over what the engine alone adds per
    token it recomputed that the ideal found cached (p50s of every request, so a
    rough figure: the requests that miss everywhere weigh on both sides)."""
    ideal, alone = rows.get("ideal"), rows.get("alone")
    if not ideal or not alone or alone["computed"] <= ideal["computed"]:
        return
    per_recomputed = ((alone["p50"] - ideal["p50"])
                      / ((alone["computed"] - ideal["computed"]) / alone["n"]))
    for arm, s in rows.items():
        if s["loaded"] and per_recomputed > 0:
            per_loaded = (s["p50"] - ideal["p50"]) / (s["loaded"] / s["n"])
            print(f"{arm:13} a loaded token costs {per_loaded * 1000:.2f} us over the "
                  f"ideal's p50, a recomputed one {per_recomputed * 1000:.2f} us: "
                  f"{per_loaded / per_recomputed:.2f}x")


def draw(ttfts: dict[str, dict[str, list[float]]], path: str) -> None:
    """TTFT distributions (ms) per workload and arm, as a PNG; without matplotlib (the
    engine's environment may lack it), the figures as JSON beside it and the command
    that draws them with a Python that has it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        Path(path + ".json").write_text(json.dumps(ttfts))
        print(f"(no matplotlib here) draw with: python {Path(__file__).relative_to(ROOT)} "
              f"--draw {path}.json --png {path}")
        return
    fig, axes = plt.subplots(1, len(ttfts), figsize=(5 * len(ttfts), 4.5), squeeze=False)
    for ax, (key, arms) in zip(axes[0], ttfts.items()):
        ax.boxplot(list(arms.values()), whis=(1, 99))
        ax.set_xticks(range(1, len(arms) + 1), list(arms))
        ax.set_yscale("log")
        ax.set_title(key)
        ax.set_ylabel("TTFT (ms, log; whiskers p1-p99)")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path)
    print(f"TTFT distributions: {path}")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--workloads", default="mrqa,zero")
    p.add_argument("--modes", default="seq,batch",
                   help="mrqa: one request at a time (seq), each round's at once (batch)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every arm, in turn")
    p.add_argument("--gpu", action="store_true", help="the GPU variant: a bigger model, "
                   "bf16, every workload (for a lent GPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--history-tokens", type=int, default=2000)
    p.add_argument("--question-tokens", type=int, default=40)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=3000)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--active", type=int, default=3)
    p.add_argument("--think-s", type=float, default=0.5)
    p.add_argument("--zero-tokens", type=int, default=2000)
    p.add_argument("--zero-requests", type=int, default=12)
    p.add_argument("--engine-cache-mib", type=int, default=0,
                   help="the engine's own KV cache (0: about two users' contexts)")
    p.add_argument("--ideal-cache-mib", type=int, default=2048)
    p.add_argument("--store-mib", type=int, default=2048)
    p.add_argument("--ssd-dram-mib", type=int, default=32)
    p.add_argument("--lmcache-chunk", type=int, default=256,
                   help="LMCache's chunk in tokens (its default): it stores and loads "
                   "whole chunks only")
    p.add_argument("--layerwise", action="store_true", help="kvstore arms not named for a "
                   "way of loading load layer by layer even where the connector's "
                   "default (auto) would copy whole")
    p.add_argument("--spans", action="store_true", help="time vLLM's and the connector's "
                   "calls in each step (engine_spans.py) and print, for the requests of "
                   "rounds 2+ of mrqa one at a time, the median ms of each per request")
    p.add_argument("--threads", type=int, default=-1,
                   help="OMP_NUM_THREADS of every arm's engine (default: 1 on the CPU "
                   "build, where two OpenMP threads on a shared 2-core machine made the "
                   "same prefill 2x slower in some arms than in others; 0: inherit)")
    p.add_argument("--arm-timeout", type=float, default=3600)
    p.add_argument("--png", default="")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--draw", default="", help="draw --png from the TTFTs a run saved "
                   "as JSON (where its environment had no matplotlib), and exit")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.gpu:  # a model where the GPU's prefill dominates, every workload
        a.layers, a.hidden, a.dtype = 24, 2048, "bfloat16"
        a.workloads = ",".join(WORKLOADS)
    if a.threads < 0:
        a.threads = 0 if a.gpu else 1
    a.workloads = a.workloads.split(",")
    a.modes = a.modes.split(",")
    if not a.engine_cache_mib:
        kv_heads = max(1, a.hidden // 256)
        per_token = 2 * a.layers * kv_heads * 64 * (4 if a.dtype == "float32" else 2)
        context = a.system_tokens + a.history_tokens + a.rounds * 60
        a.engine_cache_mib = max(8, 2 * context * per_token >> 20)
    return a


def main() -> None:
    a = parse()
    if a.draw:
        draw(json.loads(Path(a.draw).read_text()), a.png or a.draw.removesuffix(".json"))
        return
    if a.child:
        a.model = a.model or str(Path.cwd() / "model")
        result = run_arm(a.child, a)
        sys.stdout.write("\n" + json.dumps(result) + "\n")
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's slow teardown
    work = Path(tempfile.mkdtemp(prefix="kvstore-e2e-"))
    try:
        make_model(work / "model", a)
        print(f"model: {a.layers} layers, hidden {a.hidden}, {a.dtype}; engine cache "
              f"{a.engine_cache_mib} MiB, ideal {a.ideal_cache_mib} MiB; workloads "
              f"{','.join(a.workloads)}", flush=True)
        results: dict[str, dict[str, Any]] = {}
        arms = a.arms.split(",")
        for arm in arms:
            if reason := engine_arms.cannot_run(arm):
                results[arm] = {"error": reason}
        for rep in range(a.repeat):  # the arms in turn, so the machine's drift hits all,
            for arm in arms[rep % len(arms):] + arms[:rep % len(arms)]:  # none always first
                if "error" in results.get(arm, {}):
                    continue
                started = time.monotonic()
                merge(results.setdefault(arm, {}), child(arm, a, work))
                print(f"  {rep + 1}/{a.repeat} {arm}: {time.monotonic() - started:.0f} s"
                      + (f" (error: {results[arm]['error'][:200]})" if "error" in results[arm]
                         else ""), flush=True)
        report(results, a)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
