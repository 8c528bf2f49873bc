"""What the busiest rank of an expert-parallel group serves in a step, from the family's router.

Every MoE layer ends in a collective, so a step waits for the rank with the most work, not the
mean one. A seeded Monte Carlo over the router's rule: scores drawn i.i.d. per token and expert
(the trained router's skew is not modelled, so real routing is busier), the group limit applied
as DeepSeek-V3's router applies it (the `topk_group` groups of the highest top-2 score sums,
then the top K experts among them), experts dealt to ranks in contiguous blocks as graphc's
expert parallelism places them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

SAMPLES = 64
"""Steps drawn per estimate: the expected maxima move by < 2 % between seeds at this count."""


@dataclass(frozen=True)
class BusiestRank:
    """Expectations over steps of the busiest rank's share of one MoE layer."""

    experts: float
    """Distinct local experts its routes reach."""
    routes: float
    """Routes (token, expert) it serves."""


@lru_cache(maxsize=256)
def busiest_rank(tokens: int, experts: int, per_token: int, groups: int, groups_per_token: int,
                 ranks: int, seed: int = 0) -> BusiestRank:
    """The busiest of `ranks` ranks (each holding experts / ranks experts) when `tokens` tokens
    each choose `per_token` of `experts` experts within `groups_per_token` of `groups` groups."""
    if tokens == 0:
        return BusiestRank(0.0, 0.0)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(SAMPLES, tokens, groups, experts // groups, generator=generator)
    if groups_per_token < groups:
        group_scores = scores.topk(min(2, experts // groups), dim=-1).values.sum(-1)  # [S, T, G]
        kept = group_scores.topk(groups_per_token, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, kept, True)
        scores = scores.masked_fill(~mask[..., None], -1.0)
    chosen = scores.flatten(2).topk(per_token, dim=-1).indices  # [S, T, K] expert ids
    local = experts // ranks
    hits = torch.zeros(SAMPLES, experts).scatter_add_(1, chosen.flatten(1), torch.ones(SAMPLES, tokens * per_token))
    by_rank = hits.view(SAMPLES, ranks, local)
    experts_hit = (by_rank > 0).sum(-1).amax(-1).float().mean().item()
    routes = by_rank.sum(-1).amax(-1).mean().item()
    return BusiestRank(experts_hit, routes)
