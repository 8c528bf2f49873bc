"""graphc::sample: the leader's sampler, inside the step graph."""

from __future__ import annotations

import torch
from torch import Tensor

from graphc.ops.library import define_op


def sampling_noise(seed: Tensor, vocab: int) -> Tensor:
    """[B, V] uniform noise in [0, 1), each row from a generator seeded by its `seed`: the
    sampler's randomness, drawn on the host (backends whose programs take it as an input get
    exactly this, so a seed samples the same token everywhere)."""
    return torch.stack([torch.rand(vocab, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float32)
                        for s in seed.tolist()])


def _sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
            samples: Tensor | None = None) -> Tensor:
    """Pick one token per row: greedy where temperature is 0, else sampling with top-k / top-p.

    Sampling uses the Gumbel-max trick with noise drawn from a per-row generator seeded by `seed`,
    so the same (logits, seed) always gives the same token, whatever else is in the batch.

    Args:
        logits: [B, V].
        temperature: [B] fp32; 0 means greedy.
        top_k: [B] int64; 0 means no top-k limit.
        top_p: [B] fp32 in (0, 1]; 1 means no nucleus limit.
        seed: [B] int64 per-row noise seed (the host mixes request seed and step).
        samples: 0-d int32, 0 on a follower: the step graph every rank runs passes its rank's
            `samples` coordinate, and followers (which take the leader's tokens) get zeros at once.

    Returns:
        [B] int64 token ids (zeros on a follower).
    """
    if samples is not None and not bool(samples):
        return torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if not bool((temperature > 0).any()):
        return greedy
    scaled = logits / temperature.clamp_min(1e-6)[:, None]  # [B, V]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]  # [1, V]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    # Nucleus: keep the smallest prefix whose probability reaches top_p (the first token always stays).
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    noise = sampling_noise(seed, logits.shape[-1]).to(logits.device)  # [B, V]
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
    sampled = order.gather(-1, (sorted_logits + gumbel).argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


sample = define_op("sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
                   "Tensor? samples=None) -> Tensor",
                   _sample, lambda logits, temperature, top_k, top_p, seed, samples=None: logits.new_empty(
                     logits.shape[:-1], dtype=torch.int64))

