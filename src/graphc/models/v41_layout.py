"""DeepSeek-V4.1's released tensor names and graphc's paged model's (`deepseek_v41`).

The paged model keeps the released names under `model.` except where it shares DeepSeek-V3's MoE
modules: the routed experts stacked as `mlp.experts.gate_up_proj` [E, 2I, D] (each expert's `w1`
rows, then its `w3` rows) and `mlp.experts.down_proj` [E, D, I] (`w2`), the shared expert's
`w1 / w3 / w2` as `gate_proj / up_proj / down_proj`, the router's `bias` as
`e_score_correction_bias`; the embedding is `embed_tokens` and the head `lm_head` (as V4's). The eager reference
(`deepseek_v41_reference`) uses the released names as they are.
"""

from __future__ import annotations

import re

RELEASED_TO_PAGED = [
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w1\.", r"model.layers.\1.mlp.shared_experts.gate_proj."),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w3\.", r"model.layers.\1.mlp.shared_experts.up_proj."),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w2\.", r"model.layers.\1.mlp.shared_experts.down_proj."),
    (r"^layers\.(\d+)\.ffn\.gate\.bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (r"^layers\.(\d+)\.ffn\.", r"model.layers.\1.mlp."),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^(?!model\.|lm_head\.)", "model."),
]
PAGED_TO_RELEASED = [
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.", r"layers.\1.ffn.shared_experts.w1."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.", r"layers.\1.ffn.shared_experts.w3."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.", r"layers.\1.ffn.shared_experts.w2."),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"layers.\1.ffn.gate.bias"),
    (r"^model\.layers\.(\d+)\.mlp\.", r"layers.\1.ffn."),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^model\.", ""),
]
STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
PROJECTIONS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
"""Each stacked expert parameter's released projections, concatenated along rows in this order."""


def _rename(name: str, rules: list[tuple[str, str]]) -> str:
    for pattern, replacement in rules:
        renamed, count = re.subn(pattern, replacement, name)
        if count:
            return renamed
    return name


def paged_name(released: str) -> str:
    return _rename(released, RELEASED_TO_PAGED)


def released_name(paged: str) -> str:
    """The released tensor of a paged parameter (not of a stacked expert parameter: `sources`)."""
    return _rename(paged, PAGED_TO_RELEASED)


def sources(paged_names: list[str], experts: int) -> dict[str, list[list[str]]]:
    """Per paged parameter, its released tensors: one list per routed expert for a stacked one,
    else one list of one tensor (`checkpoint.Sources`)."""
    out = {}
    for name in paged_names:
        stacked = STACKED.match(name)
        if stacked:
            layer, fused = stacked.groups()
            out[name] = [[f"layers.{layer}.ffn.experts.{e}.{w}.weight" for w in PROJECTIONS[fused]]
                         for e in range(experts)]
        else:
            out[name] = [[released_name(name)]]
    return out
