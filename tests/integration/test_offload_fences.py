"""An offload commits, and a reload lets its pin go, only once the device's copies are
done: the CUDA copy kernel and torch's ``non_blocking`` copies return once queued, and
``Namespace.offload`` committed (published to readers, checksummed) slots the device had
not written yet; ``reload`` released its pin while the device still read the slots.
The order is checked here on a CPU cache through spies (a GPU run checks the bytes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from daemon_proc import DaemonProcess
from kvtest import make_identity

import kvstore.client_core as client_core
import kvstore.client_wire as client_wire
import kvstore.kernels as kernels
from kvstore import Client
from kvstore.client import Held, Reservation

LAYERS, TOKENS, HEADS, DIM = 2, 16, 2, 8


def test_offload_commits_and_reload_releases_after_the_copies_are_done(
        module_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def spy(name: str, real: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(kernels, "gather", spy("gather", kernels.gather))
    monkeypatch.setattr(kernels, "scatter", spy("scatter", kernels.scatter))
    monkeypatch.setattr(client_core, "_copies_done", spy("done", client_core._copies_done))
    monkeypatch.setattr(Reservation, "commit", spy("commit", Reservation.commit))
    monkeypatch.setattr(Held, "release", spy("release", Held.release))
    ident = make_identity(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                          block_tokens=TOKENS, kv_dtype="float32", model="fences")
    cache = [torch.randn(4, 2, TOKENS, HEADS, DIM) for _ in range(LAYERS)]
    with Client(module_daemon.endpoint, tenant="acme") as c:
        ns = c.namespace(ident)
        keys = ns.keys(range(TOKENS * 3))
        assert ns.offload(cache, [0, 1, 2], keys) == 3
        assert calls == ["gather", "done", "commit"]
        calls.clear()
        other = [torch.zeros_like(t) for t in cache]
        assert ns.reload(keys, other, [0, 1, 2]) == 3
        assert calls == ["scatter", "done", "release"]
        assert all(torch.equal(a[:3], b[:3]) for a, b in zip(cache, other))


def test_the_fence_waits_on_a_cuda_cache_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.tiers import gpu

    recorded: list[Any] = []

    class Fence:
        def wait(self) -> None:
            recorded.append("wait")

    monkeypatch.setattr(gpu.CopyFence, "record",
                        classmethod(lambda cls, device: recorded.append(device) or Fence()))
    client_wire._copies_done([torch.zeros(1)])
    assert recorded == []  # a CPU cache: nothing queued
    monkeypatch.setattr(client_wire, "_cache_device", lambda _c: torch.device("cuda", 1))
    client_wire._copies_done([torch.zeros(1)])
    assert recorded == [torch.device("cuda", 1), "wait"]
