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


def step_noise(seed: Tensor, temperature: Tensor, shape: list[int]) -> Tensor:
    """A compiled program's `noise` input (backends whose programs take the sampler's noise):
    [B, V], or a speculative step's [B, 1 + k, V] whose position j is drawn from seed + j (the
    seed of the row's j-th new token, as `verify_drafts` draws it); zeros where no row samples."""
    if not bool((temperature > 0).any()):
        return torch.zeros(shape)
    if len(shape) == 2:
        return sampling_noise(seed, shape[-1])
    return torch.stack([sampling_noise(seed + j, shape[-1]) for j in range(shape[1])], dim=1)


SAMPLER_CANDIDATES = 256
"""A sampling row draws from its `SAMPLER_CANDIDATES` most likely tokens (NxD Inference's global
top-k, 256 by default): top-k and top-p then work within them, so no program sorts or scans the
whole vocabulary (a sort of DeepSeek's 129,280 logits, and a cumulative sum that lowers to a
reduce-window as wide as the vocabulary, quadratic on the device). Exact wherever the row's
top-k is 1..256, or its top-p nucleus lies within them; otherwise the tail past them is never
drawn (a top_k of 0 or above 256 means 256). Probabilities are the whole vocabulary's: the
nucleus is measured against the full softmax, not the candidates'."""


def candidates(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """Scaled logits [..., V] (rows' parameters [...]) -> (the candidates' logits, descending, with
    what top-k and top-p drop at -inf; their token ids): each [..., min(SAMPLER_CANDIDATES, V)]."""
    values, ids = scaled.topk(min(SAMPLER_CANDIDATES, scaled.shape[-1]), dim=-1)
    probs = (values - scaled.logsumexp(dim=-1, keepdim=True)).exp()
    rank = torch.arange(values.shape[-1], device=scaled.device)
    drop = (top_k[..., None] > 0) & (rank >= top_k[..., None])
    # Nucleus: keep the smallest prefix whose probability reaches top_p (the first token always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[..., None]
    return values.masked_fill(drop, float("-inf")), ids


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
    kept, ids = candidates(scaled, top_k, top_p)  # [B, C]
    noise = sampling_noise(seed, logits.shape[-1]).to(logits.device).gather(-1, ids)  # each token's own draw
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
    sampled = ids.gather(-1, (kept + gumbel).argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


sample = define_op("sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
                   "Tensor? samples=None) -> Tensor",
                   _sample, lambda logits, temperature, top_k, top_p, seed, samples=None: logits.new_empty(
                     logits.shape[:-1], dtype=torch.int64))



def filtered_probabilities(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """[N, V] fp32 logits of rows that sample (temperature > 0) -> the distribution `sample` draws
    from: temperature, then its candidates' top-k and top-p (`candidates`), renormalised."""
    kept, ids = candidates(logits / temperature.clamp_min(1e-6)[:, None], top_k, top_p)
    return torch.zeros_like(logits).scatter(-1, ids, kept.softmax(dim=-1))


def _gumbel_pick(probabilities: Tensor, noise: Tensor) -> int:
    """A sample of `probabilities` [V] by the Gumbel-max trick on uniform `noise` [V]."""
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
    return int((probabilities.log() + gumbel).argmax())


def _verify_drafts(logits: Tensor, drafts: Tensor, draft_count: Tensor, temperature: Tensor, top_k: Tensor,
                   top_p: Tensor, seed: Tensor) -> Tensor:
    """Speculative decoding's verdict on each row's drafts, keeping the model's distribution.

    Row r proposed `draft_count[r]` = m draft tokens d_0..d_{m-1} (at most k), and `logits[r, j]`
    is the model's prediction of the token d_j stands for (j = 0..k). Greedy rows (temperature
    0) accept d_j while it is the argmax. Sampling rows follow the speculative-sampling rule
    (Leviathan et al. 2023; Chen et al. 2023) for a draft that proposes one token with
    certainty: accept d_j with probability p_j(d_j) (p_j the distribution `sample` draws from),
    and at the first rejection draw from p_j without d_j, renormalised: every emitted token is
    distributed as p. Where all m are accepted, the next token is drawn from p_m. Position j's
    uniform noise is `sampling_noise(seed + j)` (the seed of generated token j): the acceptance
    reads it at d_j, the draw after a rejection at the other tokens, so the two are independent.

    Args:
        logits: [B, 1 + k, V]; drafts: [B, k] int64; draft_count: [B] int64 in 0..k.
        temperature, top_k, top_p, seed: [B], as `sample` takes them.

    Returns:
        [B, 2 + k] int64: the accepted count n, then tokens t_0..t_k of which t_0..t_n are the
        row's new tokens (the accepted drafts, then the model's own); the rest are zeros.
    """
    rows, positions, vocab = logits.shape
    logits = logits.float()
    greedy = logits.argmax(dim=-1)  # [B, 1 + k]
    verdict = torch.zeros(rows, 1 + positions, dtype=torch.int64, device=logits.device)
    for r in range(rows):
        count, proposed = int(draft_count[r]), drafts[r].tolist()
        if temperature[r] <= 0:
            accepted = next((j for j in range(count) if int(greedy[r, j]) != proposed[j]), count)
            last = int(greedy[r, accepted])
        else:
            p = filtered_probabilities(logits[r], temperature[r].expand(positions), top_k[r].expand(positions),
                                       top_p[r].expand(positions))  # [1 + k, V]
            noise = torch.stack([sampling_noise(seed[r: r + 1] + j, vocab)[0] for j in range(positions)])
            accepted = next((j for j in range(count) if noise[j, proposed[j]] >= p[j, proposed[j]]), count)
            kept = p[accepted].clone()
            if accepted < count:  # rejected: the residual max(0, p - one-hot(d)) renormalised
                kept[proposed[accepted]] = 0.0
            last = _gumbel_pick(kept / kept.sum(), noise[accepted])
        verdict[r, : accepted + 2] = torch.tensor([accepted, *proposed[:accepted], last])
    return verdict


verify_drafts = define_op(
    "verify_drafts(Tensor logits, Tensor drafts, Tensor draft_count, Tensor temperature, Tensor top_k, "
    "Tensor top_p, Tensor seed) -> Tensor",
    _verify_drafts,
    lambda logits, drafts, draft_count, temperature, top_k, top_p, seed: logits.new_empty(
        (logits.shape[0], 1 + logits.shape[1]), dtype=torch.int64))
