"""graphc:: op of DeepSeek-V4.1's Engram: the n-gram hash.

`ngram_hash` is one op so that every backend computes it in 64-bit integers: torch's kernel in
int64 (as DeepSeek's inference code), the XLA lowering's with 32-bit words
(`backends/xla/ngram_hash.py`), since the lowered programs hold no 64-bit values and a product
of a token and its multiplier needs up to 63 bits.

Shape letters: N max n-gram (the token and the N - 1 before it), H hash heads per order,
K = (N - 1) H hash columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.ops.library import define_op


def ngram_hash_reference(context: Tensor, multipliers: list[int], primes: list[int], offsets: list[int],
                         heads: int) -> Tensor:
    """n-gram contexts [..., N] (int64; column s the token s back) -> table rows [..., K] (int64).

    r_1 = tok_0 m_0 XOR tok_1 m_1, r_k = r_{k-1} XOR tok_k m_k; column (k - 1) H + h is
    r_k mod primes[(k - 1) H + h] + offsets[(k - 1) H + h].

    Args:
        multipliers: N odd multipliers, each below INT64_MAX / (largest token + 1), so no
            product overflows and every XOR is non-negative.
        primes: K moduli, order-major; offsets: K row offsets (each modulus's rows in the table).
        heads: H.
    """
    # Python ints, not tensors: the export / inductor passes inline this kernel (no tensor constants).
    products = [context[..., s] * multiplier for s, multiplier in enumerate(multipliers)]
    mixed, columns = products[0], []
    for k in range(1, len(products)):
        mixed = torch.bitwise_xor(mixed, products[k])
        for h in range(heads):
            column = (k - 1) * heads + h
            columns.append(mixed % primes[column] + offsets[column])
    return torch.stack(columns, dim=-1)


def _ngram_hash_fake(context: Tensor, multipliers: list[int], primes: list[int], offsets: list[int],
                     heads: int) -> Tensor:
    return context.new_empty((*context.shape[:-1], len(primes)))


ngram_hash = define_op("ngram_hash(Tensor context, int[] multipliers, int[] primes, int[] offsets, int heads) -> Tensor",
                       ngram_hash_reference, _ngram_hash_fake)
