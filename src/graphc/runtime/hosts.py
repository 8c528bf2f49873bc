"""Jobs whose ranks span hosts: the options every host's command takes (torchrun's multi-node
ones), and which host runs which ranks.

Every host runs the same `graphc run` / `graphc serve` command with its own `--node-rank`; host
h runs ranks [h * R, (h + 1) * R) for R ranks a host, so the leader (rank 0) is on host 0, which
also serves the rendezvous store at the master address (every host must reach it) and, for
`graphc serve`, the HTTP server. Every host is given the same job secret (`--job-secret-file` or
$GRAPHC_JOB_SECRET), which authenticates graphc's values in that store (`graphc.runtime.rendezvous`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from graphc.errors import GraphcError

DEFAULT_MASTER_PORT = 29500
"""torchrun's."""
SECRET_ENV = "GRAPHC_JOB_SECRET"
"""The job secret itself (the alternative to `--job-secret-file`)."""
MIN_SECRET_CHARS = 16
NO_SECRET = (f"a job that spans hosts needs a secret every host is given: set {SECRET_ENV} or pass --job-secret-file F "
             "(e.g. from `openssl rand -hex 32`); without it anyone who reaches the rendezvous port could steer the job")


@dataclass(frozen=True)
class HostLayout:
    """`hosts` hosts of `ranks_per_host` ranks each."""

    hosts: int
    ranks_per_host: int

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def first_rank(self, host: int) -> int:
        """The host's relay: the leader on host 0, the rank that republishes its steps elsewhere."""
        return host * self.ranks_per_host

    def ranks(self, host: int) -> range:
        return range(self.first_rank(host), self.first_rank(host) + self.ranks_per_host)

    def describe(self, host: int) -> str:
        """'host 1 (ranks 2-3)', as the errors name a host."""
        ranks = self.ranks(host)
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"host {host} ({span}{', the leader' if host == 0 else ''})"


@dataclass(frozen=True)
class HostOptions:
    """One host's part of a job: torchrun's `--nnodes`, `--node-rank`, `--master-addr`,
    `--master-port` (or `--rdzv-endpoint HOST:PORT`), `--nproc-per-node`, and how long the hosts
    wait for each other to join."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    nproc_per_node: int | None = None
    join_timeout: float = 300.0
    secret: str | None = field(default=None, repr=False)
    """The job secret that authenticates graphc's values in the rendezvous store (`read_secret`)."""

    @classmethod
    def from_cli(cls, nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None,
                 rdzv_endpoint: str | None, nproc_per_node: int | None, join_timeout: float,
                 job_secret_file: Path | None = None) -> HostOptions:
        """The options as given on a command line (an endpoint or an address and port, not both),
        with the job secret from `job_secret_file` or $GRAPHC_JOB_SECRET (required over several hosts)."""
        if rdzv_endpoint is not None:
            if master_addr is not None or master_port is not None:
                raise GraphcError("--rdzv-endpoint names the rendezvous address and port: "
                                  "give it or --master-addr / --master-port, not both")
            host, sep, port = rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise GraphcError(f"--rdzv-endpoint: {rdzv_endpoint!r} must be HOST:PORT with a port in 1..65535")
            master_addr, master_port = host.strip("[]"), int(port)
        secret = read_secret(job_secret_file, os.environ.get(SECRET_ENV))
        options = cls(nnodes, node_rank, master_addr or "127.0.0.1", master_port or DEFAULT_MASTER_PORT,
                      nproc_per_node, join_timeout, secret)
        if not 0 <= node_rank < nnodes:
            raise GraphcError(f"--node-rank: {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
        if nnodes > 1 and secret is None:
            raise GraphcError(NO_SECRET)
        return options

    @property
    def endpoint(self) -> str:
        return f"[{self.master_addr}]:{self.master_port}" if ":" in self.master_addr else \
            f"{self.master_addr}:{self.master_port}"

    def layout(self, world: int) -> HostLayout:
        """The hosts of a job of `world` ranks, or GraphcError naming the option that does not fit it."""
        if self.nnodes > world:
            raise GraphcError(f"--nnodes: {self.nnodes} hosts for artifacts of {world} rank(s); "
                              "a host runs at least one rank")
        per_host = self.nproc_per_node if self.nproc_per_node is not None else world // self.nnodes
        if per_host * self.nnodes != world:
            given = (f"--nproc-per-node {self.nproc_per_node} x --nnodes {self.nnodes} = "
                     f"{self.nproc_per_node * self.nnodes}" if self.nproc_per_node is not None
                     else f"--nnodes {self.nnodes} does not divide them ({world} % {self.nnodes} = {world % self.nnodes})")
            raise GraphcError(f"the artifacts need {world} ranks, the same number on every host; {given}")
        return HostLayout(self.nnodes, per_host)


def read_secret(path: Path | None, from_env: str | None) -> str | None:
    """The job secret from `path` (its text, stripped) or the environment's value, one of them;
    None where neither is given.

    Raises:
        GraphcError: both are given, the file cannot be read, or the secret is too short to guess-proof.
    """
    if path is not None and from_env:
        raise GraphcError(f"--job-secret-file and {SECRET_ENV} both give the job secret: give one")
    if path is None and not from_env:
        return None
    source = "--job-secret-file" if path is not None else SECRET_ENV
    try:
        secret = Path(path).read_text().strip() if path is not None else from_env.strip()
    except OSError as e:
        raise GraphcError(f"--job-secret-file: cannot read {path} ({e.strerror or e})") from None
    if len(secret) < MIN_SECRET_CHARS:
        raise GraphcError(f"{source}: the job secret has {len(secret)} characters; at least {MIN_SECRET_CHARS} "
                          "are needed (e.g. `openssl rand -hex 32`)")
    return secret
