"""Lowering rules from ATen to `jax.lax` / `jax.numpy`, one function per op: core ATen, and the
composite ops a captured step program holds most often (linear, einsum, reshape, dtype casts...),
which would otherwise be decomposed node by node (`interpret.py`). A rule for a composite op
computes what its core-ATen decomposition does (composite float ops in fp32 at least, rounded once,
as torch's decompositions compute them).

A rule takes `out` (the node's output shape and dtype, from torch.export's fake tensors, with
int64 as int32: the programs run without jax's x64 mode, so every index is int32 as neuronx-cc
wants) and the op's arguments with tensors as jax arrays. Rules that build or reshape a tensor take
its shape from `out` rather than re-deriving it from arguments that may hold -1 or symbolic
sizes; every result is cast to `out.dtype`, which settles type promotion the way torch did.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from graphc.errors import GraphcError

aten = torch.ops.aten


@dataclass(frozen=True)
class Out:
    """A node's output: its static shape and jax dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


def _axis(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _dims(dims, rank: int) -> tuple[int, ...]:
    if dims is None or dims == []:
        return tuple(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return tuple(_axis(d, rank) for d in dims)


def _matmul(out, a, b):
    # fp32 operands at full precision (XLA:CPU would otherwise be free to use a faster, lossier
    # algorithm); bf16 operands accumulate in fp32 and round once, as ATen's CPU GEMM does.
    product = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return product.astype(out.dtype)


def _index_arrays(index, dim: int):
    """Full index arrays addressing `index`'s positions, with `index` itself along `dim`: what
    torch's gather / scatter mean by index[i][j][k] along a dim."""
    grids = list(jnp.meshgrid(*(jnp.arange(n) for n in index.shape), indexing="ij"))
    grids[dim] = index
    return tuple(grids)


def _gather(out, x, dim, index, sparse_grad=False):
    return x[_index_arrays(index, _axis(dim, x.ndim))]


def _scatter(out, x, dim, index, src):
    src = src if jnp.ndim(src) == 0 else src[tuple(slice(0, n) for n in index.shape)]
    return x.at[_index_arrays(index, _axis(dim, x.ndim))].set(src, unique_indices=False)


def _scatter_add(out, x, dim, index, src):
    dim = _axis(dim, x.ndim)
    src = src[tuple(slice(0, n) for n in index.shape)]
    if not jnp.issubdtype(x.dtype, jnp.integer):
        return x.at[_index_arrays(index, dim)].add(src)
    # An integer scatter-add (the MoE's routes per expert) as a one-hot compare and an integer sum,
    # exact as the scatter is: neuronx-cc refuses an integer scatter with a combiner by default, as it
    # would run it in f32 (error code NCC_EVRF060). J = positions along `dim`, N = x.shape[dim].
    hits = jnp.moveaxis(index, dim, -1)[..., None] == jnp.arange(x.shape[dim], dtype=index.dtype)  # [..., J, N]
    values = jnp.moveaxis(src, dim, -1)[..., None].astype(x.dtype)  # [..., J, 1]
    added = jnp.moveaxis(jnp.where(hits, values, 0).sum(axis=-2, dtype=x.dtype), -1, dim)  # index's shape, N at dim
    # torch lets the index be smaller than x along the other dims: those rows receive nothing.
    return x + jnp.pad(added, [(0, size - got) for size, got in zip(x.shape, added.shape)])


def _index(out, x, indices):
    # numpy's advanced indexing is torch's, None entries (whole dims) included.
    return x[tuple(slice(None) if i is None else i for i in indices)]


def _slice(out, x, dim=0, start=None, end=None, step=1):
    dim = _axis(dim, x.ndim)
    size = x.shape[dim]
    start, end, _ = slice(start, end, step).indices(size)
    return jax.lax.slice_in_dim(x, start, max(start, end), step, axis=dim)


def _split_with_sizes(out, x, sizes, dim=0):
    dim = _axis(dim, x.ndim)
    return tuple(jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=dim))


def _sort(out, x, stable=None, dim=-1, descending=False):
    """(values, indices) along `dim`; stable: equal keys keep their order (torch's stable sort,
    descending included)."""
    dim = _axis(dim, x.ndim)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, dim)
    keys = -x if descending else x
    keys, indices = jax.lax.sort((keys, iota), dimension=dim, is_stable=True, num_keys=1)
    return (-keys if descending else keys), indices


