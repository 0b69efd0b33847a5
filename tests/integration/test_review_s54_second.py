"""A second review of this round's changes: what a reader of each found wrong."""

from __future__ import annotations

import json
from typing import Any

from engines.engine_envs import run_in_env

# SGLang's dynamic backend reads "allocator" from the same extra config it hands the
# backend ("shm": its host pool in shared memory, ``pool_host.common.get_allocator_type``)
# and leaves it there; ``check_extra`` warned that it was not the backend's and ignored
_CHECK = """
import json, logging
from kvstore.integrations.sglang import check_extra
said = []
class Keep(logging.Handler):
    def emit(self, record): said.append(record.getMessage())
logging.getLogger("kvstore").addHandler(Keep())
check_extra({"backend_name": "kvstore", "class_name": "KVStoreHiCacheStorage",
             "module_path": "kvstore.integrations.sglang", "allocator": "shm",
             "interface_v1": 1, "endpoint": "ipc:///tmp/x.sock"})
check_extra({"allocatr": "shm"})  # (a key of nothing: still warned of)
print(json.dumps(said))
"""


def test_sglang_own_allocator_key_is_not_warned_of_as_ignored() -> None:
    said = json.loads(run_in_env("sglang", ["-c", _CHECK], timeout=120).stdout
                      .strip().splitlines()[-1])
    assert len(said) == 1 and "allocatr" in said[0], said


def test_a_posted_prefetch_past_the_bound_on_work_under_way_is_logged_quietly(
        caplog: Any) -> None:
    """An engine posts a best-effort prefetch per request and KV group and rank (vLLM's
    connector); past the daemon's bound on a session's work under way (256) each refusal
    was a warning line.  It is a debug line now; other refusals stay warnings."""
    import logging
    from types import SimpleNamespace

    from kvstore import protocol as p
    from kvstore.client_core import SessionCore

    core: Any = SimpleNamespace(_unread={1: "prefetch", 2: "prefetch", 3: "release"})
    with caplog.at_level(logging.DEBUG, logger="kvstore"):
        assert SessionCore._settle(core, p.ErrorReply(1, "limit_exceeded", "under way"))
        assert SessionCore._settle(core, p.ErrorReply(2, "capacity", "no room"))
        assert SessionCore._settle(core, p.ErrorReply(3, "limit_exceeded", "under way"))
    levels = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records]
    assert levels == [(logging.DEBUG, "the daemon refused a posted prefetch"),
                      (logging.WARNING, "the daemon refused a posted prefetch"),
                      (logging.WARNING, "the daemon refused a posted release")], levels
