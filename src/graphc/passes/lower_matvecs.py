"""Linear layers of a few rows as fused multiply-and-sum reductions (inductor only).

A decode step multiplies a few rows by every weight matrix: a matrix-vector product, bound by
reading the weight once. On this project's CPUs ATen's GEMM streams a weight at about a third
of the memory bandwidth with 1 to 8 rows, while inductor's code for a reduction over the
weight's contiguous dim streams it near the bandwidth (measured: 10 vs 25 GB/s at 1 row, 9.7 vs
18 GB/s at 8, 7.9 vs 8.3 at 16, on a 29 GB/s machine; see bench/bench_scale.py for the step).
So an `aten.linear` whose input has at most `MAX_ROWS` rows becomes

    out[m, n] = sum_k w[n, k] * x[m, k]     (products and sums in fp32, as a GEMM accumulates)

computed as an [N, rows] reduction (the weight row stays in cache across the rows), transposed
back. With more rows a GEMM's reuse wins and the node stays. The export backend runs ops
eagerly, where the product would be materialised: it keeps `linear` (see
`pipeline.BACKEND_SPECIFIC`).
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch import Tensor

from graphc.passes.inline import inline_function
from graphc.passes.manager import PassContext, PassResult

MAX_ROWS = 8
"""The most rows a linear layer may have to run as a reduction (measured; see above)."""


def matvec_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) as a reduction over the weight's contiguous dim.

    x [..., K], weight [N, K] -> [..., N], in x's dtype (fp32 products and sums).
    """
    rows = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    out = (weight.float()[:, None, :] * rows[None, :, :]).sum(-1).t()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def lower_matvecs(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    for node in list(gm.graph.nodes):
        if node.target is not torch.ops.aten.linear.default or node.kwargs:
            continue
        rows = math.prod(node.args[0].meta["val"].shape[:-1])
        if rows <= MAX_ROWS:
            inline_function(gm.graph, node, matvec_linear)
            modified = True
    return PassResult(gm, modified)
