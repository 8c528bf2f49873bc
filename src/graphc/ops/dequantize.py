"""`graphc::dequantize`: a block-scaled low-precision weight (FP8 as DeepSeek releases it) back in
the compute dtype, inside the graph, next to the op that reads it.

Weights kept as stored (`model.weights: as-stored`) enter a step graph in their checkpoint dtype
with their fp32 block scales; one node per weight turns them into what the layer multiplies by.
As one node a pass can place it right before the weight's first reader
(`passes/place_dequantization.py`: the export backend then holds one dequantised weight at a
time, not all of them) and the CPU backends inline it (`inline_reference_kernels`): inductor
fuses the scaling into the reduction of a one-row linear layer, so a decode step reads one byte
per FP8 weight. The scale is broadcast by a view (expand and reshape), not `repeat_interleave`'s
gather, so the fused code indexes it.

Exact: W_q * scale in fp32 (an fp8 value has 4 significant bits, so the product with an fp32 scale
is exact unless it under- or overflows), then one rounding to `dtype`: the values of the load-time
dequantisation (`models/fp8.py`) followed by the loader's cast, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.ops.library import define_op


def dequantize_reference(weight: Tensor, scale: Tensor, block_rows: int, block_cols: int,
                         dtype: torch.dtype) -> Tensor:
    """W [..., R, C] in `dtype` from W_q [..., R, C] and scale [..., ceil(R / br), ceil(C / bc)]:
    every element times its block's scale, in fp32, then rounded to `dtype` once."""
    *lead, rows, cols = weight.shape
    grid_rows, grid_cols = scale.shape[-2:]
    expanded = scale.float()[..., :, None, :, None].expand(*lead, grid_rows, block_rows, grid_cols, block_cols)
    expanded = expanded.reshape(*lead, grid_rows * block_rows, grid_cols * block_cols)[..., :rows, :cols]
    return (weight.float() * expanded).to(dtype)


def _dequantize(weight: Tensor, scale: Tensor, block_rows: int, block_cols: int, dtype: torch.dtype) -> Tensor:
    return dequantize_reference(weight, scale, block_rows, block_cols, dtype).contiguous()


def _dequantize_fake(weight: Tensor, scale: Tensor, block_rows: int, block_cols: int, dtype: torch.dtype) -> Tensor:
    return weight.new_empty(weight.shape, dtype=dtype)


dequantize = define_op("dequantize(Tensor weight, Tensor scale, int block_rows, int block_cols, ScalarType dtype) -> Tensor",
                       _dequantize, _dequantize_fake)
