"""DeepSeek-V4 (shared K = V attention with sinks, CSA / HCA compressed entries, mHC streams,
hash-routed layers): args, both checkpoint layouts, model, preset and `graphc plan`'s
predictions, and the family record that names them."""

from graphc.errors import GraphcError
from graphc.models.deepseek_v4 import layout, predictions, presets
from graphc.models.deepseek_v4.args import HASH_MOE, V4_ARCHITECTURE, V4Args, is_v4_config, v4_args_from_hf_config
from graphc.models.deepseek_v4.model import DeepseekV4, tensor_parallel_widths
from graphc.models.family import Family, Predictions, StoredLayout, Support, TensorParallelism, TinyCheckpoints
from graphc.models.speculation import mtp_drafter


def _check_exchange(args: V4Args, exchange: str) -> None:
    if HASH_MOE in args.mlp_layer_types and exchange == "ag_rs":
        raise GraphcError("model.moe_lowering: ag_rs routes the tokens it gathers, but DeepSeek-V4's hash-routed "
                          "layers choose experts by token id at the source: use a2a_even or a2a_v (or keep the "
                          "static MoE)")


FAMILY = Family(
    name="DeepSeek-V4",
    architectures=(V4_ARCHITECTURE,),
    recognises=is_v4_config,
    args_from_hf_config=v4_args_from_hf_config,
    build_model=lambda args, local_experts, sparse_probabilities, tp=1: DeepseekV4(args, local_experts, tp),
    stored=StoredLayout(layout.released_sources, skips=layout.skips, keeps_fp32=layout.keeps_fp32,
                        stored_sources=layout.stored_sources, stored_stacked=layout.stored_stacked,
                        index_tensors=layout.INDEX_TENSORS, fp8_quantised=layout.FP8_RELEASED,
                        fp4_quantised=layout.FP4_RELEASED),
    tensor_parallel=TensorParallelism(layout.TENSOR_PARALLEL_DIMS, tensor_parallel_widths),
    support=Support(data_parallel=False, check_exchange=_check_exchange),
    drafter=mtp_drafter(predictions.draft_layer),
    predictions=Predictions(predictions.attention_collectives, predictions.tensor_parallel_collectives),
    tiny=TinyCheckpoints(presets.PRESETS, draft_and_extra_shapes=layout.draft_shapes),
)
