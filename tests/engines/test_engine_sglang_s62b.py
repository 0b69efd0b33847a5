"""SGLang engines on AMD GPUs name their fp8 KV by the format SGLang keeps it in there,
and share no pages with NVIDIA engines of another format (sglang_s62b_run.py, in the
SGLang environment, with SGLang's ``is_hip()`` and fp8 format patched, against a real
daemon).

Before: ``--kv-cache-dtype fp8_e4m3`` was named float8_e4m3fn and ``fp8_e5m2``
float8_e5m2 on every GPU; SGLang on ROCm keeps either in the GPU's native fp8 format
(float8_e4m3fnuz on MI300), so an MI300 engine and an NVIDIA one loaded each other's
pages, read in the wrong format.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env


def test_amd_engines_fp8_pages_are_named_by_their_format(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    proc = run_in_env("sglang", [str(HERE / "sglang_s62b_run.py"), "--endpoint",
                                 daemon.endpoint, "--tenant",
                                 f"sglang-{uuid.uuid4().hex[:8]}"], timeout=180)
    out = last_json(proc.stdout)
    assert out["dtypes"] == {"nvidia_e4m3": "float8_e4m3fn",
                             "mi300_e4m3": "float8_e4m3fnuz",  # (before: float8_e4m3fn)
                             "mi300_e4m3_again": "float8_e4m3fnuz",
                             "nvidia_e5m2": "float8_e5m2",
                             "mi355_e5m2": "float8_e4m3fn"}, out  # (before: float8_e5m2)
    nothing = {"stored": True, "found": 0, "loaded": 0, "got_the_others_bytes": False}
    shared = {"stored": True, "found": 4, "loaded": 4, "got_the_others_bytes": True}
    assert out["nvidia_e4m3->mi300_e4m3"] == nothing, out
    assert out["mi300_e4m3->nvidia_e4m3"] == nothing, out
    assert out["nvidia_e5m2->mi355_e5m2"] == nothing, out
    # engines of one format share, whichever GPU and flag
    assert out["mi300_e4m3->mi300_e4m3_again"] == shared, out
    assert out["nvidia_e4m3->mi355_e5m2"] == shared, out
