"""DeepSeek Sparse Attention against dense MLA: one layer's attention for a decode step, at the
released DeepSeek-V3.2 sizes, the two measured in the same run.

    .venv/bin/python bench/bench_sparse.py [--contexts 2048 8192 32768] [--repeats 5]

Sizes: 128 heads, latent 512 + rope 64 (one cached MLA vector of 576 per token), an indexer of
64 heads x 128, index_topk 2048, blocks of 64 tokens. One sequence, one query at the end of the
context. Dense: `paged_mla_attention` over every cached token. Sparse: the indexer's logits over
every cached token, the top-k, and `sparse_mla_attention` over the 2048 selected keys (fp32 P;
bf16 P is also timed). Both are graphc's reference kernels (what the CPU backends inline),
compiled with torch.compile so neither side pays Python overhead per op. Reported: best of
`--repeats` after warm-up, the dense / sparse ratio, and the ratio of multiply-adds per key that
the two forms imply: dense H (R + P) + H R per cached key; sparse I J per cached key, plus the
dense cost over k selected keys.
"""

from __future__ import annotations

import argparse

import torch

from graphc.ops.paged_attention import paged_mla_attention_reference
from graphc.ops.sparse import (index_candidates_reference, paged_indexer_logits_reference,
                               sparse_mla_attention_reference)
from timing import best_of

HEADS, LATENT, ROPE, INDEX_HEADS, INDEX_DIM, TOPK, BLOCK = 128, 512, 64, 64, 128, 2048, 64
SCALE = (128 + 64) ** -0.5


def dense(q_latent, q_rope, pool, table, positions):
    return paged_mla_attention_reference(q_latent, q_rope, pool, 0, table, positions, SCALE)


def sparse(q_latent, q_rope, q_index, weights, pool, table, positions, bf16: bool):
    logits = paged_indexer_logits_reference(q_index, weights, pool, 0, table, positions, LATENT + ROPE,
                                            INDEX_DIM**-0.5)
    selected, _ = index_candidates_reference(logits, TOPK, BLOCK)
    return sparse_mla_attention_reference(q_latent, q_rope, pool, 0, table, positions, selected, SCALE, bf16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    dense_step = torch.compile(dense, dynamic=False)
    sparse_step = torch.compile(sparse, dynamic=False)
    print(f"{'context':>8} {'dense ms':>9} {'sparse ms':>10} {'bf16-P ms':>10} {'dense/sparse':>13} {'MAC ratio':>10}")
    for context in args.contexts:
        blocks = context // BLOCK
        pool = torch.randn(1, blocks, BLOCK, LATENT + ROPE + INDEX_DIM)
        table = torch.randperm(blocks)[None]
        positions = torch.tensor([[context - 1]])
        q_latent, q_rope = torch.randn(1, 1, HEADS, LATENT), torch.randn(1, 1, HEADS, ROPE)
        q_index, weights = torch.randn(1, 1, INDEX_HEADS, INDEX_DIM), torch.randn(1, 1, INDEX_HEADS)
        with torch.no_grad():
            # Two warm-up calls: the first compiles.
            t_dense = best_of(args.repeats, lambda: dense_step(q_latent, q_rope, pool, table, positions), warmup=2)
            t_sparse = best_of(args.repeats, lambda: sparse_step(q_latent, q_rope, q_index, weights, pool, table,
                                                                 positions, False), warmup=2)
            t_bf16 = best_of(args.repeats, lambda: sparse_step(q_latent, q_rope, q_index, weights, pool, table,
                                                               positions, True), warmup=2)
        per_key = HEADS * (LATENT + ROPE) + HEADS * LATENT
        macs = context * per_key / (context * INDEX_HEADS * INDEX_DIM + min(TOPK, context) * per_key)
        print(f"{context:>8} {t_dense * 1e3:>9.2f} {t_sparse * 1e3:>10.2f} {t_bf16 * 1e3:>10.2f} "
              f"{t_dense / t_sparse:>12.2f}x {macs:>9.2f}x")


if __name__ == "__main__":
    main()
