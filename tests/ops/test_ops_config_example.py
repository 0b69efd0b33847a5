"""The example config shipped with the unit loads, and shows every field."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from kvstore.config import (
    AuthConfig,
    Config,
    DramConfig,
    EventsConfig,
    GpuConfig,
    RemoteConfig,
    ServerConfig,
    SsdConfig,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "systemd" / "kvstore.toml"


def test_example_config_loads() -> None:
    config = load_config(EXAMPLE, env={})
    assert config.endpoint == "ipc:///run/kvstore/kvstore.sock"
    assert config.dram.directory == "/dev/shm"


def test_example_config_shows_every_field() -> None:
    data = tomllib.loads(EXAMPLE.read_text())
    assert set(data) == set(Config.__struct_fields__)
    for section, struct in (("server", ServerConfig), ("dram", DramConfig), ("ssd", SsdConfig),
                            ("remote", RemoteConfig), ("auth", AuthConfig),
                            ("gpu", GpuConfig), ("events", EventsConfig)):
        missing = set(struct.__struct_fields__) - set(data[section])
        assert not missing, f"[{section}] of the example lacks {sorted(missing)}"


def test_example_events_timing_is_the_default() -> None:
    """The batching timers are tuned together: a daemon installed from the example gets
    what one with no config file does."""
    events = load_config(EXAMPLE, env={}).events
    default = EventsConfig()
    for name in ("interval_ms", "quiet_ms", "busy_interval_ms"):
        assert getattr(events, name) == getattr(default, name), name


def test_config_check_command_accepts_the_example() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "config", "check", str(EXAMPLE)],
        check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_unit_and_example_agree_on_the_endpoint() -> None:
    unit = (ROOT / "systemd" / "kvstore.service").read_text()
    endpoint = load_config(EXAMPLE, env={}).endpoint
    assert f"Environment=KVSTORE_ENDPOINT={endpoint}\n" in unit


def test_every_section_takes_environment_overrides() -> None:
    config = load_config(None, env={
        "KVSTORE_GPU_DEVICE": "cpu", "KVSTORE_GPU_CAPACITY": "64MiB",
        "KVSTORE_REMOTE_WRITE_POLICY": "write-back", "KVSTORE_DRAM_TENANT_QUOTA": "16MiB",
        "KVSTORE_SERVER_TENANT_WEIGHTS": '{"a": 2}'})
    assert (config.gpu.device, config.gpu.capacity) == ("cpu", "64MiB")
    assert config.remote.write_policy == "write-back"
    assert config.dram.tenant_quota == "16MiB"
    assert config.server.tenant_weights == {"a": 2.0}
