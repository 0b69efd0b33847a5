"""kvstore's KV event stream decoded by vLLM's own event classes, in the vLLM test env.

A random mix of stores, reads, evictions, demotions and restarts runs against a real
daemon with events on; the batches the subscriber saw go to a script in the vLLM
environment that decodes them with ``vllm.distributed.kv_events.KVEventBatch`` and
rebuilds the index from them alone: it must equal the daemon's snapshot and answer
every chain's lookup as the daemon does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from daemon_proc import free_port
from engine_envs import HERE, last_json, run_in_env
from events_sub import Mix, Subscriber
from kvtest import make_identity

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, salt="s2")


def test_vllm_decodes_the_stream_and_rebuilds_the_index(daemon_factory: Any,
                                                        tmp_path: Path) -> None:
    pub, replay = free_port(), free_port()
    d = daemon_factory(dram_capacity="2MiB", ssd_capacity="4MiB",
                       extra=["--slab-size", "1MiB"],
                       env={"KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
                            "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}"})
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    mix = Mix(d, sub, IDENT, seed=7, tenant="acme")
    try:
        for _ in range(40):
            mix.step()
        if not mix.restarts:
            mix.restart(15)
        # a chain stored and evicted for sure (the mix's own may have gone in a restart)
        keys = mix.ns.keys(list(range(5000, 5000 + 3 * IDENT.block_tokens)))
        mix.ns.put(keys, [mix.content(k) for k in keys])
        mix.synced()
        assert mix.ns.evict(keys) == 3
        mix.chains.append(keys)
        # and blocks on SSD for sure (the mix's may all have left it, on a loaded machine):
        # chains of three quarters of DRAM (2 MiB) push older blocks down
        deadline = time.monotonic() + 30
        at = 6000
        while not mix.client.stats()["tiers"]["ssd"]["blocks"]:
            assert time.monotonic() < deadline, "nothing ever reached the SSD tier"
            more = mix.ns.keys(list(range(at, at + 24 * IDENT.block_tokens)))
            mix.ns.put(more, [mix.content(k) for k in more])
            mix.chains.append(more)
            at += 24 * IDENT.block_tokens
            time.sleep(0.2)
        mix.synced()
        snap = mix.check()
        lookups = [mix.ns.lookup(keys).tiers for keys in mix.chains]
        assert mix.synced().seq == snap.seq  # nothing moved since: the lookups match it
    finally:
        mix.close()
        sub.close()
    spec = tmp_path / "stream.json"
    spec.write_text(json.dumps({
        "payloads": [[seq, payload.hex()] for seq, payload in sub.payloads],
        "chains": [[k.hex() for k in keys] for keys in mix.chains]}))
    out = last_json(run_in_env("vllm", [str(HERE / "kv_events_decode.py"), str(spec)],
                               timeout=180).stdout)
    expected = sorted([k.hex(), p.hex() if p else None, t] for k, p, t in snap.blocks)
    assert out["entries"] == expected
    assert out["lookups"] == lookups
    counts = out["counts"]
    assert counts["AllBlocksCleared"] == 1 + mix.restarts
    assert counts["BlockStored"] > 0 and counts["BlockRemoved"] > 0
    assert any(t == "ssd" for _, _, t in expected) or any("ssd" in x for x in lookups)
