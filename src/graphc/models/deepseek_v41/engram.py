"""Engram: DeepSeek-V4.1's hashed n-gram memory ("Conditional Memory via Scalable Lookup",
arXiv 2601.07372), as the released V4.1 inference code defines it.

An Engram layer reads, before its block runs, one row per (n-gram order, hash head) of its own
table, addressed by a hash of the token and the N - 1 tokens before it; a projection of the rows
gives one key per residual stream and one value, and each stream adds the value under its own
sigmoid gate.

Hashing is deterministic and nothing of it is stored in a checkpoint:
- tokens fold through the compressed vocabulary (`token_map`; graphc's tiny models use the
  identity, and a token before the sequence start is the compressed pad id);
- per layer l, N odd int64 multipliers m_s = 2 r_s + 1, r drawn by numpy's PCG64
  (`default_rng(10007 * l)`) uniformly below (INT64_MAX // |V_c|) // 2, so a token times its
  multiplier never overflows and every XOR below stays non-negative;
- prime moduli: the consecutive primes above `vocab_base` - 1, dealt out by layer, then n-gram
  order, then head (one set shared by all, so no two (layer, order, head) share a modulus); each
  (order, head) owns a contiguous row range of its layer's table, at the running sum of the
  primes before it (the table has exactly sum(primes) rows: the release's two tables, 384,006,168
  and 384,016,682 rows, are these sums);
- for the token at t with tok_s = c[t - s]: r_1 = tok_0 m_0 XOR tok_1 m_1, r_k = r_{k-1} XOR
  tok_k m_k, and column (k - 1) H + h is r_k mod p[k][h] + offset[k][h] (order-major columns).

Sharding the table. Each rank of the expert-parallel group holds a contiguous range of
ceil(rows / ep) rows (ranks with the same expert shard hold the same rows, as for the experts).
A rank reads the rows it holds and zeros elsewhere; when the group shares its tokens (`static`)
one all-reduce sums the group's reads, and when it does not (data-parallel replicas) the group
gathers everyone's ids first and reduce-scatters the reads back to their tokens' rank. Every
entry of the sum is one rank's row plus exact zeros, so the sharded lookup equals the unsharded
one bit for bit.

Shape letters: B rows, Q tokens per row, n = hc_mult streams, D hidden, N max n-gram, H hash heads
per order, K = (N - 1) H hash columns, d the table's row width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphc.weights.fp8 import FP8, SCALE_SUFFIX
from graphc.ops import collectives
from graphc.ops.dequantize import dequantize
from graphc.ops.engram import ngram_hash

INT64_MAX = 2**63 - 1
MULTIPLIER_SEED = 10007
"""numpy seed of layer l's multipliers: MULTIPLIER_SEED * l (the layer's index in the model)."""
GATE_CLAMP = 1e-6
"""The signed square root's floor: gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))."""


@dataclass(frozen=True)
class EngramArgs:
    """One model's Engram hyper-parameters (V4.1's `engram_*` config fields)."""

    layer_ids: tuple[int, ...]
    """The decoder layers that read an Engram table (before their block)."""
    max_ngram: int
    """N: orders 2..N are hashed (N - 1 of them)."""
    heads: int
    """H: hash heads per order."""
    head_dim: int
    """d: width of one table row."""
    vocab_base: int
    """`engram_vocab_size`: the prime search starts above vocab_base - 1."""
    compressed_vocab: int
    """|V_c|: the compressed vocabulary's size (bounds the multipliers)."""
    pad_id: int
    """The compressed id standing for a token before the sequence start."""

    @property
    def columns(self) -> int:
        """K = (N - 1) H: table rows read per token."""
        return (self.max_ngram - 1) * self.heads

    def table_rows(self) -> dict[int, int]:
        """Rows of each Engram layer's table (the sum of its primes)."""
        return {layer: sum(primes) for layer, primes in prime_moduli(self).items()}


