"""DeepSeek-V3.2 sparse attention, model level (fp32).

- graphc's indexer selects the keys transformers' `DeepseekV32ForCausalLM` selects: a difference
  is allowed only for a key whose score is within the noise floor of the k-th score (a near-tie);
  overlap and token agreement go to the measurement report. (With index_topk at least the context,
  the `v32` preset runs in test_model_vs_hf.py with every other preset: logits and greedy tokens
  equal transformers'.)
- Context parallel on real gloo ranks: every layer's top-k at cp = 2 and 4 is cp = 1's, and the
  tokens are cp = 1's.
- Compiled and served (export, and inductor on one rank in the slow tier): the eager tokens, at
  cp = 1 and 2.
"""

from __future__ import annotations

import pytest
import torch

from graphc.artifacts.directory import read_manifest
from graphc.weights.checkpoint import load_model
from graphc.ops import sparse
from graphc.runtime import Engine, Request
from graphc.runtime.launch import serve
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata
from graphc.tools.generate import PagedKV, generate
from graphc.topology import Topology
from multirank import greedy_on_rank, run_ranks
from support import SPARSE_TOPK, SPARSE_V32, hf_greedy, load_hf

PROMPT = [(7 * i + 3) % 250 + 2 for i in range(60)]
NOISE_FLOOR = 1e-5
"""Relative to a query's largest |score|: fp32 accumulation-order differences between two correct
implementations are ~1e-7 of it; exact ties (e.g. every head's relu at zero) are within any floor."""


class SelectionRecorder:
    """Records every layer's indexer logits and final top-k of the steps run while it is active."""

    def __init__(self, monkeypatch):
        self.logits, self.selected = [], []
        logits_op, combine_op = sparse.paged_indexer_logits, sparse.index_topk_combine

        def logits(*args):
            self.logits.append(logits_op(*args))
            return self.logits[-1]

        def combine(*args):
            self.selected.append(combine_op(*args))
            return self.selected[-1]

        monkeypatch.setattr(sparse, "paged_indexer_logits", logits)
        monkeypatch.setattr(sparse, "index_topk_combine", combine)


def _prefill(model, tokens):
    seq = SequenceBlocks(8)
    seq.reserve(len(tokens), BlockAllocator(16))
    ids, positions, table, slots, _ = step_metadata([(seq, tokens, 0)], len(tokens), 16)
    with torch.no_grad():
        return model(ids, positions, table, slots, model.new_kv_pool(16, 8))[0]


def test_selection_matches_transformers_up_to_near_ties(tiny_checkpoints, monkeypatch, report):
    path = tiny_checkpoints[SPARSE_V32]
    ours, theirs = load_model(path), load_hf(path)
    recorder = SelectionRecorder(monkeypatch)
    logits = _prefill(ours, PROMPT)
    hf_selected = []
    for layer in theirs.model.layers:
        layer.self_attn.indexer.register_forward_hook(lambda module, inputs, out: hf_selected.append(out[0]))
    with torch.no_grad():
        hf_logits = theirs(torch.tensor([PROMPT])).logits[0]

    shared = total = near_ties = 0
    for layer, (index_logits, selected, expected) in enumerate(zip(recorder.logits, recorder.selected, hf_selected)):
        for q in range(len(PROMPT)):
            scores = index_logits[0, q]  # [K] by position
            ours_set = {p for p in selected[0, q].tolist() if p != sparse.NO_KEY}
            # transformers takes min(k, T) keys of all T, masked ones included when fewer are visible.
            theirs_set = {p for p in expected[q].tolist() if p <= q}
            assert len(ours_set) == len(theirs_set) == min(SPARSE_TOPK, q + 1)
            shared, total = shared + len(ours_set & theirs_set), total + len(theirs_set)
            if ours_set != theirs_set:
                kth = scores[selected[0, q, -1]].item()
                floor = NOISE_FLOOR * scores[: q + 1].abs().max().item()
                for key in ours_set ^ theirs_set:
                    assert abs(scores[key].item() - kth) <= floor, (
                        f"layer {layer}, query {q}: key {key} scores {scores[key].item():.7g}, the k-th "
                        f"{kth:.7g}: {abs(scores[key].item() - kth):.2e} apart, beyond the floor {floor:.2e}")
                near_ties += 1
    assert len(PROMPT) > 3 * SPARSE_TOPK  # most queries choose among more keys than they keep

    prompts = [PROMPT, PROMPT[:37][::-1]]
    expected_tokens = [hf_greedy(theirs, p, 24) for p in prompts]
    actual = generate(ours, prompts, 24, kv=PagedKV(block_size=8, num_blocks=32), stop_at_eos=False)
    agreeing = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(actual, expected_tokens)]
    report(f"v32 sparse (index_topk {SPARSE_TOPK}, {len(PROMPT)}-token prompt) vs transformers: index-set overlap "
           f"{shared}/{total} = {shared / total:.4f}, {near_ties} query-layers differ (all within the noise floor "
           f"{NOISE_FLOOR:g} of the k-th score); greedy tokens agree for {agreeing} of 24")
    if near_ties == 0:  # the same keys everywhere: fp32 must give the same logits and tokens
        torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=1e-4 * hf_logits.abs().max().item())
        assert actual == expected_tokens


