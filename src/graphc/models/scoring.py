"""A score step: a prefill chunk that also returns every position's log-probabilities, so that a
request can have its prompt's (OpenAI's `echo` with `logprobs`, lm-evaluation-harness's
loglikelihood). Compiled beside each prefill bucket where model.yaml asks
(`runtime.prompt_logprobs`); a step that scores nothing never runs it, so plain prefill keeps
its one-position vocabulary head.

Position i's scores are of the token after it in the chunk (i + 1): the chunk's last position
predicts a token the program does not hold (the next chunk's first, or the first generated
one), which the host reads from the step's `logits` output as it reads a generated token's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from graphc.models.step_model import StepInputs, StepModel
from graphc.step import score_top


class ScoringStep(nn.Module):
    """`model` (its parameters under `model.`) over a chunk: the logits at `logits_index` [B, V]
    (what the step samples from), then `graphc.step.SCORE_OUTPUTS`."""

    def __init__(self, model: StepModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, step: StepInputs, logits_index: Tensor) -> tuple[Tensor, ...]:
        every = self.model.logits(self.model.final_hidden(input_ids, step))  # [B, W, V]
        logits = every.gather(1, logits_index.view(-1, 1, 1).expand(-1, 1, every.shape[-1])).squeeze(1)
        return (logits, *prompt_scores(every, input_ids))


def prompt_scores(logits: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every position's logits [B, W, V] and the chunk's tokens [B, W] -> `graphc.step.SCORE_OUTPUTS`.
    The last position's next token is not in the chunk: its column scores its own token, which
    the host never reads."""
    logprobs = logits.float().log_softmax(dim=-1)
    following = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)  # token i + 1 at i
    chosen = logprobs.gather(-1, following[..., None]).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(score_top(logprobs.shape[-1]), dim=-1)
    return chosen, top_logprobs, top_ids
