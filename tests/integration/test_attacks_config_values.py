"""Hostile numbers in the configuration: a typed error naming the field, never a crash.

Counts past a C int, sizes past any host and numbers that are not finite passed every
field's own check: the daemon then died at start with a traceback (a ZeroMQ option, an
event's rank, the arena's size), or started and failed every hello (a reply it could not
encode), or took NaN as a limit.  The file, the environment and the flags meet the same
checks; one case starts a real daemon process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError

EVENTS = {"KVSTORE_EVENTS_ENDPOINT": "tcp://127.0.0.1:1"}
HUGE = "99999999999999999999"  # past 2**64


@pytest.mark.parametrize(("env", "field"), [
    ({"KVSTORE_SERVER_MAX_KEYS_PER_REQUEST": HUGE}, "server.max_keys_per_request"),
    ({"KVSTORE_SERVER_MAX_SESSIONS_PER_TENANT": HUGE}, "server.max_sessions_per_tenant"),
    ({"KVSTORE_SERVER_MAX_TRANSFERS_IN_FLIGHT": HUGE}, "server.max_transfers_in_flight"),
    ({**EVENTS, "KVSTORE_EVENTS_BUFFER_STEPS": "3000000000"}, "events.buffer_steps"),
    ({**EVENTS, "KVSTORE_EVENTS_QUEUE_BATCHES": "3000000000"}, "events.queue_batches"),
    ({**EVENTS, "KVSTORE_EVENTS_DATA_PARALLEL_RANK": HUGE}, "events.data_parallel_rank"),
    ({"KVSTORE_SERVER_LEASE_SECONDS": "inf"}, "server.lease_seconds"),
    ({"KVSTORE_SERVER_MAX_REQUESTS_PER_SECOND": "nan"}, "server.max_requests_per_second"),
    ({"KVSTORE_REMOTE_UNHEALTHY_SECONDS": "nan"}, "remote.unhealthy_seconds"),
    ({"KVSTORE_DRAM_DEFER_SECONDS": "inf"}, "dram.defer_seconds"),
    ({"KVSTORE_SERVER_MAX_REQUEST_BYTES": "99999999TiB"}, "server.max_request_bytes"),
    ({"KVSTORE_DRAM_CAPACITY": "99999999TiB"}, "dram.capacity"),
    ({"KVSTORE_DRAM_CAPACITY": str(1 << 70)}, "dram.capacity"),
])
def test_a_hostile_number_is_a_config_error_naming_its_field(env: dict[str, str],
                                                             field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(env=env)


def test_the_largest_values_taken_still_load() -> None:
    config = load_config(env={"KVSTORE_SERVER_MAX_KEYS_PER_REQUEST": str(2**31 - 1),
                              "KVSTORE_SERVER_MAX_REQUEST_BYTES": "1048576TiB",
                              "KVSTORE_SERVER_LEASE_SECONDS": "1e9"})
    assert config.server.max_keys_per_request == 2**31 - 1
    assert config.max_request_bytes == 1 << 60


def test_a_daemon_given_a_count_past_a_c_int_says_so_and_exits(tmp_path: Path) -> None:
    # it died of an OverflowError's traceback setting the replay socket's queue
    toml = tmp_path / "hostile.toml"
    toml.write_text('[events]\nendpoint = "tcp://127.0.0.1:1"\n'
                    'replay_endpoint = "tcp://127.0.0.1:2"\nbuffer_steps = 3000000000\n')
    run = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(toml),
         "--endpoint", f"ipc://{tmp_path / 'kvstore.sock'}", "--dram-capacity", "8MiB",
         "--ssd-capacity", "0", "--ssd-path", str(tmp_path / "ssd")],
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "events.buffer_steps" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("share", ["0.00001%", "1e-9%"])
def test_a_tenant_share_of_the_remote_store_that_rounds_to_nothing_is_refused(
        share: str) -> None:
    """Before, a share of remote.capacity under a byte came to 0, which is "no bound":
    the operator who meant a tiny bound got none, without a word."""
    with pytest.raises(ConfigError, match="remote.max_bytes_per_tenant: .* less than a byte"):
        load_config(env={"KVSTORE_REMOTE_CAPACITY": "1MiB",
                         "KVSTORE_REMOTE_MAX_BYTES_PER_TENANT": share})
    assert load_config(env={"KVSTORE_REMOTE_CAPACITY": "1MiB",
                            "KVSTORE_REMOTE_MAX_BYTES_PER_TENANT": "0.001%"}
                       ).remote_tenant_bytes == 10
