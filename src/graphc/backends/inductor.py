"""`inductor` backend: an AOTInductor package of precompiled native code."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.utils._pytree as pytree

import graphc.ops  # noqa: F401  (graphs call graphc:: ops: register them before loading)
from graphc.program_io import load_exported_program
from graphc.topology import Topology


def compile_program(program: Path, out: Path, topology: Topology) -> None:
    exported = load_exported_program(program)
    exported.example_inputs = placeholder_inputs(exported)
    torch._inductor.aoti_compile_and_package(exported, package_path=str(out))


def placeholder_inputs(program: torch.export.ExportedProgram) -> tuple[tuple, dict]:
    """Inputs of the program's shapes and dtypes, for AOTInductor, which requires example inputs.

    Captured programs carry none (capture.py drops them: they are the weights). These are
    uninitialised: AOTInductor reads their shapes, dtypes and strides, never their values, and
    pages never touched take no memory. A symbolic dim takes its size at capture.
    """
    values = {n.name: n.meta["val"] for n in program.graph.nodes if n.op == "placeholder"}
    flat = []
    for name in program.graph_signature.user_inputs:
        value = values[name]
        shape = [size if isinstance(size, int) else size.node.shape_env.guarding_hint_or_throw(size.node.expr)
                 for size in value.shape]
        flat.append(torch.empty(shape, dtype=value.dtype))
    return pytree.tree_unflatten(flat, program.call_spec.in_spec)
