"""`serve_http`: the routes served by uvicorn until SIGTERM (or Ctrl-C), on one rank or on the
leader of several. A stop signal stops accepting connections, lets in-flight requests finish
within the grace period, cancels the rest, and exits 0.
"""

from __future__ import annotations

import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from graphc.runtime.engine import Engine
from graphc.runtime.online import OnlineEngine
from graphc.server.routes import create_app


@dataclass(frozen=True)
class HttpJob:
    """What the leader rank of `graphc serve` does: serve HTTP until SIGTERM / SIGINT (picklable:
    with several ranks it travels to the leader's process)."""

    artifacts: str
    host: str
    port: int
    max_waiting: int
    grace_seconds: float
    model_name: str
    follower_timeout: float | None = None  # followers idle between requests as long as the server does
    ends_on_signal: bool = True

    @property
    def shutdown_seconds(self) -> int:
        """The agent waits the grace period (and the ranks' teardown) before killing them."""
        return int(self.grace_seconds) + 15

    def lead(self, engine: Engine) -> None:
        from tokenizers import Tokenizer

        manifest = engine.manifest
        tokenizer = Tokenizer.from_file(str(Path(self.artifacts) / manifest.tokenizer)) if manifest.tokenizer else None
        online = OnlineEngine(engine, self.max_waiting)
        listener = socket.create_server((self.host, self.port))
        config = uvicorn.Config(create_app(online, manifest, tokenizer, self.model_name), log_level="warning",
                                timeout_graceful_shutdown=self.grace_seconds, lifespan="off")
        # uvicorn handles SIGTERM / SIGINT while it serves, then re-raises them: to a handler that
        # does nothing, so a graceful stop ends here (before this point they stop the command).
        previous = {signum: signal.signal(signum, lambda *_: None) for signum in (signal.SIGTERM, signal.SIGINT)}
        print(f"serving {self.artifacts} on http://{self.host}:{listener.getsockname()[1]}", file=sys.stderr,
              flush=True)
        try:
            _DrainingServer(config).run(sockets=[listener])
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            online.stop()
            listener.close()


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM / SIGINT and not cut short by a second:
    with several ranks the leader gets a Ctrl-C twice (from the terminal, then from the agent)."""

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            super().handle_exit(sig, frame)


def serve_http(artifacts: Path, host: str, port: int, max_waiting: int, grace_seconds: float,
               model_name: str | None = None, trusted_key: Path | None = None) -> None:
    """Serve `artifacts` on (host, port) (0: any free port) until SIGTERM or Ctrl-C: in this
    process on one rank; with several, this process is torchrun's agent, the server runs in the
    leader rank's process and the followers run its steps."""
    from graphc.artifacts.directory import read_manifest
    from graphc.runtime.launch import launch_ranks
    from graphc.runtime.loader import kv_pool_blocks

    manifest = read_manifest(artifacts, trusted_key)
    job = HttpJob(str(artifacts), host, port, max_waiting, grace_seconds, model_name or Path(artifacts).resolve().name)
    if manifest.topology.world == 1:
        job.lead(Engine(artifacts, manifest=manifest))
        return
    kv_pool_blocks(manifest)  # GRAPHC_NUM_KV_BLOCKS checked here, not once per rank after start-up
    launch_ranks(Path(artifacts), job, manifest.topology.world, trusted_key=trusted_key)
