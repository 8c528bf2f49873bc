"""Single-row linear layers as fused multiply-and-sum reductions (inductor only).

A decode step of one sequence multiplies one row by every weight matrix: a matrix-vector
product, bound by reading the weight once. On this project's CPUs ATen's GEMM streams a weight
at about a third of the memory bandwidth with one row (10 GB/s on a 29 GB/s machine), while
inductor's code for a reduction over the weight's contiguous dim streams it near the bandwidth
(25 GB/s). So an `aten.linear` of one row becomes

    out[n] = sum_k w[n, k] * x[k]     (products and sums in fp32, as a GEMM accumulates)

Measured on the 140 M model's decode graphs (bench/bench_scale.py's shape), one step: 7.6 ms ->
3.8 ms at one row. With 2, 4 and 8 rows the same rewrite made the graphs 3.6-4.4x *slower*
(9.8 -> 35, 11.6 -> 47, 18 -> 80 ms) although a lone matrix-vector product of 8 rows streams
at 18 GB/s against the GEMM's 9.7: inside the graph inductor fuses differently; so only one-row
layers are rewritten (`MAX_ROWS`). The export backend runs ops eagerly, where the product would
be materialised: it keeps `linear` (the pass's backends in `registry.PIPELINE`).
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch import Tensor

from graphc.passes.inline import inline_function
from graphc.passes.manager import PassContext, PassResult

MAX_ROWS = 1
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
