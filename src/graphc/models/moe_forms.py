"""Which formulation of the routed experts a step uses: a pure rule shared by the model (its
eager default), the compiler (one form per bucket, recorded in the manifest) and `graphc plan`.

Torch-free, so `graphc plan` stays arithmetic.
"""

from __future__ import annotations

MOE_FORMS = ("dense", "gather", "grouped")
"""The routed experts' static-shape formulations (`deepseek_v3.RoutedExperts` describes each);
all give the same values up to fp32 rounding."""

MOE_FORM_CHOICES = ("auto", *MOE_FORMS)
"""What model.yaml's `model.moe_form` accepts: `auto` applies `moe_form_for` per bucket."""


def moe_form_for(rows: int, experts_per_token: int, local_experts: int) -> str:
    """The cheapest form for `rows` tokens entering a rank's `local_experts` (E') experts.

    The cost that bounds a step on a memory-bound device is the expert weight bytes it reads.
    `gather` reads one expert per route: R*K reads, no sort. `grouped` reads each local expert
    that has routes once, at most min(E', R*K), but sorts the routes and runs one GEMM per
    expert, which costs more than the gather's fused loop while the routes are few (measured
    in bench/bench_scale.py). `dense` reads all E' and computes every expert on every row.
    So `gather` while R*K <= E' (it reads no more than one pass over the rank's experts), else
    `grouped`. `dense` is never chosen: it is the reference.
    """
    return "gather" if rows * experts_per_token <= local_experts else "grouped"


def step_moe_form(choice: str, tokens: int, experts_per_token: int, experts: int, ep: int,
                  tokens_replicated: bool) -> str:
    """The form of a step of `tokens` tokens on one rank: `choice` itself, or for `auto` the
    rule's pick for the rows that reach the rank's experts (its own tokens when they are
    replicated over the EP group or ep = 1; the whole group's, ep * tokens, after a dispatch)."""
    if choice != "auto":
        return choice
    rows = tokens if tokens_replicated or ep == 1 else tokens * ep
    return moe_form_for(rows, experts_per_token, experts // ep)
