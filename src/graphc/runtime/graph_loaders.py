"""How each backend's graph files load, named by its record (`Backend.loader`): one function per
backend, `load_<backend>(path, collectives, context)`, returning a callable of (weights, inputs in
`STEP_INPUTS` order). Only a neuron archive declares a signature of its own to check against the
manifest's `GraphContext`; a `.pt2` file is checked by what loading it would unpickle. Checks run
at load; the program itself opens at its first step, shared by the engines of a process
(`opened_programs`). Runtime-side: it imports no compiler.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from graphc.artifacts.manifest import GraphContext
from graphc.program_io import load_exported_program
from graphc.runtime.archive_check import check_export_archive
from graphc.runtime.opened_programs import opened_once
from graphc.step import STEP_INPUTS


def load_export(path: Path, collectives: bool, context: GraphContext) -> Callable:
    check_export_archive(path)  # torch.export.load would unpickle what an archive asks it to
    module = opened_once(("export", context.graph.sha256), lambda: load_exported_program(path).module())
    return lambda weights, inputs: module()(weights, *inputs)


def load_inductor(path: Path, collectives: bool, context: GraphContext) -> Callable:
    # The C++ loader directly: `aoti_load_package` first probes the CPU's vector ISA by compiling
    # test programs, only to warn on a mismatch (about 6 s on a host with a cold inductor cache,
    # most of a cold start); and the package's __call__ re-parses its pytree specs and
    # re-flattens ~60 inputs on every step, while the step's inputs are already flat. Packages
    # with collectives run with the GIL released (see gil_free_runner.py).
    def open_package() -> Callable:
        if collectives:
            from graphc.runtime.gil_free_runner import gil_free_runner

            return gil_free_runner(str(path))
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1).boxed_run

    run = opened_once(("inductor", context.graph.sha256, collectives), open_package)
    return lambda weights, inputs: tuple(run()([*weights, *inputs]))


def load_neuron(path: Path, collectives: bool, context: GraphContext) -> Callable:
    """On a Neuron device (GRAPHC_NEURON_DEVICE=1) the program's NEFF; otherwise its CPU-variant HLO on
    XLA:CPU (jax is imported only here)."""
    if os.environ.get("GRAPHC_NEURON_DEVICE") == "1":
        import torch.distributed as dist

        from graphc.runtime.neuron_runner import load_neff

        rank, world = (dist.get_rank(), dist.get_world_size()) if collectives else (0, 1)
        run = load_neff(path, rank, world, context)
    else:
        from graphc.runtime.xla_runner import load_xla

        run = load_xla(path, collectives, context)
    return lambda weights, inputs: run(weights, dict(zip(STEP_INPUTS, inputs)))
