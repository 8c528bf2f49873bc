"""lower_matvecs: linear layers of at most MAX_ROWS rows become fp32 multiply-and-sum reductions (one per row)
with the same outputs; larger ones (batched decode, prefill) stay linear."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.passes.lower_matvecs import MAX_ROWS, lower_matvecs, matvec_linear
from graphc.passes.verifier import verify
from support import captured, copy_program, run_program
from passes_support import context


def _linears(program) -> int:
    return Counter(n.target for n in program.graph.nodes)[torch.ops.aten.linear.default]


@pytest.mark.parametrize("bucket", [Bucket("decode", 1), Bucket("decode", MAX_ROWS)])
def test_small_linears_become_reductions_with_the_same_outputs(bucket, tiny_checkpoints):
    model, program = captured(tiny_checkpoints["lora-groups"], bucket)
    before = copy_program(program)
    assert _linears(program) > 0

    result = lower_matvecs(program.graph_module, context(bucket))

    assert result.modified and _linears(program) == 0
    assert Counter(n.target for n in program.graph.nodes)[torch.ops.aten.sum.dim_IntList] >= _linears(before)
    verify(result.graph_module, context(bucket))
    (tokens, logits), pool = run_program(program, model, bucket)
    (tokens_before, logits_before), pool_before = run_program(before, model, bucket)
    assert tokens.tolist() == tokens_before.tolist()
    assert ((logits - logits_before).abs().max() / logits_before.abs().max()).item() < 1e-5
    torch.testing.assert_close(pool, pool_before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bucket", [Bucket("prefill", MAX_ROWS + 1), Bucket("decode", MAX_ROWS + 1)])
def test_larger_linears_stay_and_the_one_row_lm_head_goes(bucket, tiny_checkpoints):
    _, program = captured(tiny_checkpoints["lora-groups"], bucket)
    rows = {n.name: n.args[0].meta["val"].shape[:-1].numel() for n in program.graph.nodes
            if n.target is torch.ops.aten.linear.default}
    small = sum(r <= MAX_ROWS for r in rows.values())
    assert small == (1 if bucket.kind == "prefill" else 0)  # a prefill's LM head reads its last token only
    assert lower_matvecs(program.graph_module, context(bucket)).modified == bool(small)
    assert _linears(program) == len(rows) - small


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matvec_linear_equals_linear_with_fp32_accumulation(dtype):
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=g).to(dtype) for shape in ((2, 3, 64), (48, 64), (48,)))
    out = matvec_linear(x, weight, bias)
    assert out.shape == (2, 3, 48) and out.dtype == dtype
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(dtype)  # one rounding, at the end
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
