"""Backends turn a rewritten step program (saved as a torch.export `.pt2`) into a servable file.

`BACKENDS` is the registry every other module reads (model.yaml's schema, the CLI's choices,
the emitter, the pass list, the manifest schema); a backend's compiler module is imported only
when it compiles. `compile_program` runs in a worker process: it must import nothing from the
parent's state and register the graphc ops before loading the program. Torch-free.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from graphc.errors import GraphcError
from graphc.topology import Topology


@dataclass(frozen=True)
class Backend:
    name: str
    extension: str
    """Of its graph files (AOTInductor insists on package paths ending in .pt2)."""
    parallel_compile: bool
    """Whether graphs are worth compiling in worker processes (a copy is not)."""
    serves_here: bool
    """Whether `graphc run` can load its graphs on this host's CPU (neuron's: their XLA:CPU variant)."""
    compiler: str
    """The module whose `compile_program(program, out, topology)` compiles one graph."""
    fixed_pool: bool = False
    """Whether the KV pool's block count is fixed when compiling (static shapes everywhere), its
    last block a scratch slot that padding tokens write instead of being dropped: the runtime
    never allocates it and refuses another GRAPHC_NUM_KV_BLOCKS."""
    follower_programs: bool = False
    """Whether followers get a program of their own, without the sampler (a backend that compiles
    the sampler into the graph). Otherwise every rank runs one program per bucket, whose sampler
    op returns at once on followers (the `samples` coordinate): half the compiles."""

    def programs(self, world: int) -> tuple[str, ...]:
        """The programs compiled per bucket for `world` ranks (`PROGRAMS`): at most two, whatever the world."""
        if not self.follower_programs:
            return (EVERY_RANK,)
        return (LEADER,) if world == 1 else (LEADER, FOLLOWERS)

    def program_of(self, rank: int) -> str:
        """Which of `programs` rank `rank` runs."""
        return EVERY_RANK if not self.follower_programs else LEADER if rank == 0 else FOLLOWERS


EVERY_RANK, LEADER, FOLLOWERS = PROGRAMS = ("every-rank", "leader", "followers")
"""The programs of a bucket: the one every rank runs, or the leader's (which samples) and the one
every follower shares. A rank's place in its groups is the step's `coordinates` input, never a
constant, so no program is specific to one rank."""


BACKENDS = {backend.name: backend for backend in (
    Backend("export", "pt2", parallel_compile=False, serves_here=True, compiler="graphc.backends.export"),
    Backend("inductor", "aoti.pt2", parallel_compile=True, serves_here=True, compiler="graphc.backends.inductor"),
    Backend("neuron", "neuron.zip", parallel_compile=True, serves_here=True, compiler="graphc.backends.neuron",
            fixed_pool=True, follower_programs=True),
)}

BackendName = Literal[tuple(BACKENDS)]  # noqa: typed.build reads the names from this Literal
"""A backend's name, as model.yaml and the manifest spell it."""


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise GraphcError(f"backend {name!r} is unknown; backends: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def compile_program(name: str, program: Path, out: Path, topology: Topology) -> None:
    """Compile the saved program at `program` (for `topology`) into `out` with backend `name`."""
    importlib.import_module(backend(name).compiler).compile_program(program, out, topology)
