"""SGLang servers of different weights served under one alias never load each other's
pages through kvstore (sglang_s62_run.py, in the SGLang environment, against a real
daemon).

Before: SGLang names the model to storage backends by ``--served-model-name``, and the
backend took that name as the model's; with no revision of the weights found (a hub id
outside the default Hugging Face cache), a canary of new weights served under the
stable deployment's alias found and loaded the stable one's pages.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env


def test_servers_of_other_weights_under_one_alias_share_no_pages(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    proc = run_in_env("sglang", [str(HERE / "sglang_s62_run.py"), "--endpoint", daemon.endpoint,
                                 "--tenant", f"sglang-{uuid.uuid4().hex[:8]}"], timeout=180)
    out = last_json(proc.stdout)
    assert out["one_alias"] == {"stored": True, "found": 0, "loaded": 0,
                                "got_the_others_bytes": False}, out
    assert out["names"] == ["example-org/tiny-base", "example-org/tiny-finetune"], out
    # one model's servers under two aliases compute the same pages: shared
    assert out["two_aliases"] == {"stored": True, "found": 4, "loaded": 4,
                                  "got_the_others_bytes": True}, out
