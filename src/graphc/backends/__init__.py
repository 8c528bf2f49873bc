"""Backends turn a rewritten step program (saved as a torch.export `.pt2`) into a servable file.

`BACKENDS` is the registry every other module reads (model.yaml's schema, the CLI's choices, the
emitter, the pass list, the manifest schema, the loader, the lint): one `Backend` record each, and
nothing outside it tells backends apart by name. A record's hooks name functions as
`module:function`, imported only when called: the runtime imports this module, and must not
import a compiler with it. `compile_program` runs in a worker process: it must import nothing
from the parent's state and register the graphc ops before loading the program. Torch-free.

Every backend compiles one program per bucket that every rank runs: a rank's place in its groups
is the step's `coordinates` input, never a constant, and its sampler keeps its tokens only where
the `samples` coordinate says the rank samples (the first of each attention replica; zeros
elsewhere). A follower computing the sampler it discards costs it no latency: the leader's step,
which every collective waits on, computes it too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from graphc.errors import GraphcError
from graphc.models.moe_forms import MOE_LOWERINGS, moe_exchange
from graphc.topology import Topology

@dataclass(frozen=True)
class Backend:
    """What a backend compiles, how its artifacts load, and the limits and extras that are its own."""

    name: str
    extension: str
    """Of its graph files (AOTInductor insists on package paths ending in .pt2)."""
    parallel_compile: bool
    """Whether graphs are worth compiling in worker processes (a copy is not)."""
    serves_here: bool
    """Whether `graphc run` can load its graphs on this host's CPU (neuron's: their XLA:CPU variant)."""
    compiler: str
    """`module:function(program, out, topology)` compiling one saved program into `out`."""
    loader: str
    """`module:function(path, collectives, context)` loading one graph file as a callable of
    (weights, inputs), the file checked against its `artifacts.manifest.GraphContext` first: a runtime module, as the
    runtime imports no compiler."""
    fixed_pool: bool = False
    """Whether the KV pool's block count is fixed when compiling (static shapes everywhere), its
    last block a scratch slot that padding tokens write instead of being dropped: the runtime
    never allocates it and refuses another GRAPHC_NUM_KV_BLOCKS."""
    toolchain: str | None = None
    """`module:function()` naming the host tools that change what a compile makes, a part of the
    compile cache's key (neuron's: whether neuronx-cc adds NEFFs); None: nothing beyond torch."""
    manifest_extras: str | None = None
    """`module:function()` returning what the manifest's `extra` records for this backend alone."""
    linter: str | None = None
    """`module:function(artifacts, manifest)` returning the problems of `graphc inspect --lint`
    that are this backend's own, one line each."""
    memory_report: str | None = None
    """`module:function(artifacts, manifest)` returning each program file's bytes in its compiler's
    buffer assignment (`graphc inspect --memory`); None where the backend has none to read."""
    neuron_finish: bool = False
    """Whether `graphc neuron-finish` takes its artifacts (adds each program's NEFF on a Neuron host)."""
    fuses_gather: bool = True
    """Whether its compiler fuses the gather form's per-route matrix reads into their products
    (`moe_forms.moe_form_for`); the export backend's ATen ops copy them first."""
    grouped_gemm: str = "grouped"
    """How it runs the routed experts' grouped GEMM, as the step model counts it: ATen's dynamic
    kernel (`grouped`, a key of `perf.work.EXPERT_LOWERINGS`), or neuron's static-shape rule
    (`grouped-neuron`, resolved per call into `expert-major` or `blockwise`)."""
    lowerings: tuple[str, ...] | None = None
    """The MoE lowerings it compiles (`moe_forms.MOE_LOWERINGS`' names); None: every one."""
    stand_ins: dict[str, tuple[str, str]] = field(default_factory=dict)
    """A lowering not among `lowerings` -> (the lowering compiled in its place, why): one that
    gives the same values (`moe_forms.MOE_LOWERINGS`). Its graphs record the stand-in, and the
    compile and `graphc inspect` say so (`exchange`)."""

    def exchange(self, choice: str, topology: Topology, static_enabled: bool = True) -> tuple[str, str | None]:
        """The MoE exchange this backend compiles for model.moe_lowering `choice` on `topology`
        (`moe_forms.moe_exchange` among its `lowerings`) and, where another stands in for the one
        chosen, the note saying so."""
        exchange = moe_exchange(choice, topology.ep, topology.tokens_replicated, static_enabled, self.lowerings)
        if exchange not in self.stand_ins:
            return exchange, None
        lowering, why = self.stand_ins[exchange]
        return lowering, f"model.moe_lowering: {exchange} is compiled as {lowering} on {self.name} ({why})"

    def __post_init__(self):
        # Every lowering compiles: as itself or through its stand-in, which must be one of the
        # backend's own (so no topology is refused for its exchange).
        if self.lowerings is not None:
            missing = set(MOE_LOWERINGS) - set(self.lowerings) - set(self.stand_ins)
            strays = {lowering for lowering, _ in self.stand_ins.values()} - set(self.lowerings)
            if missing or strays:
                raise ValueError(f"backend {self.name}: lowerings {sorted(missing)} have no stand-in, stand-ins "
                                 f"{sorted(strays)} are not among its lowerings")

    def compile(self, program: Path, out: Path, topology: Topology) -> None:
        _imported(self.compiler)(program, out, topology)

    def graph_loader(self) -> Callable:
        """`load_<backend>(path, collectives, context)` (`runtime.graph_loaders`): a graph file's
        runner, checked against its `artifacts.manifest.GraphContext`."""
        return _imported(self.loader)

    def cache_toolchain(self) -> str:
        return _imported(self.toolchain)() if self.toolchain else ""

    def extras(self) -> dict[str, str]:
        return _imported(self.manifest_extras)() if self.manifest_extras else {}

    def lint(self, artifacts: Path, manifest: Manifest) -> list[str]:
        return _imported(self.linter)(artifacts, manifest) if self.linter else []

    def memory(self, artifacts: Path, manifest: Manifest) -> dict:
        """`memory_report`'s figures (file -> `backends.xla.memory.ProgramMemory`).

        Raises:
            GraphcError: the backend has no buffer assignment to read.
        """
        if self.memory_report is None:
            having = ", ".join(name for name, record in BACKENDS.items() if record.memory_report)
            raise GraphcError(f"--memory reads a compiler's buffer assignment, which {self.name} artifacts do not "
                              f"have; backends with one: {having}")
        return _imported(self.memory_report)(artifacts, manifest)