def _topk(out, x, k, dim=-1, largest=True, sorted=True):
    dim = _axis(dim, x.ndim)
    moved = jnp.moveaxis(x, dim, -1)
    values, indices = jax.lax.top_k(moved if largest else -moved, k)
    values = values if largest else -values
    return jnp.moveaxis(values, -1, dim), jnp.moveaxis(indices, -1, dim)


def _div_mode(out, a, b, rounding_mode=None):
    if rounding_mode == "floor":
        return jnp.floor_divide(a, b)
    if rounding_mode == "trunc":
        if jnp.issubdtype(out.dtype, jnp.integer):  # exact: lax.div on integers rounds toward zero
            a, b = jnp.broadcast_arrays(jnp.asarray(a, out.dtype), jnp.asarray(b, out.dtype))
            return jax.lax.div(a, b)
        return jnp.trunc(jnp.true_divide(a, b))
    return jnp.true_divide(a, b)


def _reduction(function: Callable) -> Callable:
    def rule(out, x, dim=None, keepdim=False, dtype=None):
        return function(x.astype(out.dtype) if dtype is not None else x, axis=_dims(dim, x.ndim), keepdims=keepdim)
    return rule


def _full(out, size, fill_value, **_):
    return jnp.full(out.shape, fill_value, dtype=out.dtype)


def _full_like(out, x, fill_value, **_):
    return jnp.full(out.shape, fill_value, dtype=out.dtype)


def _arange(out, start, end=None, step=1, **_):
    return (jnp.arange(out.shape[0]) * step + start).astype(out.dtype)


def _binary(function: Callable) -> Callable:
    return lambda out, a, b, **kwargs: function(a, b)


def _unary(function: Callable) -> Callable:
    return lambda out, x, **kwargs: function(x)


def _add(out, a, b, alpha=1):
    return a + (b if alpha == 1 else b * alpha)


def _sub(out, a, b, alpha=1):
    return a - (b if alpha == 1 else b * alpha)


def _clamp(out, x, min=None, max=None):
    return jnp.clip(x, min, max)


def _cat(out, tensors, dim=0):
    rank = max(t.ndim for t in tensors)
    return jnp.concatenate([t for t in tensors if t.ndim == rank], axis=_axis(dim, rank))


def _squeeze(out, x, dims=None):
    return x.reshape(out.shape)


def _select(out, x, dim, index):
    dim = _axis(dim, x.ndim)
    return jax.lax.index_in_dim(x, index % x.shape[dim], axis=dim, keepdims=False)


def first_argmax(x):
    """Index of the first maximum along the last dim, as max then the least index holding it:
    no variadic reduce (neuronx-cc refuses jnp.argmax's), the same answer as torch.argmax for
    every input without NaN."""
    best = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == best, iota, x.shape[-1]), axis=-1)


def _argmax(out, x, dim=None, keepdim=False):
    """torch.argmax over `dim` (the first maximum), as `first_argmax` over that dim moved last."""
    if dim is None:
        return first_argmax(x.reshape(-1)).reshape(out.shape)
    dim = dim % x.ndim
    return first_argmax(jnp.moveaxis(x, dim, -1)).reshape(out.shape).astype(out.dtype)


def _cumsum(out, x, dim, dtype=None):
    return jnp.cumsum(x.astype(out.dtype), axis=_axis(dim, x.ndim))


def _linear(out, x, weight, bias=None):
    product = jnp.matmul(x, weight.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return (product if bias is None else product + bias).astype(out.dtype)


def _einsum(out, equation, tensors, path=None):
    return jnp.einsum(equation, *tensors, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32).astype(out.dtype)


def _in_fp32(function: Callable) -> Callable:
    """A composite float op computed in fp32 at least and rounded once (torch's decompositions
    compute them at `opmath` precision)."""
    def rule(out, x, *args, **kwargs):
        return function(x.astype(jnp.promote_types(x.dtype, jnp.float32)), *args, **kwargs)
    return rule


def _softplus(x, beta=1, threshold=20):
    scaled = x * beta
    return jnp.where(scaled > threshold, x, jnp.log1p(jnp.exp(scaled)) / beta)


def _logsumexp(x, dim, keepdim=False):
    return jax.nn.logsumexp(x, axis=_dims(dim, x.ndim), keepdims=keepdim)


def _split_like_out(out, x, *_, dim=0, **__):
    """split / chunk / unbind: the pieces `out` describes, along `dim`."""
    dim = _axis(dim, x.ndim)
    sizes = [piece.shape[dim] if len(piece.shape) == x.ndim else 1 for piece in out]
    pieces = jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=dim)
    return tuple(piece.reshape(shape.shape) for piece, shape in zip(pieces, out))


