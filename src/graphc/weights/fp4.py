"""DeepSeek-V4-Flash's and V4.1-Flash's FP4 weight format: their routed experts as float4_e2m1
values, two to a byte, with one power-of-two scale per 32 columns of a row (config.json's
`expert_dtype: fp4`, `experts_in_fp4`).

A weight W [R, C] is stored as `X.weight`, R x C / 2 bytes of safetensors dtype I8 (the releases'
shard headers) or F4 (torch.float4_e2m1fn_x2, whose shape counts values), column 2j in a byte's low
nibble and 2j + 1 in its high one, and `X.scale` [R, ceil(C / 32)] (float8_e8m0fnu), as DeepSeek's
V4 inference code reads them (`fp4_gemm`: the codes unpacked low
nibble first, each times its block's scale). A code is a sign bit (bit 3), two exponent bits of bias
1 and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Dequantisation is exact in
fp32 (a value of 2 significant bits times a power of two).

Kept as stored, the bytes travel as torch.int8 (`PAIRS`), and so do the scales' (`EXPONENTS`: an
fp32 scale per 32 values would add a quarter to the bytes a step reads): torch has no arithmetic
on float4_e2m1fn_x2 or float8_e8m0fnu, and uint8 is what an FP8 weight becomes in a lowered
program (`backends/xla/aten.FP8_BITS`), so a byte type of its own keeps them apart; no other
weight or scale is int8 (`checkpoint.WEIGHT_DTYPES`).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = (1, 32)
"""The rows and columns one scale covers."""
PAIRS = torch.int8
"""The dtype of a weight kept as stored in FP4: one byte per two values."""
EXPONENTS = torch.int8
"""The dtype of its scales kept as stored: their float8_e8m0fnu bytes."""
E2M1_MAX = 6.0
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_values(codes: Tensor) -> Tensor:
    """The fp32 value of each 4-bit code (an integer tensor of 0..15), from its bits: a normal
    code (exponent e > 0) is (1 + m / 2) 2^(e - 1), built as fp32's bits; a subnormal m / 2."""
    codes = codes.to(torch.int32)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).view(torch.float32)
    magnitude = torch.where(exponent == 0, mantissa.to(torch.float32) * 0.5, normal)
    return torch.where((codes >> 3) == 1, -magnitude, magnitude)


def e8m0_values(exponents: Tensor) -> Tensor:
    """The fp32 value of each float8_e8m0fnu byte (int8, uint8 or float8_e8m0fnu) as torch
    converts it: 2^(e - 127), built as fp32's bits; e = 0 the subnormal 2^-127, 255 NaN."""
    e = (exponents if exponents.dtype == EXPONENTS else exponents.view(EXPONENTS)).to(torch.int32) & 0xFF
    bits = torch.where(e == 0, 1 << 22, torch.where(e == 0xFF, 0x7FC00000, e << 23))
    return bits.view(torch.float32)


def unpack(pairs: Tensor) -> Tensor:
    """[..., C] fp32 values from [..., C / 2] bytes (int8, uint8 or float4_e2m1fn_x2)."""
    as_int = (pairs if pairs.dtype == PAIRS else pairs.view(PAIRS)).to(torch.int32) & 0xFF
    return e2m1_values(torch.stack([as_int & 0xF, as_int >> 4], dim=-1).flatten(-2))


def dequantize(pairs: Tensor, scale: Tensor) -> Tensor:
    """fp32 W [R, C] from its bytes [R, C / 2] and scales [R, ceil(C / 32)] (float8_e8m0fnu, their
    bytes as `EXPONENTS`, or fp32).

    Raises:
        ValueError: the scales do not tile the weight.
    """
    rows, columns = pairs.shape[0], 2 * pairs.shape[1]
    blocks = -(-columns // BLOCK[1])
    if pairs.dim() != 2 or tuple(scale.shape) != (rows, blocks):
        raise ValueError(f"scales {list(scale.shape)} do not tile an FP4 weight of {[rows, columns]} in "
                         f"{list(BLOCK)} blocks; expected {[rows, blocks]}")
    scales = e8m0_values(scale) if scale.dtype in (EXPONENTS, torch.float8_e8m0fnu) else scale.float()
    return unpack(pairs) * scales.repeat_interleave(BLOCK[1], dim=1)[:, :columns]


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(bytes as float4_e2m1fn_x2 [R, C / 2], scales float8_e8m0fnu [R, ceil(C / 32)]) for an fp32
    weight of an even column count: each block's scale the least power of two that brings its
    largest magnitude within 6, each value rounded to the nearest code (ties to the smaller)."""
    rows, columns = weight.shape
    if columns % 2:
        raise ValueError(f"an FP4 weight packs two columns to a byte; {columns} columns is odd")
    blocks = -(-columns // BLOCK[1])
    padded = torch.zeros(rows, blocks * BLOCK[1])
    padded[:, :columns] = weight.float()
    amax = padded.view(rows, blocks, BLOCK[1]).abs().amax(-1)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX))), torch.ones_like(amax))
    scaled = weight.float() / scale.repeat_interleave(BLOCK[1], dim=1)[:, :columns]
    magnitude = (scaled.abs().clamp(max=E2M1_MAX)[..., None] - torch.tensor(_MAGNITUDES)).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).to(torch.int64) << 3)).to(torch.uint8)
    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return pairs.view(torch.float4_e2m1fn_x2), scale.to(torch.float8_e8m0fnu)


def experts_in_fp4(config: dict) -> bool:
    """Whether config.json says the release stores its routed experts as FP4: `expert_dtype: fp4`,
    top level (DeepSeek-V4-Flash) or in `quantization_config` (V4.1-Flash)."""
    quantization = config.get("quantization_config") or {}
    return "fp4" in (config.get("expert_dtype"), quantization.get("expert_dtype"))