def _imported(hook: str) -> Callable:
    """The function a hook names (`module:function`), its module imported now."""
    module, function = hook.split(":")
    return getattr(importlib.import_module(module), function)


BACKENDS = {backend.name: backend for backend in (
    Backend("export", "pt2", parallel_compile=False, serves_here=True, fuses_gather=False,
            compiler="graphc.backends.export:compile_program", loader="graphc.runtime.graph_loaders:load_export"),
    Backend("inductor", "aoti.pt2", parallel_compile=True, serves_here=True,
            compiler="graphc.backends.inductor:compile_program", loader="graphc.runtime.graph_loaders:load_inductor"),
    # The all-to-all's even form only: a2a_v sizes its sends from the split matrix, which XLA's
    # static-shape all-to-all cannot take, and its variable-size collective, ragged-all-to-all, is
    # one XLA:CPU does not execute (jaxlib 0.10: "HLO opcode `ragged-all-to-all` is not supported
    # by XLA:CPU ThunkEmitter"), so no program holding it could be checked here. The padded even
    # form stands in for it (same values, `moe_forms.MOE_LOWERINGS`), and `auto` picks it.
    Backend("neuron", "neuron.zip", parallel_compile=True, serves_here=True,
            compiler="graphc.backends.neuron:compile_program", loader="graphc.runtime.graph_loaders:load_neuron",
            fixed_pool=True, toolchain="graphc.backends.neuron_archive:toolchain",
            manifest_extras="graphc.backends.neuron_archive:manifest_extras",
            linter="graphc.backends.xla.lint:lint_archives", neuron_finish=True,
            memory_report="graphc.backends.xla.memory:program_memory", grouped_gemm="grouped-neuron",
            lowerings=("ag_rs", "a2a_even"),
            stand_ins={"a2a_v": ("a2a_even", "the padded even form: a2a_v's variable-size exchange, XLA's "
                                             "ragged-all-to-all, does not run on XLA:CPU, so it could not be checked "
                                             "here")}),
)}

BackendName = Literal[tuple(BACKENDS)]  # noqa: typed.build reads the names from this Literal
"""A backend's name, as model.yaml and the manifest spell it."""


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise GraphcError(f"backend {name!r} is unknown; backends: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def compile_program(name: str, program: Path, out: Path, topology: Topology) -> None:
    """Compile the saved program at `program` (for `topology`) into `out` with backend `name`."""
    backend(name).compile(program, out, topology)