def _pad(out, x, pad, mode="constant", value=None):
    if mode != "constant":
        raise GraphcError(f"xla lowering: aten.pad in mode {mode!r}; only 'constant' padding is lowered")
    return _constant_pad_nd(out, x, pad, 0 if value is None else value)


def _embedding(out, weight, indices, *_):
    return jnp.take(weight, indices, axis=0)


def _index_select(out, x, dim, index):
    return jnp.take(x, index, axis=_axis(dim, x.ndim))


def _scalar_tensor(out, value, **_):
    return jnp.asarray(value, dtype=out.dtype)


def _softmax(out, x, dim, half_to_float=False):
    """In fp32 at least, as ATen accumulates a bf16 softmax, then in the output's dtype."""
    wide = jnp.promote_types(out.dtype, jnp.float32)
    return jax.nn.softmax(x.astype(wide), axis=_axis(dim, x.ndim)).astype(out.dtype)


def _log_softmax(out, x, dim, half_to_float=False):
    """In fp32 at least, as `_softmax`."""
    wide = jnp.promote_types(out.dtype, jnp.float32)
    return jax.nn.log_softmax(x.astype(wide), axis=_axis(dim, x.ndim)).astype(out.dtype)


def _constant_pad_nd(out, x, pad, value=0):
    """torch's pad list: (before, after) pairs from the last dim backwards; negative entries crop."""
    config = [(0, 0, 0)] * x.ndim
    for pair in range(len(pad) // 2):
        config[x.ndim - 1 - pair] = (pad[2 * pair], pad[2 * pair + 1], 0)
    return jax.lax.pad(x, jnp.asarray(value, x.dtype), config)


def _native_layer_norm(out, x, normalized_shape, weight, bias, eps):
    """(y, mean, rstd) over the trailing `normalized_shape` dims, statistics in fp32 as ATen's."""
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True) + eps)
    y = (xf - mean) * rstd
    y = y * weight if weight is not None else y
    y = y + bias if bias is not None else y
    return y.astype(out[0].dtype), mean.astype(out[1].dtype), rstd.astype(out[2].dtype)


FP8_BITS = jnp.uint8
"""How a float8_e4m3fn value (a weight kept as stored) enters a lowered program: as its byte.
neuronx-cc takes no F8E4M3FN operand on trn1 / trn2 (its error NCC_EVRF051), and the flag it
offers instead, `--experimental-unsafe-fp8e4m3fn-as-fp8e4m3`, reads the bytes as IEEE-style
e4m3, whose largest finite value is 240: DeepSeek's block quantisation maps every block's
largest magnitude to e4m3fn's 448, so each block's largest weights would be misread. The byte
is decoded exactly with integer ops (`fp8_e4m3fn_to_f32`) where the graph converts it, right
before its scaling and its dot. No other value of a step is a byte (torch.uint8 has no entry in
`interpret.JAX_DTYPES`), so a byte operand is always an FP8 weight."""


def fp8_e4m3fn_to_f32(bits):
    """The float32 value of each float8_e4m3fn byte (sign, 4 exponent bits of bias 7, 3 mantissa
    bits; exponent 0 subnormal; S.1111.111 NaN, the format's only non-finite value)."""
    b = bits.astype(jnp.uint32)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    normal = jax.lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
    magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 2.0**-9, normal)
    magnitude = jnp.where((exponent == 15) & (mantissa == 7), jnp.float32(jnp.nan), magnitude)
    return jnp.where((b >> 7) == 1, -magnitude, magnitude)


def _to_copy(out, x, *_, **__):
    # Every other conversion is the result's cast to `out.dtype` (`interpret._cast`).
    return fp8_e4m3fn_to_f32(x) if x.dtype == FP8_BITS and out.dtype != FP8_BITS else x


def _zeros(out, *_, **__):
    return jnp.zeros(out.shape, out.dtype)


