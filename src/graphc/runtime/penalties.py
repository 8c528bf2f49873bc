"""Penalties and logit bias (OpenAI's `presence_penalty`, `frequency_penalty`, `logit_bias`;
vLLM's `repetition_penalty`), with vLLM's semantics, in vLLM's order: the bias is added, then the
repetition penalty divides a positive logit (multiplies a negative one) of every token the prompt
or the output holds, then the frequency penalty subtracts its weight times the token's count in
the output and the presence penalty its weight once for a token the output holds. The request's
temperature, top-k and top-p then apply as always.

Applied on the leader (`graphc.runtime.leader_sampling`). A row with them does not draft under
speculative decoding: verifying drafts needs the penalised distribution at every draft position,
and the step returns the logits of its first new token only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


MAX_LOGIT_BIAS_TOKENS = 300
"""OpenAI's bound on a request's `logit_bias` entries."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
PENALTY_RANGE = (-2.0, 2.0)
"""OpenAI's range for presence and frequency penalties."""


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    """1 is off; above 1 discourages tokens seen in the prompt or the output."""
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)


def penalised_logits(logits, penalties: Penalties, prompt: list[int], output: list[int]):
    """`logits` [V] with the bias and the penalties applied (a new tensor)."""
    import torch

    adjusted = logits.float().clone()
    if penalties.logit_bias:
        adjusted[torch.tensor(list(penalties.logit_bias))] += torch.tensor(list(penalties.logit_bias.values()))
    if penalties.repetition != 1.0:
        seen = torch.tensor(prompt + output, dtype=torch.int64).unique()
        values = adjusted[seen]
        adjusted[seen] = torch.where(values > 0, values / penalties.repetition, values * penalties.repetition)
    if output and (penalties.frequency or penalties.presence):
        tokens, counts = torch.tensor(output, dtype=torch.int64).unique(return_counts=True)
        adjusted[tokens] -= penalties.frequency * counts.float() + penalties.presence
    return adjusted
