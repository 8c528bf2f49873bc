"""graphc:: custom ops: single-device semantics against direct computations."""

from __future__ import annotations

import pytest
import torch

from graphc.ops import collectives, paged_attention, sampler
from graphc.step import PADDING_SLOT

L, N, S, R, P, H = 2, 6, 4, 8, 4, 3  # layers, pool blocks, block size, latent, rope, heads


def _pool(seed: int = 0) -> torch.Tensor:
    return torch.randn(L, N, S, R + P, generator=torch.Generator().manual_seed(seed))


def test_kv_write_fills_slots_and_skips_padding():
    pool = torch.zeros(L, N, S, R + P)
    kv = torch.randn(2, 3, R + P)
    slots = torch.tensor([[5, 6, PADDING_SLOT], [0, PADDING_SLOT, 23]])
    paged_attention.kv_write(pool, 1, kv, slots)
    flat = pool[1].view(-1, R + P)
    torch.testing.assert_close(flat[5], kv[0, 0])
    torch.testing.assert_close(flat[6], kv[0, 1])
    torch.testing.assert_close(flat[0], kv[1, 0])
    torch.testing.assert_close(flat[23], kv[1, 2])
    written = {0, 5, 6, 23}
    untouched = [s for s in range(N * S) if s not in written]
    assert flat[untouched].abs().sum() == 0, "padding tokens must not write"
    assert pool[0].abs().sum() == 0, "other layers must not be written"


def _naive_attention(q_latent, q_rope, pool, layer, block_table, positions, scale):
    """One query at a time over the row's keys laid out contiguously by position."""
    out = torch.zeros_like(q_latent)
    lse = torch.zeros(q_latent.shape[:-1])
    for b in range(q_latent.shape[0]):
        keys = torch.cat([pool[layer, block] for block in block_table[b].tolist()])  # [M*S, C]
        for q in range(q_latent.shape[1]):
            visible = keys[: positions[b, q] + 1]
            latent, rope = visible[:, :R], visible[:, R:]
            for h in range(H):
                scores = (latent @ q_latent[b, q, h] + rope @ q_rope[b, q, h]) * scale
                lse[b, q, h] = torch.logsumexp(scores, 0)
                out[b, q, h] = torch.softmax(scores, 0) @ latent
    return out, lse


def test_paged_attention_matches_naive_causal_attention_over_shuffled_blocks():
    pool = _pool()
    block_table = torch.tensor([[4, 1, 3], [2, 0, 5]])  # rows own non-contiguous blocks
    positions = torch.tensor([[7, 8, 9, 10], [0, 1, 2, 2]])  # row 1 ends in a padding token
    g = torch.Generator().manual_seed(1)
    q_latent, q_rope = torch.randn(2, 4, H, R, generator=g), torch.randn(2, 4, H, P, generator=g)
    out, lse = paged_attention.paged_mla_attention(q_latent, q_rope, pool, 1, block_table, positions, 0.3)
    expected_out, expected_lse = _naive_attention(q_latent, q_rope, pool, 1, block_table, positions, 0.3)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


def test_attention_partials_over_disjoint_keys_combine_exactly_by_lse():
    """The property context parallelism relies on: per-shard (out, lse) recombine to the full result."""
    pool = _pool(2)
    position = torch.tensor([[11]])  # sees every key of three blocks, wherever they sit in a table
    g = torch.Generator().manual_seed(3)
    q_latent, q_rope = torch.randn(1, 1, H, R, generator=g), torch.randn(1, 1, H, P, generator=g)
    full, full_lse = paged_attention.paged_mla_attention(q_latent, q_rope, pool, 0, torch.tensor([[0, 1, 2]]), position, 0.5)
    shards = [paged_attention.paged_mla_attention(q_latent, q_rope, pool, 0, torch.tensor(table), position, 0.5)
              for table in ([[0, 2]], [[1]])]
    total = torch.logsumexp(torch.stack([lse for _, lse in shards]), 0)  # [1, 1, H]
    combined = sum(torch.exp(lse - total)[..., None] * out for out, lse in shards)
    torch.testing.assert_close(combined, full)
    torch.testing.assert_close(total, full_lse)


