"""vLLM on the CPU with kvstore's connector under set-ups the other engine tests do not
take: a ``kv_connector_extra_config`` with a value of the wrong type or range.

Before: the connector took a ``timeout`` of -1 (a daemon that stopped answering hung the
engine's step for good) or 0 (every call a miss, the engine served without kvstore),
and a ``max_pending_save_mib`` of -5; a ``timeout`` of "10s" raised float()'s bare
ValueError, which names no key, after the scheduler's connect had started; an
``endpoint`` that is not text crashed the connect thread, and the engine served on.
Now each is refused when the engine starts, with the key named (before, the engine
with a timeout of -1 and no daemon up never finished starting).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_envs import HERE, last_json, run_in_env

VALUES = """
import json
from kvstore.integrations.vllm import check_values
out = {}
for extra in json.loads(__import__("sys").argv[1]):
    try:
        check_values(extra)
        out[json.dumps(extra)] = "taken"
    except ValueError as exc:
        out[json.dumps(extra)] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""
BAD = [{"timeout": -1}, {"timeout": 0}, {"timeout": "10s"}, {"timeout": None},
       {"timeout": True}, {"max_pending_save_mib": -5}, {"max_pending_save_mib": "1GiB"},
       {"prefill_tokens_per_s": "fast"}, {"prefill_tokens_per_s": -1},
       {"rates_refresh_s": "x"}, {"endpoint": 5}, {"model_name": ["m"]},
       {"tenant": ["a"]}, {"token": 1.5}]
GOOD = [{"timeout": 2.5, "max_pending_save_mib": "64", "prefill_tokens_per_s": 0,
         "rates_refresh_s": 0, "endpoint": "ipc:///x", "tenant": 7, "token": "t",
         "model_revision": 3, "model_name": "m"}, {"endpoint": None}]

START = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import vllm_run, vllm_setups_run
vllm_run.make_model("tiny-llama")
try:
    vllm_setups_run.start_engine("tiny-llama", {}, {"extra": json.loads(sys.argv[2])})
    print(json.dumps("started"))
except Exception as exc:
    print(json.dumps(f"{type(exc).__name__}: {exc}"))
os._exit(0)
"""


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    """What ``check_values`` says of each extra config (no engine started)."""
    found: dict[str, Any] = last_json(run_in_env("vllm", ["-c", VALUES,
                                                          json.dumps(BAD + GOOD)],
                                                 timeout=120).stdout)
    return found


def test_a_value_of_the_wrong_type_or_range_is_refused_naming_its_key(
        values: dict[str, Any]) -> None:
    for extra in BAD:
        (key,) = extra
        said = values[json.dumps(extra)]
        assert said.startswith("ConfigError: KVStoreConnector") and repr(key) in said, said
    for extra in GOOD:
        assert values[json.dumps(extra)] == "taken", extra


def test_an_engine_with_a_timeout_of_minus_one_fails_its_start(tmp_path: Path) -> None:
    # (the daemon need not be up: the value is refused before any connect)
    extra = {"endpoint": f"ipc://{tmp_path / 'kvstore.sock'}", "timeout": -1}
    said = last_json(run_in_env("vllm", ["-c", START, str(HERE), json.dumps(extra)],
                                timeout=300, cwd=tmp_path).stdout)
    assert said.startswith("ConfigError: KVStoreConnector") and "'timeout'" in said, said
