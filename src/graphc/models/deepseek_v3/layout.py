"""DeepSeek-V3 / V3.2's checkpoint layout (HF's): graphc's names are the stored names but the
routed experts', which graphc stacks (`layers.STACKED_EXPERT`) from one tensor per expert and
projection."""

from __future__ import annotations

import re

from graphc.models.deepseek_v3.args import V3Args
from graphc.models.family import Sources
from graphc.models.layers import STACKED_EXPERT

FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "self_attn.indexer.weights_proj.weight")
"""Parameters that stay fp32 whatever the model dtype, as DeepSeek (and transformers) keep them:
the router, and the indexer's per-head weights."""
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
FP8_QUANTISED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?(?!weights_proj)(\w+_proj|kv_a_proj_with_mqa|wq_b|wk)\.weight$")
"""The weights DeepSeek's FP8 releases quantise: the decoder layers' linear projections (the
indexer's too, but not its per-head weights, which stay in full precision)."""
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
"""What an MTP layer stores that is the main model's own (DeepSeek-V3 shares the embedding and the
output head with its MTP modules, report section 2.2): a served MTP layer reads the main model's."""
MTP_EXTRA_TENSORS = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                     "shared_head.norm.weight", "shared_head.head.weight")
"""What an MTP layer stores beside a decoder layer's tensors."""

TENSOR_PARALLEL_DIMS = (
    (re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj|indexer\.wq_b|indexer\.weights_proj)\.weight$"), 0),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), 1),
    (re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$"), 0),
    (re.compile(r"\.mlp\.(shared_experts\.)?down_proj\.weight$"), 1),
    (re.compile(r"^model\.embed_tokens\.weight$"), 1),
    (re.compile(r"^lm_head\.weight$"), 0),
)
"""The weights tensor parallelism splits, and along which dim: the per-head rows of the q, kv and
indexer up-projections and o_proj's per-head columns; the dense and shared FFNs' gate and up
rows and down columns; the embedding's hidden columns and the LM head's vocabulary rows. The
latent projections (q_a, kv_a), the indexer's key, the norms, the router and the routed experts
(split over ep instead) are held whole."""

EXPERT_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Each stacked expert parameter's checkpoint projections, concatenated along rows in this order."""


def hf_tensor_names(graphc_name: str, experts: int | range) -> list[str]:
    """The HF-layout DeepSeek-V3 tensor(s) that make up one graphc parameter, in stacking order
    (`experts`: how many routed experts, or which ones)."""
    stacked = STACKED_EXPERT.match(graphc_name)
    if stacked:
        prefix, fused = stacked.groups()
        return [f"{prefix}.{e}.{proj}.weight" for e in (range(experts) if isinstance(experts, int) else experts)
                for proj in EXPERT_PROJECTIONS[fused]]
    return [graphc_name]


def released_sources(args: V3Args, parameters: list[str]) -> Sources:
    sources = {}
    for name in parameters:
        stacked = STACKED_EXPERT.match(name)
        if stacked:
            parts = len(EXPERT_PROJECTIONS[stacked.group(2)])
            names = hf_tensor_names(name, args.n_routed_experts)
            sources[name] = [names[i:i + parts] for i in range(0, len(names), parts)]
        else:
            sources[name] = [[name]]
    return sources


def is_multi_token_prediction(name: str, args: V3Args) -> bool:
    """What a loader skips of the MTP modules, stored as layers num_hidden_layers ..
    num_hidden_layers + n - 1: those not served as the draft (`V3Args.draft_layers`), and the
    served one's copies of the embedding and head."""
    layer = LAYER_INDEX.match(name)
    if not layer or not args.num_hidden_layers <= int(layer.group(1)) < (
            args.num_hidden_layers + args.num_nextn_predict_layers):
        return False
    return int(layer.group(1)) >= args.num_hidden_layers + args.draft_layers or name.endswith(MTP_SHARED_COPIES)


def keeps_fp32(name: str, args: V3Args) -> bool:
    return name.endswith(FP32_SUFFIXES)


def draft_shapes(args: V3Args, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The MTP layers' tensors, given the main layers' `shapes`: each a full (MoE) decoder layer
    plus its own projections and head."""
    last, out = f"model.layers.{args.num_hidden_layers - 1}.", {}
    for mtp in range(args.num_nextn_predict_layers):
        prefix = f"model.layers.{args.num_hidden_layers + mtp}."
        out.update({prefix + name.removeprefix(last): shape for name, shape in shapes.items() if name.startswith(last)})
        d, v = args.hidden_size, args.vocab_size
        out.update({prefix + n: s for n, s in zip(MTP_EXTRA_TENSORS, [(v, d), (d,), (d,), (d, 2 * d), (d,), (v, d)])})
    return out
