"""`graphc::dequantize`: a block-scaled low-precision weight (FP8 or FP4 as DeepSeek releases it)
back in the compute dtype, inside the graph, next to the op that reads it.

Weights kept as stored (`model.weights: as-stored`) enter a step graph in their checkpoint dtype
with their fp32 block scales; one node per weight turns them into what the layer multiplies by.
As one node a pass can place it right before the weight's first reader
(`passes/place_dequantization.py`: the export backend then holds one dequantised weight at a
time, not all of them) and the CPU backends inline it (`inline_reference_kernels`): inductor
fuses the scaling into the reduction of a one-row linear layer, so a decode step reads one byte
per FP8 weight. The scale is broadcast by a view (expand and reshape), not `repeat_interleave`'s
gather, so the fused code indexes it.

The weight's dtype says its format: float8_e4m3fn values (`weights/fp8.py`), or int8 bytes each
holding two float4_e2m1 codes (`weights/fp4.py`, whose scales cover 1 x 32), unpacked here to twice
the columns; the scale's: fp32, or int8 float8_e8m0fnu bytes (FP4's).

Exact: W_q * scale in fp32 (an fp8 value has 4 significant bits, an fp4 one 2, so the product with
an fp32 scale is exact unless it under- or overflows), then one rounding to `dtype`: the values of
the load-time dequantisation (`weights/fp8.py`, `weights/fp4.py`) followed by the loader's cast, bit
for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.weights import fp4
from graphc.ops.library import define_op


def dequantize_reference(weight: Tensor, scale: Tensor, block_rows: int, block_cols: int,
                         dtype: torch.dtype) -> Tensor:
    """W [..., R, C] in `dtype` from W_q [..., R, C] (FP4: [..., R, C / 2] bytes) and scale
    [..., ceil(R / br), ceil(C / bc)]: every element times its block's scale, in fp32, then rounded
    to `dtype` once."""
    values = fp4.unpack(weight) if weight.dtype == fp4.PAIRS else weight.float()
    scales = fp4.e8m0_values(scale) if scale.dtype == fp4.EXPONENTS else scale.float()
    *lead, rows, cols = values.shape
    grid_rows, grid_cols = scale.shape[-2:]
    expanded = scales[..., :, None, :, None].expand(*lead, grid_rows, block_rows, grid_cols, block_cols)
    expanded = expanded.reshape(*lead, grid_rows * block_rows, grid_cols * block_cols)[..., :rows, :cols]
    return (values * expanded).to(dtype)


def _dequantize(weight: Tensor, scale: Tensor, block_rows: int, block_cols: int, dtype: torch.dtype) -> Tensor:
    return dequantize_reference(weight, scale, block_rows, block_cols, dtype).contiguous()


def _dequantize_fake(weight: Tensor, scale: Tensor, block_rows: int, block_cols: int, dtype: torch.dtype) -> Tensor:
    *lead, rows, cols = weight.shape
    return weight.new_empty((*lead, rows, 2 * cols if weight.dtype == fp4.PAIRS else cols), dtype=dtype)


dequantize = define_op("dequantize(Tensor weight, Tensor scale, int block_rows, int block_cols, ScalarType dtype) -> Tensor",
                       _dequantize, _dequantize_fake)
