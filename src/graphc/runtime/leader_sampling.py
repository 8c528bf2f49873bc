"""Rows the leader samples itself: those with penalties or logit bias (`graphc.runtime.penalties`)
or a grammar (`graphc.runtime.constraints`). The step's program samples every row from the
model's own distribution; for these rows the leader takes the row's logits from the step,
applies the penalties, sets the tokens the grammar forbids to -inf, and draws with the very
sampler the programs run (`graphc.ops.sampler`) and the row's own noise seed, so the row samples
as the program would from the adjusted distribution. The program's token for the row is
replaced. Rows that use none of these never reach here: they cost nothing more.
"""

from __future__ import annotations

from graphc.runtime.penalties import penalised_logits
from graphc.sampling import SEED_STRIDE


def leader_token(logits, request, output: list[int]) -> int:
    """The token `request`'s row draws at this step from `logits` [V], given its output so far
    (the grammar, if any, takes it)."""
    import torch

    from graphc.ops.sampler import sample

    adjusted = logits.float()
    if request.penalties is not None:
        adjusted = penalised_logits(adjusted, request.penalties, request.prompt, output)
    if request.constraint is not None:
        adjusted = adjusted.masked_fill(~request.constraint.allowed(), float("-inf"))
    sampling = request.sampling
    token = int(sample(adjusted[None], torch.tensor([sampling.temperature], dtype=torch.float32),
                       torch.tensor([sampling.top_k]), torch.tensor([sampling.top_p], dtype=torch.float32),
                       torch.tensor([sampling.seed * SEED_STRIDE + len(output)]))[0])
    if request.constraint is not None:
        request.constraint.take(token)
    return token
