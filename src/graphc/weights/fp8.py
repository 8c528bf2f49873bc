"""DeepSeek's FP8 weight format: float8_e4m3fn weights with one fp32 scale per block.

A quantised weight `W` [R, C] is stored as `W_q` (float8_e4m3fn) and `W.weight_scale_inv`
[ceil(R / br), ceil(C / bc)] (fp32), with the block shape [br, bc] in config.json's
`quantization_config.weight_block_size` ([128, 128] in DeepSeek's releases). Dequantisation is
exact: every element is W_q * its block's scale, computed in fp32 (an fp8 value times an fp32
scale is exactly representable in fp32 unless it under- or overflows), and the last row and
column of blocks are ragged where R or C is not a multiple of the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

SCALE_SUFFIX = "_scale_inv"
"""A quantised weight `X.weight` has its scales in `X.weight_scale_inv`."""
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale tensor's shape for a weight of `shape`."""
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """fp32 W = W_q * scale of its block, for W_q [R, C] and scale_inv [ceil(R/br), ceil(C/bc)].

    Raises:
        ValueError: the scales do not tile the weight with this block.
    """
    if weight.dim() != 2 or tuple(scale_inv.shape) != scale_grid(tuple(weight.shape), block):
        raise ValueError(f"scales {list(scale_inv.shape)} do not tile a weight of {list(weight.shape)} in "
                         f"{list(block)} blocks; expected {list(scale_grid(tuple(weight.shape), block))}")
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scales


def quantize(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(W_q, scale_inv) for an fp32 weight: each block scaled so its largest magnitude maps to
    the largest float8_e4m3fn value (an all-zero block keeps scale 1)."""
    rows, cols = weight.shape
    grid = scale_grid((rows, cols), block)
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    expanded = scale_inv.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    quantized = (weight.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized, scale_inv


@dataclass(frozen=True)
class QuantizedWeight:
    """A parameter kept as stored (`model.weights: as-stored`): its FP8 values, with fp32 block
    scales in the buffer `scale`; step graphs dequantise it to `dtype` (`graphc::dequantize`)."""

    scale: str
    """The model buffer holding its scales [..., ceil(R / br), ceil(C / bc)] (fp32)."""
    block: tuple[int, int]
    """[br, bc]: the rows and columns one scale covers."""
    dtype: torch.dtype
    """What the model computes with: the model dtype, or fp32 for what the family keeps fp32."""
    by_row: bool = False
    """Read a few rows a step (V4.1's Engram tables, scaled per row): the module dequantises the
    rows it gathers (`deepseek_v41/engram.Engram.read`), not the graph the whole table."""


UE8M0_SUFFIX = ".scale"
"""DeepSeek-V4.1's release names the scales of `X.weight` `X.scale`: powers of two stored as
float8_e8m0fnu (an exponent byte), over 32 x 32 blocks (an Engram table's over 1 x 32)."""
UE8M0 = torch.float8_e8m0fnu


def scale_name(weight: str, ue8m0: bool) -> str:
    """The scale tensor of `weight` in DeepSeek-V3/V4's naming or (ue8m0) V4.1's."""
    return weight.removesuffix(".weight") + UE8M0_SUFFIX if ue8m0 else weight + SCALE_SUFFIX


def scaled_weight(scale: str, ue8m0: bool) -> str | None:
    """The weight a scale tensor named `scale` belongs to; None if the name is not a scale's."""
    suffix = UE8M0_SUFFIX if ue8m0 else SCALE_SUFFIX
    if not scale.endswith(suffix):
        return None
    return scale.removesuffix(suffix) + (".weight" if ue8m0 else "")


def quantize_ue8m0(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(W_q, scale) with power-of-two scales (float8_e8m0fnu): each block's the least power of
    two that maps its largest magnitude inside float8_e4m3fn's range."""
    quantized, scale_inv = quantize(weight, block)
    scale = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    rows, cols = weight.shape
    expanded = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.to(UE8M0)
