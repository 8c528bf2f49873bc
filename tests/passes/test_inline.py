"""inline_function: a node becomes the ATen ops of a Python function; a program that calls the
same op at the same signature many times (once a layer) has it traced once."""

from __future__ import annotations

import functools
import operator

import torch

from graphc.passes.inline import inline_function


class _Scaled(torch.nn.Module):
    def forward(self, a, b, c):
        return a * 2, b * 2, c * 2, a * 3


def _inline_every_mul(recorded: list) -> tuple[torch.fx.GraphModule, tuple]:
    inputs = (torch.randn(2, 3), torch.randn(2, 3), torch.randn(4))
    gm = torch.export.export(_Scaled(), inputs).graph_module

    def scaled_by_adding(x, factor):
        recorded.append((tuple(x.shape), factor))  # once a trace
        return functools.reduce(operator.add, [x] * factor)

    muls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.mul.Tensor]
    assert len(muls) == 4
    for node in muls:
        inline_function(gm.graph, node, scaled_by_adding)
    gm.recompile()
    return gm, inputs


def test_each_signature_is_traced_once_and_every_node_gets_its_own_ops():
    traces: list = []
    gm, (a, b, c) = _inline_every_mul(traces)

    # a * 2 and b * 2 share a trace; c * 2 (another shape) and a * 3 (another factor) do not.
    assert traces == [((2, 3), 2), ((4,), 2), ((2, 3), 3)]
    assert not any(n.target == torch.ops.aten.mul.Tensor for n in gm.graph.nodes)
    adds = [n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor]
    assert len(adds) == 1 + 1 + 1 + 2  # x + x per factor 2 (three nodes), x + x + x for a * 3
    for got, want in zip(gm(a, b, c), (a * 2, b * 2, c * 2, a * 3)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_another_graph_traces_again():
    """The traces belong to the graph being rewritten (their fake tensors to its program)."""
    traces: list = []
    _inline_every_mul(traces)
    _inline_every_mul(traces)
    assert len(traces) == 6
