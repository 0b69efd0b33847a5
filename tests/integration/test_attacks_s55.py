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


def run_command(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvstore ARGS`` in a process of bounded memory."""
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, timeout=120, preexec_fn=_limited)


def test_route_tokens_from_an_endless_file_is_a_one_line_refusal(tmp_path: Path) -> None:
    """``kvstore route --tokens /dev/zero`` read the file whole: the command's memory grew
    till the host killed it (here, its bounded memory ran out: a MemoryError traceback).
    The token ids are now read up to a bound, past which it says so in one line."""
    ident = make_identity()
    identity = tmp_path / "identity.json"
    identity.write_text(json.dumps({f: getattr(ident, f) for f in ident.__struct_fields__}))
    done = run_command("route", "--endpoints", f"ipc://{tmp_path}/none", "--tokens",
                       "/dev/zero", "--identity", f"@{identity}", "--deadline", "0.1")
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: "), done.stderr
    assert "holds more than" in lines[0], done.stderr
