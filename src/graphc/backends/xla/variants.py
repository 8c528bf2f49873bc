"""The two HLO variants of a program, and the one instruction they differ in.

Both are lowered by the same rules; a variant overrides the rules of the ops its target takes in
another form. The differences, all of them:

| op | `neuron` (for neuronx-cc) | `cpu` (XLA:CPU runs it here) |
|---|---|---|
| `aten.topk` (the MoE router) | custom call `AwsNeuronTopK` on float input, k in `backend_config`, indices u32 | `topk` (`jax.lax.top_k`) |

What both share on purpose, because neuronx-cc accepts it and XLA:CPU runs it: argmax as max then
the least index holding it (no variadic reduce), padding tokens' KV written to a reserved scratch
slot (no out-of-bounds scatter drops), int32 indices (no s64), sorts with an LT comparator, static
shapes, the sampler's noise as an input (no rng). `lint.py` checks the neuron variant for each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np
import torch
from jax._src import core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax.extend.core import Primitive

NEURON_TOPK = "AwsNeuronTopK"
"""neuronx-cc's top-k custom call: operand [..., N] float, result (values, indices u32) along
the last dim, `backend_config` the decimal k."""


@dataclass(frozen=True)
class Variant:
    name: str
    rules: dict = field(default_factory=dict)
    """aten op -> rule, overriding `aten.RULES`."""


neuron_topk_p = Primitive("graphc_neuron_topk")
neuron_topk_p.multiple_results = True
neuron_topk_p.def_abstract_eval(lambda x, *, k: (core.ShapedArray((*x.shape[:-1], k), x.dtype),
                                                  core.ShapedArray((*x.shape[:-1], k), np.uint32)))


def _neuron_topk_lowering(ctx, x, *, k):
    types = [mlir.aval_to_ir_type(aval) for aval in ctx.avals_out]
    call = mlir.custom_call(NEURON_TOPK, result_types=[ir.TupleType.get_tuple(types)], operands=[x],
                            backend_config=str(k), api_version=1)
    return [mlir.hlo.get_tuple_element(call.result, mlir.i32_attr(i)) for i in range(2)]


mlir.register_lowering(neuron_topk_p, _neuron_topk_lowering)


def _neuron_topk(out, x, k, dim=-1, largest=True, sorted=True):
    dim = dim % x.ndim
    moved = jnp.moveaxis(x.astype(jnp.float32), dim, -1)
    values, indices = neuron_topk_p.bind(moved if largest else -moved, k=k)
    values = values if largest else -values
    return jnp.moveaxis(values, -1, dim).astype(x.dtype), jnp.moveaxis(indices.astype(jnp.int32), -1, dim)


NEURON = Variant("neuron", {torch.ops.aten.topk.default: _neuron_topk})
CPU = Variant("cpu")
VARIANTS = {variant.name: variant for variant in (NEURON, CPU)}
