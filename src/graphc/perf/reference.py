"""Layouts measured by others, described for the step model (graphc does not compile them).

NxD Inference's DeepSeek-V3 on one trn2.48xlarge (its `contrib/models/DeepSeek-V3` README): TP 64
at LNC 2, BF16 weights, batch 1, sequence 512; TPOT p50 20.5 ms, TTFT 1,667 ms for 256 input
tokens; a profile of ~63 % compute, ~16 % collectives, ~16 % memory, ~5 % stragglers. Its layout:
attention heads, the dense and shared FFNs and the vocabulary split 64 ways, the q_a / kv_a
projections and the router replicated (as graphc's tensor parallelism holds them), every one of
the 256 routed experts on every rank with its intermediate split 64 ways (expert tensor
parallelism); two all-reduces a layer over the 64 ranks (after attention, after the FFN) and an
all-gather of the logits. Its MoE (neuronx-distributed's `ExpertMLPsV2`): token generation loads
only the experts chosen (T x K / E below 1), context encoding runs the dropless blockwise GEMM in
blocks of 512 rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphc.buckets.selection import Bucket
from graphc.models.step_model import ModelArgs
from graphc.perf.step_time import RuntimeCollective, StepWork
from graphc.perf.work import Layout, step_work
from graphc.topology import Topology
from graphc.weights.abstract import stored_tensors

NXD_V3 = {"tpot_ms": 20.5, "ttft_ms": 1667.0, "prompt": 256, "sequence": 512,
          "shares": {"compute": 0.63, "collectives": 0.16, "memory": 0.16, "straggler": 0.05}}
"""NxD Inference's measured DeepSeek-V3 point (its contrib README), the step model's calibration."""

TP = 64


def nxd_v3_work(args: ModelArgs, checkpoint: Path, bucket: Bucket) -> StepWork:
    """A step of NxD Inference's DeepSeek-V3 layout (module docstring) on one of its 64 ranks:
    token generation for a decode bucket, context encoding for a prefill one."""
    tensors = stored_tensors(args, checkpoint, torch.bfloat16, as_stored=False, ep=1, tp=TP)
    decode = bucket.kind == "decode"
    layout = Layout(Topology(tp=TP), "gather" if decode else "blockwise", "local", etp=TP,
                    context_slots=NXD_V3["sequence"], block_size=1)
    tokens = bucket.rows * bucket.width
    hidden = tokens * args.hidden_size * 2
    calls = (RuntimeCollective("all_reduce", TP, "node", hidden, 2 * args.num_hidden_layers),
             RuntimeCollective("all_gather", TP, "node", bucket.rows * args.vocab_size // TP * 2, 1))
    return step_work(args, tensors, set(), layout, bucket, "bfloat16", 0, calls)
