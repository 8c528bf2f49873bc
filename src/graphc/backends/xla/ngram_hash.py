"""The lowering of `graphc::ngram_hash` (DeepSeek-V4.1's Engram hash) in 32-bit words.

The lowered programs hold no 64-bit values (neuronx-cc takes int32 indices; jax runs without x64),
but the hash multiplies a token by a multiplier of up to 63 bits, XORs the products and reduces
them modulo primes. Here a 64-bit value is a pair of uint32 words (hi, lo):

- product: the token's two 16-bit limbs times the multiplier's four (constants), each partial
  product exact in uint32, split into 16-bit halves summed per column, carries propagated: the
  product modulo 2^64, as torch's int64 multiplication wraps;
- XOR: word by word;
- modulo p: Horner's rule over the value's bits from the top, b at a time, r = (r * 2^b + bits) mod p
  with b the widest chunk for which r * 2^b stays below 2^32 for every prime (b = 8 at the release's
  primes of about 2^24: 8 steps).

Equal to the int64 kernel (`graphc.ops.engram`) for every context whose products are below 2^63,
which the multipliers guarantee for every token below the compressed vocabulary; the row ids are
int32, so a table of 2^31 rows or more is refused.
"""

from __future__ import annotations

import jax.numpy as jnp

from graphc.errors import GraphcError

_LIMB = 16
_LIMB_MASK = (1 << _LIMB) - 1
WORD = 32


def _u32(value: int):
    return jnp.uint32(value)


def times_constant(value, constant: int):
    """value (uint32, any shape) times `constant` (a non-negative int below 2^64), modulo 2^64, as
    (hi, lo) uint32 words."""
    value_limbs = (value & _u32(_LIMB_MASK), value >> _u32(_LIMB))
    constant_limbs = [(constant >> (_LIMB * j)) & _LIMB_MASK for j in range(4)]
    columns = [jnp.zeros_like(value) for _ in range(4)]
    for i, limb in enumerate(value_limbs):
        for j, factor in enumerate(constant_limbs):
            if i + j >= 4 or factor == 0:
                continue
            product = limb * _u32(factor)  # < 2^32: exact
            columns[i + j] = columns[i + j] + (product & _u32(_LIMB_MASK))
            if i + j + 1 < 4:
                columns[i + j + 1] = columns[i + j + 1] + (product >> _u32(_LIMB))
    limbs, carry = [], jnp.zeros_like(value)
    for column in columns:
        total = column + carry  # a handful of 16-bit terms: far below 2^32
        limbs.append(total & _u32(_LIMB_MASK))
        carry = total >> _u32(_LIMB)
    return limbs[3] << _u32(_LIMB) | limbs[2], limbs[1] << _u32(_LIMB) | limbs[0]


def _bits(hi, lo, start: int, width: int):
    """Bits [start, start + width) of the 64-bit (hi, lo), as uint32."""
    mask = _u32((1 << width) - 1)
    if start >= WORD:
        return (hi >> _u32(start - WORD)) & mask
    if start + width <= WORD:
        return (lo >> _u32(start)) & mask
    return ((lo >> _u32(start)) | (hi << _u32(WORD - start))) & mask


def modulo(hi, lo, moduli: list[int]):
    """(hi, lo) [..., 1] or [..., K] modulo each of `moduli` [K] (each below 2^31), as uint32 [..., K]."""
    chunk = WORD - max(moduli).bit_length()  # r < p < 2^(32 - chunk): r * 2^chunk < 2^32
    p = jnp.asarray(moduli, dtype=jnp.uint32)
    remainder, top = jnp.zeros(jnp.broadcast_shapes(hi.shape, p.shape), jnp.uint32), 2 * WORD
    while top > 0:
        width = min(chunk, top)
        top -= width
        remainder = ((remainder << _u32(width)) | _bits(hi, lo, top, width)) % p
    return remainder


def ngram_hash(lowering, out, context, multipliers: list[int], primes: list[int], offsets: list[int], heads: int):
    """`graphc.ops.engram.ngram_hash_reference` over int32 tokens, in uint32 words."""
    if offsets[-1] + primes[-1] >= 2**31:
        raise GraphcError(f"xla lowering: an Engram table of {offsets[-1] + primes[-1]} rows; row ids are int32 "
                          "here (below 2**31 rows)")
    tokens = context.astype(jnp.uint32)
    hi, lo = times_constant(tokens[..., 0], multipliers[0])
    columns_hi, columns_lo = [], []
    for k in range(1, len(multipliers)):
        product_hi, product_lo = times_constant(tokens[..., k], multipliers[k])
        hi, lo = hi ^ product_hi, lo ^ product_lo
        columns_hi += [hi[..., None]] * heads
        columns_lo += [lo[..., None]] * heads
    rows = modulo(jnp.concatenate(columns_hi, axis=-1), jnp.concatenate(columns_lo, axis=-1), primes)
    return rows.astype(jnp.int32) + jnp.asarray(offsets, dtype=jnp.int32)
