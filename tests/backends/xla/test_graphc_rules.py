"""The lowering rules of graphc:: ops against their torch kernels (graphc.ops), on one process.

The collectives' rules run here over groups of one replica (under jit, as lowered), the all-to-all
MoE's also over four ranks vmapped on one axis; their multi-rank behaviour as lowered is what
test_neuron_backend.py serves at 2 and 4 ranks.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from graphc.backends.xla import graphc_ops
from graphc.backends.xla import ngram_hash as ngram_words
from graphc.backends.xla.aten import Out
from graphc.backends.xla.lower import Lowering
from graphc.backends.xla.variants import CPU, NEURON
from graphc.errors import GraphcError
from graphc.ops.collectives import combine_gathers
from graphc.models.deepseek_v41.engram import EngramArgs, NgramHash
from graphc.ops import all_to_all, collectives, hyper_connections, moe, paged_attention, sampler, sparse
from graphc.ops import engram as engram_ops
from graphc.step import PADDING_SLOT
from graphc.topology import Topology


def _lowering(noise=None) -> Lowering:
    lowering = Lowering(Topology(1, 1), CPU)
    lowering.noise = None if noise is None else jnp.asarray(noise.numpy())
    return lowering


def _jax(tensor: torch.Tensor):
    return jnp.asarray(tensor.numpy().astype(np.int32) if tensor.dtype == torch.int64 else tensor.numpy())


def _out(tensor: torch.Tensor) -> Out:
    return Out(tuple(tensor.shape), np.int32 if tensor.dtype == torch.int64 else tensor.numpy().dtype)


def test_kv_write_writes_each_slot_and_sends_padding_to_the_scratch_block():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 6, 4, 5, generator=g)
    kv = torch.randn(2, 3, 5, generator=g)
    slots = torch.tensor([[3, 9, PADDING_SLOT], [PADDING_SLOT, 0, 17]])
    expected = pool.clone()
    paged_attention.kv_write(expected, 1, kv, slots)
    _, written = graphc_ops.kv_write(_lowering(), None, _jax(pool), 1, _jax(kv), _jax(slots))
    written = torch.from_numpy(np.asarray(written))
    assert torch.equal(written[:, :-1], expected[:, :-1])  # every real slot, nothing else
    scratch = written[1, -1].reshape(-1, 5)[0]  # the last block's first slot: a padding token's vector
    assert any(torch.equal(scratch, kv.reshape(-1, 5)[i]) for i in (2, 3))


@pytest.mark.parametrize("vocab", [50, 600])  # below and above SAMPLER_CANDIDATES
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 5, 1.0), (0.7, 0, 0.9),
                                                       (1.3, 7, 0.5)])
def test_sample_equals_the_torch_sampler_given_its_noise(temperature, top_k, top_p, vocab):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocab, generator=g) * 3
    logits[0, 7] = float("-inf")
    rows = logits.shape[0]
    args = (torch.full((rows,), temperature), torch.full((rows,), top_k), torch.full((rows,), top_p),
            torch.arange(rows) * 1_000_003 + 11)
    expected = sampler.sample(logits, *args)
    noise = sampler.sampling_noise(args[3], logits.shape[-1])
    tokens = graphc_ops.sample(_lowering(noise), _out(expected), _jax(logits), *(_jax(a) for a in args))
    assert np.array_equal(np.asarray(tokens), expected.numpy())
    follower = graphc_ops.sample(_lowering(noise), _out(expected), _jax(logits), *(_jax(a) for a in args),
                                 jnp.asarray(0, jnp.int32))
    assert not np.asarray(follower).any()


@pytest.mark.parametrize("rule", ["sample", "verify_drafts"])
def test_the_samplers_neuron_module_neither_sorts_nor_scans_deepseeks_vocabulary(rule):
    """At DeepSeek's 129,280 tokens, the neuron variant takes its candidates with the compiler's
    top-k call: no sort, and no cumulative sum (a reduce-window) wider than the candidates."""
    rows, vocab = 4, 129_280
    lowering = Lowering(Topology(1, 1), NEURON)
    logits, drafts = jnp.zeros((rows, 3, vocab)), jnp.zeros((rows, 2), jnp.int32)
    parameters = (jnp.ones(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows), jnp.zeros(rows, jnp.int32))

    def step(logits, noise, *parameters):
        lowering.noise = noise
        if rule == "sample":
            return graphc_ops.sample(lowering, Out((rows,), np.int32), logits[:, 0], *parameters)
        return graphc_ops.verify_drafts(lowering, Out((rows, 4), np.int32), logits, drafts, parameters[1], *parameters)

    noise = logits[:, 0] if rule == "sample" else logits
    text = jax.jit(step).lower(logits, noise, *parameters).compiler_ir("hlo").as_hlo_text()
    assert " sort(" not in text and "AwsNeuronTopK" in text
    windows = [max(map(int, size.split("x"))) for size in re.findall(r"window=\{size=([\dx]+)", text)]
    assert windows and max(windows) <= sampler.SAMPLER_CANDIDATES


@pytest.mark.parametrize("vocab", [40, 600])  # below and above SAMPLER_CANDIDATES
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.9, 0, 1.0), (1.2, 6, 1.0), (0.8, 0, 0.85)])
def test_verify_drafts_equals_the_torch_verdict_given_its_noise(temperature, top_k, top_p, vocab):
    """Rows with 0..3 drafts (k = 3), drafts the model's argmax, its runner-up or unlikely: the
    accepted count and the tokens, exactly, with position j's noise from seed + j."""
    g = torch.Generator().manual_seed(3)
    rows, k = 64, 3
    logits = torch.randn(rows, 1 + k, vocab, generator=g) * 2.5
    ranked = logits.argsort(dim=-1, descending=True)[:, :k]  # [B, k, V] -> each position's ranking
    choice = torch.randint(0, 3, (rows, k), generator=g)  # 0: the argmax, 1: the runner-up, 2: any token
    drafts = torch.where(choice < 2, ranked[..., :2].gather(-1, choice.clamp(max=1)[..., None])[..., 0],
                         torch.randint(0, vocab, (rows, k), generator=g))
    count = torch.arange(rows) % (k + 1)
    args = (torch.full((rows,), temperature), torch.full((rows,), top_k), torch.full((rows,), top_p),
            torch.arange(rows) * 1_000_003 + 5)
    expected = sampler.verify_drafts(logits, drafts, count, *args)
    noise = sampler.step_noise(args[3], args[0], [rows, 1 + k, vocab])
    verdict = graphc_ops.verify_drafts(_lowering(noise), _out(expected), _jax(logits), _jax(drafts), _jax(count),
                                       *(_jax(a) for a in args))
    assert np.array_equal(np.asarray(verdict), expected.numpy())
    assert 0 < int(expected[:, 0].sum()) < int(count.sum())  # some drafts accepted, some rejected


