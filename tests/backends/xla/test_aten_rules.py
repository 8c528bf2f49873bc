"""The XLA backend's lowering rules (graphc.backends.xla.aten.RULES) against the torch ops they lower.

- every rule, called as `interpret` calls it (an `Out` from torch's result, tensors as jax arrays,
  int64 as int32) and its result cast to `out.dtype`, equals the torch op: exactly for integer and
  bool results and for data movement, within FP32 (fp32 math) or BF16 (bf16 results) of the
  result's largest finite magnitude otherwise; edge cases are cases of their own;
- `first_argmax` is torch.argmax, ties and -inf included;
- the table covers every op of real step programs as captured.
"""

from __future__ import annotations

import operator

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from graphc.backends.xla import aten as aten_rules
from graphc.backends.xla import graphc_ops
from graphc.backends.xla.aten import RULES, Out
from graphc.backends.xla.graphc_ops import first_argmax
from graphc.buckets.selection import Bucket
from graphc.compiler.capture import capture_bucket
from graphc.weights.checkpoint import load_model
from graphc.passes.manager import PassContext, PassManager
from graphc.passes.registry import backend_passes
from graphc.passes.verifier import verify
from graphc.topology import Topology
from support import SPARSE_V32

aten = torch.ops.aten
INF = float("inf")
OPEN_END = 9223372036854775807
"""The end torch.export writes for an open slice (x[:, 2:])."""

FP32 = 1e-6
"""fp32 math: relative to the result's largest finite magnitude, about 8 fp32 ulps (2**-23): room
for a different evaluation order or a last-bit difference in exp/log/sin, nothing more."""
BF16 = 2.0**-7
"""bf16 results: both sides compute in fp32 and round once to bf16; fp32 values that differ in
their last bits can round to adjacent bf16 values, one bf16 ulp (at most 2**-7 of the value) apart."""

DTYPES = {torch.float32: np.dtype(np.float32), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
          torch.int64: np.dtype(np.int32), torch.int32: np.dtype(np.int32), torch.bool: np.dtype(np.bool_)}
"""torch dtype -> the dtype of its values in a lowered program (no int64: jax runs without x64)."""

NOT_TENSOR_OPS = {operator.getitem, operator.mul, operator.add, operator.sub, operator.floordiv, aten.sym_size.int,
                  aten.sym_numel.default}
"""Entries of RULES on tuples and Python ints, tested by test_int_and_tuple_rules."""


# ---------------------------------------------------------------- inputs

def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=_g(seed))).to(dtype)


def _rand(*shape, seed=0):
    return torch.rand(*shape, generator=_g(seed))


def _randint(low, high, *shape, seed=0):
    return torch.randint(low, high, shape, generator=_g(seed))


def _with_neg_inf(x, seed=1, fraction=0.3):
    """`x` with about `fraction` of its entries -inf (masked scores)."""
    return x.masked_fill(torch.rand(x.shape, generator=_g(seed)) < fraction, -INF)


def _masked_rows(seed=0):
    """[3, 5, 7] scores with -inf entries, one row entirely -inf and one with a single finite entry."""
    x = _with_neg_inf(_randn(3, 5, 7, seed=seed), seed=seed + 1)
    x[0, 1] = -INF
    x[1, 2] = -INF
    x[1, 2, 4] = 0.5
    return x


def _rows_of_permutations(rows, n, k, seed=0):
    """[rows, k] distinct indices per row below n (scatter targets without collisions)."""
    g = _g(seed)
    return torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(rows)])


X = _randn(3, 5, 7)
XB = _randn(3, 5, 7, dtype=torch.bfloat16)
I = _randint(-50, 50, 3, 5, 7, seed=2)
B = _randn(3, 5, 7, seed=3) > 0
SIGNED = _randint(1, 9, 3, 5, 7, seed=1) * torch.tensor([1, -1, 1, -1, 1, -1, -1])  # nonzero, both signs
SMALL = _randint(-3, 4, 3, 5, 7, seed=4).float()  # many ties, for comparisons and sorts
MASKED = _masked_rows()
POSITIVE = _rand(3, 5, 7, seed=5) + 0.05


# ---------------------------------------------------------------- cases

def _case(name, op, *args, tol=None, **kwargs):
    return pytest.param(op, args, kwargs, tol, id=name)


