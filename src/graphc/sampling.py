"""Per-request sampling parameters and how they become the sampler's per-row inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEED_STRIDE = 1_000_003
"""Mixes a request's seed with its step index: row seed = seed * SEED_STRIDE + step."""


@dataclass(frozen=True)
class Sampling:
    """See `ops.sample`: temperature 0 is greedy; top_k 0 and top_p 1 disable those limits."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def sampler_inputs(params: list[Sampling], steps: list[int], rows: int) -> dict[str, torch.Tensor]:
    """temperature/top_k/top_p/seed tensors for `rows` rows; rows past `params` are greedy padding."""
    padded = list(params) + [Sampling()] * (rows - len(params))
    steps = list(steps) + [0] * (rows - len(steps))
    return {
        "temperature": torch.tensor([p.temperature for p in padded], dtype=torch.float32),
        "top_k": torch.tensor([p.top_k for p in padded], dtype=torch.int64),
        "top_p": torch.tensor([p.top_p for p in padded], dtype=torch.float32),
        "seed": torch.tensor([p.seed * SEED_STRIDE + s for p, s in zip(padded, steps)], dtype=torch.int64),
    }
