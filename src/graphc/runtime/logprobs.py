"""The log-probabilities a request asks for (OpenAI's `logprobs`): of each generated token, and of
the N most likely tokens at its position; and (`echo`) of its prompt's tokens, from the score
steps' outputs (`graphc.models.scoring`), all computed in the program but for a chunk's last
position, whose next token is read from the step's logits as a generated token's is.

They are the model's own distribution, the log-softmax of the logits the step's program returns
for the row (its `logits` output, the leader's rows), before temperature, top-k and top-p, as
vLLM reports them by default (`raw_logprobs`): the same whether the token was picked greedily or
sampled. Computed on the leader only for the rows that ask, one row's vocabulary at a time.

What they cannot cover yet: rows of other data-parallel replicas (their logits stay on their own
ranks: such requests are refused), and accepted drafts (a speculative step returns the logits of
its first new token only): a row that asks for logprobs does not draft, so each step gives it one
token and that token's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability, and its position's most likely tokens."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    """(token id, log-probability) of the N most likely tokens, most likely first."""


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """`token`'s log-probability under `logits` [V] and the `top` most likely tokens'."""
    logprobs = logits.float().log_softmax(dim=-1)
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]))
    return TokenLogprobs(float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist())))


def chunk_logprobs(chosen: torch.Tensor, top_logprobs: torch.Tensor, top_ids: torch.Tensor, count: int,
                   top: int) -> list[TokenLogprobs]:
    """A score step's outputs of one row ([W], [W, N], [W, N]) -> the entries of its first `count`
    positions (each of the token after it), with `top` alternatives each."""
    logprobs, values, ids = chosen[:count].tolist(), top_logprobs[:count, :top].tolist(), top_ids[:count, :top].tolist()
    return [TokenLogprobs(lp, tuple(zip(i, v))) for lp, i, v in zip(logprobs, ids, values)]
