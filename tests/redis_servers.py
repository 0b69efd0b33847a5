"""Real redis-server processes for tests: one standalone server, or a small cluster.

Self-contained (the standard library and redis-py only), so fixtures in any conftest can
use it.  Servers listen on free loopback ports, keep nothing on disk (``--save ''
--appendonly no``) and are killed by ``stop()``; a standalone server can be paused,
killed and restarted on the same port to test outages.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER_ENV = "KVSTORE_REDIS_SERVER"
START_TIMEOUT_S = 10.0


def redis_server_binary() -> str | None:
    """The redis-server (or valkey-server) to run: $KVSTORE_REDIS_SERVER, else on PATH."""
    configured = os.environ.get(REDIS_SERVER_ENV)
    if configured:
        return configured
    return shutil.which("redis-server") or shutil.which("valkey-server")


def redis_cli_binary() -> str | None:
    """The redis-cli (or valkey-cli) next to the server binary, else on PATH."""
    server = redis_server_binary()
    if server is not None:
        for name in ("redis-cli", "valkey-cli"):
            sibling = Path(server).with_name(name)
            if sibling.exists():
                return str(sibling)
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that nothing listens on right now."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:  # held open together, so the kernel hands out distinct ports
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


class RedisServer:
    """One redis-server process on 127.0.0.1; ``port`` stays the same across restarts."""

    def __init__(
        self, workdir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("no redis-server found; set $" + REDIS_SERVER_ENV)
        self.binary = binary
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer(port={self.port}, {state})"

    @property
    def url(self) -> str:
        """The backend URL of this server (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self) -> redis.Redis:
        """A short-timeout synchronous client, for setup and for poking at stored values."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0)

    def start(self) -> None:
        """Start the server and return once it answers PING."""
        if self.running:
            raise RuntimeError(f"{self!r} is already running")
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
            "--daemonize", "no",
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_for_ping()

    def _wait_for_ping(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client() as client:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited: {self.log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.02)

    def log_tail(self) -> str:
        """The end of the server's log, for error messages."""
        log = self.workdir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections stay open but nothing answers."""
        assert self.process is not None, "pause() needs a started server"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Thaw a paused process (SIGCONT)."""
        assert self.process is not None, "resume() needs a started server"
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the port can be reused by ``start()`` at once."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process must wake to die
            self.process.kill()
        self.process.wait(timeout=10)
        self.process = None

    stop = kill


class RedisClusterServers:
    """Three (or more) masters with no replicas, created with ``redis-cli --cluster``."""

    def __init__(self, workdir: Path, nodes: int = 3) -> None:
        if nodes < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.servers: list[RedisServer] = []
        ports = free_ports(2 * nodes)
        for index in range(nodes):
            node_dir = workdir / f"node{index}"
            # Choose the bus port ourselves: the default (port + 10000) may be taken.
            port, bus_port = ports[2 * index], ports[2 * index + 1]
            self.servers.append(RedisServer(node_dir, port=port, extra_args=(
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "2000",
                "--cluster-port", str(bus_port),
            )))

    def __repr__(self) -> str:
        return f"RedisClusterServers(ports={[s.port for s in self.servers]})"

    @property
    def url(self) -> str:
        """The backend URL: one startup node; the client discovers the others."""
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def start(self) -> None:
        """Start every node, join them into one cluster, wait for cluster_state:ok."""
        for server in self.servers:
            server.start()
        cli = redis_cli_binary()
        if cli is None:
            raise FileNotFoundError("no redis-cli found to create the cluster")
        addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, timeout=START_TIMEOUT_S * 3,
        )
        self._wait_for_state_ok()

    def _wait_for_state_ok(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S * 3
        for server in self.servers:
            with server.client() as client:
                while True:
                    info = client.execute_command("CLUSTER INFO")
                    # redis-py parses the reply into a dict; older versions hand back text
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    state = info.get("cluster_state") if isinstance(info, dict) else None
                    if state == "ok" or "cluster_state:ok" in text:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"cluster never reached cluster_state:ok: {text}")
                    time.sleep(0.05)

    def stop(self) -> None:
        """Kill every node."""
        for server in self.servers:
            server.stop()
