"""A hostile user of the command line and of a running daemon: what it is given that it
should not be is a typed one-line error, and what it holds for anyone stays bounded.
Real command processes and daemon processes, raw ZeroMQ sockets."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

from kvtest import make_identity

# the most address space the command is given: an input it reads whole runs out of it at
# once instead of taking the host's memory
_COMMAND_MEMORY = 1 << 30


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_COMMAND_MEMORY, _COMMAND_MEMORY))


def run_command(*args: str, bounded: bool = False) -> subprocess.CompletedProcess[str]:
    """``kvstore ARGS``, in a process of bounded memory where ``bounded`` (a daemon the
    command starts would not fit in it)."""
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, timeout=300, preexec_fn=_limited if bounded else None)


def test_route_tokens_from_an_endless_file_is_a_one_line_refusal(tmp_path: Path) -> None:
    """``kvstore route --tokens /dev/zero`` read the file whole: the command's memory grew
    till the host killed it (here, its bounded memory ran out: a MemoryError traceback).
    The token ids are now read up to a bound, past which it says so in one line."""
    ident = make_identity()
    identity = tmp_path / "identity.json"
    identity.write_text(json.dumps({f: getattr(ident, f) for f in ident.__struct_fields__}))
    done = run_command("route", "--endpoints", f"ipc://{tmp_path}/none", "--tokens",
                       "/dev/zero", "--identity", f"@{identity}", "--deadline", "0.1",
                       bounded=True)
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: "), done.stderr
    assert "holds more than" in lines[0], done.stderr


def test_bench_plot_in_a_directory_that_cannot_be_made_is_refused_before_it_runs(
        tmp_path: Path) -> None:
    """``kvstore bench --plot DIR`` where DIR cannot be made (under a file, say) ran
    every section asked for, then ended in a traceback from ``mkdir``, its figures never
    printed.  Now it is refused with the arguments' other errors, before anything runs."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    done = run_command("bench", "--quick", "--plot", str(taken / "charts"), "control")
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done
    assert "starting a daemon" not in done.stderr, done.stderr  # nothing ran
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstore bench: error: --plot: "), done.stderr


def test_a_lease_too_short_to_renew_is_a_config_error_naming_its_field(
        tmp_path: Path) -> None:
    """``server.lease_seconds = 1e-9`` (or ``serve --lease 1e-300``, or either on a
    SIGHUP) was taken as positive: every session's lease ran out before its next request
    (each client told its session expired), and the reaper, due every quarter of a lease,
    ran on every turn of the idle daemon's loop (a third of a core measured).  A lease
    under ``config.MIN_LEASE_SECONDS`` (0.1) is now refused, as a negative one is."""
    for lease in ("1e-300", "1e-9", "0.05"):
        config = tmp_path / "lease.toml"
        config.write_text(f"[server]\nlease_seconds = {lease}\n")
        done = run_command("config", "check", str(config))
        assert done.returncode == 2, (lease, done)
        assert "server.lease_seconds" in done.stderr and "Traceback" not in done.stderr, done
    config.write_text("[server]\nlease_seconds = 0.1\n")
    assert run_command("config", "check", str(config)).returncode == 0