def test_block_table_past_the_context_is_never_read(tiny_checkpoints):
    """A prefill then a decode step whose block table holds out-of-range ids past the context."""
    model = load_model(tiny_checkpoints[SPARSE_V32])
    tokens = PROMPT[:30]  # 4 blocks of 8, in a table of 16
    seq = SequenceBlocks(8)
    seq.reserve(len(tokens) + 1, BlockAllocator(16))
    outputs = []
    for garbage in (False, True):
        pool = model.new_kv_pool(16, 8)
        steps = [(tokens[:-1], 0), (tokens[-1:], len(tokens) - 1)]
        for run, start in steps:
            ids, positions, table, slots, last = step_metadata([(seq, run, start)], len(run), 16)
            if garbage:
                table[:, len(seq.blocks):] = torch.tensor([10**12, -3, 16, 99, -1, 2**40] * 2)
            with torch.no_grad():
                outputs.append(model(ids, positions, table, slots, pool, last))
    assert all(torch.equal(a, b) for a, b in zip(outputs[:2], outputs[2:]))


BLOCK_SIZE, BLOCKS_PER_SHARD, BLOCKS_PER_ROW = 4, 12, 14
CP_PROMPT = PROMPT[:41]  # 11 blocks of 4: every shard owns several
CHUNK, DECODE_STEPS = 13, 6


def sparse_generate_on_rank(rank: int, topology: Topology, checkpoint: str):
    """Chunked prefill then greedy decode with `rank`'s share of the cache and experts.
    Returns (tokens, every layer's top-k of every step)."""
    with pytest.MonkeyPatch.context() as patch:
        recorder = SelectionRecorder(patch)
        _, tokens = greedy_on_rank(rank, topology, checkpoint, "static", [CP_PROMPT], CHUNK, DECODE_STEPS, BLOCK_SIZE,
                                   BLOCKS_PER_SHARD, BLOCKS_PER_ROW)
        return tokens, [s.tolist() for s in recorder.selected]


@pytest.fixture(scope="module")
def single_rank_selection(tiny_checkpoints):
    return sparse_generate_on_rank(0, Topology(1, 1), str(tiny_checkpoints[SPARSE_V32]))


@pytest.mark.multirank
@pytest.mark.parametrize("cp, ep", [(2, 2), (4, 2)])
def test_context_parallel_top_k_and_tokens_equal_one_rank(cp, ep, tiny_checkpoints, single_rank_selection):
    tokens, selections = single_rank_selection
    assert any(len({p for row in s for q in row for p in q if p >= 0}) > SPARSE_TOPK for s in selections)
    for rank_tokens, rank_selections in run_ranks(Topology(cp, ep), sparse_generate_on_rank,
                                                  str(tiny_checkpoints[SPARSE_V32])):
        assert rank_tokens == tokens
        assert rank_selections == selections  # every step, layer, query: the same keys in the same order


CASE_PROMPTS = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (1, 9, 40)]


def _requests():
    return [Request(p, 12, stop_at_eos=False) for p in CASE_PROMPTS]


@pytest.fixture(scope="module")
def eager_tokens(tiny_checkpoints):
    model = load_model(tiny_checkpoints[SPARSE_V32])
    return generate(model, CASE_PROMPTS, 12, kv=PagedKV(block_size=8, num_blocks=64), stop_at_eos=False)


@pytest.mark.compiles
@pytest.mark.parametrize("backend", ["export", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_sparse_model_gives_the_eager_tokens(backend, compiled, eager_tokens):
    artifacts = compiled(SPARSE_V32, backend, "small")
    assert [r.output_ids for r in Engine(artifacts).generate(_requests())] == eager_tokens
    assert read_manifest(artifacts).model.sparse_probabilities == "fp32"  # an fp32 model's default


@pytest.mark.compiles
@pytest.mark.multirank
def test_compiled_ranks_serve_the_eager_tokens(compiled, eager_tokens):
    """The top-k combine as a compiled collective, served by one process per rank (cp = 4 is the
    eager test's above: the same ops, a larger group)."""
    artifacts = compiled(SPARSE_V32, "export", "small", 2, 2)
    [outcome] = serve(artifacts, [_requests()])
    results = outcome.results
    assert [r.output_ids for r in results] == eager_tokens
