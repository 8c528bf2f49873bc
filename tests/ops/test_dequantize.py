"""graphc::dequantize against the load-time dequantisation (weights/fp8.py) followed by the loader's
cast: the same bits, ragged edge blocks, stacked experts and row-wise scales included."""

from __future__ import annotations

import pytest
import torch

import graphc.ops  # noqa: F401  (registers the op)
from graphc.weights.fp8 import dequantize, quantize
from graphc.ops.dequantize import dequantize_reference


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((48, 64), (32, 32)), ((5, 130), (1, 64)),
                                          ((1, 1), (128, 128))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_dequantising_on_load_then_casting(shape, block, dtype):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    quantized, scale = quantize(weight, block)
    got = torch.ops.graphc.dequantize(quantized, scale, *block, dtype)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, dequantize(quantized, scale, block).to(dtype))


def test_stacked_experts_dequantise_each_expert_with_its_own_scales():
    g = torch.Generator().manual_seed(1)
    pairs = [quantize(torch.randn(40, 70, generator=g) * (e + 1), (16, 32)) for e in range(3)]
    weights, scales = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    got = dequantize_reference(weights, scales, 16, 32, torch.bfloat16)
    for e, (q, s) in enumerate(pairs):
        assert torch.equal(got[e], dequantize(q, s, (16, 32)).bfloat16())


def test_exports_as_one_node_with_its_block_and_dtype():
    class Dequantise(torch.nn.Module):
        def forward(self, weight, scale):
            return torch.ops.graphc.dequantize(weight, scale, 32, 32, torch.bfloat16) * 2

    quantized, scale = quantize(torch.randn(48, 64), (32, 32))
    program = torch.export.export(Dequantise(), (quantized, scale))
    nodes = [n for n in program.graph.nodes if n.target is torch.ops.graphc.dequantize.default]
    assert len(nodes) == 1 and nodes[0].args[2:] == (32, 32, torch.bfloat16)
    assert nodes[0].meta["val"].dtype == torch.bfloat16 and tuple(nodes[0].meta["val"].shape) == (48, 64)