def test_attention_ignores_cache_beyond_each_query_position():
    pool = _pool(4)
    q = torch.randn(1, 1, H, R), torch.randn(1, 1, H, P)
    args = (torch.tensor([[3, 0]]), torch.tensor([[5]]), 0.2)
    before = paged_attention.paged_mla_attention(q[0], q[1], pool, 0, args[0], args[1], args[2])
    pool[0, 0, 2:] = 1e6  # positions 6.. of the row (block 0 holds positions 4..7): invisible to position 5
    after = paged_attention.paged_mla_attention(q[0], q[1], pool, 0, args[0], args[1], args[2])
    torch.testing.assert_close(before[0], after[0])


def _sample(logits, temperature=0.0, top_k=0, top_p=1.0, seeds=None):
    rows = logits.shape[0]
    seeds = torch.arange(rows) if seeds is None else seeds
    return sampler.sample(logits, torch.full((rows,), float(temperature)), torch.full((rows,), top_k),
                      torch.full((rows,), float(top_p)), seeds)


def test_sample_greedy_and_degenerate_limits_are_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1)
    assert torch.equal(_sample(logits), argmax)
    assert torch.equal(_sample(logits, temperature=1.0, top_k=1), argmax)
    assert torch.equal(_sample(logits, temperature=1.0, top_p=1e-6), argmax)


def test_sample_on_a_follower_returns_zeros_and_on_the_leader_samples():
    """The `samples` coordinate: the one program every rank runs samples on the leader only."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    rows = logits.shape[0]
    args = (torch.full((rows,), 1.0), torch.full((rows,), 5), torch.full((rows,), 0.9), torch.arange(rows))
    leader = sampler.sample(logits, *args, torch.tensor(1, dtype=torch.int32))
    assert torch.equal(leader, sampler.sample(logits, *args))
    follower = sampler.sample(logits, *args, torch.tensor(0, dtype=torch.int32))
    assert torch.equal(follower, torch.zeros(rows, dtype=torch.int64)) and not torch.equal(leader, follower)


def test_sample_is_deterministic_per_seed_and_independent_of_batch():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(1))
    seeds = torch.arange(100, 108)
    first = _sample(logits, temperature=1.0, seeds=seeds)
    assert torch.equal(first, _sample(logits, temperature=1.0, seeds=seeds))
    alone = torch.cat([_sample(logits[i : i + 1], temperature=1.0, seeds=seeds[i : i + 1]) for i in range(8)])
    assert torch.equal(first, alone)


def test_sample_respects_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(400, 1)
    picks = _sample(logits, temperature=2.0, top_k=3, seeds=torch.arange(400))
    assert set(picks.tolist()) == {0, 1, 2}
    probs = torch.softmax(logits[0] / 2.0, 0)
    # top_p just above the first two tokens' mass keeps exactly three tokens.
    picks = _sample(logits, temperature=2.0, top_p=float(probs[:2].sum()) + 1e-3, seeds=torch.arange(400))
    assert set(picks.tolist()) == {0, 1, 2}


def _full_vocabulary_sample(logits, temperature, top_k, top_p, seeds):
    """The sampler without its candidate cap: top-k and top-p over the whole sorted vocabulary,
    each token's Gumbel noise its own."""
    scaled = logits / temperature
    ordered, order = scaled.sort(dim=-1, descending=True)
    probs = ordered.softmax(-1)
    rank = torch.arange(logits.shape[-1])
    drop = ((top_k > 0) & (rank >= top_k)) | ((probs.cumsum(-1) - probs) >= top_p)
    kept = torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    noise = sampler.sampling_noise(seeds, logits.shape[-1])
    return (kept - torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))).argmax(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 1, 1.0), (1.0, 40, 1.0), (0.7, 256, 1.0), (0.8, 0, 0.9),
                                                       (1.1, 100, 0.95)])