CASES = [
    # conversions and copies
    _case("to_copy-f32-to-bf16", aten._to_copy.default, _randn(3, 5, 7, scale=10), dtype=torch.bfloat16),
    _case("to_copy-bf16-to-f32", aten._to_copy.default, XB, dtype=torch.float32),
    _case("to_copy-f32-to-int-truncates", aten._to_copy.default, _randn(3, 5, 7, scale=5), dtype=torch.int64),
    _case("to_copy-bf16-to-int", aten._to_copy.default, _randn(3, 5, 7, dtype=torch.bfloat16, scale=5),
          dtype=torch.int64),
    _case("to_copy-int-to-f32", aten._to_copy.default, I, dtype=torch.float32),
    _case("to_copy-int-to-bf16", aten._to_copy.default, I * 7, dtype=torch.bfloat16),
    _case("to_copy-bool-to-f32", aten._to_copy.default, B, dtype=torch.float32),
    _case("to_copy-f32-to-bool", aten._to_copy.default, SMALL, dtype=torch.bool),
    _case("to_copy-int-to-int32", aten._to_copy.default, I, dtype=torch.int32),
    _case("clone", aten.clone.default, MASKED),
    _case("clone-memory-format", aten.clone.default, I, memory_format=torch.contiguous_format),
    _case("alias", aten.alias.default, XB),
    # unary
    _case("abs-neg-inf", aten.abs.default, MASKED),
    _case("abs-int", aten.abs.default, I),
    _case("relu-neg-inf", aten.relu.default, MASKED),
    _case("neg", aten.neg.default, MASKED),
    _case("neg-int", aten.neg.default, I),
    _case("exp", aten.exp.default, _randn(3, 5, 7, scale=3), tol=FP32),
    _case("exp-neg-inf", aten.exp.default, MASKED, tol=FP32),
    _case("log", aten.log.default, POSITIVE * 10, tol=FP32),
    _case("log-zero-is-neg-inf", aten.log.default, POSITIVE.masked_fill(B, 0.0), tol=FP32),
    _case("log1p-tiny-and-large", aten.log1p.default, POSITIVE * torch.tensor([1e-7, 1e-3, 1, 10, 1e3, 0, 5]),
          tol=FP32),
    _case("cos", aten.cos.default, _randn(3, 5, 7, scale=4), tol=FP32),
    _case("sin", aten.sin.default, _randn(3, 5, 7, scale=4), tol=FP32),
    _case("sigmoid", aten.sigmoid.default, _randn(3, 5, 7, scale=6), tol=FP32),
    _case("sigmoid-neg-inf", aten.sigmoid.default, MASKED, tol=FP32),
    _case("rsqrt", aten.rsqrt.default, POSITIVE, tol=FP32),
    _case("sqrt", aten.sqrt.default, POSITIVE.masked_fill(B, 0.0), tol=FP32),
    # Halves (token-id digits read back from the pool are near-integers) round to even, as torch's.
    _case("round-halves-to-even", aten.round.default, torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 254.9999, 3.0001])),
    _case("round", aten.round.default, _randn(3, 5, 7, scale=300)),
    _case("isinf", aten.isinf.default, MASKED.masked_fill(B & (MASKED > 0), INF)),
    _case("bitwise_not-bool", aten.bitwise_not.default, B),
    _case("bitwise_not-int", aten.bitwise_not.default, I),
    # binary arithmetic
    _case("add-broadcast", aten.add.Tensor, X, _randn(7, seed=1), tol=FP32),
    _case("add-alpha", aten.add.Tensor, X, _randn(5, 1, seed=1), alpha=0.5, tol=FP32),
    _case("add-int-alpha", aten.add.Tensor, I, _randint(-9, 9, 7, seed=1), alpha=3),
    _case("add-int-float-scalar", aten.add.Tensor, I, 0.5, tol=FP32),
    _case("add-neg-inf", aten.add.Tensor, MASKED, X, tol=FP32),
    _case("sub", aten.sub.Tensor, X, _randn(3, 1, 7, seed=1), tol=FP32),
    _case("sub-alpha", aten.sub.Tensor, X, _randn(3, 5, 7, seed=1), alpha=2, tol=FP32),
    _case("sub-int-scalar", aten.sub.Tensor, I, 7),
    # logsumexp's x - amax(x): -inf entries stay -inf, a row of -inf only gives NaN on both sides
    _case("sub-row-max-neg-inf", aten.sub.Tensor, MASKED, MASKED.amax(-1, keepdim=True), tol=FP32),
    _case("mul", aten.mul.Tensor, X, _randn(3, 5, 1, seed=1), tol=FP32),
    _case("mul-scalar", aten.mul.Tensor, X, 0.125, tol=FP32),
    _case("mul-int", aten.mul.Tensor, I, _randint(-5, 5, 3, 5, 7, seed=1)),
    _case("mul-bf16", aten.mul.Tensor, XB, _randn(3, 5, 7, seed=1, dtype=torch.bfloat16), tol=BF16),
    _case("div", aten.div.Tensor, X, POSITIVE - 0.5, tol=FP32),
    _case("div-int-is-float", aten.div.Tensor, I, 7, tol=FP32),
    _case("div-floor-negative-ints", aten.div.Tensor_mode, I, SIGNED, rounding_mode="floor"),
    _case("div-floor-int-scalar", aten.div.Tensor_mode, I, 16, rounding_mode="floor"),
    _case("div-trunc-negative-ints", aten.div.Tensor_mode, I, SIGNED, rounding_mode="trunc"),
    _case("div-trunc-int-scalar", aten.div.Tensor_mode, I, -3, rounding_mode="trunc"),
    _case("div-trunc-large-ints", aten.div.Tensor_mode, torch.tensor([2**24 + 1, 2**30 + 3, -(2**27) - 5]),
          torch.tensor([1, 1, 3]), rounding_mode="trunc"),
    _case("div-floor-float", aten.div.Tensor_mode, _randn(3, 5, 7, scale=10), _randn(7, seed=1), rounding_mode="floor",
          tol=FP32),
    _case("div-trunc-float", aten.div.Tensor_mode, _randn(3, 5, 7, scale=10), _randn(7, seed=1), rounding_mode="trunc",
          tol=FP32),
    _case("div-mode-none", aten.div.Tensor_mode, X, POSITIVE, rounding_mode=None, tol=FP32),
    _case("pow-square", aten.pow.Tensor_Scalar, X, 2, tol=FP32),
    _case("pow-half", aten.pow.Tensor_Scalar, POSITIVE, 0.5, tol=FP32),
    _case("pow-negative", aten.pow.Tensor_Scalar, POSITIVE, -1.5, tol=FP32),
    _case("pow-int", aten.pow.Tensor_Scalar, _randint(-9, 9, 3, 5, 7), 3),
    _case("remainder-scalar-negative-ints", aten.remainder.Scalar, I, 3),
    _case("remainder-scalar-negative-divisor", aten.remainder.Scalar, I, -4),
    _case("remainder-scalar-float", aten.remainder.Scalar, _randn(3, 5, 7, scale=10), 2.5, tol=FP32),
    _case("remainder-tensor-negative-ints", aten.remainder.Tensor, I, SIGNED),
    _case("remainder-tensor-float", aten.remainder.Tensor, _randn(3, 5, 7, scale=10), -POSITIVE * 3, tol=FP32),
    _case("maximum-neg-inf", aten.maximum.default, MASKED, _with_neg_inf(X, seed=7)),
    _case("maximum-int", aten.maximum.default, I, _randint(-50, 50, 7, seed=1)),
    _case("minimum-neg-inf", aten.minimum.default, MASKED, X),
    _case("minimum-int", aten.minimum.default, I, _randint(-50, 50, 5, 1, seed=1)),
    # Engram's signed square root; a negative zero's sign is carried too.
    _case("copysign", aten.copysign.Tensor, POSITIVE, _randn(3, 5, 7, seed=4).masked_fill(B, -0.0)),
    _case("bitwise_and-bool", aten.bitwise_and.Tensor, B, _randn(5, 7, seed=1) > 0),
    _case("bitwise_and-int", aten.bitwise_and.Tensor, torch.tensor([6, 5, 12, -1]), torch.tensor([3, 3, 10, 6])),
    _case("bitwise_or-bool", aten.bitwise_or.Tensor, B, _randn(3, 5, 7, seed=1) > 0),
    _case("bitwise_or-int", aten.bitwise_or.Tensor, torch.tensor([6, 4, 0, -8]), torch.tensor([3, 1, 0, 1])),
    # an FP4 weight's decode (`weights/fp4.py`): its bytes' nibbles, an fp32 built from its bits
    _case("bitwise_and-scalar", aten.bitwise_and.Scalar, torch.tensor([-1, 200, 15, 16, 255], dtype=torch.int32), 0xF),
    _case("rshift", aten.__rshift__.Scalar, torch.tensor([255, 16, 7, 0, 1 << 30], dtype=torch.int32), 4),
    _case("lshift", aten.__lshift__.Scalar, torch.tensor([0, 1, 3, 129, 127], dtype=torch.int32), 23),
    _case("view-int32-as-float32", aten.view.dtype, torch.tensor([0x3F800000, 0x40C00000, 0, -2**31, 0x00400000],
                                                                  dtype=torch.int32), torch.float32),
    # comparisons (ties and -inf)
    _case("eq-scalar-neg-inf", aten.eq.Scalar, MASKED, -INF),
    _case("eq-scalar-int", aten.eq.Scalar, _randint(0, 4, 3, 5, 7), 2),
    _case("eq-tensor", aten.eq.Tensor, SMALL, _randint(-3, 4, 7, seed=1).float()),
    _case("ne-scalar", aten.ne.Scalar, _randint(0, 3, 3, 5, 7), 0),
    _case("ne-tensor", aten.ne.Tensor, SMALL, SMALL.flip(-1)),
    _case("ge-scalar", aten.ge.Scalar, SMALL, 1),
    _case("ge-tensor", aten.ge.Tensor, _randint(-3, 4, 3, 5, 7), _randint(-3, 4, 5, 1, seed=1)),
    _case("gt-scalar", aten.gt.Scalar, MASKED, -INF),
    _case("gt-tensor", aten.gt.Tensor, SMALL, SMALL.flip(0)),
    _case("le-scalar", aten.le.Scalar, SMALL, -1.5),
    _case("le-tensor", aten.le.Tensor, _randint(0, 8, 3, 5, 7), _randint(0, 8, 3, 5, 7, seed=1)),
    _case("lt-scalar", aten.lt.Scalar, _randint(0, 8, 3, 5, 7), 4),
    _case("lt-tensor", aten.lt.Tensor, MASKED, SMALL),
    _case("where-neg-inf", aten.where.self, B, X, torch.tensor(-INF)),
    _case("where-broadcast", aten.where.self, _randn(5, 1, seed=1) > 0, MASKED, X[0]),
    _case("where-int", aten.where.self, B, I, torch.tensor(0)),
    _case("clamp-min", aten.clamp.default, X, -0.5),
    _case("clamp-max", aten.clamp.default, MASKED, None, 0.25),
    _case("clamp-both", aten.clamp.default, MASKED, -1.0, 1.0),
    _case("clamp-int", aten.clamp.default, I, 0, 20),
    # matmul
    _case("mm-f32", aten.mm.default, _randn(5, 16), _randn(16, 3, seed=1), tol=FP32),
    _case("mm-bf16", aten.mm.default, _randn(5, 64, dtype=torch.bfloat16), _randn(64, 3, seed=1, dtype=torch.bfloat16),
          tol=BF16),
    _case("bmm-f32", aten.bmm.default, _randn(3, 5, 7), _randn(3, 7, 4, seed=1), tol=FP32),
    _case("bmm-bf16", aten.bmm.default, _randn(3, 5, 64, dtype=torch.bfloat16),
          _randn(3, 64, 4, seed=1, dtype=torch.bfloat16), tol=BF16),
    # reductions
    _case("amax-neg-inf-rows", aten.amax.default, MASKED, [-1]),
    _case("amax-keepdim-two-dims", aten.amax.default, MASKED, [0, -1], True),
    _case("amax-int", aten.amax.default, I, [1]),
    _case("any-dim", aten.any.dim, B, 1),
    _case("any-dim-keepdim", aten.any.dim, B, -1, True),
    _case("any-dims", aten.any.dims, B, [0, 2]),
    _case("argmax-last", aten.argmax.default, X, -1),
    _case("argmax-keepdim-ties", aten.argmax.default, I.clamp(-5, 5), 1, True),
    _case("argmax-all", aten.argmax.default, X),
    _case("amin-keepdim", aten.amin.default, X, [-2], True),
    _case("amin-all", aten.amin.default, I, []),
    _case("sum-last", aten.sum.dim_IntList, X, [-1], tol=FP32),
    _case("sum-keepdim", aten.sum.dim_IntList, X, [0, 2], True, tol=FP32),
    _case("sum-all-none", aten.sum.dim_IntList, X, None, tol=FP32),
    _case("sum-all-empty-list", aten.sum.dim_IntList, I, []),
    _case("sum-bool-dtype-int", aten.sum.dim_IntList, B, [-1], dtype=torch.int64),
    _case("sum-int-keepdim", aten.sum.dim_IntList, I, [1], True),
    _case("sum-bf16-dtype-f32", aten.sum.dim_IntList, XB, [-1], dtype=torch.float32, tol=FP32),
    _case("mean-last-keepdim", aten.mean.dim, X, [-1], True, tol=FP32),
    _case("mean-two-dims", aten.mean.dim, X, [0, -1], tol=FP32),
    _case("mean-bf16-dtype-f32", aten.mean.dim, XB, [-1], True, dtype=torch.float32, tol=FP32),
    _case("mean-int-dtype-f32", aten.mean.dim, I, [1], dtype=torch.float32, tol=FP32),
    _case("cumsum-f32", aten.cumsum.default, X, -1, tol=FP32),
    _case("cumsum-bool-dtype-int", aten.cumsum.default, B, -1, dtype=torch.int64),
    _case("cumsum-bool-dtype-int32", aten.cumsum.default, B, 1, dtype=torch.int32),
    _case("cumsum-int", aten.cumsum.default, I, 0),
    _case("cumsum-int-dtype-f32", aten.cumsum.default, I, -2, dtype=torch.float32, tol=FP32),
    _case("softmax-last", aten._softmax.default, _randn(3, 5, 7, scale=4), -1, False, tol=FP32),
    _case("softmax-dim0-neg-inf-partial-rows", aten._softmax.default, MASKED.masked_fill(MASKED.isinf().all(-1,
          keepdim=True), 0.0), 0, False, tol=FP32),
    _case("softmax-bf16", aten._softmax.default, XB, 1, False, tol=BF16),
    _case("log-softmax-last", aten._log_softmax.default, _randn(3, 5, 7, scale=4), -1, False, tol=FP32),
    _case("log-softmax-bf16", aten._log_softmax.default, XB, 1, False, tol=BF16),
    _case("native_layer_norm", aten.native_layer_norm.default, _randn(3, 5, 7, scale=3) + 1, [7],
          _randn(7, seed=1), _randn(7, seed=2), 1e-5, tol=FP32),
    _case("native_layer_norm-two-dims-no-affine", aten.native_layer_norm.default, X, [5, 7], None, None, 1e-6,
          tol=FP32),
    _case("native_layer_norm-bf16", aten.native_layer_norm.default, XB, [7],
          _randn(7, seed=1, dtype=torch.bfloat16), _randn(7, seed=2, dtype=torch.bfloat16), 1e-5, tol=BF16),
    # views and data movement (exact)
    _case("view-minus-one", aten.view.default, X, [-1, 7]),
    _case("view-split-dim", aten.view.default, I, [3, 5, 7, 1]),
    _case("unsafe_view", aten._unsafe_view.default, XB, [15, -1]),
    _case("expand-minus-one", aten.expand.default, _randn(3, 1, 7), [2, -1, 5, -1]),
    _case("expand-scalar", aten.expand.default, torch.tensor(3), [2, 3]),
    _case("permute", aten.permute.default, X, [2, 0, 1]),
    _case("permute-negative-dims", aten.permute.default, I, [-1, -3, -2]),
    _case("unsqueeze-first", aten.unsqueeze.default, X, 0),
    _case("unsqueeze-negative", aten.unsqueeze.default, I, -1),
    _case("unsqueeze-middle-negative", aten.unsqueeze.default, X, -3),
    _case("squeeze-dims", aten.squeeze.dims, _randn(1, 3, 1, 5, 1), [0, -1]),
    _case("squeeze-dims-non-unit-kept", aten.squeeze.dims, _randn(1, 3, 1, 5), [0, 1, -2]),
    _case("squeeze-dim-negative", aten.squeeze.dim, _randn(3, 1, 5), -2),
    _case("squeeze-dim-non-unit", aten.squeeze.dim, X, 1),
    _case("select", aten.select.int, X, 0, 2),
    _case("select-negative", aten.select.int, I, -2, -1),
    _case("slice-open-end", aten.slice.Tensor, X, 1, 2, OPEN_END),
    _case("slice-negative-start", aten.slice.Tensor, X, -1, -3),
    _case("slice-end-beyond-size", aten.slice.Tensor, I, 0, 1, 100),
    _case("slice-negative-end", aten.slice.Tensor, X, 2, 0, -1),
    _case("slice-step", aten.slice.Tensor, X, -1, 1, OPEN_END, 2),
    _case("slice-empty-start-after-end", aten.slice.Tensor, X, 2, 5, 3),
    _case("slice-empty-start-beyond-size", aten.slice.Tensor, I, 1, 10, OPEN_END),
    _case("slice-defaults", aten.slice.Tensor, X),
    _case("split_with_sizes", aten.split_with_sizes.default, X, [2, 3, 2], -1),
    _case("split_with_sizes-dim0", aten.split_with_sizes.default, I, [1, 2]),
    _case("split_with_sizes-empty-piece", aten.split_with_sizes.default, X, [0, 5], 1),
    _case("cat-negative-dim", aten.cat.default, [X, _randn(3, 5, 2, seed=1), MASKED], -1),
    _case("cat-int-dim0", aten.cat.default, [I, I[:1]]),
    _case("constant_pad_nd-last-two-dims", aten.constant_pad_nd.default, X, [1, 2, 0, 3], -1.5),
    _case("constant_pad_nd-crops-negative", aten.constant_pad_nd.default, I, [-2, 1]),
    _case("constant_pad_nd-bool", aten.constant_pad_nd.default, B, [0, 0, 0, 0, 2, 0], True),
    _case("cat-skips-legacy-empty", aten.cat.default, [X[0], torch.empty(0), X[1]], 0),
    _case("cat-empty-piece", aten.cat.default, [X, X[:, :0]], 1),
    _case("index-none-then-tensor", aten.index.Tensor, X, [None, torch.tensor([4, 0, 0, 2])]),
    _case("index-tensors-around-slice", aten.index.Tensor, X, [torch.tensor([2, 0]), None, torch.tensor([6, 1])]),
    _case("index-negative-indices", aten.index.Tensor, I, [torch.tensor([-1, 0, -3])]),
    _case("index-broadcast-tensors", aten.index.Tensor, X, [torch.tensor([[0], [2]]), torch.tensor([1, 3, 4])]),
    _case("index-2d-after-nones", aten.index.Tensor, XB, [None, None, _randint(0, 7, 2, 4)]),
    _case("index_select-negative-dim", aten.index_select.default, X, -1, torch.tensor([6, 0, 6, 3])),
    _case("index_select-dim0", aten.index_select.default, I, 0, torch.tensor([2, 2, 0])),
    _case("gather-last", aten.gather.default, MASKED, -1, _randint(0, 7, 3, 5, 4)),
    _case("gather-smaller-index", aten.gather.default, I, 1, _randint(0, 5, 2, 3, 7)),
    _case("gather-sparse-grad-kwarg", aten.gather.default, X, 0, _randint(0, 3, 3, 5, 7), sparse_grad=False),
    _case("scatter-src-larger-than-index", aten.scatter.src, X, -1, _rows_of_permutations(3, 7, 4).reshape(3, 1, 4)
          .expand(3, 5, 4).contiguous(), _randn(3, 5, 7, seed=1)),
    _case("scatter-src-dim0", aten.scatter.src, I, 0, _rows_of_permutations(7, 3, 2).T.reshape(2, 1, 7)
          .expand(2, 4, 7).contiguous(), _randint(100, 200, 3, 5, 7)),
    _case("scatter-value-neg-inf", aten.scatter.value, X, -1, _rows_of_permutations(15, 7, 3).reshape(3, 5, 3), -INF),
    _case("scatter-value-int", aten.scatter.value, I, 1, _randint(0, 5, 3, 2, 7), 0),
    _case("scatter_add-repeated-int", aten.scatter_add.default, I, -1, _randint(0, 3, 3, 5, 6),
          _randint(-9, 9, 3, 5, 7, seed=1)),
    _case("scatter_add-int-dim0-smaller-index", aten.scatter_add.default, I, 0, _randint(0, 3, 2, 4, 5),
          _randint(-9, 9, 3, 5, 7, seed=2)),
    _case("scatter_add-counts", aten.scatter_add.default, torch.zeros(9, dtype=torch.int64),  # the MoE's routes
          0, _randint(0, 9, 24), torch.ones(24, dtype=torch.int64)),
    _case("scatter_add-repeated-float", aten.scatter_add.default, X, 0, _randint(0, 2, 4, 5, 7),
          _randn(5, 5, 7, seed=1), tol=FP32),
    _case("embedding", aten.embedding.default, _randn(10, 4), torch.tensor([[3, 3, 9], [0, 1, 3]])),
    _case("embedding-padding-idx", aten.embedding.default, _randn(10, 4, dtype=torch.bfloat16),
          torch.tensor([2, 0, 2]), 0),
    # sort and top-k
    _case("sort-stable-descending-ties", aten.sort.stable, torch.tensor([1.0, 3, 3, 2, 3]), stable=True,
          descending=True),
    _case("sort-stable-ascending-ties", aten.sort.stable, torch.tensor([[2.0, 1, 2, 1, 0], [3, 3, 3, 3, 3]]),
          stable=True, dim=-1),
    _case("sort-stable-descending-many-ties", aten.sort.stable, SMALL, stable=True, dim=-1, descending=True),
    _case("sort-stable-neg-inf", aten.sort.stable, MASKED, stable=True, dim=-1, descending=True),
    _case("sort-stable-neg-inf-ascending", aten.sort.stable, MASKED, stable=True, dim=2),
    _case("sort-stable-middle-dim", aten.sort.stable, SMALL, stable=True, dim=1, descending=True),
    _case("sort-stable-signed-zeros-tie", aten.sort.stable, torch.tensor([0.0, -0.0, 1, -0.0, 0.0]), stable=True,
          descending=True),
    _case("sort-stable-int", aten.sort.stable, I, stable=True, dim=0, descending=True),
    _case("topk", aten.topk.default, X, 3),
    _case("topk-middle-dim", aten.topk.default, X, 2, 1),
    _case("topk-negative-dim", aten.topk.default, X, 4, -2),
    _case("topk-skips-neg-inf", aten.topk.default, X.index_fill(-1, torch.tensor([1, 4]), -INF), 3),
    _case("topk-smallest", aten.topk.default, X, 3, -1, False),
    _case("topk-smallest-neg-inf-first", aten.topk.default, X.index_fill(-1, torch.tensor([2]), -INF), 3, -1,
          largest=False),
    _case("topk-int", aten.topk.default, torch.randperm(35, generator=_g(3)).reshape(5, 7), 2),
    # creation
    _case("full-f32", aten.full.default, [3, 5], 1.5),
    _case("full-neg-inf", aten.full.default, [2, 7], -INF, dtype=torch.float32),
    _case("full-int", aten.full.default, [4], 7, dtype=torch.int64),
    _case("full-bool", aten.full.default, [2, 3], True, dtype=torch.bool),
    _case("full-bf16", aten.full.default, [3], 0.1, dtype=torch.bfloat16),
    _case("full-scalar-shape", aten.full.default, [], -1, dtype=torch.int64, device=torch.device("cpu"),
          pin_memory=False),
    _case("full_like-neg-inf", aten.full_like.default, X, -INF),
    _case("full_like-int", aten.full_like.default, I, 3),
    _case("full_like-dtype", aten.full_like.default, X, 0, dtype=torch.int64),
    _case("full_like-bool", aten.full_like.default, B, False),
    _case("scalar_tensor-neg-inf", aten.scalar_tensor.default, -INF),
    _case("scalar_tensor-int", aten.scalar_tensor.default, 3, dtype=torch.int64),
    _case("scalar_tensor-bool", aten.scalar_tensor.default, True, dtype=torch.bool),
    _case("scalar_tensor-bf16", aten.scalar_tensor.default, 0.1, dtype=torch.bfloat16),
    _case("arange-start-step-int", aten.arange.start_step, 0, 10, 3),
    _case("arange-start-step-negative", aten.arange.start_step, 10, -2, -3),
    _case("arange-start-step-float-step", aten.arange.start_step, 0, 1, 0.1, tol=FP32),
    _case("arange-start-step-float-start", aten.arange.start_step, -1.5, 2.0, 0.25, dtype=torch.float32, tol=FP32),
    _case("arange-start-step-int-dtype", aten.arange.start_step, 0, 7, 1, dtype=torch.int64),
    _case("arange-start", aten.arange.start, 2, 9),
    _case("arange-start-float", aten.arange.start, 0.5, 4, dtype=torch.float32, tol=FP32),
    # composite ops as captured (no run_decompositions before lowering): their decompositions' results
    _case("to-dtype-bf16", aten.to.dtype, _randn(3, 5, 7, scale=10), torch.bfloat16),
    _case("to-dtype-int", aten.to.dtype, _randn(3, 5, 7, scale=5), torch.int64),
    _case("to-device-dtype", aten.to.device, XB, torch.device("cpu"), torch.float32),
    _case("contiguous", aten.contiguous.default, X),
    _case("lift-fresh-copy", aten.lift_fresh_copy.default, I),
    _case("detach-in-place", aten.detach_.default, X.clone()),
    _case("detach", aten.detach.default, _randn(3, 5)),
    _case("reshape", aten.reshape.default, X, [5, -1]),
    _case("view-as", aten.view_as.default, X, X.reshape(15, 7)),
    _case("flatten", aten.flatten.using_ints, X, 0, 1),
    _case("unflatten", aten.unflatten.int, X.reshape(15, 7), 0, [3, 5]),
    _case("expand-as", aten.expand_as.default, X[:, :1], X),
    _case("transpose", aten.transpose.int, X, 0, -1),
    _case("linear", aten.linear.default, X, _randn(4, 7, seed=6), tol=FP32),
    _case("linear-bias", aten.linear.default, X, _randn(4, 7, seed=6), _randn(4, seed=7), tol=FP32),
    _case("linear-bf16", aten.linear.default, XB, _randn(4, 7, seed=6, dtype=torch.bfloat16), tol=BF16),
    _case("einsum", aten.einsum.default, "bqd,bkd->bqk", [X, _randn(3, 4, 7, seed=6)], tol=FP32),
    _case("einsum-bf16", aten.einsum.default, "bqd,ed->bqe", [XB, _randn(4, 7, seed=6, dtype=torch.bfloat16)],
          tol=BF16),
    _case("silu", aten.silu.default, _randn(3, 5, 7, scale=4), tol=FP32),
    _case("silu-bf16", aten.silu.default, _randn(3, 5, 7, scale=4, dtype=torch.bfloat16), tol=BF16),
    _case("softplus", aten.softplus.default, _randn(3, 5, 7, scale=15), tol=FP32),  # both sides of threshold 20
    _case("softplus-beta", aten.softplus.default, _randn(3, 5, 7, scale=4), 2.0, 5.0, tol=FP32),
    _case("logsumexp", aten.logsumexp.default, MASKED, [-1], True, tol=FP32),  # a row of -inf included
    _case("logsumexp-bf16", aten.logsumexp.default, XB, [1, 2], tol=BF16),
    _case("square", aten.square.default, X, tol=FP32),
    _case("floor-divide-int", aten.floor_divide.default, I, _randint(1, 7, 7, seed=6)),
    _case("floor-divide-signs", aten.floor_divide.default, I, -3),
    _case("and", aten.__and__.Tensor, B, _randn(5, 7, seed=8) > 0),
    _case("masked-fill", aten.masked_fill.Scalar, X, B, -INF),
    _case("masked-fill-int", aten.masked_fill.Scalar, I, B, 7),
    _case("where-scalar-other", aten.where.ScalarOther, B, X, 0.0),
    _case("where-scalar-self", aten.where.ScalarSelf, B, -1.5, X),
    _case("zeros", aten.zeros.default, [3, 4], dtype=torch.float32),
    _case("zeros-like", aten.zeros_like.default, I),
    _case("ones-like", aten.ones_like.default, XB),
    _case("arange-end", aten.arange.default, 9, dtype=torch.int64),
    _case("stack", aten.stack.default, [X, X + 1], -1),
    _case("split", aten.split.Tensor, X, 3, 2),
    _case("chunk", aten.chunk.default, X, 2, 1),
    _case("unbind", aten.unbind.int, X, 1),
    _case("argsort-stable", aten.argsort.stable, SMALL, stable=True, dim=1, descending=True),
    _case("pad", aten.pad.default, X, [1, 2, 0, 1], "constant", -1.0),
    _case("repeat-interleave", aten.repeat_interleave.self_int, X, 2, 1),
    _case("repeat-interleave-flat", aten.repeat_interleave.self_int, I, 3),
    _case("softmax-int-dtype", aten.softmax.int, XB, -1, torch.float32, tol=FP32),
    _case("matmul-broadcast", aten.matmul.default, X[:, None], _randn(5, 7, 4, seed=6), tol=FP32),
    _case("matmul-vector", aten.matmul.default, X, _randn(7, seed=6), tol=FP32),
    _case("new-zeros", aten.new_zeros.default, XB, [2, 3]),
    _case("new-full", aten.new_full.default, I, [2, 3], -7),
    _case("layer-norm", aten.layer_norm.default, _randn(3, 5, 7, scale=3), [7], _randn(7, seed=6), _randn(7, seed=7),
          1e-5, tol=FP32),
]


