"""Each tensor-parallel rank loads its slice of every split weight and the whole of the others:
FP8 kept as stored (its scales sliced with it) or dequantised on load, the slices side by side
are the one-rank model's weights, bit for bit."""

from __future__ import annotations

import pytest
import torch

from graphc.weights.checkpoint import QUANTIZED_WEIGHTS, load_model
from graphc.models.registry import family_of
from graphc.weights.tensor_shard import TensorShard
from graphc.ops.dequantize import dequantize_reference


def _weights(model) -> dict[str, torch.Tensor]:
    """Every parameter as the model computes with it (kept FP8 / FP4 dequantised with its scales)."""
    buffers, out = dict(model.named_buffers()), {}
    for name, parameter in model.named_parameters():
        quantized = getattr(model, QUANTIZED_WEIGHTS).get(name)
        if quantized is None:
            out[name] = parameter.float()
        else:  # as the step graph dequantises it (V4.1's FP4 experts unpacked too)
            out[name] = dequantize_reference(parameter, buffers[quantized.scale], *quantized.block, torch.float32)
    return out


@pytest.mark.parametrize("preset, tp", [("lora-groups", 2), ("lora-groups", 4), ("v32", 2), ("v32", 4),
                                        ("v4", 2), ("v41", 2)])  # V4's and V4.1's 2 output groups: tp <= 2
@pytest.mark.parametrize("as_stored", [True, False])
def test_the_ranks_slices_side_by_side_are_the_one_rank_weights(fp8_checkpoints, preset, as_stored, tp):
    checkpoint = fp8_checkpoints[preset]
    whole = _weights(load_model(checkpoint, as_stored=as_stored))
    ranks = [_weights(load_model(checkpoint, as_stored=as_stored, tp_shard=TensorShard(r, tp))) for r in range(tp)]
    split_dim = family_of(load_model(checkpoint).args).tensor_parallel_dim
    split = 0
    for name, weight in whole.items():
        dim = split_dim(name)
        joined = torch.cat([rank[name] for rank in ranks], dim=dim) if dim is not None else ranks[0][name]
        assert torch.equal(joined, weight), name
        if dim is None:
            assert all(torch.equal(rank[name], weight) for rank in ranks), name
        split += dim is not None
    assert split >= 10  # the attention, FFN, embedding and head projections, not a few