def test_sampling_within_its_candidates_is_exact_where_top_k_or_the_nucleus_fits_them(temperature, top_k, top_p):
    """At a vocabulary of 1,000: the tokens the uncapped sampler draws, wherever the row's top-k is
    at most SAMPLER_CANDIDATES or its nucleus lies within them (peaked logits: it does)."""
    rows, vocab = 64, 1000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 4
    seeds = torch.arange(rows) * 7919 + 3
    assert sampler.SAMPLER_CANDIDATES < vocab
    assert torch.equal(_sample(logits, temperature, top_k, top_p, seeds),
                       _full_vocabulary_sample(logits, temperature, top_k, top_p, seeds))


def test_a_row_without_limits_draws_from_its_candidates_only():
    """top_k 0 and top_p 1 over flat logits: the uncapped sampler draws past the 256 most likely
    tokens; the sampler never does (the documented cap)."""
    rows, vocab = 256, 1000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5))
    seeds = torch.arange(rows)
    top = logits.topk(sampler.SAMPLER_CANDIDATES, dim=-1).indices
    inside = lambda picks: (top == picks[:, None]).any(-1)  # noqa: E731
    assert inside(_sample(logits, 1.0, 0, 1.0, seeds)).all()
    assert not inside(_full_vocabulary_sample(logits, 1.0, 0, 1.0, seeds)).all()


def test_sample_frequencies_follow_the_softmax():
    draws = 3000
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]]).repeat(draws, 1)
    picks = _sample(logits, temperature=1.0, seeds=torch.arange(draws))
    observed = torch.bincount(picks, minlength=4).float() / draws
    expected = torch.softmax(logits[0], 0)
    sigma = torch.sqrt(expected * (1 - expected) / draws)
    assert ((observed - expected).abs() < 5 * sigma).all(), (observed, expected)


@pytest.mark.parametrize("op", ["moe_dispatch", "moe_combine"])
def test_moe_collectives_are_identity_on_one_device(op):
    x = torch.randn(5, 7)
    y = getattr(collectives, op)(x, "ep")
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()


def test_real_kernels_return_the_contiguous_layout_their_fakes_promise():
    """Compilers trust fake strides; a permuted input must not make a real output permuted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q_latent = torch.randn(3, 2, H, R).permute(1, 0, 2, 3)  # [2, 3, H, R], non-contiguous
    q_rope = torch.randn(2, 3, H, P)
    hidden = torch.randn(7, 5).t()  # [5, 7], non-contiguous
    calls = {
        "paged_mla_attention": lambda: paged_attention.paged_mla_attention(
            q_latent, q_rope, _pool(), 0, torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 2, 3]] * 2), 0.5),
        "moe_dispatch": lambda: (collectives.moe_dispatch(hidden, "ep"),),
        "moe_combine": lambda: (collectives.moe_combine(hidden, "ep"),),
    }
    for name, call in calls.items():
        real = call()
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = call()
        for r, f in zip(real, fake):
            assert r.is_contiguous(), name
            assert r.stride() == f.stride(), name


def test_merging_gathered_partials_is_the_attention_over_every_ranks_keys():
    """`merge_partials` (the all-gather form of `attention_combine`): each rank's softmax over its
    own keys, weighed by its log-sum-exp, is the softmax over all of them; a rank that saw no key
    (lse -inf) adds nothing."""
    g = torch.Generator().manual_seed(5)
    scores, values = torch.randn(3, 2, 6, generator=g), torch.randn(3, 6, 5, generator=g)  # [H, Q, S], [H, S, R]
    full = torch.softmax(scores, -1) @ values  # [H, Q, R]
    partials = []
    for keys in (slice(0, 2), slice(2, 6), slice(6, 6)):
        s, v = scores[..., keys], values[:, keys]
        lse = torch.logsumexp(s, -1) if s.shape[-1] else torch.full(s.shape[:-1], -torch.inf)
        out = torch.softmax(s, -1) @ v if s.shape[-1] else torch.zeros(3, 2, 5)
        partials.append(torch.cat([out, lse[..., None]], -1))
    torch.testing.assert_close(collectives.merge_partials(torch.stack(partials)), full, rtol=1e-6, atol=1e-6)
