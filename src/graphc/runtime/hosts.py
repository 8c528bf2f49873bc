"""Jobs whose ranks span hosts: the options every host's command takes (torchrun's multi-node
ones), and which host runs which ranks.

Every host runs the same `graphc run` / `graphc serve` command with its own `--node-rank`; host
h runs ranks [h * R, (h + 1) * R) for R ranks a host, so the leader (rank 0) is on host 0, which
also serves the rendezvous store at the master address (every host must reach it) and, for
`graphc serve`, the HTTP server.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphc.errors import GraphcError

DEFAULT_MASTER_PORT = 29500
"""torchrun's."""


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

    @classmethod
    def from_cli(cls, nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None,
                 rdzv_endpoint: str | None, nproc_per_node: int | None, join_timeout: float) -> HostOptions:
        """The options as given on a command line (an endpoint or an address and port, not both)."""
        if rdzv_endpoint is not None:
            if master_addr is not None or master_port is not None:
                raise GraphcError("--rdzv-endpoint names the rendezvous address and port: "
                                  "give it or --master-addr / --master-port, not both")
            host, sep, port = rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise GraphcError(f"--rdzv-endpoint: {rdzv_endpoint!r} must be HOST:PORT with a port in 1..65535")
            master_addr, master_port = host.strip("[]"), int(port)
        options = cls(nnodes, node_rank, master_addr or "127.0.0.1", master_port or DEFAULT_MASTER_PORT,
                      nproc_per_node, join_timeout)
        if not 0 <= node_rank < nnodes:
            raise GraphcError(f"--node-rank: {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
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