@pytest.mark.parametrize("block", [0, 1, 2, 4, 16])  # expert-major, then blocks of 1 to 16 rows
@pytest.mark.parametrize("local_rows", [-1, 7])  # no bound, and the exact one
def test_grouped_mm_equals_the_op_and_zeroes_rows_past_the_last_expert(monkeypatch, block, local_rows):
    monkeypatch.setattr(graphc_ops, "neuron_grouped_block", lambda *args: block)
    g = torch.Generator().manual_seed(2)
    rows, weights = torch.randn(10, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 has no rows; rows 7.. are off-shard
    expected = moe.grouped_mm(rows, weights, offsets)
    out = graphc_ops.grouped_mm(_lowering(), _out(expected), _jax(rows), _jax(weights), _jax(offsets), local_rows)
    np.testing.assert_allclose(np.asarray(out), expected.numpy(), rtol=0, atol=1e-5)
    assert not np.asarray(out)[7:].any()


def _in_jit(rule, *args, **kwargs):
    """Run a collective's rule as lowered: under jit, over the one-replica groups of Topology(1, 1)."""
    return jax.jit(lambda *a: rule(_lowering(), *a, **kwargs))(*args)


def test_collectives_over_a_group_of_one_are_the_torch_ops_on_one_device():
    g = torch.Generator().manual_seed(3)
    out, lse = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, generator=g)
    combined = _in_jit(lambda low, o, s: graphc_ops.attention_combine(low, _out(out), o, s, "cp"), _jax(out), _jax(lse))
    np.testing.assert_allclose(np.asarray(combined), out.numpy(), rtol=1e-6)
    hidden = torch.randn(5, 8, generator=g)
    for rule in (graphc_ops.moe_dispatch, graphc_ops.moe_combine):
        moved = _in_jit(lambda low, h, rule=rule: rule(low, _out(hidden), h, "ep", 1), _jax(hidden))
        assert np.array_equal(np.asarray(moved), hidden.numpy())
    for rule, kernel in ((graphc_ops.all_reduce, collectives.all_reduce),
                         (graphc_ops.all_reduce_max, collectives.all_reduce_max)):
        reduced = _in_jit(lambda low, h, rule=rule: rule(low, _out(hidden), h, "world"), _jax(hidden))
        assert np.array_equal(np.asarray(reduced), hidden.numpy())
        assert np.array_equal(np.asarray(kernel(hidden, "world")), hidden.numpy())