# ---------------------------------------------------------------- harness

def _jax(value):
    """An argument as `interpret` passes it: tensors as jax arrays (int64 as int32)."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            return jnp.asarray(value.float().numpy()).astype(jnp.bfloat16)  # exact: bf16 -> fp32 -> bf16
        return jnp.asarray(value.numpy().astype(DTYPES[value.dtype]))
    if isinstance(value, (list, tuple)):
        return type(value)(_jax(v) for v in value)
    if isinstance(value, dict):
        return {key: _jax(v) for key, v in value.items()}
    return value


def _out(expected):
    if isinstance(expected, (list, tuple)):
        return tuple(_out(e) for e in expected)
    return Out(tuple(expected.shape), DTYPES[expected.dtype])


def _cast(result, out):
    """As interpret._cast: every result takes its node's dtype."""
    if isinstance(out, tuple):
        assert isinstance(result, (list, tuple)) and len(result) == len(out)
        return tuple(_cast(r, o) for r, o in zip(result, out))
    return jnp.asarray(result).astype(out.dtype)


def _compare(expected, result, tol):
    if isinstance(expected, (list, tuple)):
        for e, r in zip(expected, result, strict=True):
            _compare(e, r, tol)
        return
    want = expected.float().numpy() if expected.dtype == torch.bfloat16 else expected.numpy()
    got = np.asarray(result)
    assert got.dtype == DTYPES[expected.dtype]
    assert got.shape == want.shape, f"shape {got.shape}, torch {want.shape}"
    got = got.astype(np.float32) if got.dtype == DTYPES[torch.bfloat16] else got
    if tol is None or not expected.is_floating_point():
        np.testing.assert_array_equal(got, want)
    else:
        finite = np.abs(want[np.isfinite(want)])
        scale = float(finite.max()) if finite.size else 1.0
        # infinities must sit at the same places with the same sign; finite values within tol * scale
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("op, args, kwargs, tol", CASES)
def test_rule_matches_torch(op, args, kwargs, tol):
    """The rule's result, cast to the node's dtype, equals the torch op's: exactly, or within tol of
    the result's largest finite magnitude for float math."""
    expected = op(*args, **kwargs)
    out = _out(expected)
    result = _cast(RULES[op](out, *_jax(args), **_jax(kwargs)), out)
    _compare(expected, result, tol)


