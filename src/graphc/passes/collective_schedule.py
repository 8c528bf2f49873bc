"""The compile-time check that a bucket's collectives cannot hang: every rank's schedule, as one
happens-before graph.

A rank issues its collectives in program order, each on one of its groups. The k-th collective a
rank issues on a concrete group (its ranks, e.g. EP group [2, 3]) must meet the k-th collective
of every other member of that group: one node, shared by the members. Edges follow each rank's
program order between consecutive nodes. The job can hang when
- a node's members disagree on what it is (op, group, lowering or other non-tensor arguments,
  input dtypes or shapes): they would enter different collectives, or the same with other sizes;
- a member never reaches the node (it issues fewer collectives on that group);
- the graph has a cycle: rank a waits in node X for rank b, which waits in node Y for a.
Every rank of a bucket runs one program, but its groups are its own (data-parallel replicas, EP
groups across them): "the same sequence on every rank" says nothing about which ranks meet in
which collective. This check is what holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx

from graphc.errors import GraphcError
from graphc.passes.graph import COLLECTIVE_OPS, graphc_op, op_argument
from graphc.topology import Topology


@dataclass(frozen=True)
class Collective:
    """What a rank enters when it issues one collective: members must agree on all of it."""

    op: str
    group: str
    arguments: tuple
    """The non-tensor arguments but the group (sizes, lowering), as (name, value) pairs."""
    inputs: tuple
    """(dtype, shape) of each tensor input."""

    def __str__(self) -> str:
        arguments = ", ".join(f"{name}={value}" for name, value in self.arguments)
        inputs = ", ".join(f"{dtype}{list(shape)}" for dtype, shape in self.inputs)
        return f"{self.op}({self.group}; {inputs}{'; ' if arguments else ''}{arguments})"


def program_collectives(gm: torch.fx.GraphModule) -> list[Collective]:
    """The collectives a program issues, in program order."""
    issued = []
    for node in gm.graph.nodes:
        op = graphc_op(node)
        if op not in COLLECTIVE_OPS:
            continue
        schema = node.target._schema
        arguments, inputs = [], []
        for argument in schema.arguments:
            value = op_argument(node, argument.name)
            if isinstance(value, torch.fx.Node):
                fake = value.meta["val"]
                inputs.append((str(fake.dtype).removeprefix("torch."), tuple(d if isinstance(d, int) else str(d) for d in fake.shape)))
            elif argument.name != "group" and value is not None:
                arguments.append((argument.name, value))
        issued.append(Collective(op.removeprefix("graphc::"), op_argument(node, "group"), tuple(arguments),
                                 tuple(inputs)))
    return issued


def check_collective_schedule(topology: Topology, bucket_name: str, schedules: dict[int, list[Collective]]) -> None:
    """Refuse a bucket whose ranks' `schedules` (every rank's collectives in program order) could
    hang; the error names the bucket, group, ranks and ops."""
    happens_before = nx.DiGraph()
    members: dict[tuple, dict[int, Collective]] = {}
    for rank, issued in sorted(schedules.items()):
        seen: dict[tuple[int, ...], int] = {}
        previous = None
        for collective in issued:
            ranks = tuple(topology.group_ranks(collective.group, rank))
            node = (ranks, seen.get(ranks, 0))
            seen[ranks] = node[1] + 1
            members.setdefault(node, {})[rank] = collective
            happens_before.add_node(node)
            if previous is not None:
                happens_before.add_edge(previous, node)
            previous = node
    for (ranks, index), entered in members.items():
        where = f"{bucket_name}: collective #{index} on group {list(ranks)}"
        absent = [rank for rank in ranks if rank not in entered]
        if absent:
            present = ", ".join(f"rank {rank}: {c}" for rank, c in sorted(entered.items()))
            raise GraphcError(f"{where}: ranks {absent} never issue it ({present}); the group would hang")
        if len(set(entered.values())) > 1:
            issued = "; ".join(f"rank {rank}: {c}" for rank, c in sorted(entered.items()))
            raise GraphcError(f"{where}: the members disagree ({issued}); the group would hang")
    try:
        cycle = nx.find_cycle(happens_before)
    except nx.NetworkXNoCycle:
        return
    nodes = [start for start, _ in cycle] + [cycle[0][0]]  # back to where it started
    steps = " -> ".join(f"#{index} on {list(ranks)} ({members[ranks, index][ranks[0]].op})" for ranks, index in nodes)
    raise GraphcError(f"{bucket_name}: the ranks' collectives wait on each other in a cycle: {steps}; the job would hang")
