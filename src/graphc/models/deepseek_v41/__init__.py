"""DeepSeek-V4.1 with Engram (V4's attention with shared KV and index sources, two-level top-k,
single-pass mHC, n-gram memory tables, the DSpark drafter): args, released layout, paged model,
eager reference, Engram, DSpark, preset and `graphc plan`'s predictions, and the family record that names them."""

from graphc.models.deepseek_v41 import layout, predictions, presets
from graphc.models.deepseek_v41.args import V41_ARCHITECTURE, check_loadable, is_v41_config, v41_args_from_hf_config
from graphc.models.deepseek_v41 import dspark
from graphc.models.deepseek_v41.dspark import DeepseekV41Drafting
from graphc.models.deepseek_v41.model import DeepseekV41, tensor_parallel_widths
from graphc.models.deepseek_v41.reference import DeepseekV41Reference
from graphc.models.drafter import Drafter
from graphc.models.family import (Family, Predictions, Reference, StoredLayout, Support, TensorParallelism,
                                  TinyCheckpoints)

FAMILY = Family(
    name="DeepSeek-V4.1",
    architectures=(V41_ARCHITECTURE,),
    recognises=is_v41_config,
    args_from_hf_config=v41_args_from_hf_config,
    build_model=lambda args, local_experts, sparse_probabilities, tp=1:
        (DeepseekV41Drafting if args.draft_layers else DeepseekV41)(args, local_experts, tp),
    stored=StoredLayout(layout.released_sources, skips=layout.skips, keeps_fp32=layout.keeps_fp32,
                        row_sharded_tables=(layout.ENGRAM_TABLE,), ue8m0_scales=True,
                        fp8_quantised=layout.FP8_RELEASED, fp4_quantised=layout.FP4_RELEASED),
    tensor_parallel=TensorParallelism(layout.TENSOR_PARALLEL_DIMS, tensor_parallel_widths),
    # A V4.1 layer also takes the previous sublayer's pre-mix and the selections earlier layers
    # published: a layer alone is not a step.
    support=Support(data_parallel=False, check_loadable=check_loadable,
                    probe_refusal="graphc probe does not take DeepSeek-V4.1 layers yet (each depends on state "
                                  "earlier layers publish); use `graphc compare` against its reference"),
    reference=Reference(DeepseekV41Reference, "graphc's DeepSeek-V4.1 reference"),
    predictions=Predictions(predictions.attention_collectives, predictions.tensor_parallel_collectives,
                            predictions.engram_collectives),
    tiny=TinyCheckpoints(presets.PRESETS, layout.draft_and_vision_shapes, layout.serving_every_draft_stage,
                         {"scale_fmt": "ue8m0", "expert_dtype": "fp4"}),
    drafter=Drafter("dspark", dspark.draft, dspark.stage_args, served_layers=lambda args: args.dspark.stages,
                    check=dspark.check, passes=dspark.passes),
)
