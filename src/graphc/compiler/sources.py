"""Which of graphc's own sources a cached compile result depends on, as digests for its key.

A checkout changes code without changing graphc's version, so cached results key on sources. Two
caches, two sets:

- A rewritten program (capture, then passes) depends on everything that runs before emit: the
  models, ops, capture and passes, and whatever they import. `frontend_sources_digest` hashes
  every source except the stages that only run after it (`_AFTER_PASSES`), so an edit to a
  lowering or to the runtime keeps every rewritten program.
- A compiled file depends on its backend's compiler and what that imports (`emit_sources_digest`:
  the closure of its graphc imports, read from the sources, and the save of the program it
  compiles), so an edit to the neuron lowering recompiles neuron programs only.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]

_AFTER_PASSES = ("backends/", "runtime/", "server/", "tools/", "compiler/emit.py", "artifacts/writer.py", "cli.py")
"""Sources that run only once a program is rewritten (`backends/__init__.py`, the backend records
with their exchanges and pass lists, is read before, and stays in)."""


def sources_digest(package: Path, names: list[str] | None = None) -> str:
    """The sha256 of the Python sources under `package` (their names and contents): all of them,
    or those whose package-relative names are `names`."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if names is None or name in names:
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def frontend_sources_digest() -> str:
    """What capture and passes run: every graphc source but those only emit and serving run."""
    return sources_digest(PACKAGE, frontend_sources(PACKAGE))


def frontend_sources(package: Path) -> list[str]:
    """The package-relative names of `package`'s sources that run before emit."""
    names = [path.relative_to(package).as_posix() for path in package.rglob("*.py")]
    return [name for name in names
            if name == "backends/__init__.py" or not any(name.startswith(after) for after in _AFTER_PASSES)]


@functools.cache
def emit_sources_digest(compiler_module: str) -> str:
    """What emitting a program with `compiler_module` (a backend's compiler) runs: that module, the
    program's save (`graphc.program_io`) and every graphc module they import, transitively."""
    return sources_digest(PACKAGE, sorted(module_closure([compiler_module, "graphc.program_io"])))


def module_closure(modules: list[str]) -> set[str]:
    """The package-relative files of `modules` and of every graphc module they import (at module
    level or inside functions), with the packages on the way (their `__init__.py` runs too)."""
    files: set[str] = set()
    todo = list(modules)
    while todo:
        parts = todo.pop().split(".")
        for end in range(1, len(parts) + 1):  # graphc.a.b runs graphc's and graphc.a's __init__ first
            file = _module_file(parts[1:end])
            if file is not None and file not in files:
                files.add(file)
                todo.extend(_graphc_imports(file, ".".join(parts[:end])))
    return files


def _module_file(parts: list[str]) -> str | None:
    base = PACKAGE.joinpath(*parts)
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path.relative_to(PACKAGE).as_posix()
    return None  # a name imported from a module (`from graphc.x import f`), not a module


def _graphc_imports(file: str, module: str) -> list[str]:
    """The graphc modules (or names in them) that `file` (module `module`) imports."""
    package = module if file.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse((PACKAGE / file).read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package upwards
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return [name for name in found if name == "graphc" or name.startswith("graphc.")]
