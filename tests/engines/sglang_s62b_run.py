"""SGLang engines on AMD GPUs keep fp8 KV in the GPU's own fp8 format, whichever fp8
``--kv-cache-dtype`` they were given, and must not share pages with NVIDIA engines of
another format: kvstore's HiCache backend, built by SGLang's own factory, against a
daemon.  Runs inside the SGLang test environment, started by test_engine_sglang_s62b.py;
prints one JSON object of named checks on its last line.

The platform is SGLang's own decision, patched: its ``is_hip()`` (true on ROCm), and
its fp8 kernels' ``fp8_dtype`` (what ``configure_kv_cache_dtype`` keeps fp8 KV in on
ROCm: float8_e4m3fnuz on MI300's gfx94x, float8_e4m3fn on later GPUs; computed from
device 0 when the module is imported).  Where that module cannot be imported (its
CUDA-built dependencies), a stand-in module with that one value takes its place.  The
host pool is sglang_identity_run.py's stand-in (SGLang's own needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang.srt.utils as sglang_utils  # noqa: E402
import torch  # noqa: E402
from sglang_identity_run import ShapedPool, backend, shared  # noqa: E402

FP8_KERNELS = "sglang.kernels.ops.quantization.fp8_kernel"


def fp8_kernels() -> Any:
    """SGLang's fp8 kernel module (imported off ROCm, as SGLang would), or a stand-in."""
    try:
        return __import__(FP8_KERNELS, fromlist=["fp8_dtype"])
    except Exception:  # (its CUDA-built dependencies are not in the CPU build)
        module = types.ModuleType(FP8_KERNELS)
        module.fp8_dtype = torch.float8_e4m3fn  # type: ignore[attr-defined]
        sys.modules[FP8_KERNELS] = module
        return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--tenant", required=True)
    a = parser.parse_args()
    kernels = fp8_kernels()
    made: list[Any] = []
    pools: dict[str, ShapedPool] = {}

    def engine(name: str, flag: str, seed: int, *, amd_fp8: torch.dtype | None = None) -> Any:
        """An engine under ``--kv-cache-dtype flag``: on an NVIDIA GPU, or (``amd_fp8``)
        on an AMD one whose native fp8 format that is."""
        sglang_utils.is_hip = lambda: amd_fp8 is not None  # type: ignore[assignment]
        if amd_fp8 is not None:
            kernels.fp8_dtype = amd_fp8
        pools[name] = ShapedPool(seed, dtype=torch.uint8)
        made.append(backend(a.endpoint, a.tenant, pools[name],
                            extra={"kv_cache_dtype": flag}))
        return made[-1]

    engines = {
        "nvidia_e4m3": engine("nvidia_e4m3", "fp8_e4m3", 1),
        "mi300_e4m3": engine("mi300_e4m3", "fp8_e4m3", 2, amd_fp8=torch.float8_e4m3fnuz),
        "mi300_e4m3_again": engine("mi300_e4m3_again", "fp8_e4m3", 3,
                                   amd_fp8=torch.float8_e4m3fnuz),
        "nvidia_e5m2": engine("nvidia_e5m2", "fp8_e5m2", 4),
        "mi355_e5m2": engine("mi355_e5m2", "fp8_e5m2", 5, amd_fp8=torch.float8_e4m3fn),
    }
    out: dict[str, Any] = {"dtypes": {name: e._identity.kv_dtype
                                      for name, e in engines.items()}}
    for start, (first, second) in enumerate((
            ("nvidia_e4m3", "mi300_e4m3"), ("mi300_e4m3", "nvidia_e4m3"),
            ("mi300_e4m3", "mi300_e4m3_again"), ("nvidia_e5m2", "mi355_e5m2"),
            ("nvidia_e4m3", "mi355_e5m2")), 1):
        out[f"{first}->{second}"] = shared(engines[first], engines[second], pools[first],
                                           pools[second], 1000 * start)
    for storage in made:
        storage.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