def hash_multipliers(layer: int, max_ngram: int, compressed_vocab: int) -> list[int]:
    """Layer `layer`'s N odd multipliers (index s multiplies the token s back)."""
    bound = max(1, (INT64_MAX // compressed_vocab) // 2)
    drawn = np.random.default_rng(MULTIPLIER_SEED * layer).integers(0, bound, size=max_ngram, dtype=np.int64)
    return [2 * int(r) + 1 for r in drawn]


def prime_moduli(args: EngramArgs) -> dict[int, list[int]]:
    """Per Engram layer its K prime moduli, order-major (column (k - 1) H + h is order k + 1,
    head h)."""
    found: dict[int, list[int]] = {}
    candidate = args.vocab_base - 1
    for layer in args.layer_ids:
        found[layer] = []
        # The release restarts each (layer, order) at vocab_base - 1 but skips every prime already
        # dealt: consecutive primes.
        for _ in range(args.columns):
            candidate = sympy.nextprime(candidate)
            found[layer].append(int(candidate))
    return found


def ngram_context(token_ids: Tensor, max_ngram: int, pad_id: int) -> Tensor:
    """[..., T] whole sequences (from position 0) -> [..., T, N]: column s is the token s back,
    `pad_id` before the start."""
    padded = F.pad(token_ids, (max_ngram - 1, 0), value=pad_id)
    return padded.unfold(-1, max_ngram, 1).flip(-1)


class NgramHash(nn.Module):
    """One layer's hash: n-gram contexts [..., N] -> absolute rows of its table [..., K]
    (`graphc::ngram_hash`, 64-bit on every backend)."""

    def __init__(self, args: EngramArgs, layer: int):
        super().__init__()
        # Derived from the config, never stored: plain ints, op arguments.
        self.primes = prime_moduli(args)[layer]
        self.offsets = [0, *np.cumsum(self.primes[:-1]).tolist()]
        self.multipliers = hash_multipliers(layer, args.max_ngram, args.compressed_vocab)
        self.heads = args.heads

    def forward(self, context: Tensor) -> Tensor:
        return ngram_hash(context, self.multipliers, self.primes, self.offsets, self.heads)


class Engram(nn.Module):
    """One layer's lookup and gated add into the residual streams (before its block).

    Parameters (V4.1's names): `embed.weight` [rows held here, d] (this rank's row range),
    `wkv.weight` [(n + 1) D, K d] (each stream's key, then the one value), `q_weight` and
    `k_weight` [n, D] (only their product is used: the two RMSNorm weights of the gate's dot
    product, folded).
    """

    def __init__(self, args: EngramArgs, layer: int, hidden: int, streams: int, eps: float, shards: int = 1):
        super().__init__()
        self.streams, self.hidden, self.eps = streams, hidden, eps
        self.hash = NgramHash(args, layer)
        self.rows = args.table_rows()[layer]
        self.embed = nn.Embedding(-(-self.rows // shards), args.head_dim)
        self.wkv = nn.Linear(args.columns * args.head_dim, (streams + 1) * hidden, bias=False)
        self.q_weight = nn.Parameter(torch.ones(streams, hidden))
        self.k_weight = nn.Parameter(torch.ones(streams, hidden))

    def read(self, local: Tensor, dtype: torch.dtype) -> Tensor:
        """The rows [..., d] of this rank's table at `local` in `dtype`: the table's own, or, kept
        as stored (FP8 with a scale per row and block in `embed.weight_scale_inv`: `load_model`'s
        `as_stored`), the rows it gathers dequantised, not the whole table (values equal
        dequantising on load: each value times its scale in fp32, one rounding)."""
        rows = self.embed(local)
        if rows.dtype != FP8:
            return rows
        scales = F.embedding(local, self.embed.get_buffer("weight" + SCALE_SUFFIX))  # [..., d / bc]
        return dequantize(rows, scales, 1, rows.shape[-1] // scales.shape[-1], dtype)

    def lookup(self, rows: Tensor, dtype: torch.dtype, shard: Tensor | int = 0, group_size: int = 1,
               exchange: str = "local") -> Tensor:
        """Table rows [T, K] (absolute) -> their vectors [T, K d] in `dtype` from the group's shards.

        Args:
            shard: this rank's place in the expert-parallel group (it holds rows
                [shard * R, (shard + 1) * R), R = `embed.num_embeddings`).
            group_size: ranks in the group.
            exchange: the step's MoE exchange: `local` (one shard), `static` (the group shares
                these tokens: all-reduce), anything else (each rank has its own: all-gather the
                ids, reduce-scatter the reads).
        """
        gathers = exchange not in ("local", "static")
        if gathers:
            rows = collectives.moe_dispatch(rows, "ep", group_size)  # [T * ep, K]
        held = self.embed.num_embeddings
        local = rows - torch.as_tensor(shard) * held
        here = (local >= 0) & (local < held)
        vectors = torch.where(here[..., None], self.read(torch.where(here, local, 0), dtype), 0).flatten(1)  # [T', K d]
        if gathers:
            return collectives.moe_combine(vectors, "ep", group_size)
        if exchange == "static":
            return collectives.all_reduce(vectors, "ep")
        return vectors

    def forward(self, streams: Tensor, context: Tensor, valid: Tensor | None = None, shard: Tensor | int = 0,
                group_size: int = 1, exchange: str = "local") -> Tensor:
        """streams [B, Q, n, D], n-gram contexts [B, Q, N] (int64), valid [B, Q] (gate 0 where
        false) -> the streams with the gated memory added (added in fp32, rounded once)."""
        rows, width = streams.shape[:2]
        table_rows = self.hash(context).flatten(0, 1)  # [B Q, K]
        vectors = self.lookup(table_rows, streams.dtype, shard, group_size, exchange)  # [B Q, K d]
        keys, value = self.wkv(vectors.to(self.wkv.weight.dtype)).view(rows, width, -1).split(
            [self.streams * self.hidden, self.hidden], dim=-1)
        keys = keys.float().view(rows, width, self.streams, self.hidden)  # [B, Q, n, D]
        h = streams.float()
        weight = self.q_weight.float() * self.k_weight.float()  # [n, D]
        scale = (torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(keys.square().mean(-1) + self.eps)
                 * self.hidden**-0.5)  # [B, Q, n]
        dot = (h * weight * keys).sum(-1) * scale
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_CLAMP).sqrt(), dot))  # [B, Q, n]
        if valid is not None:
            gate = torch.where(valid[..., None], gate, 0.0)
        return (h + gate[..., None] * value.float()[:, :, None, :]).to(streams.dtype)
