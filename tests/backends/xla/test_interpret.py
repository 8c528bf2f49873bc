"""The graph interpreter of the XLA lowering (graphc.backends.xla.interpret) on small programs:
ops without a rule decomposed node by node and equal to torch, each signature traced once; the
KV pool written in place as torch writes it, and a read through a view taken before a later
write refused."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import graphc.ops  # noqa: F401  (graphc::kv_write)
from graphc.backends.xla import aten as aten_rules
from graphc.backends.xla import graphc_ops
from graphc.backends.xla import interpret
from graphc.errors import GraphcError
from graphc.topology import Topology

aten = torch.ops.aten


def _rules():
    from graphc.backends.xla.lower import Lowering
    from graphc.backends.xla.variants import CPU

    lowering = Lowering(Topology(1, 1), CPU)
    return {**aten_rules.RULES, interpret.KV_WRITE: lambda out, *a, **k: graphc_ops.kv_write(lowering, out, *a, **k)}


class Step(nn.Module):
    """Writes layer 0 of the pool, then reads it back (through a view taken after the write, or,
    with `stale_view`, one taken before it)."""

    def __init__(self, stale_view: bool = False):
        super().__init__()
        self.stale_view = stale_view

    def forward(self, x, slot_mapping, kv_pool):
        early = kv_pool[0]  # a view of the pool
        torch.ops.graphc.kv_write(kv_pool, 0, torch.nn.functional.hardswish(x), slot_mapping)
        layer = early if self.stale_view else kv_pool[0]
        return layer.sum(dim=(0, 1)), torch.addcmul(x, x, x).sum(-1)


def _exported(stale_view: bool = False):
    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(0))
    slots, pool = torch.tensor([[0, 5, 2]]), torch.zeros(2, 4, 2, 4)
    return torch.export.export(Step(stale_view), (x, slots, pool)), (x, slots, pool)


def test_ops_without_a_rule_are_decomposed_and_the_pool_is_written_in_place():
    program, (x, slots, pool) = _exported()
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert {aten.hardswish.default, aten.addcmul.default} <= targets  # no rule of their own
    assert not {aten.hardswish.default, aten.addcmul.default} & set(aten_rules.RULES)
    interpreter = interpret.Interpreter(_rules(), num_blocks=4)
    written, read_back, products = interpreter.run_program(program, [jnp.asarray(v.numpy().astype(
        np.int32 if v.dtype == torch.int64 else np.float32)) for v in (x, slots, pool)])
    expected_pool = pool.clone()
    expected = Step()(x, slots, expected_pool)
    np.testing.assert_allclose(np.asarray(written)[:, :-1], expected_pool.numpy()[:, :-1], rtol=1e-6)  # scratch block aside
    np.testing.assert_allclose(np.asarray(read_back), expected[0].numpy(), rtol=1e-6)  # the read sees the write
    # A sum's fp32 rounding is relative to its terms, not to the sum (a row of x + x^2 can cancel
    # to near 0: unseeded, one did, 6e-8 off on -0.018): the bound scales with the terms.
    terms = (x.abs() + x * x).sum(-1).numpy()
    np.testing.assert_allclose(np.asarray(products), expected[1].numpy(), rtol=1e-6, atol=1e-6 * terms.max())
    assert {key[0] for key in interpreter._decomposed} == {aten.hardswish.default, aten.addcmul.default}
    interpreter.run_program(program, [jnp.asarray(np.zeros(v.shape, np.int32 if v.dtype == torch.int64 else np.float32))
                                      for v in (x, slots, pool)])
    assert len(interpreter._decomposed) == 2  # one trace per signature, however often it runs


def test_a_read_through_a_view_taken_before_a_later_write_is_refused():
    program, (x, slots, pool) = _exported(stale_view=True)
    with pytest.raises(GraphcError, match=r"reads the KV pool through select\w*, taken before a later write of the "
                                          r"pool; take the view after the write"):
        interpret.Interpreter(_rules(), num_blocks=4).run_program(program, [jnp.zeros(1)] * 3)


def test_an_op_with_neither_a_rule_nor_a_decomposition_is_named():
    class Angle(nn.Module):
        def forward(self, x, slot_mapping, kv_pool):
            torch.ops.graphc.kv_write(kv_pool, 0, x, slot_mapping)
            return torch.atan2(x, x + 1).sum(-1), x.sum(-1)

    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(0))
    slots, pool = torch.tensor([[0, 5, 2]]), torch.zeros(2, 4, 2, 4)
    program = torch.export.export(Angle(), (x, slots, pool))
    with pytest.raises(GraphcError, match=r"no rule for aten\.atan2\.default \(node atan2\) and no core-ATen "
                                          r"decomposition; add one to graphc/backends/xla"):
        interpret.Interpreter(_rules(), num_blocks=4).run_program(
            program, [jnp.zeros(x.shape), jnp.zeros(slots.shape, jnp.int32), jnp.zeros(pool.shape)])


def test_any_other_write_of_an_input_is_refused():
    class Fill(nn.Module):
        def forward(self, x, slot_mapping, kv_pool):
            torch.ops.graphc.kv_write(kv_pool, 0, x, slot_mapping)
            x.mul_(2)
            return x.sum(-1), x.sum(-1)

    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(0))
    slots, pool = torch.tensor([[0, 5, 2]]), torch.zeros(2, 4, 2, 4)
    program = torch.export.export(Fill(), (x, slots, pool))
    with pytest.raises(GraphcError, match=r"mul_ \(aten\.mul_\.Tensor\) writes its input in place; only "
                                          r"graphc::kv_write may"):
        interpret.Interpreter(_rules(), num_blocks=4).run_program(program, [jnp.zeros(1)] * 3)
