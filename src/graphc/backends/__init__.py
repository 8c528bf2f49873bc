"""Backends turn a specialised step program (saved as a torch.export `.pt2`) into a servable file.

`compile_program` runs in a worker process: it must import nothing from the parent's state and
register the graphc ops before loading the program.
"""

from __future__ import annotations

from pathlib import Path

from graphc.errors import GraphcError

EXTENSIONS = {"export": "pt2", "inductor": "aoti.pt2", "neuron": "neff"}


def compile_program(backend: str, program: Path, out: Path) -> None:
    """Compile the saved program at `program` into `out` with `backend`."""
    if backend == "export":
        from graphc.backends.export import compile_program as run
    elif backend == "inductor":
        from graphc.backends.inductor import compile_program as run
    elif backend == "neuron":
        from graphc.backends.neuron import compile_program as run
    else:
        raise GraphcError(f"backend {backend!r} is unknown; backends: {', '.join(EXTENSIONS)}")
    run(program, out)
