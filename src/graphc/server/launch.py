"""`serve_http`: the routes served by uvicorn until SIGTERM (or Ctrl-C), on one rank or on the
leader of several. A stop signal stops accepting connections, lets in-flight requests finish
within the grace period, ends the rest with an error (a stream: an error event, then [DONE]),
and exits 0.
"""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from graphc.errors import GraphcError
from graphc.runtime.engine import Engine
from graphc.runtime.hosts import HostOptions
from graphc.runtime.online import OnlineEngine
from graphc.server.isolation import CacheIsolation
from graphc.server.limits import RequestLimits
from graphc.server.routes import create_app

CUT_SECONDS = 5.0
"""Past the grace period, how long the requests ended with an error have to send their last
events before uvicorn cancels what is left."""


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
    limits: RequestLimits = RequestLimits()
    api_keys: tuple[str, ...] = ()
    """Empty: no key needed."""
    default_seed: int | None = None
    """The seed of a request that gives none; None: fresh noise per request."""
    follower_timeout: float | None = None  # followers idle between requests as long as the server does
    ends_on_signal: bool = True
    isolation: CacheIsolation = CacheIsolation()

    @property
    def shutdown_seconds(self) -> int:
        """The agent waits the grace period (and the ranks' teardown) before killing them."""
        return int(self.grace_seconds + CUT_SECONDS) + 15

    def lead(self, engine: Engine, listener: socket.socket | None = None) -> None:
        """Serve on `listener` (by default, one bound here to host and port) until a stop signal."""
        from tokenizers import Tokenizer

        manifest = engine.manifest
        tokenizer = Tokenizer.from_file(str(Path(self.artifacts) / manifest.tokenizer)) if manifest.tokenizer else None
        online = OnlineEngine(engine, self.max_waiting)
        listener = listener or bound_listener(self.host, self.port)
        app = create_app(online, manifest, tokenizer, self.model_name, self.limits, self.api_keys, self.default_seed,
                         self.isolation)
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=self.grace_seconds + CUT_SECONDS,
                                lifespan="off")
        # uvicorn handles SIGTERM / SIGINT while it serves, then re-raises them: to a handler that
        # does nothing, so a graceful stop ends here (before this point they stop the command).
        previous = {signum: signal.signal(signum, lambda *_: None) for signum in (signal.SIGTERM, signal.SIGINT)}
        key = " (API key required)" if self.api_keys else ""
        print(f"serving {self.artifacts} on {url(self.host, listener.getsockname()[1])}{key}", file=sys.stderr,
              flush=True)
        try:
            _DrainingServer(config, online, self.grace_seconds).run(sockets=[listener])
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            online.stop()
            listener.close()


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM / SIGINT and not cut short by a second:
    with several ranks the leader gets a Ctrl-C twice (from the terminal, then from the agent).
    When the grace period ends, the requests still running end with an error of their own, which
    they send, rather than being cancelled by uvicorn (a CancelledError traceback each, a stream
    cut without its end)."""

    def __init__(self, config: uvicorn.Config, online: OnlineEngine, grace_seconds: float):
        super().__init__(config)
        self.online, self.grace_seconds = online, grace_seconds

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        message = f"the server is shutting down and its grace period ({self.grace_seconds:g} s) has ended"
        cut = asyncio.get_running_loop().call_later(self.grace_seconds, self.online.abort, message)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()


def url(host: str, port: int) -> str:
    """The server's address as a URL (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bound_listener(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port), of the family the host resolves to first (an IPv6
    address or a name that resolves to one: IPv6; `::` takes IPv4 clients too where the host
    allows), or GraphcError saying why there can be none."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        dualstack = family == socket.AF_INET6 and host == "::" and socket.has_dualstack_ipv6()
        listener = socket.create_server((host, port), family=family, dualstack_ipv6=dualstack)
        # asyncio turns Nagle's algorithm off only on connections whose socket says IPPROTO_TCP, and
        # accepted sockets inherit the listener's proto, which create_server leaves 0: with Nagle on,
        # a response's body waits for the client's delayed ACK of its headers (40 ms per request).
        return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=listener.detach())
    except OSError as e:
        hint = {errno.EADDRINUSE: "another process holds the port: choose another --port (0: any free one)",
                errno.EACCES: "ports below 1024 need privileges: choose another --port"}.get(
            e.errno, "--host must name an address of this host (127.0.0.1, 0.0.0.0, ::1, ::, ...)")
        reason = (e.strerror or str(e)).partition(" (while attempting")[0]  # create_server appends the address
        raise GraphcError(f"cannot listen on {host}:{port}: {reason}; {hint}") from None


def serve_http(artifacts: Path, host: str, port: int, max_waiting: int, grace_seconds: float,
               model_name: str | None = None, trusted_key: Path | None = None,
               limits: RequestLimits = RequestLimits(), api_keys: tuple[str, ...] = (),
               hosts: HostOptions = HostOptions(), default_seed: int | None = None,
               isolation: CacheIsolation = CacheIsolation()) -> None:
    """Serve `artifacts` on (host, port) (0: any free port) until SIGTERM or Ctrl-C: in this
    process on one rank; with several, this process is torchrun's agent, the server runs in the
    leader rank's process and the followers run its steps. The address is bound (or refused)
    before any graph loads. `hosts`: this host's part of a job that spans hosts: only host 0
    (the leader's) serves HTTP, the others run their ranks until the leader stops."""
    from graphc.artifacts.directory import read_manifest
    from graphc.runtime.launch import launch_ranks
    from graphc.runtime.loader import check_servable, kv_pool_blocks

    isolation.check(api_keys)
    manifest = read_manifest(artifacts, trusted_key)
    check_servable(Path(artifacts), manifest)  # before the address is bound or any rank starts
    job = HttpJob(str(artifacts), host, port, max_waiting, grace_seconds, model_name or Path(artifacts).resolve().name,
                  limits, api_keys, default_seed, isolation=isolation)
    hosts.layout(manifest.topology.world)  # host options that do not fit: refused before anything starts
    if hosts.node_rank == 0:
        listener = bound_listener(host, port)
        if manifest.topology.world == 1:
            job.lead(Engine(artifacts, manifest=manifest), listener)
            return
        listener.close()  # the leader rank binds it again; here it only showed the address can be bound
    kv_pool_blocks(manifest)  # GRAPHC_NUM_KV_BLOCKS checked here, not once per rank after start-up
    launch_ranks(Path(artifacts), job, manifest.topology.world, trusted_key=trusted_key, hosts=hosts)