@pytest.mark.parametrize("rule, combiner", [(graphc_ops.all_reduce, "add"), (graphc_ops.all_reduce_max, "maximum")])
def test_each_all_reduce_combines_with_its_own_operation(rule, combiner):
    """The group's values are summed or maxed by the all-reduce's region: the one thing a group
    of one cannot show."""
    text = jax.jit(lambda x: rule(_lowering(), None, x, "world")).lower(jnp.zeros((2, 3))).as_text()
    [region] = re.findall(r'"stablehlo.all_reduce".*?\}\)', text, flags=re.S)
    assert set(re.findall(r"stablehlo\.(add|maximum)", region)) == {combiner}


def test_hc_sinkhorn_equals_the_torch_kernel():
    g = torch.Generator().manual_seed(8)
    comb = torch.softmax(torch.randn(3, 5, 4, 4, generator=g), dim=-1) + 1e-6
    expected = hyper_connections.hc_sinkhorn(comb, 20, 1e-6)
    got = jax.jit(lambda c: graphc_ops.hc_sinkhorn(_lowering(), _out(expected), c, 20, 1e-6))(_jax(comb))
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=2e-6, atol=0)
    np.testing.assert_allclose(np.asarray(got).sum(-1), 1, rtol=1e-4)  # doubly stochastic, to eps
    np.testing.assert_allclose(np.asarray(got).sum(-2), 1, rtol=1e-4)


def test_index_topk_combine_orders_candidates_by_score_then_position():
    """One rank's candidates (as index_candidates gives them) come back best first, ties to the lower
    position, NO_KEY where the score is -inf: the torch combine's order."""
    logits = torch.tensor([[[0.5, 2.0, 2.0, float("-inf"), 1.0, float("-inf")]]])
    positions, scores = sparse.index_candidates_reference(logits, 4, block_size=2)
    combined = _in_jit(lambda low, p, s: graphc_ops.index_topk_combine(low, _out(positions), p, s, "cp"),
                       _jax(positions), _jax(scores))
    assert np.asarray(combined).tolist() == [[[1, 2, 4, 0]]] == positions.tolist()
    logits[..., 4] = float("-inf")
    positions, scores = sparse.index_candidates_reference(logits, 4, block_size=2)
    combined = _in_jit(lambda low, p, s: graphc_ops.index_topk_combine(low, _out(positions), p, s, "cp"),
                       _jax(positions), _jax(scores))
    assert np.asarray(combined).tolist() == [[[1, 2, 0, sparse.NO_KEY]]] == positions.tolist()