def test_an_integer_scatter_add_lowers_without_a_scatter():
    """neuronx-cc refuses an integer scatter with a combiner (NCC_EVRF060): the MoE's counts per
    expert lower to a compare and a sum; a float scatter-add stays a scatter."""
    import jax

    def hlo(x, index, src):
        out = Out(x.shape, x.dtype)
        return jax.jit(lambda *a: RULES[aten.scatter_add.default](out, a[0], 0, a[1], a[2])).lower(
            x, index, src).as_text(dialect="hlo")

    routes = jnp.zeros(24, jnp.int32)
    assert " scatter(" not in hlo(jnp.zeros(9, jnp.int32), routes, jnp.ones(24, jnp.int32))
    assert " scatter(" in hlo(jnp.zeros(9, jnp.float32), routes, jnp.ones(24, jnp.float32))


def test_every_tensor_rule_has_a_case():
    """No rule of the table goes untested by test_rule_matches_torch."""
    tested = {case.values[0] for case in CASES}
    assert not [str(op) for op in RULES if op not in tested and op not in NOT_TENSOR_OPS]


def test_int_and_tuple_rules():
    """getitem picks from a multi-output node; sym_size / sym_numel read static dims; operator.* on
    Python ints are Python's (floordiv of negatives included)."""
    values = (jnp.zeros(2), jnp.ones(3))
    assert RULES[operator.getitem](None, values, 1) is values[1]
    assert RULES[aten.sym_size.int](None, jnp.zeros((2, 5, 3)), 1) == 5
    assert RULES[aten.sym_size.int](None, jnp.zeros((2, 5, 3)), -1) == 3
    assert RULES[aten.sym_numel.default](None, jnp.zeros((2, 5, 3))) == 30
    for function in (operator.mul, operator.add, operator.sub, operator.floordiv):
        for a, b in ((12, 5), (-7, 2), (7, -2), (0, 3)):
            assert RULES[function](None, a, b) == function(a, b)


