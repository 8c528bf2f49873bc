"""Simulated hosts for jobs that span hosts: each `graphc` command in its own mount and IPC
namespace with its own /dev/shm (a directory of the test's, bind-mounted there, so the test can
look into it afterwards), all on the loopback network."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

GRAPHC = str(Path(sys.executable).parent / "graphc")
JOB_SECRET = {"GRAPHC_JOB_SECRET": "the-tests-job-secret-0123456789"}
"""Every simulated host's (a job that spans hosts needs one)."""
# Inside the namespace: this host's /dev/shm is the directory given as $0, then the command.
HOST_SHELL = 'mount --bind "$0" /dev/shm && exec "$@"'
NAMESPACE = ["unshare", "--mount", "--ipc", "--propagation", "private"]


def namespaces_or_skip() -> None:
    """Skip (saying why) where this machine does not let a test make mount and IPC namespaces."""
    try:
        probe = subprocess.run([*NAMESPACE, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("unshare (util-linux) is not installed: hosts cannot be simulated")
    if probe.returncode != 0:
        pytest.skip(f"mount and IPC namespaces are not allowed here (unshare: {probe.stderr.strip()}); "
                    "CI runs as root and has them")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Host:
    """One host's `graphc` command (`--nnodes`, `--node-rank` and the rendezvous port added),
    its own /dev/shm at `shm`, stdout and stderr collected as they come."""

    def __init__(self, shm: Path, node_rank: int, nnodes: int, port: int, *args: str, env: dict | None = None):
        shm.mkdir(parents=True, exist_ok=True)
        self.shm, self.node_rank = shm, node_rank
        self.process = subprocess.Popen(
            [*NAMESPACE, "sh", "-c", HOST_SHELL, str(shm), GRAPHC, *args, "--nnodes", str(nnodes),
             "--node-rank", str(node_rank), "--master-port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, **JOB_SECRET, **(env or {})})
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._drain, args=(pipe, lines), daemon=True)
                         for pipe, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line)

    def wait(self, timeout: float = 240) -> int:
        code = self.process.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return code

    def kill(self) -> None:
        """The host dies: every process of its command, at once."""
        os.killpg(self.process.pid, signal.SIGKILL)

    def ranks(self) -> list[int]:
        """The pids of this host's rank processes (spawned by its launcher)."""
        import psutil

        try:
            launcher = psutil.Process(self.process.pid)
            return [p.pid for p in launcher.children() if "spawn_main" in " ".join(p.cmdline())]
        except psutil.NoSuchProcess:
            return []

    def errors(self) -> list[str]:
        """stderr without the progress lines."""
        return [line.rstrip("\n") for line in self.err if not line.startswith("loading ")]

    def segments(self) -> list[str]:
        """graphc's shared-memory segments left on this host."""
        return sorted(p.name for p in self.shm.glob("graphc-*"))


def start_hosts(root: Path, nnodes: int, *args: str, port: int | None = None, env: dict | None = None) -> list[Host]:
    port = port or free_port()
    return [Host(root / f"host{h}-shm", h, nnodes, port, *args, env=env) for h in range(nnodes)]
