"""The pass manager: runs a flat list of passes, verifying and logging between them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch.fx

from graphc.buckets.selection import Bucket
from graphc.errors import GraphcError
from graphc.topology import Topology


@dataclass(frozen=True)
class PassContext:
    """What a pass may specialise on."""

    topology: Topology
    bucket: Bucket
    blocks_per_row: int
    """Width M of the block table."""


@dataclass(frozen=True)
class PassResult:
    graph_module: torch.fx.GraphModule
    modified: bool


Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]


class GraphInvariantError(GraphcError):
    """A graph breaks an invariant of passes/README.md; names the node when there is one."""

    def __init__(self, message: str, node: torch.fx.Node | None = None):
        super().__init__(message + (f" (node {node.name}: {node.format_node()})" if node is not None else ""))
        self.node = node


class PassFailure(GraphcError):
    """A pass raised; the message names the pass and the passes that ran before it."""


@dataclass
class PassLog:
    """What each pass did: (name, modified, op counts before, op counts after)."""

    entries: list[tuple[str, bool, dict[str, int], dict[str, int]]] = field(default_factory=list)

    def changes(self) -> list[str]:
        lines = []
        for name, modified, before, after in self.entries:
            delta = {op: after.get(op, 0) - before.get(op, 0) for op in sorted(set(before) | set(after))}
            delta = {op: d for op, d in delta.items() if d}
            lines.append(f"{name}: " + (", ".join(f"{op} {d:+d}" for op, d in delta.items())
                                        if delta else ("modified" if modified else "no change")))
        return lines


def op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    return dict(Counter(_op_name(n) for n in gm.graph.nodes if n.op == "call_function"))


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    name = getattr(target, "name", None)
    return name() if callable(name) else getattr(target, "__name__", str(target))


class PassManager:
    """Runs `passes` in order.

    Args:
        passes: (name, pass) pairs, in pipeline order.
        verifier: checks a graph; run before the first pass and after each one when `verify`.
        verify: run the verifier between passes (always on in tests).
        disabled: pass names to skip (`--disable-pass`; names are checked by `registry.check_pass_names`).
        dump_dir: write the graph before the first pass and after each pass here (`--dump-graphs`).
    """

    def __init__(self, passes: list[tuple[str, Pass]], verifier: Callable[[torch.fx.GraphModule, PassContext], None],
                 verify: bool = True, disabled: frozenset[str] = frozenset(), dump_dir: Path | None = None):
        self.passes, self.verifier, self.verify = passes, verifier, verify
        self.disabled, self.dump_dir = disabled, dump_dir

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassLog:
        log = PassLog()
        ran: list[str] = []
        self._check(gm, ctx, "capture", ran)
        self._dump(gm, ctx, 0, "capture")
        for index, (name, run_pass) in enumerate(self.passes, start=1):
            if name in self.disabled:
                continue
            before = op_counts(gm)
            existing = set(gm.graph.nodes)
            try:
                result = run_pass(gm, ctx)
            except GraphcError as e:
                raise PassFailure(self._failure(name, ran, ctx, e)) from e
            except Exception as e:  # a bug in a pass: keep the traceback, add where it happened
                raise RuntimeError(self._failure(name, ran, ctx, e)) from e
            gm = result.graph_module
            for node in gm.graph.nodes:
                if node not in existing:
                    node.meta["graphc_pass"] = name
            if result.modified:
                gm.graph.lint()
                gm.recompile()
            ran.append(name)
            log.entries.append((name, result.modified, before, op_counts(gm)))
            self._check(gm, ctx, name, ran[:-1])
            self._dump(gm, ctx, index, name)
        return log

    def _check(self, gm, ctx, name, ran) -> None:
        if not self.verify:
            return
        try:
            self.verifier(gm, ctx)
        except GraphcError as e:
            raise PassFailure(self._failure(name, ran, ctx, e, "the graph it produced fails verification")) from e

    @staticmethod
    def _failure(name, ran, ctx, error, what="failed") -> str:
        after = f"after {', '.join(ran)}" if ran else "as the first pass"
        return f"pass {name} {what} ({after}; {ctx.bucket.name}): {error}"

    def _dump(self, gm, ctx, index, name) -> None:
        if self.dump_dir is None:
            return
        folder = Path(self.dump_dir) / ctx.bucket.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index:02d}-{name}.py").write_text(gm.code)