def _where(out, condition, a, b):
    return jnp.where(condition, a, b)


def _same(out, x, *_, **__):
    return x


def _reshaped(out, x, *_, **__):
    return x.reshape(out.shape)


RULES: dict = {
    aten._to_copy.default: _to_copy,
    aten.to.dtype: _to_copy,
    aten.to.device: _to_copy,
    aten.contiguous.default: _same,
    aten.lift_fresh_copy.default: _same,
    aten.detach_.default: _same,
    aten.detach.default: _same,
    aten.reshape.default: _reshaped,
    aten.view_as.default: _reshaped,
    aten.flatten.using_ints: _reshaped,
    aten.unflatten.int: _reshaped,
    aten.expand_as.default: lambda out, x, other: jnp.broadcast_to(x, out.shape),
    aten.transpose.int: lambda out, x, dim0, dim1: jnp.swapaxes(x, dim0, dim1),
    aten.linear.default: _linear,
    aten.einsum.default: _einsum,
    aten.silu.default: _in_fp32(jax.nn.silu),
    aten.softplus.default: _in_fp32(_softplus),
    aten.logsumexp.default: _in_fp32(_logsumexp),
    aten.square.default: _unary(jnp.square),
    aten.floor_divide.default: _binary(jnp.floor_divide),
    aten.__and__.Tensor: _binary(jnp.bitwise_and),
    aten.masked_fill.Scalar: lambda out, x, mask, value: jnp.where(mask, jnp.asarray(value, x.dtype), x),
    aten.where.ScalarOther: _where,
    aten.where.ScalarSelf: _where,
    aten.zeros.default: _zeros,
    aten.new_zeros.default: _zeros,
    aten.new_full.default: lambda out, x, size, fill_value, **_: jnp.full(out.shape, fill_value, out.dtype),
    aten.zeros_like.default: _zeros,
    aten.ones_like.default: lambda out, *_, **__: jnp.ones(out.shape, out.dtype),
    aten.arange.default: lambda out, end, **_: jnp.arange(out.shape[0]).astype(out.dtype),
    aten.stack.default: lambda out, tensors, dim=0: jnp.stack(tensors, axis=_axis(dim, len(out.shape))),
    aten.split.Tensor: lambda out, x, split_size, dim=0: _split_like_out(out, x, dim=dim),
    aten.chunk.default: lambda out, x, chunks, dim=0: _split_like_out(out, x, dim=dim),
    aten.unbind.int: lambda out, x, dim=0: _split_like_out(out, x, dim=dim),
    aten.argsort.stable: lambda out, x, stable=False, dim=-1, descending=False: _sort(out, x, True, dim, descending)[1],
    aten.pad.default: _pad,
    aten.repeat_interleave.self_int: lambda out, x, repeats, dim=None, output_size=None: jnp.repeat(
        x.reshape(-1) if dim is None else x, repeats, axis=0 if dim is None else _axis(dim, x.ndim)),
    aten.clone.default: _to_copy,
    aten.alias.default: _to_copy,
    aten.abs.default: _unary(jnp.abs),
    aten.relu.default: _unary(jax.nn.relu),
    aten.neg.default: _unary(jnp.negative),
    aten.exp.default: _unary(jnp.exp),
    aten.log.default: _unary(jnp.log),
    aten.log1p.default: _unary(jnp.log1p),
    aten.cos.default: _unary(jnp.cos),
    aten.sin.default: _unary(jnp.sin),
    aten.sigmoid.default: _unary(jax.nn.sigmoid),
    aten.rsqrt.default: _unary(jax.lax.rsqrt),
    aten.sqrt.default: _unary(jnp.sqrt),
    aten.round.default: _unary(jnp.round),  # half to even, as torch.round
    aten.isinf.default: _unary(jnp.isinf),
    aten.bitwise_not.default: _unary(jnp.invert),
    aten.add.Tensor: _add,
    aten.sub.Tensor: _sub,
    aten.mul.Tensor: _binary(jnp.multiply),
    aten.div.Tensor: _binary(jnp.true_divide),
    aten.div.Tensor_mode: _div_mode,
    aten.pow.Tensor_Scalar: _binary(jnp.power),
    aten.remainder.Scalar: _binary(jnp.remainder),
    aten.remainder.Tensor: _binary(jnp.remainder),
    aten.maximum.default: _binary(jnp.maximum),
    aten.minimum.default: _binary(jnp.minimum),
    aten.copysign.Tensor: _binary(jnp.copysign),
    aten.bitwise_and.Tensor: _binary(jnp.bitwise_and),
    aten.bitwise_and.Scalar: _binary(jnp.bitwise_and),
    aten.__rshift__.Scalar: _binary(jnp.right_shift),
    aten.__lshift__.Scalar: _binary(jnp.left_shift),
    aten.view.dtype: lambda out, x, dtype: jax.lax.bitcast_convert_type(x, out.dtype),
    aten.bitwise_or.Tensor: _binary(jnp.bitwise_or),
    aten.eq.Scalar: _binary(jnp.equal),
    aten.eq.Tensor: _binary(jnp.equal),
    aten.ne.Scalar: _binary(jnp.not_equal),
    aten.ne.Tensor: _binary(jnp.not_equal),
    aten.ge.Scalar: _binary(jnp.greater_equal),
    aten.ge.Tensor: _binary(jnp.greater_equal),
    aten.gt.Scalar: _binary(jnp.greater),
    aten.gt.Tensor: _binary(jnp.greater),
    aten.le.Scalar: _binary(jnp.less_equal),
    aten.le.Tensor: _binary(jnp.less_equal),
    aten.lt.Scalar: _binary(jnp.less),
    aten.lt.Tensor: _binary(jnp.less),
    aten.where.self: _where,
    aten.clamp.default: _clamp,
    aten.mm.default: _matmul,
    aten.bmm.default: _matmul,
    aten.matmul.default: _matmul,
    aten.amax.default: _reduction(jnp.max),
    aten.amin.default: _reduction(jnp.min),
    aten.sum.dim_IntList: _reduction(jnp.sum),
    aten.any.dim: _reduction(jnp.any),
    aten.any.dims: _reduction(jnp.any),
    aten.argmax.default: _argmax,
    aten.mean.dim: _reduction(jnp.mean),
    aten.cumsum.default: _cumsum,
    aten._softmax.default: _softmax,
    aten.softmax.int: lambda out, x, dim, dtype=None: _softmax(out, x, dim),
    aten._log_softmax.default: _log_softmax,
    aten.native_layer_norm.default: _native_layer_norm,
    aten.layer_norm.default: lambda out, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True:
        _native_layer_norm((out, out, out), x, normalized_shape, weight, bias, eps)[0],
    aten.view.default: lambda out, x, size: x.reshape(out.shape),
    aten._unsafe_view.default: lambda out, x, size: x.reshape(out.shape),
    aten.expand.default: lambda out, x, size, implicit=False: jnp.broadcast_to(x, out.shape),
    aten.permute.default: lambda out, x, dims: jnp.transpose(x, _dims(dims, x.ndim)),
    aten.unsqueeze.default: lambda out, x, dim: x.reshape(out.shape),
    aten.squeeze.dims: _squeeze,
    aten.squeeze.dim: _squeeze,
    aten.select.int: _select,
    aten.slice.Tensor: _slice,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.cat.default: _cat,
    aten.constant_pad_nd.default: _constant_pad_nd,
    aten.index.Tensor: _index,
    aten.index_select.default: _index_select,
    aten.gather.default: _gather,
    aten.scatter.src: _scatter,
    aten.scatter.value: _scatter,
    aten.scatter_add.default: _scatter_add,
    aten.embedding.default: _embedding,
    aten.sort.stable: _sort,
    aten.topk.default: _topk,
    aten.full.default: _full,
    aten.full_like.default: _full_like,
    aten.scalar_tensor.default: _scalar_tensor,
    aten.arange.start_step: _arange,
    aten.arange.start: _arange,
    operator.getitem: lambda out, values, index: values[index],
    # Sizes derived from the pool's block count, fixed at lowering: plain ints here.
    aten.sym_size.int: lambda out, x, dim: x.shape[dim],
    aten.sym_numel.default: lambda out, x: int(np.prod(x.shape)),
    operator.mul: _binary(operator.mul),
    operator.add: _binary(operator.add),
    operator.sub: _binary(operator.sub),
    operator.floordiv: _binary(operator.floordiv),
}
"""Core ATen op -> rule."""

IGNORED = frozenset({aten._assert_tensor_metadata.default})
"""Ops with no value: torch.export's run-time metadata checks."""
