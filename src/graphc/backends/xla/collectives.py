"""Cross-replica collectives as jax primitives: one `all-reduce` / `all-gather` / `reduce-scatter` /
`all-to-all` HLO instruction each, over explicit `replica_groups` and without channel ids.

That is the per-rank form neuronx-cc takes (a module compiled for `num_replicas` = world, each
rank running it as its replica) and the one XLA:CPU runs across processes with gloo. jax's own
`psum` emits it only under the retired pmap lowering (under `jit` it emits the SPMD,
channel-id form), so graphc lowers its own.

`groups` is every group of the collective's kind, as rank lists (`Topology`): all of them, since an
HLO instruction names the groups of every replica.
"""

from __future__ import annotations

import numpy as np
from jax._src import core
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax.extend.core import Primitive
from jax.interpreters import mlir

Groups = tuple[tuple[int, ...], ...]


def _groups_attribute(groups: Groups) -> ir.DenseIntElementsAttr:
    return ir.DenseIntElementsAttr.get(np.asarray(groups, dtype=np.int64))


def _reduction_region(op, dtype, combine=hlo.add) -> None:
    scalar = ir.RankedTensorType.get([], mlir.dtype_to_ir_type(dtype))
    block = op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        hlo.return_([combine(*block.arguments)])


def _size(groups: Groups) -> int:
    return len(groups[0])


all_reduce_p = Primitive("graphc_all_reduce")
all_reduce_p.def_abstract_eval(lambda x, *, groups, maximum=False: core.ShapedArray(x.shape, x.dtype))


def _all_reduce_lowering(ctx, x, *, groups, maximum=False):
    op = hlo.AllReduceOp([x.type], [x], replica_groups=_groups_attribute(groups))
    _reduction_region(op, ctx.avals_in[0].dtype, hlo.maximum if maximum else hlo.add)
    return op.results


mlir.register_lowering(all_reduce_p, _all_reduce_lowering)

all_gather_p = Primitive("graphc_all_gather")
all_gather_p.def_abstract_eval(
    lambda x, *, groups: core.ShapedArray((x.shape[0] * _size(groups), *x.shape[1:]), x.dtype))


def _all_gather_lowering(ctx, x, *, groups):
    out = mlir.aval_to_ir_type(ctx.avals_out[0])
    return hlo.AllGatherOp([out], [x], all_gather_dim=mlir.i64_attr(0), replica_groups=_groups_attribute(groups)).results


mlir.register_lowering(all_gather_p, _all_gather_lowering)

reduce_scatter_p = Primitive("graphc_reduce_scatter")
reduce_scatter_p.def_abstract_eval(
    lambda x, *, groups: core.ShapedArray((x.shape[0] // _size(groups), *x.shape[1:]), x.dtype))


def _reduce_scatter_lowering(ctx, x, *, groups):
    out = mlir.aval_to_ir_type(ctx.avals_out[0])
    op = hlo.ReduceScatterOp(out, x, scatter_dimension=mlir.i64_attr(0), replica_groups=_groups_attribute(groups))
    _reduction_region(op, ctx.avals_in[0].dtype)
    return op.results


mlir.register_lowering(reduce_scatter_p, _reduce_scatter_lowering)


all_to_all_p = Primitive("graphc_all_to_all")
all_to_all_p.def_abstract_eval(lambda x, *, groups: core.ShapedArray(x.shape, x.dtype))


def _all_to_all_lowering(ctx, x, *, groups):
    return hlo.AllToAllOp([x], split_dimension=0, concat_dimension=0, split_count=_size(groups),
                          replica_groups=_groups_attribute(groups)).results


mlir.register_lowering(all_to_all_p, _all_to_all_lowering)


def all_reduce(x, groups: Groups):
    """The sum of `x` over each rank's group."""
    return all_reduce_p.bind(x, groups=groups)


def all_reduce_max(x, groups: Groups):
    """The elementwise maximum of `x` over each rank's group."""
    return all_reduce_p.bind(x, groups=groups, maximum=True)


def all_gather(x, groups: Groups):
    """[G, *x.shape]: every rank's `x` of the group, in rank order."""
    return all_gather_p.bind(x, groups=groups).reshape(_size(groups), *x.shape)


def reduce_scatter(x, groups: Groups):
    """The sum over the group of `x` [G * T, ...], this rank's rows [T, ...] (rank-major)."""
    return reduce_scatter_p.bind(x, groups=groups)


def all_to_all(x, groups: Groups):
    """An even all-to-all of `x` [G * T, ...]: block g of this rank's rows goes to the group's
    rank g, and block g of the result came from it (rank-major, as `torch.distributed`'s)."""
    return all_to_all_p.bind(x, groups=groups)
