"""A third-party backend, really pip-installed, is found through its entry points."""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.plugins import available_backends, load_backend

PACKAGE_SOURCE = Path(__file__).parent / "thirdparty_pkg"
MODULE = "kvstore_demo_backend"


@pytest.fixture(scope="module")
def demo_installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """pip-install the demo package into a fresh directory and put it on sys.path."""
    work = tmp_path_factory.mktemp("thirdparty")
    source, target = work / "src", work / "site"
    shutil.copytree(PACKAGE_SOURCE, source)  # the build writes into its source tree
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--disable-pip-version-check",
         "--root-user-action=ignore", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        for name in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
            del sys.modules[name]
        importlib.invalidate_caches()


def test_not_installed_it_is_unknown() -> None:
    # first in this file, so it runs before the module fixture installs the demo package
    with pytest.raises(ConfigError, match="unknown storage backend 'demo'"):
        load_backend("demo", {"label": "x"})


def test_the_plugin_is_listed(demo_installed: Path) -> None:
    providers = available_backends()
    assert providers["demo"] == ["kvstore_demo_backend:DemoBackend (from kvstore-demo-backend)"]
    assert "demo-broken" in providers


def test_load_backend_finds_and_uses_it(demo_installed: Path) -> None:
    namespace, key = os.urandom(16), os.urandom(16)

    async def scenario() -> None:
        async with load_backend("demo", {"label": "tenant-a", "timeout_s": 1}) as backend:
            assert type(backend.inner).__module__ == MODULE
            assert Path(sys.modules[MODULE].__file__ or "").is_relative_to(demo_installed)
            assert await backend.put(namespace, [key], [b"third party"]) == [True]
            out = bytearray(11)
            assert await backend.get_into(namespace, [key], [memoryview(out)]) == [True]
            assert out == b"third party"
            assert await backend.exists(namespace, [key, os.urandom(16)]) == 1
            assert (await backend.health()).detail == "demo backend 'tenant-a'"

    asyncio.run(scenario())


def test_its_options_are_checked_at_load(demo_installed: Path) -> None:
    with pytest.raises(ConfigError, match="missing required field `label`"):
        load_backend("demo", {})
    with pytest.raises(ConfigError, match="unknown field `colour`"):
        load_backend("demo", {"label": "x", "colour": "red"})


def test_broken_entry_points_are_config_errors(demo_installed: Path) -> None:
    with pytest.raises(ConfigError, match="'demo-broken'.*failed to import"):
        load_backend("demo-broken", {})
    with pytest.raises(ConfigError, match="'demo-not-a-backend'.*not a StorageBackend"):
        load_backend("demo-not-a-backend", {})
