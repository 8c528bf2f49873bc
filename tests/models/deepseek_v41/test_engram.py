"""Engram (`graphc.models.deepseek_v41.engram`): the hash against frozen ids and the release's table sizes, the
gate against its equations, and the table sharded over 2-16 real ranks, exported, bit for bit
against one unsharded table in both sharding forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from graphc.models.deepseek_v41.engram import Engram, EngramArgs, NgramHash, hash_multipliers, ngram_context, prime_moduli
from graphc.topology import Topology
from multirank import run_ranks

TINY = EngramArgs(layer_ids=(1, 4), max_ngram=4, heads=2, head_dim=8, vocab_base=1000, compressed_vocab=1000,
                  pad_id=2)
RELEASE = EngramArgs(layer_ids=(1, 14), max_ngram=4, heads=8, head_dim=256, vocab_base=16_000_000,
                     compressed_vocab=99092, pad_id=2)
HIDDEN, STREAMS, EPS = 32, 4, 1e-20


def test_release_table_rows_are_the_sums_of_its_primes():
    """The V4.1 release's `engram_num_embeddings` (its two tables' row counts), from the prime rule."""
    assert RELEASE.table_rows() == {1: 384_006_168, 14: 384_016_682}
    assert prime_moduli(RELEASE)[1][:3] == [16_000_057, 16_000_079, 16_000_081]  # the first primes above 16 M
    assert prime_moduli(RELEASE)[14][0] == 16_000_477  # after layer 1's 24: no modulus is shared


def test_multipliers_are_pinned():
    """numpy does not promise its streams across versions: a change here changes every hash."""
    assert hash_multipliers(1, 4, 99092) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert hash_multipliers(14, 4, 99092) == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    assert all(m % 2 == 1 for m in hash_multipliers(4, 4, 1000))


def test_hash_ids_of_a_tiny_config_are_frozen():
    context = ngram_context(torch.tensor([5, 7, 11, 13, 999]), TINY.max_ngram, TINY.pad_id)
    assert context[:2].tolist() == [[5, 2, 2, 2], [7, 5, 2, 2]]  # token s back, pad before the start
    assert NgramHash(TINY, 1)(context).tolist() == [
        [258, 1994, 2334, 3061, 4615, 5188], [404, 1929, 2783, 3066, 4319, 5536], [880, 1541, 2619, 3917, 4414, 5519],
        [974, 1339, 2130, 3212, 4873, 6110], [820, 1093, 2145, 3104, 4127, 5803]]
    assert NgramHash(TINY, 4)(context)[[0, 3, 4]].tolist() == [
        [495, 1741, 2836, 3666, 4451, 6068], [456, 2033, 2649, 3565, 4215, 6266], [635, 1643, 2726, 3465, 4764, 6060]]


def test_each_column_lands_in_its_own_row_range():
    primes = prime_moduli(TINY)[1]
    starts = torch.tensor([0, *torch.tensor(primes).cumsum(0)[:-1].tolist()])
    ids = NgramHash(TINY, 1)(torch.randint(0, 1000, (200, 4)))
    assert ((ids >= starts) & (ids < starts + torch.tensor(primes))).all()


def random_engram(shards: int = 1, seed: int = 0) -> Engram:
    torch.manual_seed(seed)
    engram = Engram(TINY, 1, HIDDEN, STREAMS, EPS, shards)
    for p in engram.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return engram.requires_grad_(False)


def test_gate_is_the_normalised_per_stream_dot_product():
    """dot_i = <RMSNorm_q(h_i), RMSNorm_k(k_i)> / sqrt(D); gate = sigmoid(sign * sqrt(|dot|)); the
    one value adds into each stream under its gate."""
    engram = random_engram()
    streams = torch.randn(2, 5, STREAMS, HIDDEN)
    context = torch.randint(0, 1000, (2, 5, 4))
    out = engram(streams, context)
    kv = engram.wkv(engram.embed(engram.hash(context)).flatten(-2))
    keys, value = kv[..., :-HIDDEN].unflatten(-1, (STREAMS, HIDDEN)), kv[..., -HIDDEN:]
    dot = (F.rms_norm(streams, (HIDDEN,), eps=EPS) * engram.q_weight
           * F.rms_norm(keys, (HIDDEN,), eps=EPS) * engram.k_weight).sum(-1) / HIDDEN**0.5
    gate = torch.sigmoid(dot.sign() * dot.abs().sqrt())
    torch.testing.assert_close(out, streams + gate[..., None] * value[:, :, None, :], rtol=1e-5, atol=1e-5)
    masked = engram(streams, context, valid=torch.tensor([[True] * 5, [False] * 5]))
    assert torch.equal(masked[1], streams[1]) and torch.equal(masked[0], out[0])


def test_a_zero_dot_gates_by_the_clamp_not_by_one_half():
    engram = random_engram()
    with torch.no_grad():
        engram.q_weight.zero_()
    streams = torch.randn(1, 2, STREAMS, HIDDEN)
    value = engram.wkv(engram.embed(engram.hash(torch.zeros(1, 2, 4, dtype=torch.long))).flatten(-2))[..., -HIDDEN:]
    out = engram(streams, torch.zeros(1, 2, 4, dtype=torch.long))
    torch.testing.assert_close(out, streams + torch.sigmoid(torch.tensor(1e-3)) * value[:, :, None, :])


class EngramStep(torch.nn.Module):
    """The Engram of one rank as a step graph takes it: its shard a 0-d int32 input."""

    def __init__(self, engram: Engram, group_size: int, exchange: str):
        super().__init__()
        self.engram, self.group_size, self.exchange = engram, group_size, exchange

    def forward(self, streams, context, shard):
        return self.engram(streams, context, shard=shard, group_size=self.group_size, exchange=self.exchange)


def _sharded_on_rank(rank, topology, programs, table_path, tokens):
    """Each rank: its exported graphs with its own rows of the table loaded (and no others), on
    the group's shared tokens (`static`) and on its own (`ag_rs`)."""
    held = -(-TINY.table_rows()[1] // topology.world)
    with safe_open(table_path, "pt") as f:
        rows = f.get_slice("embed.weight")[rank * held:(rank + 1) * held]
    rows = F.pad(rows, (0, 0, 0, held - rows.shape[0]))  # the last rank's range runs past the table
    shard = torch.tensor(rank, dtype=torch.int32)
    out = {}
    for exchange, (streams, context) in (("static", tokens[0]), ("ag_rs", tokens[rank])):
        module = torch.export.load(programs[exchange]).module()
        module.engram.embed.weight.copy_(rows)
        out[exchange] = module(streams, context, shard)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, 4, *(pytest.param(w, marks=pytest.mark.slow) for w in (8, 16))])
