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
    # a module the other checkout lacks is missing, not this checkout's
    (other / "scheduler" / "duel_samples.py").unlink()
    missing = subprocess.run([sys.executable, "-c", "import kvstore.scheduler.dueling"],
                             capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(other)},
                             cwd=tmp_path, timeout=60)
    assert missing.returncode != 0
    assert "No module named 'kvstore.scheduler.duel_samples'" in missing.stderr
    # and this checkout by path its own, with one finder however often it is reloaded
    code = ("import importlib, sys, kvstore, kvstore.scheduler.dueling as d; "
            "importlib.reload(kvstore); importlib.reload(kvstore); "
            "print(d.__file__, sum(getattr(f, '__qualname__', '') == '_Beside' "
            "for f in sys.meta_path))")
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path,
                          timeout=60, check=True).stdout.split()
    assert here[0].startswith(str(ROOT / "scheduler")) and here[1] == "1", here


def test_an_application_with_a_scheduler_package_of_its_own_keeps_it(
        tmp_path: Path) -> None:
    # kvstore installed among an application's files (pip install --target), beside the
    # application's own pyproject and its own top-level ``scheduler``: kvstore's
    # subpackages are the ones inside it, the application's package its own
    app = tmp_path / "app"
    shutil.copytree(ROOT / "kvstore", app / "kvstore",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("scheduler", "tiers", "kernels", "plugins"):
        shutil.copytree(ROOT / folder, app / "kvstore" / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (app / "pyproject.toml").write_text('[project]\nname = "app"\n')
    (app / "scheduler").mkdir()
    (app / "scheduler" / "__init__.py").write_text("MINE = True\n")
    code = ("import kvstore, kvstore.scheduler.dueling as d, scheduler; "
            "print(d.__file__, scheduler.MINE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(app)}, cwd=app,
                         timeout=60, check=True).stdout.split()
    assert out[0].startswith(str(app / "kvstore" / "scheduler")) and out[1] == "True", out
