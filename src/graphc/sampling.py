"""Per-request sampling parameters and how they become the sampler's per-row inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SEED_STRIDE = 1_000_003
"""Mixes a request's seed with its step index: row seed = seed * SEED_STRIDE + step."""
SEED_MAX = 2**32 - 1
"""The largest seed: seed * SEED_STRIDE + step must fit the sampler's int64."""
TOP_K_MAX = 2**31 - 1
"""The largest top_k (any value at least the vocabulary keeps every token)."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for at each position (vLLM's default bound), and what
a score step returns (`graphc.models.scoring`)."""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SAMPLING_RULES = {
    "temperature": (lambda v: _number(v) and v >= 0, "a finite number >= 0 (0 is greedy)"),
    "top_k": (lambda v: _integer(v) and 0 <= v <= TOP_K_MAX, f"an integer in 0..{TOP_K_MAX} (0 keeps every token)"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "seed": (lambda v: _integer(v) and 0 <= v <= SEED_MAX, f"an integer in 0..{SEED_MAX}"),
}
"""What each sampling parameter accepts: one rule for model.yaml, `graphc run`'s options and
prompts files (NaN and infinities are refused everywhere)."""


def sampling_error(name: str, value) -> str | None:
    """Why `value` cannot be sampling parameter `name` ("nan must be ..."), or None."""
    accepts, allowed = SAMPLING_RULES[name]
    return None if accepts(value) else f"{value!r} must be {allowed}"


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens (see `graphc.ops.sampler`); also `runtime.sampling` in model.yaml."""

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
    import torch  # here, not at the top: the manifest schema reads `Sampling` without torch

    padded = list(params) + [Sampling()] * (rows - len(params))
    steps = list(steps) + [0] * (rows - len(steps))
    return {
        "temperature": torch.tensor([p.temperature for p in padded], dtype=torch.float32),
        "top_k": torch.tensor([p.top_k for p in padded], dtype=torch.int64),
        "top_p": torch.tensor([p.top_p for p in padded], dtype=torch.float32),
        "seed": torch.tensor([p.seed * SEED_STRIDE + s for p, s in zip(padded, steps)], dtype=torch.int64),
    }