def test_the_even_all_to_all_moe_equals_the_torch_kernels_at_one_rank():
    g = torch.Generator().manual_seed(5)
    hidden, weights = torch.randn(4, 8, generator=g), torch.rand(4, 2, generator=g)
    ids, valid = torch.randint(0, 4, (4, 2), generator=g), torch.tensor([True, True, False, True])
    expected = all_to_all._moe_a2a_dispatch(hidden, ids, weights, valid, 4, "ep", 1, "a2a_even")
    got = _in_jit(lambda low, *a: graphc_ops.moe_a2a_dispatch(low, None, *a, 4, "ep", 1, "a2a_even"),
                  _jax(hidden), _jax(ids), _jax(weights), _jax(valid))
    for mine, theirs in zip(got, expected):
        assert np.array_equal(np.asarray(mine), theirs.numpy())
    partial, sent, received = expected[0] * 3, expected[3], expected[4]
    combined = _in_jit(lambda low, *a: graphc_ops.moe_a2a_combine(low, _out(hidden), *a, "ep", 1, "a2a_even"),
                       _jax(partial), _jax(sent), _jax(received))
    assert np.array_equal(np.asarray(combined), all_to_all._moe_a2a_combine(partial, sent, received, "ep", 1,
                                                                             "a2a_even").numpy())


