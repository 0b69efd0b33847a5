"""kvstore's HiCache backend under SGLang set-ups the other engine tests do not take
(sglang_s54_run.py, in the SGLang environment, against real daemons): extra configs
with misspelt keys or values of the wrong type; page sizes of 1, 7 and 100 tokens
through the v1 interface and the tensor one; MLA pages shared by tensor-parallel ranks;
a key twice in a batch; hits with a gap; DRAM pinned full by another engine; a daemon
killed and started again under the backend."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env


def s54_run(role: str, daemon: DaemonProcess, *extra: str) -> Any:
    proc = run_in_env("sglang", [str(HERE / "sglang_s54_run.py"), "--role", role,
                                 "--endpoint", daemon.endpoint,
                                 "--tenant", f"sglang-{uuid.uuid4().hex[:8]}", *extra],
                      timeout=240)
    return last_json(proc.stdout)


def test_misspelt_keys_and_wrong_types_in_the_extra_config_fail_the_start(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # each was taken: a "tennant" or "model_revison" ignored without a word (the pages
    # went to the default tenant, or were shared with other weights'), an "endpont"
    # left the default endpoint; a timeout of "10s" raised float()'s bare ValueError,
    # one of 0 or -1 was taken, a list became the salt "['a']"
    run = s54_run("config", daemon_factory(dram_capacity="64MiB",
                                           extra=["--slab-size", "16MiB"]))
    for extra, near in (('{"tennant": "other"}', "'tenant'"),
                        ('{"model_revison": "r2"}', "'model_revision'")):
        assert run[extra].startswith("ConfigError:") and f"did you mean {near}" in run[extra]
    assert run['{"endpont": "ipc:///run/kvstore/kvstore.sock"}'].startswith("ConfigError:")
    for extra in ('{"timeout": "10s"}', '{"timeout": 0}', '{"timeout": -1}'):
        assert run[extra].startswith("ConfigError:") and "'timeout'" in run[extra], run
    assert run['{"salt": ["a"]}'].startswith("ConfigError:") and "'salt'" in run[
        '{"salt": ["a"]}']
    assert run['{"model_name": 7}'].startswith("ConfigError:")
    # a key of SGLang's, or of nothing near the backend's, starts (with a warning);
    # numbers where a name goes are taken as their text
    assert run['{"enable_metadata_cache": true}'] == "started"
    assert run['{"salt": 3, "timeout": 2.5}'] == "started"


def test_set_ups_the_other_tests_do_not_take(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    shared = daemon_factory(dram_capacity="128MiB", extra=["--slab-size", "16MiB"])
    full = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    run = s54_run("setups", shared, "--full-endpoint", full.endpoint,
                  "--workdir", str(tmp_path))
    # pages of 1, 7 and 100 tokens, through the v1 interface and the tensor one
    assert all(got == [5, 5, 5, True] for got in run["page_sizes"].values()), run
    shapes = run["shapes"]
    assert shapes["mla"] == [4, 4, 4, True]  # rank 1 loads rank 0's MLA pages
    # a key twice in one batch: stored once (its first page), loaded as that page
    assert shapes["twice_set"] == [True] * 4 and shapes["twice_exists"] == 4
    assert shapes["twice_get"] == [True] * 4 and all(shapes["twice_pages"])
    # pages 0-2 and 4 cached: the prefix is found and loaded, nothing past the gap
    assert shapes["gap_exists"] == 3
    assert shapes["gap_get_v1"] == [True] * 3 + [False] * 3
    assert shapes["gap_get"] == [True] * 3 + [False] * 3 and all(shapes["gap_bytes"])
    assert shapes["held"] == {"pinned": 0, "reserved": 0}
    # DRAM pinned full by another engine: SGLang is told which pages were not stored
    # (a prefix was), finds and loads just those, its other pages untouched
    full_run = run["pinned_full"]
    stored = sum(full_run["set"])
    assert 0 < stored < 20 and full_run["set"] == [True] * stored + [False] * (20 - stored)
    assert full_run["found"] == stored and full_run["loaded"] == stored
    assert full_run["same"] and full_run["rest_untouched"]
    assert full_run["held"] == {"pinned": 0, "reserved": 0}
    # the daemon killed and started again: misses (nothing written to the pages), then
    # the pages stored again load right
    again = run["restarted"]
    assert again["stored"] == 3 and again["found_after"] == 0 and again["loaded_after"] == 0
    assert again["untouched"]
    assert again["set_again"] == [True] * 6 and again["found"] == 6 and again["loaded"] == 6
    assert again["same"] and again["held"] == {"pinned": 0, "reserved": 0}


def test_pages_stored_again_take_no_slot_and_evict_nothing(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # Pages 2-7 of a request stored by one engine, then the whole request by another:
    # its lookup finds no leading page, so pages 2-7 are sent again, and are duplicates
    # taking no slot; only pages 0 and 1 make room.  The whole request again: found.
    out = s54_run("stored_again", daemon_factory(dram_capacity="64MiB",
                                                 extra=["--slab-size", "4MiB"]))
    assert out["free"] == 4 and (out["part_set"], out["whole_set"]) == (6, 8), out
    assert out["part"] == {"evictions": 2, "duplicates": 0, "commits": 6}, out
    assert out["whole"] == {"evictions": 2, "duplicates": 6, "commits": 2}, out
    assert out["again"] == {"evictions": 0, "duplicates": 0, "commits": 0}, out
    assert out["loaded"] == 8 and out["same"], out
    assert out["held"] == {"pinned": 0, "reserved": 0}, out
