"""How DeepSeek-V4 checkpoints name their tensors.

graphc's parameter names are transformers' `DeepseekV4ForCausalLM` module names (routed experts
stacked: `model.layers.N.mlp.experts.gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]). Checkpoints
come in two layouts, both read through the renames of transformers' conversion mapping for
`deepseek_v4` (`graphc_name`), so whatever transformers loads, graphc loads the same way:
- *released* (DeepSeek's checkpoints): no `model.` prefix, `embed` / `head`, `layers.N.attn.*`
  (`wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`, `wo_a`, `wo_b`, `attn_sink`, `compressor.{wkv,
  wgate, ape, norm}`, `indexer.{wq_b, weights_proj, compressor.*}`), `layers.N.ffn.*` (`gate.bias`,
  `gate.tid2eid`, `experts.E.w1/w2/w3`, `shared_experts.w1/w2/w3`), `attn_norm` / `ffn_norm`,
  `hc_attn_{fn,base,scale}` / `hc_ffn_*`, `hc_head_{fn,base,scale}`; the multi-token-prediction
  modules under `mtp.i.`: a decoder layer's tensors named as a layer's, and `e_proj`, `h_proj`,
  `enorm`, `hnorm`, `norm`, `hc_head_{fn,base,scale}` (graphc's `model.mtp.i.`: `final_norm` is
  its `norm`; transformers does not load them).
- *transformers* (`save_pretrained`): the same renames reversed where they are not anchored, under
  `model.` (`model.layers.N.attn.norm.weight`, `model.embed_tokens.weight`, `head.weight`, ...).
`released_name` writes the released layout (graphc's tiny checkpoints); transformers loading what
it writes tests it against the conversion mapping.

FP8: in the released layout the attention projections and the experts' weights may be
float8_e4m3fn with `weight_scale_inv` block scales (weights/fp8.py); the compressor and indexer
projections stay in full precision, as DeepSeek ships them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from graphc.errors import CheckpointError
from graphc.models.deepseek_v4.args import MOE, V4Args
from graphc.models.family import Sources
from graphc.models.layers import STACKED_EXPERT

FP32_SUFFIXES = ("norm.weight", "hc.fn", "hc.base", "hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
                 "sinks", "position_bias", "e_score_correction_bias", "mlp.gate.weight")
"""Parameters that stay fp32 whatever the model dtype, as DeepSeek and transformers keep them."""

RELEASED_EXPERT_WEIGHTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
"""Each stacked expert parameter's released per-expert weights, concatenated along rows in order."""

MULTI_TOKEN_PREDICTION = re.compile(r"(^|\.)mtp\.(\d+)\.")
"""Tensors of the MTP modules, in either layout (group 2: the module)."""

INDEX_TENSORS = ("tid2eid",)
"""Integer tensors (the hash layers' token -> experts tables)."""

TENSOR_PARALLEL_DIMS = (
    (re.compile(r"\.self_attn\.(q_b_proj\.weight|sinks|o_a_proj\.weight)$"), 0),
    (re.compile(r"\.self_attn\.o_b_proj\.weight$"), 1),
    (re.compile(r"\.compressor\.indexer\.(q_b_proj|scorer\.weights_proj)\.weight$"), 0),
    (re.compile(r"\.mlp\.shared_experts\.(gate_proj|up_proj)\.weight$"), 0),
    (re.compile(r"\.mlp\.shared_experts\.down_proj\.weight$"), 1),
    (re.compile(r"^model\.embed_tokens\.weight$"), 1),
    (re.compile(r"^lm_head\.weight$"), 0),
)
"""The weights tensor parallelism splits (graphc names), and along which dim: the query heads'
q_b rows and sinks, the output groups' o_a rows and o_b columns, CSA's indexer heads (q_b rows,
scorer rows), the shared experts' gate and up rows and down columns, the embedding's columns and
the LM head's rows. The shared K = V projection, the compressors, the mHC mixes, the norms and
the router are held whole."""

