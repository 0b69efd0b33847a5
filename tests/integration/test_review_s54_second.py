"""A second review of this round's changes: what a reader of each found wrong."""

from __future__ import annotations

import json

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