@pytest.mark.parametrize("name, x", [
    ("random", _randn(4, 33)),
    ("ties", _randint(0, 3, 6, 17).float()),
    ("all-equal", torch.zeros(2, 9)),
    ("neg-inf", _masked_rows().reshape(15, 7)),
    ("bf16-ties", _randint(-2, 2, 3, 5, 11).to(torch.bfloat16)),
    ("int", _randint(0, 4, 5, 8)),
])
def test_first_argmax_is_torch_argmax(name, x):
    """first_argmax is torch.argmax along the last dim: the first index wins ties, rows of -inf
    (entirely or in part) included."""
    got = np.asarray(first_argmax(_jax(x)))
    np.testing.assert_array_equal(got, torch.argmax(x, dim=-1).numpy())


@pytest.mark.parametrize("preset, as_stored", [("lora-groups", False), (SPARSE_V32, False), ("v4", False),
                                               # V4.1's programs in the slow tier (their captures cost
                                               # ~45 s); per commit they are compiled for neuron and served.
                                               pytest.param("v41", False, marks=pytest.mark.slow),
                                               pytest.param("v41", True, marks=pytest.mark.slow)])
def test_rules_cover_every_op_of_a_step_program(preset, as_stored, tiny_checkpoints, fp8_checkpoints):
    """Every op of a decode step program as captured, after the neuron passes, has a rule of its own
    (or is ignored, or a graphc op): none is left to the node-by-node decomposition, which costs a
    trace per distinct node (`interpret.py`). As stored: V4.1's FP8 and FP4 weights' decodes."""
    model = load_model((fp8_checkpoints if as_stored else tiny_checkpoints)[preset], as_stored=as_stored)
    bucket = Bucket("decode", 2)
    program = capture_bucket(model, bucket, 4, 8, 8)
    PassManager(backend_passes("neuron"), verify).run(program.graph_module,
                                                      PassContext(Topology(1, 1), bucket, 4))
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    missing = [str(t) for t in targets if t not in RULES and t not in aten_rules.IGNORED and t not in graphc_ops.RULES]
    assert not missing


