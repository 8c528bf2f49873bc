"""Linear layers of a few rows as fused multiply-and-sum reductions (inductor only).

A decode step multiplies a few rows by every weight matrix: matrix-vector products, bound by
reading each weight once. On this project's CPUs ATen's GEMM streams a weight at about a third
of the memory bandwidth with one row (10 GB/s on a 29 GB/s machine) and no faster with a few,
while inductor's code for a reduction over the weight's contiguous dim streams it near the
bandwidth (25 GB/s). So an `aten.linear` of M <= `MAX_ROWS` rows becomes, per row m,

    out[m, n] = sum_k w[n, k] * x[m, k]     (products and sums in fp32, as a GEMM accumulates)

one reduction per row over the same [N, K] range, which inductor fuses into one loop reading the
weight once. (Written as one reduction over a broadcast [N, M, K] product instead, inductor did
not keep the weight's read shared: 2-8 rows ran 3.6-4.4x slower than ATen.)

Measured on the 140 M model's decode graphs (bench/bench_scale.py's shape, context 64), one step
in ms, ATen's GEMM -> the per-row reductions: 2 token rows (one row of 1 + 1 tokens: speculative
decoding's verify) 8.95 -> 4.65, 4 rows 12.7 -> 8.6, 8 rows 17.3 -> 15.7, 4 rows of 2 tokens
16.1 -> 14.3, and 8 rows of 2 tokens 55.0 -> 54.7, even. One row: 3.2-3.4 (7.6 with ATen's
GEMM). `MAX_ROWS` is 4, not 8: past 4 rows the gain is 10 % while every linear's reductions are
compiled row by row (the tiny preset's compile with prefill-8 graphs, 6 graphs: 59 s with one
row, 73 s with 8, 62 s with 4). The export backend runs ops eagerly, where the products would be
materialised: it keeps `linear` (the pass's backends in `registry.PIPELINE`).
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch import Tensor

from graphc.passes.inline import inline_function
from graphc.passes.manager import PassContext, PassResult

MAX_ROWS = 4
"""The most rows a linear layer may have to run as reductions (measured; see above)."""


def matvec_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) as one reduction over the weight's contiguous dim per row.

    x [..., K], weight [N, K] -> [..., N], in x's dtype (fp32 products and sums).
    """
    rows, weight = x.reshape(-1, x.shape[-1]).float(), weight.float()  # [M, K], [N, K]
    out = torch.stack([(weight * row).sum(-1) for row in rows.unbind(0)])  # [M, N]
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
