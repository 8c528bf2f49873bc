"""Per-request sampling parameters and how they become the sampler's per-row inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEED_STRIDE = 1_000_003
"""Mixes a request's seed with its step index: row seed = seed * SEED_STRIDE + step."""


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens (see `ops.sample`); also `runtime.sampling` in model.yaml."""

    temperature: float = 0.0
    """0 is greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    seed: int = 0
    """Seed of the sampling noise (per request, mixed with the step)."""


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