def test_fp8_bytes_decode_to_torchs_float8_e4m3fn_values_for_every_byte():
    """Weights kept as stored enter programs as bytes (`aten.FP8_BITS`); their conversion is
    torch's, bit for bit, over all 256 (both NaNs NaN), and only a byte operand is decoded."""
    bits = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(bits).view(torch.float8_e4m3fn).float()
    out = Out((256,), np.dtype(np.float32))
    got = np.asarray(RULES[aten._to_copy.default](out, jnp.asarray(bits), dtype=torch.float32))
    finite = ~np.isnan(want.numpy())
    assert np.array_equal(got.view(np.uint32)[finite], want.numpy().view(np.uint32)[finite])
    assert np.isnan(got[~finite]).all() and (~finite).sum() == 2
    assert np.float32(-448.0) in got and np.float32(2.0**-9) in got  # the extremes: largest, least subnormal
    ints = jnp.arange(4, dtype=jnp.int32)
    assert RULES[aten._to_copy.default](out, ints, dtype=torch.float32) is ints  # others: the result's cast


def test_pad_modes_other_than_constant_are_refused_by_name():
    from graphc.errors import GraphcError

    with pytest.raises(GraphcError, match=r"^xla lowering: aten\.pad in mode 'reflect'; only 'constant' padding"):
        RULES[aten.pad.default](Out((3, 9), np.dtype(np.float32)), jnp.zeros((3, 7)), [1, 1], "reflect")
