"""The pass pipeline: the one list of graph rewrites, in order, with where each applies.

`graphc compile` runs the backend's passes on every program of every bucket (`backend_passes`);
`graphc probe` runs the ones that apply to a single layer (`layer_passes`); `--disable-pass`
takes any name here (`PASS_NAMES`), capture choices included.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphc.backends import BACKENDS
from graphc.errors import GraphcError
from graphc.passes.dead_code_elimination import dead_code_elimination
from graphc.passes.inline_int64_kernels import inline_int64_kernels
from graphc.passes.inline_reference_kernels import inline_reference_kernels
from graphc.passes.lower_matvecs import lower_matvecs
from graphc.passes.lower_trivial_collectives import lower_trivial_collectives
from graphc.passes.manager import Pass
from graphc.passes.place_dequantization import place_dequantization
from graphc.passes.verify_bucket_shapes import verify_bucket_shapes


@dataclass(frozen=True)
class PassEntry:
    name: str
    run: Pass | None
    """The rewrite; None for a capture choice (decided when the graph is captured, because it
    changes shapes: `graphc.compiler.capture` applies it, and disabling it by name captures the
    other form)."""
    why: str
    """What it does and why it sits where it does."""
    backends: tuple[str, ...] = tuple(BACKENDS)
    """The backends that run it; the others keep the op for their own lowering."""
    on_layers: bool = True
    """Whether it applies to one layer's graph (`graphc probe`), not only to a whole step (whose
    inputs, sampler and bucket shapes a layer graph does not have)."""


PIPELINE = (
    PassEntry("static_moe", None,
              "capture choice: with ep > 1, the static MoE form (no token dispatch, an all-reduce over the EP "
              "group) since every rank holds the same tokens; disabled, the generic all-gather / reduce-scatter form"),
    PassEntry("verify_bucket_shapes", verify_bucket_shapes,
              "first: nothing should build on a graph captured with the wrong shapes", on_layers=False),
    PassEntry("lower_trivial_collectives", lower_trivial_collectives,
              "groups of one rank move no data: backends never see a no-op collective"),
    PassEntry("place_dequantization", place_dequantization,
              "each weight kept as stored is dequantised right before its first reader, not at the top of the "
              "step: one layer's dequantised weights live at a time; before inlining, which keeps the place"),
    PassEntry("inline_reference_kernels", inline_reference_kernels,
              "attention, sparse attention and expert routing as ATen ops: compiled with the rest on the CPU "
              "backends, not Python kernels per layer; lowered to XLA with the rest on neuron"),
    PassEntry("inline_int64_kernels", inline_int64_kernels,
              "export / inductor: V4.1's n-gram hash as its int64 ATen ops, fused with the rest (neuron keeps the "
              "op: its programs hold no 64-bit values, and its lowering computes the hash in 32-bit words)",
              backends=("export", "inductor")),
    PassEntry("lower_matvecs", lower_matvecs,
              "inductor: one-row linear layers (decode at batch 1, the LM head) as reductions that stream the "
              "weight near the memory bandwidth; after inlining, so it sees every linear of the step",
              backends=("inductor",), on_layers=False),
    PassEntry("dead_code_elimination", dead_code_elimination, "last: sweep what the rewrites above left unused"),
)
"""Capture choices, then the rewrites of each bucket's program, in order (see README.md)."""

PASS_NAMES = tuple(entry.name for entry in PIPELINE)


def check_pass_names(names) -> None:
    """Refuse `--disable-pass` names that are no pass (before any work)."""
    unknown = sorted(set(names) - set(PASS_NAMES))
    if unknown:
        raise GraphcError(f"--disable-pass {unknown[0]}: no such pass; passes: {', '.join(PASS_NAMES)}")


def backend_passes(backend: str) -> list[tuple[str, Pass]]:
    """The (name, pass) pairs `backend` runs on every bucket's program, in order."""
    return [(e.name, e.run) for e in PIPELINE if e.run is not None and backend in e.backends]


def layer_passes(backend: str) -> list[tuple[str, Pass]]:
    """The passes of `backend_passes` that apply to one layer's graph (`graphc probe`)."""
    return [(e.name, e.run) for e in PIPELINE if e.run is not None and backend in e.backends and e.on_layers]
