"""An SSD tier of one slab (a capacity under `ssd.slab_size`, 64 MiB by default, shrinks
the slab to it) serves one block size at a time: a second size found no SSD room at all,
and a clean stop's flush, which trades half of a size's slabs, none.  Found by the restart
harness (a 24 MiB tier lost 112-234 blocks of the other size at each stop); the daemon
now says so at start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess


def test_a_one_slab_ssd_tier_is_warned_of(tmp_path: Path,
                                          daemon_factory: Callable[..., DaemonProcess]
                                          ) -> None:
    one = daemon_factory(ssd_capacity="24MiB")
    assert "holds one slab" in one.log() and "ssd.slab_size" in one.log(), one.log()
    config = tmp_path / "slabs.toml"
    config.write_text('[ssd]\nslab_size = "4MiB"\n')
    six = daemon_factory(ssd_capacity="24MiB", extra=["--config", str(config)])
    assert "holds one slab" not in six.log(), six.log()
    none = daemon_factory()
    assert "holds one slab" not in none.log(), none.log()