def test_the_even_all_to_all_moe_routes_every_token_to_its_experts_ranks(monkeypatch):
    """Four ranks as one vmapped axis (jax's own all-to-all standing in for the HLO one): each
    token's rows reach the ranks holding its experts, renumbered there, and come back summed;
    a padding token is sent nowhere."""
    ranks, tokens, experts = 4, 3, 8
    monkeypatch.setattr(graphc_ops.collectives, "all_to_all",
                        lambda x, groups: jax.lax.all_to_all(x, "ranks", 0, 0, tiled=True))
    g = torch.Generator().manual_seed(6)
    hidden, weights = torch.randn(ranks, tokens, 5, generator=g), torch.rand(ranks, tokens, 2, generator=g)
    ids = torch.randint(0, experts, (ranks, tokens, 2), generator=g)
    valid = torch.ones(ranks, tokens, dtype=torch.bool)
    valid[1, 2] = False
    lowering = Lowering(Topology(cp=1, ep=ranks, dp=ranks), CPU)

    def rank(h, i, w, v):
        rows, local_ids, local_weights, sent, received = graphc_ops.moe_a2a_dispatch(
            lowering, None, h, i, w, v, experts, "ep", ranks, "a2a_even")
        me = jax.lax.axis_index("ranks")
        held = local_ids < experts // ranks
        scale = jnp.where(held, local_weights * (local_ids + me * (experts // ranks) + 1), 0).sum(-1)  # expert e: x (e + 1)
        return graphc_ops.moe_a2a_combine(lowering, None, rows * scale[:, None], sent, received, "ep", ranks,
                                          "a2a_even"), sent

    combined, sent = jax.vmap(rank, axis_name="ranks")(_jax(hidden), _jax(ids), _jax(weights), _jax(valid))
    expected = hidden * (weights * (ids + 1)).sum(-1, keepdim=True) * valid[..., None]
    np.testing.assert_allclose(np.asarray(combined), expected.numpy(), rtol=1e-6)
    destinations = (ids // (experts // ranks))  # [ranks, T, K]
    assert np.asarray(sent)[1, :, 2].tolist() == [False] * ranks  # the padding token went nowhere
    for r in range(ranks):
        for t in range(tokens):
            assert set(np.flatnonzero(np.asarray(sent)[r, :, t])) == (set(destinations[r, t].tolist()) if valid[r, t]
                                                                      else set())


ENGRAMS = {"release": EngramArgs(layer_ids=(1, 14), max_ngram=4, heads=8, head_dim=256, vocab_base=16_000_000,
                                 compressed_vocab=99092, pad_id=2),
           "tiny": EngramArgs(layer_ids=(1, 4), max_ngram=4, heads=2, head_dim=8, vocab_base=1000,
                              compressed_vocab=1000, pad_id=2)}


@pytest.mark.parametrize("engram", ENGRAMS, ids=str)
def test_ngram_hash_in_32_bit_words_equals_the_int64_kernel(engram):
    """Engram's hash as lowered (no 64-bit values) gives the int64 kernel's rows for every layer of
    the release's hash (primes about 2^24, multipliers about 2^46) and the tiny one's, tokens up to
    the largest of the compressed vocabulary."""
    args = ENGRAMS[engram]
    g = torch.Generator().manual_seed(9)
    context = torch.randint(0, args.compressed_vocab, (40, 5, args.max_ngram), generator=g)
    context[0, 0], context[0, 1] = args.compressed_vocab - 1, args.pad_id
    for layer in args.layer_ids:
        hash_ = NgramHash(args, layer)
        expected = engram_ops.ngram_hash(context, hash_.multipliers, hash_.primes, hash_.offsets, hash_.heads)
        got = jax.jit(lambda c: graphc_ops.ngram_hash(_lowering(), _out(expected), c, hash_.multipliers, hash_.primes,
                                                      hash_.offsets, hash_.heads))(_jax(context))
        assert np.array_equal(np.asarray(got), expected.numpy())


def test_64_bit_products_and_remainders_in_32_bit_words_are_pythons_integers():
    """The word arithmetic itself, against Python's integers: products wrap modulo 2^64 as int64's
    do (a factor near 2^64 included), remainders for moduli up to 2^31 - 1."""
    rng = np.random.default_rng(4)
    values = np.concatenate([rng.integers(0, 2**32, 200, dtype=np.uint64), [0, 1, 2**32 - 1]]).astype(np.uint32)
    for constant in (1, 3, 76632096046245, 2**63 - 1, 2**64 - 1):
        hi, lo = ngram_words.times_constant(jnp.asarray(values), constant)
        got = (np.asarray(hi).astype(object) << 32) | np.asarray(lo).astype(object)
        assert got.tolist() == [int(v) * constant % 2**64 for v in values]
    wide = [int(v) for v in rng.integers(0, 2**63, 200, dtype=np.int64)] + [0, 2**64 - 1, 2**63]
    hi, lo = (jnp.asarray([[w >> 32] for w in wide], jnp.uint32), jnp.asarray([[w & 0xFFFFFFFF] for w in wide],
                                                                                 jnp.uint32))
    moduli = [2, 3, 1009, 16_000_057, 2**31 - 1]
    got = np.asarray(ngram_words.modulo(hi, lo, moduli))
    assert got.tolist() == [[w % p for p in moduli] for w in wide]


def test_ngram_hash_refuses_a_table_past_int32_row_ids():
    with pytest.raises(GraphcError, match=r"an Engram table of 2147483648 rows; row ids are int32 here"):
        graphc_ops.ngram_hash(_lowering(), None, jnp.zeros((1, 2), jnp.int32), [1, 3], [2**31 - 7], [7], 1)


@pytest.mark.parametrize("tokens, collectives_in_module", [(2, {"all-gather": 1}), (4096, {"all-reduce": 2})])
def test_the_attention_combine_gathers_a_small_payload_and_all_reduces_a_large_one(tokens, collectives_in_module):
    """One all-gather merged locally while the gathered partials are latency-bound
    (`combine_gathers`), the two all-reduces above that."""
    lowering = Lowering(Topology(2, 1), CPU)
    out, lse = jnp.zeros((1, tokens, 4, 31)), jnp.zeros((1, tokens, 4))
    text = jax.jit(lambda o, s: graphc_ops.attention_combine(lowering, Out(out.shape, np.float32), o, s, "cp")
                   ).lower(out, lse).compiler_ir("hlo").as_hlo_text()
    found = {op: len(re.findall(rf"\s{op}\(", text)) for op in ("all-gather", "all-reduce")}
    assert {op: n for op, n in found.items() if n} == collectives_in_module
    assert combine_gathers(1 * tokens * 4 * 32 * 4, 2) == ("all-gather" in collectives_in_module)