def test_sharded_tables_equal_one_table_bit_for_bit(world, tmp_path):
    whole = random_engram()
    save_file({"embed.weight": whole.embed.weight.contiguous()}, tmp_path / "table.safetensors")
    tokens = [(torch.randn(2, 3, STREAMS, HIDDEN), torch.randint(0, 1000, (2, 3, 4))) for _ in range(world)]
    programs = {}
    for exchange in ("static", "ag_rs"):
        sharded = Engram(TINY, 1, HIDDEN, STREAMS, EPS, shards=world).requires_grad_(False)
        sharded.load_state_dict({k: v for k, v in whole.state_dict().items() if k != "embed.weight"}, strict=False)
        shard = torch.tensor(0, dtype=torch.int32)
        programs[exchange] = tmp_path / f"{exchange}.pt2"
        torch.export.save(torch.export.export(EngramStep(sharded, world, exchange), (*tokens[0], shard)),
                          programs[exchange])
    results = run_ranks(Topology(cp=1, ep=world, dp=world), _sharded_on_rank, programs,
                        tmp_path / "table.safetensors", tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a GEMM's rounding depends on how it splits over threads
    try:
        for rank, result in enumerate(results):
            assert torch.equal(result["static"], whole(*tokens[0])), f"rank {rank}, static"
            assert torch.equal(result["ag_rs"], whole(*tokens[rank])), f"rank {rank}, ag_rs"
    finally:
        torch.set_num_threads(threads)
