"""`Drafter`: how a family's draft layers propose tokens in speculative decoding, in one record the
family owns (`Family.drafter`). Code outside the family asks it, never names a method: the config
checks a model.yaml against it, the step graph drafts with it (`speculation.speculative_step`),
`graphc plan` counts its passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import Tensor

    from graphc.models.step_model import ModelArgs
    from graphc.topology import Topology


def _accepts(*_) -> None:
    return None


def _one_layer(args: "ModelArgs") -> int:
    return 1


def _one_token_at_a_time(args: "ModelArgs", tokens: int, rows: int, k: int) -> list[tuple[int, int]]:
    return [(tokens, rows)] + [(rows, rows)] * (k - 1)


@dataclass(frozen=True)
class Drafter:
    """One way of drafting: its name in model.yaml, its part of the step graph, what it serves and
    what `graphc plan` counts of it."""

    method: str
    """model.yaml's `model.speculative.method` for it."""
    draft: Callable[..., "Tensor"]
    """(model, k, hidden [B, W, D], input_ids [B, W], step: `StepInputs`, kept_until [B, 1] (each
    row's last accepted position), picked [B, 1] (its next token)) -> the row's next k drafts
    [B, k], inside the step graph."""
    layer: Callable[["ModelArgs"], "ModelArgs"]
    """The draft layers as the args of a model of their own, whose collectives are theirs (`graphc
    plan`)."""
    served_layers: Callable[["ModelArgs"], int] = _one_layer
    """How many of the checkpoint's draft layers the model serves (`args.draft_layers`)."""
    check: Callable[["ModelArgs", int, "Topology"], None] = _accepts
    """(args, k, topology): raises `GraphcError` naming the model.yaml field (`model.speculative.tokens`,
    `topology.ep`, ...) that the checkpoint's draft layers cannot take."""
    passes: Callable[["ModelArgs", int, int, int], list[tuple[int, int]]] = _one_token_at_a_time
    """(args, tokens, rows, k) -> its passes in a step of `rows` rows and `tokens` tokens, as (tokens
    through the draft layers, rows through the LM head); by default an MTP layer's: over every
    token, then k - 1 times more over one token a row."""

