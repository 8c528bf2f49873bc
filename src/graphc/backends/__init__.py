"""Backends turn a specialised step program (saved as a torch.export `.pt2`) into a servable file.

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


@dataclass(frozen=True)
class Backend:
    name: str
    extension: str
    """Of its graph files (AOTInductor insists on package paths ending in .pt2)."""
    parallel_compile: bool
    """Whether graphs are worth compiling in worker processes (a copy is not)."""
    serves_here: bool
    """Whether `graphc run` can load its graphs on this host's CPU."""
    compiler: str
    """The module whose `compile_program(program, out)` compiles one graph."""


BACKENDS = {backend.name: backend for backend in (
    Backend("export", "pt2", parallel_compile=False, serves_here=True, compiler="graphc.backends.export"),
    Backend("inductor", "aoti.pt2", parallel_compile=True, serves_here=True, compiler="graphc.backends.inductor"),
    Backend("neuron", "neff", parallel_compile=True, serves_here=False, compiler="graphc.backends.neuron"),
)}

BackendName = Literal[tuple(BACKENDS)]  # noqa: typed.build reads the names from this Literal
"""A backend's name, as model.yaml and the manifest spell it."""


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise GraphcError(f"backend {name!r} is unknown; backends: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def compile_program(name: str, program: Path, out: Path) -> None:
    """Compile the saved program at `program` into `out` with backend `name`."""
    importlib.import_module(backend(name).compiler).compile_program(program, out)
