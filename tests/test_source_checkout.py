"""A source checkout run by path (``PYTHONPATH=ROOT``, as the benchmarks run another
version beside this one) imports its own subpackages, not the installed checkout's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_another_checkout_imports_its_own_scheduler_and_tiers(tmp_path: Path) -> None:
    other = tmp_path / "other"
    for folder in ("kvstore", "scheduler", "tiers", "kernels", "plugins"):
        shutil.copytree(ROOT / folder, other / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", other / "pyproject.toml")
    (other / "scheduler" / "marker.py").write_text("WHERE = 'other'\n")
    code = ("import kvstore, kvstore.scheduler.dueling as d, kvstore.tiers as t, "
            "kvstore.scheduler.marker as m; print(kvstore.__file__, d.__file__, "
            "t.__file__, m.WHERE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(other)}, cwd=tmp_path,
                         timeout=60, check=True).stdout.split()
    assert all(path.startswith(str(other)) for path in out[:3]), out
    assert out[3] == "other"
    # and this checkout, as installed, its own
    here = subprocess.run([sys.executable, "-c", "import kvstore.scheduler.dueling as d; "
                           "print(d.__file__)"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, check=True).stdout.strip()
    assert here.startswith(str(ROOT)), here
