"""DeepSeek-V4.1's released tensor names and graphc's paged model's (`model.py`).

The paged model keeps the released names under `model.` except where it shares DeepSeek-V3's MoE
modules: the routed experts stacked as `mlp.experts.gate_up_proj` [E, 2I, D] (each expert's `w1`
rows, then its `w3` rows) and `mlp.experts.down_proj` [E, D, I] (`w2`), the shared expert's
`w1 / w3 / w2` as `gate_proj / up_proj / down_proj`, the router's `bias` as
`e_score_correction_bias`; the embedding is `embed_tokens` and the head `lm_head` (as V4's). The eager reference
(`reference.py`) uses the released names as they are.
"""

from __future__ import annotations

import dataclasses
import re

from graphc.models.deepseek_v41.args import V41Args
from graphc.models.deepseek_v4.layout import MULTI_TOKEN_PREDICTION
from graphc.models.family import Sources

PAGED_TO_RELEASED = [  # a main layer's (`layers.i`) and a DSpark stage's (`mtp.s`) alike
    (r"^model\.(layers|mtp)\.(\d+)\.mlp\.shared_experts\.gate_proj\.", r"\1.\2.ffn.shared_experts.w1."),
    (r"^model\.(layers|mtp)\.(\d+)\.mlp\.shared_experts\.up_proj\.", r"\1.\2.ffn.shared_experts.w3."),
    (r"^model\.(layers|mtp)\.(\d+)\.mlp\.shared_experts\.down_proj\.", r"\1.\2.ffn.shared_experts.w2."),
    (r"^model\.(layers|mtp)\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"\1.\2.ffn.gate.bias"),
    (r"^model\.(layers|mtp)\.(\d+)\.mlp\.", r"\1.\2.ffn."),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^model\.", ""),
]
V41_FP32 = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|attn_sink|norm\.weight|gate\.bias|^head\.weight|"
                      r"compressor\.wgate\.weight)$")
"""DeepSeek-V4.1 parameters held in fp32 whatever the model dtype, as its inference code holds them
(and the compressor projections of layers pooling 2 or more tokens: `keeps_fp32`)."""
LAYER_INDEX = re.compile(r"^layers\.(\d+)\.")
ENGRAM_TABLE = "engram.embed.weight"
OUTSIDE_TEXT_MODEL = re.compile(r"^(vision|aligner)\.|^image_(start|end|newline)$|\.ffn\.gate\.bias_vl$")
"""DeepSeek-V4.1's vision path (its tower, image markers, the routers' image-token biases): a
text-only loader skips them."""
FP8_RELEASED = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.(experts\.\d+|shared_experts)"
                          r"\.w[123]|engram\.(wkv|embed))\.weight$")
"""The weights DeepSeek-V4.1's release quantises: FP8, the Engram tables with a scale per row and
32 columns, except the routed experts (`FP4_RELEASED`)."""
FP4_RELEASED = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
"""The routed experts' weights, which DeepSeek-V4.1's release stores as FP4 (`weights/fp4.py`)."""
TENSOR_PARALLEL_DIMS = (
    (re.compile(r"\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight|indexer\.wq_b\.weight|indexer\.weights_proj\.weight)$"), 0),
    (re.compile(r"\.attn\.wo_b\.weight$"), 1),
    (re.compile(r"\.mlp\.shared_experts\.(gate_proj|up_proj)\.weight$"), 0),
    (re.compile(r"\.mlp\.shared_experts\.down_proj\.weight$"), 1),
    (re.compile(r"^model\.embed_tokens\.weight$"), 1),
    (re.compile(r"^lm_head\.weight$"), 0),
)
"""The weights tensor parallelism splits (paged names), and along which dim: as V4's (query heads'
wq_b rows and sinks, the output groups' wo_a rows and wo_b columns, the index layers' indexer
heads, the shared expert), the embedding's columns and the LM head's rows; the shared K = V head,
compressors, index keys, mHC mixes, Engram and the router whole."""
STACKED = re.compile(r"^model\.(layers|mtp)\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
CONFIDENCE_HEAD = re.compile(r"^mtp\.\d+\.confidence_head\.")
"""DSpark's acceptance estimate, which graphc does not serve (`dspark.py`)."""
PROJECTIONS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
"""Each stacked expert parameter's released projections, concatenated along rows in this order."""


def _rename(name: str, rules: list[tuple[str, str]]) -> str:
    for pattern, replacement in rules:
        renamed, count = re.subn(pattern, replacement, name)
        if count:
            return renamed
    return name


def released_name(paged: str) -> str:
    """The released tensor of a paged parameter (not of a stacked expert parameter: `sources`)."""
    return _rename(paged, PAGED_TO_RELEASED)


def released_sources(args: V41Args, paged_names: list[str]) -> Sources:
    """Per paged parameter, its released tensors: one list per routed expert for a stacked one,
    else one list of one tensor."""
    out = {}
    for name in paged_names:
        stacked = STACKED.match(name)
        if stacked:
            kind, layer, fused = stacked.groups()
            experts = args.dspark.n_routed_experts if kind == "mtp" else args.n_routed_experts
            out[name] = [[f"{kind}.{layer}.ffn.experts.{e}.{w}.weight" for w in PROJECTIONS[fused]]
                         for e in range(experts)]
        else:
            out[name] = [[released_name(name)]]
    return out


def skips(name: str, args: V41Args) -> bool:
    """The MTP modules (`mtp.`) unless the model serves them (DSpark's stages; never their
    confidence head) and the vision path."""
    drafter = MULTI_TOKEN_PREDICTION.search(name)
    return bool(OUTSIDE_TEXT_MODEL.search(name)) or bool(drafter) and (not args.draft_layers or
                                                                       bool(CONFIDENCE_HEAD.search(name)))


def keeps_fp32(name: str, args: V41Args) -> bool:
    """By the released name (the reference's, or the paged model's mapped back)."""
    name = released_name(name)
    layer = LAYER_INDEX.match(name)
    pools = bool(layer) and args.compress_ratios[int(layer.group(1))] > 1
    return bool(V41_FP32.search(name)) or (pools and name.endswith("compressor.wkv.weight"))


def draft_and_vision_shapes(args: V41Args, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """What a V4.1 release stores that the model does not load: DSpark's confidence head (its
    stages are the served model's, `serving_every_draft_stage`), or where the config has no DSpark
    each MTP module as one more decoder layer's tensors under `mtp.`; the image tokens' router bias."""
    if args.dspark is None:
        out = {f"mtp.{mtp}." + n.removeprefix("layers.0."): shape for mtp in range(args.num_nextn_predict_layers)
               for n, shape in shapes.items() if n.startswith("layers.0.")}
    else:
        out = {f"mtp.{args.dspark.stages - 1}.confidence_head.proj.weight": (1, args.hidden_size
                                                                              + args.dspark.markov_rank)}
    out.update({f"layers.{i}.ffn.gate.bias_vl": (args.n_routed_experts,) for i in range(args.num_hidden_layers)})
    return out


def serving_every_draft_stage(args: V41Args) -> V41Args:
    """The args of a model serving all of DSpark's stages (those without DSpark: as they are)."""
    return args if args.dspark is None else dataclasses.replace(args, draft_layers=args.dspark.stages)
