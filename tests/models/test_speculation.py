"""Speculative decoding's verdict (`graphc::verify_drafts`): greedy rows accept drafts while they
are the argmax; sampling rows keep the model's distribution (chi-square over many seeds, against
the distribution `graphc::sample` draws from and against `sample` itself)."""

from __future__ import annotations

import pytest
import torch

from graphc.ops import sampler
from graphc.sampling import SEED_STRIDE

CHI_SQUARE_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
"""The 0.999 quantile of the chi-square distribution by degrees of freedom: a correct sampler
exceeds it once in a thousand seed sets (the seeds here are fixed, so the tests are too)."""
DRAWS = 2500


def _verdict(logits, drafts, count, temperature=0.0, top_k=0, top_p=1.0, seeds=None):
    rows = logits.shape[0]
    seeds = torch.arange(rows) * SEED_STRIDE if seeds is None else seeds
    return sampler.verify_drafts(logits, drafts, torch.full((rows,), count), torch.full((rows,), temperature),
                                 torch.full((rows,), top_k), torch.full((rows,), top_p), seeds)


def test_greedy_rows_accept_drafts_while_they_are_the_argmax():
    logits = torch.full((4, 3, 6), -1.0)
    logits[:, 0, 2] = logits[:, 1, 4] = logits[:, 2, 5] = 1.0  # the argmax: 2, then 4, then 5
    drafts = torch.tensor([[2, 4], [2, 3], [1, 4], [2, 4]])
    counts = torch.tensor([2, 2, 2, 1])
    verdict = sampler.verify_drafts(logits, drafts, counts, torch.zeros(4), torch.zeros(4, dtype=torch.int64),
                                    torch.ones(4), torch.zeros(4, dtype=torch.int64))
    assert verdict.tolist() == [
        [2, 2, 4, 5],  # both accepted, then the model's token after them
        [1, 2, 4, 0],  # the second rejected: the model's own token in its place
        [0, 2, 0, 0],  # the first rejected
        [1, 2, 4, 0],  # one draft only: accepted, then the model's token
    ]


def _chi_square(counts: torch.Tensor, probabilities: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probabilities`, over the tokens it may draw."""
    support = probabilities > 0
    assert counts[~support].sum() == 0, "a token the distribution excludes was drawn"
    expected = probabilities[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 1.0), (0, 0.8)])
@pytest.mark.parametrize("draft", [0, 3])  # the likeliest token, and a less likely one
def test_sampling_rows_emit_tokens_distributed_as_without_drafts(top_k, top_p, draft):
    generator = torch.Generator().manual_seed(7)
    logits = (torch.randn(1, 2, 6, generator=generator) * 1.5).expand(DRAWS, 2, 6)  # V = 6, k = 1
    order = logits[0, 0].argsort(descending=True)
    drafts = order[draft].expand(DRAWS, 1)
    verdict = _verdict(logits, drafts, 1, temperature=0.9, top_k=top_k, top_p=top_p)
    rows = torch.full((DRAWS,), 0.9), torch.full((DRAWS,), top_k), torch.full((DRAWS,), top_p)
    first = sampler.filtered_probabilities(logits[:, 0].float(), *rows)[0]
    statistic, freedom = _chi_square(torch.bincount(verdict[:, 1], minlength=6).float(), first)
    assert statistic < CHI_SQUARE_999[freedom], (statistic, freedom)
    # The non-speculative sampler, over the same seeds, draws from the same distribution.
    plain = sampler.sample(logits[:, 0], *rows, torch.arange(DRAWS) * SEED_STRIDE)
    statistic, freedom = _chi_square(torch.bincount(plain, minlength=6).float(), first)
    assert statistic < CHI_SQUARE_999[freedom], (statistic, freedom)
    # Where the draft was accepted, the token after it is distributed as the model's next one.
    accepted = verdict[:, 0] == 1
    if first[drafts[0, 0]] == 0:  # outside the nucleus: never accepted
        assert not accepted.any()
        return
    assert 0 < int(accepted.sum()) < DRAWS
    second = sampler.filtered_probabilities(logits[:1, 1].float(), *(r[:1] for r in rows))[0]
    statistic, freedom = _chi_square(torch.bincount(verdict[accepted, 2], minlength=6).float(), second)
    assert statistic < CHI_SQUARE_999[freedom], (statistic, freedom)


def test_a_draft_the_distribution_excludes_is_never_accepted():
    logits = torch.tensor([[[4.0, 3.0, -2.0, -3.0], [0.0, 0.0, 0.0, 0.0]]]).expand(500, 2, 4)
    verdict = _verdict(logits, torch.full((500, 1), 3), 1, temperature=1.0, top_k=2)
    assert (verdict[:, 0] == 0).all() and set(verdict[:, 1].tolist()) <= {0, 1}


@pytest.mark.parametrize("cp", [1, 2])
def test_drafts_ahead_write_their_shards_slots_and_nothing_past_a_sequences_blocks(cp):
    """`_slots` against the host's `SequenceBlocks.slot`: block j on shard j % cp; past the block
    table's last logical block (or in a padding row) nothing is written."""
    from graphc.models.speculation import _slots
    from graphc.models.step_model import Parallelism, StepInputs
    from graphc.runtime.paged import SequenceBlocks, step_metadata
    from graphc.step import PADDING_SLOT

    block_size, blocks_per_row = 4, 4  # 16 positions a sequence at most
    sequence = SequenceBlocks(block_size, [5, 2, 7, 1], cp)
    for shard in range(cp):
        table = step_metadata([(sequence, [9], 0)], 1, blocks_per_row, total_rows=2, shard=shard)[2]
        positions = torch.tensor([[p] for p in range(20)])
        live = torch.tensor([[True]])
        step = StepInputs(positions, table[:1].expand(20, -1), None, torch.zeros(1, 8, block_size, 1),
                          Parallelism(cp_rank=shard, cp=cp))
        got = _slots(step, positions, live.expand(20, 1))[:, 0].tolist()
        assert got == [sequence.slot(p, shard) for p in range(16)] + [PADDING_SLOT] * 4
        padding_row = StepInputs(positions[:1], table[1:], None, step.kv_pool, step.parallel)
        assert _slots(padding_row, positions[:1], torch.tensor([[False]])).item() == PADDING_SLOT
