"""`inductor` backend: an AOTInductor package of precompiled native code."""

from __future__ import annotations

from pathlib import Path

import torch

import graphc.moe_ops  # noqa: F401  (registers graphc:: ops before the program is loaded)
import graphc.ops  # noqa: F401
import graphc.sparse_ops  # noqa: F401


def compile_program(program: Path, out: Path) -> None:
    exported = torch.export.load(str(program))
    torch._inductor.aoti_compile_and_package(exported, package_path=str(out))
