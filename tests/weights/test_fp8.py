"""FP8 block-quantised checkpoints (DeepSeek's release format): exact dequantisation, including
ragged edge blocks, and loading a tiny FP8 checkpoint made by `make-tiny --fp8-block` (compiled with its
weights kept as stored: test_weights_as_stored.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphc.errors import CheckpointError
from graphc.weights.checkpoint import check_checkpoint, load_model
from graphc.models.deepseek_v3.layout import FP8_QUANTISED
from graphc.weights.fp8 import FP8, FP8_MAX, SCALE_SUFFIX, dequantize, quantize
from graphc.weights.tiny import make_tiny_checkpoint

BLOCK = 32  # the tiny matrices (48, 64, 128 wide) then span several blocks, some ragged


def direct_dequantize(weight, scale_inv, block):
    """Element by element: W[i, j] = W_q[i, j] * scale_inv[i // br, j // bc]."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = weight[i, j].float() * scale_inv[i // block[0], j // block[1]]
    return out


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((129, 257), (128, 128)), ((128, 128), (128, 128)),
                                          ((1, 1), (128, 128)), ((5, 130), (4, 64)), ((48, 64), (32, 32))])
def test_dequantize_equals_the_direct_computation(shape, block):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale_inv = torch.rand(grid, generator=g) * 1e-2 + 1e-4
    assert torch.equal(dequantize(weight, scale_inv, block), direct_dequantize(weight, scale_inv, block))


def test_quantize_maps_each_blocks_largest_magnitude_to_fp8_max_and_round_trips_within_fp8_precision():
    weight = torch.randn(70, 45, generator=torch.Generator().manual_seed(1))
    weight[:32, :16] = 0  # an all-zero block keeps scale 1
    quantized, scale_inv = quantize(weight, (32, 16))
    assert quantized.dtype == FP8 and scale_inv.shape == (3, 3) and scale_inv[0, 0] == 1
    blocks = quantized.float()
    for bi in range(3):
        for bj in range(3):
            tile = blocks[bi * 32:(bi + 1) * 32, bj * 16:(bj + 1) * 16]
            assert tile.abs().max() == (0 if (bi, bj) == (0, 0) else FP8_MAX)
    restored = dequantize(quantized, scale_inv, (32, 16))
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus subnormal steps near zero
    assert ((restored - weight).abs() <= weight.abs() * 2**-4 + scale_inv.max() * 2**-9).all()


def test_scales_that_do_not_tile_the_weight_are_refused():
    with pytest.raises(ValueError, match=r"scales \[2, 2\] do not tile a weight of \[300, 200\] in \[128, 128\] "
                                         r"blocks; expected \[3, 2\]"):
        dequantize(torch.zeros(300, 200).to(FP8), torch.ones(2, 2), (128, 128))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt", fp8_block=BLOCK)


def test_make_tiny_stores_the_release_layout(fp8_checkpoint):
    stored = load_file(fp8_checkpoint / "model.safetensors")
    config = json.loads((fp8_checkpoint / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [BLOCK, BLOCK]}
    quantised = [n for n in stored if FP8_QUANTISED.match(n)]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in quantised and "model.layers.0.self_attn.q_a_proj.weight" in quantised
    for name in quantised:
        assert stored[name].dtype == FP8 and stored[name + SCALE_SUFFIX].dtype == torch.float32
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert stored[name].dtype == torch.float32 and name + SCALE_SUFFIX not in stored


def test_loading_dequantises_every_weight_exactly(fp8_checkpoint):
    stored = load_file(fp8_checkpoint / "model.safetensors")
    params = dict(load_model(fp8_checkpoint).named_parameters())
    q_a = params["model.layers.1.self_attn.q_a_proj.weight"]  # [48, 64]: a ragged row of blocks
    expected = direct_dequantize(stored["model.layers.1.self_attn.q_a_proj.weight"],
                                 stored["model.layers.1.self_attn.q_a_proj.weight" + SCALE_SUFFIX], (BLOCK, BLOCK))
    assert torch.equal(q_a, expected)
    intermediate = params["model.layers.1.mlp.experts.down_proj"].shape[-1]
    expert = params["model.layers.1.mlp.experts.gate_up_proj"][3, intermediate:]  # expert 3's up rows
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(expert, dequantize(stored[name], stored[name + SCALE_SUFFIX], (BLOCK, BLOCK)))
    assert torch.equal(params["lm_head.weight"], stored["lm_head.weight"])


def test_an_fp8_checkpoint_generates_as_its_dequantised_fp32_copy(fp8_checkpoint, tmp_path):
    from graphc.tools.generate import PagedKV, generate

    stored = load_file(fp8_checkpoint / "model.safetensors")
    plain = {n: dequantize(t, stored[n + SCALE_SUFFIX], (BLOCK, BLOCK)) if t.dtype == FP8 else t
             for n, t in stored.items() if not n.endswith(SCALE_SUFFIX)}
    copy = tmp_path / "dequantised"
    copy.mkdir()
    config = json.loads((fp8_checkpoint / "config.json").read_text())
    del config["quantization_config"]
    (copy / "config.json").write_text(json.dumps(config))
    save_file(plain, copy / "model.safetensors")
    prompts = [[3, 1, 4, 1, 5, 9], [2, 6]]
    runs = [generate(load_model(path), prompts, max_new_tokens=8, kv=PagedKV(4, 64), prefill_chunk=8)
            for path in (fp8_checkpoint, copy)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("break_it, says", [
    (lambda t, c: t.pop("model.layers.1.self_attn.q_a_proj.weight" + SCALE_SUFFIX),
     r"tensor model\.layers\.1\.self_attn\.q_a_proj\.weight is float8_e4m3fn but .*weight_scale_inv is missing"),
    (lambda t, c: c.pop("quantization_config"),
     r"config\.json: the checkpoint holds FP8 scales \(_scale_inv\) but quantization_config is missing"),
    (lambda t, c: t.__setitem__("model.layers.1.self_attn.q_a_proj.weight" + SCALE_SUFFIX, torch.ones(1, 1)),
     r"model\.layers\.1\.self_attn\.q_a_proj\.weight_scale_inv: scales \[1, 1\] do not tile a weight of \[48, 64\]"),
    (lambda t, c: t.__setitem__("model.norm.weight" + SCALE_SUFFIX, torch.ones(1)),
     r"model\.norm\.weight_scale_inv scales model\.norm\.weight, which is stored as torch\.float32, not float8"),
    (lambda t, c: t.__setitem__("model.layers.1.self_attn.bogus.weight" + SCALE_SUFFIX, torch.ones(1, 1)),
     r"scale tensor\(s\) of no expected weight: model\.layers\.1\.self_attn\.bogus\.weight_scale_inv"),
])
def test_broken_fp8_checkpoints_are_refused_from_the_headers_naming_the_tensor(fp8_checkpoint, tmp_path, break_it,
                                                                              says):
    broken = shutil.copytree(fp8_checkpoint, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    config = json.loads((broken / "config.json").read_text())
    break_it(tensors, config)
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=says):
        check_checkpoint(broken)  # what `graphc validate` runs, and `load_model` first