_WHOLE_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_FORWARD_RENAMES = [  # transformers' conversion mapping, applied in order (after any `model.` prefix)
    (r"^mtp\.(\d+)\.norm\.", r"mtp.\1.final_norm."),  # graphc's own two: the MTP modules'
    (r"\.hc_head_(fn|base|scale)$", r".hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
PER_EXPERT = re.compile(r"^(model\.(?:layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")
"""A released per-expert weight, after the renames."""

_RENAMES = [  # released_name's: the forward renames' inverse, applied in order to a layer parameter's name
    (r"^model\.layers\.", "layers."),
    (r"^model\.mtp\.(\d+)\.final_norm\.", r"mtp.\1.norm."),
    (r"^model\.mtp\.(\d+)\.hc_head\.hc_(fn|base|scale)$", r"mtp.\1.hc_head_\2"),
    (r"^model\.mtp\.", "mtp."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
]

FP8_RELEASED = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|"
                          r"ffn\.(experts\.\d+|shared_experts)\.w[123]|e_proj|h_proj)\.weight$")
"""The released weights DeepSeek's FP8 checkpoints quantise."""
FP4_RELEASED = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
"""Of those, the routed experts' weights, which DeepSeek-V4-Flash stores as FP4 (its config.json's
`expert_dtype: fp4`; V4-Flash-Base keeps them FP8)."""


def released_name(name: str) -> str:
    """The released name of a graphc (transformers) parameter that is not a stacked expert."""
    if name in _WHOLE_NAMES:
        return _WHOLE_NAMES[name]
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def released_expert_weights(experts_prefix: str, fused: str, experts: int) -> list[list[str]]:
    """The released per-expert weights of graphc's stacked `{experts_prefix}.{fused}`, one list per
    expert in stacking order (`experts_prefix`: `model.layers.N.mlp.experts`)."""
    prefix = released_name(experts_prefix + ".").removesuffix(".")
    return [[f"{prefix}.{e}.{w}.weight" for w in RELEASED_EXPERT_WEIGHTS[fused]] for e in range(experts)]


def graphc_name(stored: str) -> str:
    """The graphc parameter a stored tensor belongs to (a per-expert weight keeps its
    `experts.E.wN.weight` tail: `PER_EXPERT`)."""
    name = stored.removeprefix("model.")
    for pattern, replacement in _FORWARD_RENAMES:
        name = re.sub(pattern, replacement, name)
    return name if name == "lm_head.weight" else "model." + name


def parameter_sources(stored: Iterable[str], routed_experts: int) -> tuple[dict[str, list[list[str]]], list[str]]:
    """Which stored tensors make each graphc parameter.

    Returns:
        sources: per parameter, its tensors: one list per routed expert (in `RELEASED_EXPERT_WEIGHTS`
            order) for a stacked parameter stored per expert, else one list of one tensor.
        missing: per-expert tensors a stacked parameter lacks (named as stored).

    Raises:
        CheckpointError: two stored tensors map to the same parameter.
    """
    sources: dict[str, list[list[str]]] = {}
    per_expert: dict[str, dict[tuple[int, str], str]] = {}
    for name in sorted(stored):
        target = graphc_name(name)
        expert = PER_EXPERT.match(target)
        if expert:
            prefix, index, weight = expert.groups()
            fused = "down_proj" if weight == "w2" else "gate_up_proj"
            per_expert.setdefault(f"{prefix}.{fused}", {})[int(index), weight] = name
            continue
        if target in sources:
            raise CheckpointError(f"tensors {sources[target][0][0]} and {name} are both {target}; a checkpoint "
                                  "holds each parameter once")
        sources[target] = [[name]]
    missing = []
    for target, found in per_expert.items():
        order = RELEASED_EXPERT_WEIGHTS[target.rsplit(".", 1)[1]]
        example = next(iter(found.values()))
        wanted = [[(e, w) for w in order] for e in range(routed_experts)]
        missing += [re.sub(r"experts\.\d+\.w\d", f"experts.{e}.{w}", example)
                    for expert in wanted for e, w in expert if (e, w) not in found]
        sources[target] = [[found.get(key, "") for key in expert] for expert in wanted]
    return sources, missing


def released_sources(args: V4Args, parameters: list[str]) -> Sources:
    """Per graphc parameter, its tensors in the released layout."""
    sources = {}
    for name in parameters:
        stacked = STACKED_EXPERT.match(name)
        sources[name] = (released_expert_weights(*stacked.groups(), args.n_routed_experts) if stacked
                         else [[released_name(name)]])
    return sources


def stored_sources(args: V4Args, parameters: list[str], stored: set[str]) -> tuple[Sources, list[str], list[str]]:
    """(sources, missing, unexpected) of a checkpoint in either layout (`parameter_sources`)."""
    sources, missing = parameter_sources(stored, args.n_routed_experts)
    missing += [released_name(n) for n in parameters if n not in sources]
    unexpected = sorted(n for target, groups in sources.items() if target not in parameters for parts in groups
                        for n in parts)
    return {name: groups for name, groups in sources.items() if name in parameters}, missing, unexpected


def stored_stacked(stored: str) -> bool:
    """transformers' layout may store a layer's routed experts as one stacked tensor."""
    return bool(STACKED_EXPERT.match(graphc_name(stored)))


def skips(name: str, args: V4Args) -> bool:
    """The MTP modules not served as the draft (`V4Args.draft_layers`)."""
    module = MULTI_TOKEN_PREDICTION.search(name)
    return bool(module) and int(module.group(2)) >= args.draft_layers


def keeps_fp32(name: str, args: V4Args) -> bool:
    return name.endswith(FP32_SUFFIXES)


def draft_shapes(args: V4Args, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The MTP modules' tensors, under `mtp.i.`, given the main layers' `shapes`: the attention
    half of a main layer of the module's kind, the FFN half of a score-routed one, and its own
    projections, norms and stream head."""
    def half(kinds: tuple[str, ...], kind: str, prefixes: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
        if kind not in kinds:
            raise CheckpointError(f"config.json: no main layer is {kind}, the MTP module's kind; graphc takes its "
                                  "tensors' shapes from one")
        layer = f"layers.{kinds.index(kind)}."
        return {n.removeprefix(layer): shape for n, shape in shapes.items()
                if n.startswith(layer) and n.removeprefix(layer).startswith(prefixes)}

    hidden, out = args.hidden_size, {}
    for module, kind in enumerate(args.draft_layer_types):
        tensors = {**half(args.layer_types, kind, ("attn.", "attn_norm.", "hc_attn_")),
                   **half(args.mlp_layer_types, MOE, ("ffn.", "ffn_norm.", "hc_ffn_")),
                   "e_proj.weight": (hidden, hidden), "h_proj.weight": (hidden, hidden), "enorm.weight": (hidden,),
                   "hnorm.weight": (hidden,), "norm.weight": (hidden,),
                   **{f"hc_head_{part}": shapes[f"hc_head_{part}"] for part in ("fn", "base", "scale")}}
        out.update({f"mtp.{module}.{name}": shape for name, shape in tensors.items()})
    return out
