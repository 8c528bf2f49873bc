"""DeepSeek-V3 and V3.2 (MLA, V3.2's lightning indexer and sparse attention): args, HF layout,
model, presets and `graphc plan`'s predictions, and the family record that names them."""

from graphc.models.deepseek_v3 import layout, predictions, presets
from graphc.models.deepseek_v3.args import V3_ARCHITECTURE, V32_ARCHITECTURE, is_v3_config, v3_args_from_hf_config
from graphc.models.deepseek_v3.model import DeepseekV3, tensor_parallel_widths
from graphc.models.family import Family, Predictions, StoredLayout, TensorParallelism, TinyCheckpoints
from graphc.models.speculation import mtp_drafter

FAMILY = Family(
    name="DeepSeek-V3 / V3.2",
    architectures=(V3_ARCHITECTURE, V32_ARCHITECTURE),
    recognises=is_v3_config,
    args_from_hf_config=v3_args_from_hf_config,
    build_model=DeepseekV3,
    stored=StoredLayout(layout.released_sources, skips=layout.is_multi_token_prediction, keeps_fp32=layout.keeps_fp32,
                        fp8_quantised=layout.FP8_QUANTISED),
    tensor_parallel=TensorParallelism(layout.TENSOR_PARALLEL_DIMS, tensor_parallel_widths),
    drafter=mtp_drafter(predictions.draft_layer),
    predictions=Predictions(predictions.attention_collectives, predictions.tensor_parallel_collectives),
    tiny=TinyCheckpoints(presets.PRESETS, draft_and_extra_shapes=layout.draft_shapes),
)
