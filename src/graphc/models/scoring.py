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

from torch import Tensor, nn

from graphc.models.step_model import StepInputs, StepModel
from graphc.sampling import MAX_TOP_LOGPROBS

SCORE_OUTPUTS = ("prompt_logprobs", "prompt_top_logprobs", "prompt_top_ids")
"""What a score step returns after a step's tokens and logits: [B, W] fp32, each position's
log-probability of the next token in its row; [B, W, N] fp32 and int64, its N most likely tokens'
(N = `MAX_TOP_LOGPROBS`, or the vocabulary if smaller), most likely first."""


class ScoringStep(nn.Module):
    """`model` (its parameters under `model.`) over a chunk: the logits at `logits_index` [B, V]
    (what the step samples from), then `SCORE_OUTPUTS`."""

    def __init__(self, model: StepModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, step: StepInputs, logits_index: Tensor) -> tuple[Tensor, ...]:
        every = self.model.logits(self.model.final_hidden(input_ids, step))  # [B, W, V]
        logits = every.gather(1, logits_index.view(-1, 1, 1).expand(-1, 1, every.shape[-1])).squeeze(1)
        return (logits, *prompt_scores(every, input_ids))


def prompt_scores(logits: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every position's logits [B, W, V] and the chunk's tokens [B, W] -> `SCORE_OUTPUTS` (the last
    position's next token is unknown here: its column holds its own token's score)."""
    logprobs = logits.float().log_softmax(dim=-1)
    following = input_ids.roll(-1, dims=1)  # token i + 1 at i
    chosen = logprobs.gather(-1, following[..., None]).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(min(MAX_TOP_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return chosen, top_logprobs, top_ids
