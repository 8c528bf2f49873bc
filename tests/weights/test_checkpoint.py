"""`graphc.weights.checkpoint.load_model` and the config reader: what loads, what is refused, and why.

Every refusal is a `CheckpointError` whose message names the offending tensor, file, shape, dtype
or architecture. Checkpoints are copied into `tmp_path` before being modified; the session
fixtures' directories are never touched.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphc.errors import CheckpointError, GraphcError
from graphc.weights.hf_config import read_hf_config
from graphc.models.registry import model_args_from_hf_config
from graphc.models import deepseek_v3
from graphc.weights.checkpoint import expected_tensors, load_model
from graphc.models.registry import load_model_args
from graphc.models.deepseek_v3.layout import FP32_SUFFIXES, hf_tensor_names, is_multi_token_prediction
from graphc.models.layers import rope_inverse_frequencies
from graphc.weights.tiny import PRESETS, preset_config

PRESET = "lora-groups"
MLA_PRESETS = tuple(deepseek_v3.FAMILY.tiny.presets)
YARN_PRESETS = ["direct-q-yarn", "yarn-mscale"]
# Names present in the lora-groups preset (layer 0 dense, layers 1..2 MoE, 8 experts).
ATTN_WEIGHT = "model.layers.1.self_attn.q_a_proj.weight"
EXPERT_WEIGHT = "model.layers.1.mlp.experts.3.up_proj.weight"


# --- helpers -------------------------------------------------------------------------------------


def _copy(src: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _write_config(path: Path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _update_config(path: Path, **changes) -> None:
    _write_config(path, {**_config(path), **changes})


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_tensors(path: Path, edit) -> None:
    tensors = _tensors(path)
    edit(tensors)
    _save(path, tensors)


def _raises(path: Path, *fragments: str, dtype: torch.dtype = torch.float32):
    """Assert `load_model(path)` raises a CheckpointError naming every fragment (in order)."""
    pattern = ".*".join(re.escape(f) for f in fragments)
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_model(path, dtype=dtype)
    return info.value


def _mtp_layer(path: Path) -> int:
    return _config(path)["num_hidden_layers"]


@pytest.fixture
def ckpt(tiny_checkpoints, tmp_path) -> Path:
    """A private, modifiable copy of the default preset's checkpoint."""
    return _copy(tiny_checkpoints[PRESET], tmp_path)


@pytest.fixture(scope="module")
def reference_model(tiny_checkpoints):
    """The default preset loaded unmodified in fp32 (read-only in the tests)."""
    return load_model(tiny_checkpoints[PRESET])


# --- loading what is stored ------------------------------------------------------------------------


@pytest.mark.parametrize("preset", MLA_PRESETS)  # V4's: tests/models/deepseek_v4/
def test_every_preset_loads_with_stored_values(preset, tiny_checkpoints):
    path = tiny_checkpoints[preset]
    config = preset_config(preset)
    stored = _tensors(path)
    model = load_model(path)
    params = dict(model.named_parameters())
    state = model.state_dict()

    assert len(model.model.layers) == config["num_hidden_layers"]
    assert not model.training

    attn = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    torch.testing.assert_close(params[attn], stored[attn], rtol=0, atol=0)
    q = "model.layers.0.self_attn.q_proj.weight" if config["q_lora_rank"] is None else ATTN_WEIGHT.replace(".1.", ".0.")
    torch.testing.assert_close(params[q], stored[q], rtol=0, atol=0)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        torch.testing.assert_close(state[name], stored[name], rtol=0, atol=0)

    moe = config["first_k_dense_replace"]  # first MoE layer
    experts = config["n_routed_experts"]
    def per_expert(proj):
        return [stored[f"model.layers.{moe}.mlp.experts.{e}.{proj}.weight"] for e in range(experts)]

    # Stored as the graphs read them: gate and up fused per expert, gate rows first.
    fused = {"gate_up_proj": [torch.cat(pair) for pair in zip(per_expert("gate_proj"), per_expert("up_proj"))],
             "down_proj": per_expert("down_proj")}
    for param, parts in fused.items():
        stacked = f"model.layers.{moe}.mlp.experts.{param}"
        projections = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
        assert hf_tensor_names(stacked, experts) == [f"model.layers.{moe}.mlp.experts.{e}.{proj}.weight"
                                                     for e in range(experts) for proj in projections]
        torch.testing.assert_close(params[stacked], torch.stack(parts), rtol=0, atol=0)
    bias = f"model.layers.{moe}.mlp.gate.e_score_correction_bias"
    torch.testing.assert_close(state[bias], stored[bias], rtol=0, atol=0)


def test_every_stored_main_tensor_is_loaded(tiny_checkpoints, reference_model):
    """All of the state dict, stacked experts unstacked, equals the file (nothing left at init)."""
    stored = _tensors(tiny_checkpoints[PRESET])
    args = reference_model.args
    for name, value in reference_model.state_dict().items():
        names = hf_tensor_names(name, args.n_routed_experts)
        # Stacked experts: per-expert projections in order, fused ones (gate, up) adjacent.
        expected = torch.stack([stored[n] for n in names]).view(value.shape) if len(names) > 1 else stored[names[0]]
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)


def test_expected_tensors_matches_the_stored_main_layers(tiny_checkpoints):
    path = tiny_checkpoints[PRESET]
    args = load_model_args(path)
    stored = {n: tuple(t.shape) for n, t in _tensors(path).items()}
    main = {n: s for n, s in stored.items() if not is_multi_token_prediction(n, args)}
    assert expected_tensors(args) == main


# --- multi-token prediction --------------------------------------------------------------------------


def test_mtp_layer_is_stored_and_skipped(tiny_checkpoints):
    path = tiny_checkpoints[PRESET]
    config = _config(path)
    layers = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    args = load_model_args(path)
    mtp = [n for n in _tensors(path) if n.startswith(f"model.layers.{layers}.")]
    assert f"model.layers.{layers}.eh_proj.weight" in mtp
    assert f"model.layers.{layers}.self_attn.q_a_proj.weight" in mtp
    assert all(is_multi_token_prediction(n, args) for n in mtp)
    assert not is_multi_token_prediction(f"model.layers.{layers - 1}.input_layernorm.weight", args)
    assert not is_multi_token_prediction(f"model.layers.{layers + 1}.input_layernorm.weight", args)
    assert not is_multi_token_prediction("model.embed_tokens.weight", args)
    assert len(load_model(path).model.layers) == layers


def test_mtp_layer_is_unexpected_when_config_has_no_mtp(ckpt):
    layer = _mtp_layer(ckpt)
    _update_config(ckpt, num_nextn_predict_layers=0)
    _raises(ckpt, "unexpected tensor(s)", f"model.layers.{layer}.")


def test_mtp_layer_is_unexpected_when_config_omits_the_field(ckpt):
    layer = _mtp_layer(ckpt)
    config = _config(ckpt)
    del config["num_nextn_predict_layers"]
    _write_config(ckpt, config)
    _raises(ckpt, "unexpected tensor(s)", f"model.layers.{layer}.")


def test_layer_beyond_the_mtp_range_is_unexpected(ckpt):
    beyond = f"model.layers.{_mtp_layer(ckpt) + 1}.input_layernorm.weight"

    def add(tensors):
        tensors[beyond] = torch.ones(64)

    _edit_tensors(ckpt, add)
    _raises(ckpt, "unexpected tensor(s)", beyond)


# --- bad tensors ---------------------------------------------------------------------------------------


def test_missing_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop(ATTN_WEIGHT))
    _raises(ckpt, "missing tensor(s)", ATTN_WEIGHT)


def test_missing_expert_is_named_by_its_hf_name(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop(EXPERT_WEIGHT))
    _raises(ckpt, "missing tensor(s)", EXPERT_WEIGHT)


def test_missing_lm_head_when_untied_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    _raises(ckpt, "missing tensor(s)", "lm_head.weight")


def test_many_missing_tensors_are_summarised(ckpt):
    def drop_layer_two(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            del tensors[name]

    _edit_tensors(ckpt, drop_layer_two)
    error = _raises(ckpt, "missing tensor(s)", "model.layers.2.", "more)")
    assert re.search(r"\(and \d+ more\)", str(error))


def test_unexpected_tensor_is_named(ckpt):
    extra = "model.layers.1.self_attn.rotary_emb.inv_freq"

    def add(tensors):
        tensors[extra] = torch.ones(4)

    _edit_tensors(ckpt, add)
    _raises(ckpt, "unexpected tensor(s)", extra)


def test_wrong_shape_names_tensor_and_both_shapes(ckpt):
    shape = tuple(_tensors(ckpt)[ATTN_WEIGHT].shape)  # (48, 64)

    def reshape(tensors):
        tensors[ATTN_WEIGHT] = torch.zeros(shape[0], shape[1] + 1)

    _edit_tensors(ckpt, reshape)
    _raises(ckpt, "model.safetensors", ATTN_WEIGHT, f"[{shape[0]}, {shape[1] + 1}]", f"[{shape[0]}, {shape[1]}]")


def test_wrong_expert_shape_names_the_expert(ckpt):
    shape = tuple(_tensors(ckpt)[EXPERT_WEIGHT].shape)

    def reshape(tensors):
        tensors[EXPERT_WEIGHT] = torch.zeros(shape[0] * 2, shape[1])

    _edit_tensors(ckpt, reshape)
    _raises(ckpt, EXPERT_WEIGHT, f"[{shape[0] * 2}, {shape[1]}]", f"[{shape[0]}, {shape[1]}]")


def test_int_tensor_in_place_of_a_float_weight_names_the_dtype(ckpt):
    def to_int(tensors):
        tensors[ATTN_WEIGHT] = tensors[ATTN_WEIGHT].to(torch.int32)

    _edit_tensors(ckpt, to_int)
    _raises(ckpt, ATTN_WEIGHT, "dtype torch.int32", "float32, bfloat16, float16")


def test_bf16_and_fp16_stored_tensors_are_accepted(ckpt):
    def lower(tensors):
        tensors[ATTN_WEIGHT] = tensors[ATTN_WEIGHT].to(torch.bfloat16)
        tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float16)

    _edit_tensors(ckpt, lower)
    stored = _tensors(ckpt)
    model = load_model(ckpt)
    assert model.lm_head.weight.dtype == torch.float32
    torch.testing.assert_close(dict(model.named_parameters())[ATTN_WEIGHT], stored[ATTN_WEIGHT].float(), rtol=0, atol=0)


def test_unsupported_load_dtype_is_refused(tiny_checkpoints):
    with pytest.raises(CheckpointError, match=r"dtype torch\.float64 is not supported"):
        load_model(tiny_checkpoints[PRESET], dtype=torch.float64)


# --- config and directory ------------------------------------------------------------------------------


def test_a_v3_checkpoint_labelled_v32_is_refused_naming_the_indexer_tensors(ckpt):
    _write_config(ckpt, {**_config(ckpt), "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"})
    _raises(ckpt, "missing tensor(s)", "model.layers.0.self_attn.indexer.k_norm.bias")


@pytest.mark.parametrize(("changes", "message"), [
    ({"q_lora_rank": None}, "the indexer (index_* fields) needs q_lora_rank"),
    ({"index_head_dim": 8}, "index_head_dim (8) must exceed qk_rope_head_dim (8)"),
    ({"index_topk": 0}, "config.json: index_topk is 0; expected an integer >= 1"),
    ({"mlp_layer_types": ["sparse", "sparse", "sparse"]}, "mlp_layer_types ['sparse', 'sparse', 'sparse'] is not "
                                                           "supported; graphc runs first_k_dense_replace (1) dense"),
    ({"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
     "layer_types ['full_attention', 'indexed_attention'] is not supported"),
])
def test_impossible_v32_configs_are_refused(changes, message):
    config = {**preset_config("v32"), **changes}
    with pytest.raises(CheckpointError, match=re.escape(message)):
        model_args_from_hf_config(config)


@pytest.mark.parametrize(
    ("architectures", "model_type", "named"),
    [
        (["DeepseekV2ForCausalLM"], "deepseek_v2", "DeepseekV2ForCausalLM"),
        (["LlamaForCausalLM"], "llama", "LlamaForCausalLM"),
        (None, "deepseek_v2", "model_type 'deepseek_v2'"),
    ],
)
def test_unsupported_architecture_is_refused_by_name(ckpt, architectures, model_type, named):
    config = {**_config(ckpt), "model_type": model_type}
    if architectures is None:
        del config["architectures"]
    else:
        config["architectures"] = architectures
    _write_config(ckpt, config)
    _raises(ckpt, "config.json", f"architecture {named} is not supported", "DeepseekV3ForCausalLM")


def test_model_type_alone_is_enough(ckpt):
    config = _config(ckpt)
    del config["architectures"]
    _write_config(ckpt, config)
    assert len(load_model(ckpt).model.layers) == config["num_hidden_layers"]


def test_missing_checkpoint_dir(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match=rf"checkpoint dir '{re.escape(str(missing))}' does not exist"):
        load_model(missing)


def test_dir_without_config(ckpt):
    (ckpt / "config.json").unlink()
    _raises(ckpt, str(ckpt / "config.json"), "missing", "needs config.json")


def test_dir_without_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    _raises(ckpt, f"checkpoint dir {str(ckpt)!r}", "no model.safetensors and no model.safetensors.index.json")


def test_invalid_json_config(ckpt):
    (ckpt / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"],')
    _raises(ckpt, str(ckpt / "config.json"), "not valid JSON")


def test_missing_required_config_field_is_named(ckpt):
    config = _config(ckpt)
    del config["kv_lora_rank"]
    _write_config(ckpt, config)
    _raises(ckpt, "config.json: missing required field(s) kv_lora_rank")


def test_inconsistent_config_is_refused(ckpt):
    _update_config(ckpt, num_experts_per_tok=9)
    _raises(ckpt, "config.json", "num_experts_per_tok (9) must be <= n_routed_experts (8)")


def test_the_config_reader_errors_are_graphc_errors(tmp_path):
    with pytest.raises(GraphcError):
        read_hf_config(tmp_path / "nowhere")


# --- sharded checkpoints --------------------------------------------------------------------------------


def _shard(path: Path) -> list[str]:
    """Split model.safetensors into two shards + index, as transformers' save_pretrained writes them."""
    tensors = _tensors(path)
    names = sorted(tensors)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for shard, half in zip(shards, halves):
        save_file({n: tensors[n] for n in half}, path / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in half})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "model.safetensors").unlink()
    return shards


def test_sharded_checkpoint_loads_identically(ckpt, reference_model):
    shards = _shard(ckpt)
    # The shards really split the main layers (each holds some of layer 1, say).
    for shard in shards:
        assert load_file(ckpt / shard)
    model = load_model(ckpt)
    ours, ref = model.state_dict(), reference_model.state_dict()
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=0, msg=name)


def test_sharded_checkpoint_with_missing_shard_names_it(ckpt):
    shards = _shard(ckpt)
    (ckpt / shards[1]).unlink()
    _raises(ckpt, "model.safetensors.index.json", f"shard {shards[1]!r} is missing")


def test_sharded_index_without_weight_map(ckpt):
    _shard(ckpt)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    _raises(ckpt, "model.safetensors.index.json", "no 'weight_map' object")


def test_sharded_wrong_shape_names_the_shard(ckpt):
    shards = _shard(ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][ATTN_WEIGHT]
    tensors = load_file(ckpt / shard)
    tensors[ATTN_WEIGHT] = torch.zeros(3, 3)
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    assert shard in shards
    _raises(ckpt, f"{shard}: tensor {ATTN_WEIGHT} has shape [3, 3]")


# --- tied embeddings --------------------------------------------------------------------------------------


def test_tied_embeddings_share_the_embedding(ckpt):
    _update_config(ckpt, tie_word_embeddings=True)
    _edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    embedding = _tensors(ckpt)["model.embed_tokens.weight"]
    model = load_model(ckpt)
    torch.testing.assert_close(model.lm_head.weight, embedding, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, model.model.embed_tokens.weight, rtol=0, atol=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tied_embeddings_do_not_expect_lm_head(ckpt):
    args = model_args_from_hf_config({**_config(ckpt), "tie_word_embeddings": True})
    assert "lm_head.weight" not in expected_tensors(args)
    assert "model.embed_tokens.weight" in expected_tensors(args)


# --- dtype and device ---------------------------------------------------------------------------------------


def _is_router(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_load_keeps_router_fp32_on_cpu_without_meta(tiny_checkpoints, dtype):
    path = tiny_checkpoints[PRESET]
    stored = _tensors(path)
    model = load_model(path, dtype=dtype, device="cpu")
    assert model.dtype == dtype
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    routers = [n for n in [*params, *buffers] if _is_router(n)]
    moe_layers = range(1, _config(path)["num_hidden_layers"])
    assert sorted(routers) == sorted(
        f"model.layers.{i}.mlp.gate.{p}" for i in moe_layers for p in ("weight", "e_score_correction_bias")
    )
    for name, tensor in [*params.items(), *buffers.items()]:
        assert not tensor.is_meta, name
        assert tensor.device == torch.device("cpu"), name
    for name, tensor in params.items():
        assert tensor.dtype == (torch.float32 if _is_router(name) else dtype), name
    for name, tensor in buffers.items():
        # The router's correction bias and RoPE's inverse frequencies are the only buffers; both fp32.
        assert name.endswith(("e_score_correction_bias", "inv_freq")), name
        assert tensor.dtype == torch.float32, name
    # Values: fp32 for the router exactly as stored, the rest rounded once.
    gate = "model.layers.1.mlp.gate.weight"
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    torch.testing.assert_close(params[gate], stored[gate], rtol=0, atol=0)
    torch.testing.assert_close(buffers[bias], stored[bias], rtol=0, atol=0)
    torch.testing.assert_close(params[ATTN_WEIGHT], stored[ATTN_WEIGHT].to(dtype), rtol=0, atol=0)


def test_fp32_load_has_no_meta_tensors(reference_model):
    for name, tensor in [*reference_model.named_parameters(), *reference_model.named_buffers()]:
        assert not tensor.is_meta, name
        assert tensor.device == torch.device("cpu"), name
        assert tensor.dtype == torch.float32, name


# --- RoPE / YaRN against transformers -------------------------------------------------------------------------


def _released_config(preset: str) -> dict:
    """The preset as a released DeepSeek config.json: `rope_scaling` with `type`, top-level `rope_theta`.

    A deep copy, so transformers' in-place rope standardisation cannot leak into the presets.
    """
    config = copy.deepcopy(preset_config(preset))
    if "rope_scaling" in config:
        for key in ("rope_theta", "rope_type"):
            config["rope_scaling"].pop(key, None)
    return config


def _hf_config(preset: str):
    from transformers import DeepseekV3Config

    # transformers standardises rope_scaling in place (adds rope_theta/rope_type): give it a copy.
    config = _released_config(preset)
    return DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype")})


@pytest.mark.parametrize("preset", YARN_PRESETS)
def test_yarn_frequencies_and_attention_factor_match_transformers(preset, tiny_checkpoints):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = load_model_args(tiny_checkpoints[preset])
    assert args.rope.yarn_factor == _released_config(preset)["rope_scaling"]["factor"]
    hf = _hf_config(preset)
    assert hf.rope_parameters["rope_type"] == "yarn"
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    inv_freq, factor = rope_inverse_frequencies(args.rope, args.qk_rope_head_dim)
    assert inv_freq.shape == (args.qk_rope_head_dim // 2,)
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)
    # The loaded model carries the same frequencies and factor.
    model = load_model(tiny_checkpoints[preset])
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert model.model.rotary_emb.attention_factor == pytest.approx(hf_factor, rel=1e-12)


def test_yarn_mscale_preset_has_a_non_unit_attention_factor(tiny_checkpoints):
    args = load_model_args(tiny_checkpoints["yarn-mscale"])
    _, factor = rope_inverse_frequencies(args.rope, args.qk_rope_head_dim)
    assert factor != pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("preset", YARN_PRESETS + ["lora-groups"])
def test_softmax_scale_matches_transformers(preset, tiny_checkpoints):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    args = load_model_args(tiny_checkpoints[preset])
    hf = _hf_config(preset)
    expected = yarn_apply_mscale(hf.rope_parameters, args.qk_head_dim**-0.5)
    assert args.softmax_scale == pytest.approx(expected, rel=1e-12)
    if preset in YARN_PRESETS:
        assert args.softmax_scale > args.qk_head_dim**-0.5 * 1.01  # the mscale**2 correction applied
    else:
        assert args.softmax_scale == args.qk_head_dim**-0.5


def test_default_rope_frequencies_match_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    args = model_args_from_hf_config(_released_config("lora-groups"))
    hf_inv_freq, hf_factor = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(_hf_config("lora-groups"))
    inv_freq, factor = rope_inverse_frequencies(args.rope, args.qk_rope_head_dim)
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == hf_factor == 1.0


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_released_deepseek_config_and_transformers5_config_give_the_same_rope(preset, tmp_path):
    released = _released_config(preset)  # rope_scaling {"type": "yarn", ...} + top-level rope_theta
    hf = _hf_config(preset)
    hf.architectures = ["DeepseekV3ForCausalLM"]
    hf.save_pretrained(tmp_path)  # transformers 5 writes rope_parameters with the theta inside
    written = _config(tmp_path)
    assert "rope_parameters" in written and "rope_scaling" not in written
    # A hand-written transformers-5 form: rope_type only, theta only inside rope_parameters.
    pure = {k: v for k, v in released.items() if k not in ("rope_scaling", "rope_theta")}
    scaling = {k: v for k, v in released.get("rope_scaling", {}).items() if k != "type"}
    pure["rope_parameters"] = {**scaling, "rope_type": "yarn" if scaling else "default",
                               "rope_theta": released["rope_theta"]}

    expected = model_args_from_hf_config(released).rope
    assert model_args_from_hf_config(written).rope == expected
    assert model_args_from_hf_config(pure).rope == expected
    if "rope_scaling" in released:
        assert expected.yarn_factor == released["rope_scaling"]["factor"]
        assert expected.yarn_original_max_position == released["rope_scaling"]["original_max_position_embeddings"]
    else:
        assert expected.yarn_factor is None
    assert expected.interleave == released["rope_interleave"]


def test_rope_theta_is_read_from_either_place():
    base = _released_config("direct-q-yarn")
    released = {**base, "rope_theta": 50000.0}
    scaling = {k: v for k, v in base["rope_scaling"].items() if k != "type"}
    new = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {**scaling, "rope_type": "yarn", "rope_theta": 50000.0}
    assert model_args_from_hf_config(released).rope.theta == 50000.0
    assert model_args_from_hf_config(new).rope == model_args_from_hf_config(released).rope


def test_unsupported_rope_type_is_named(ckpt):
    _update_config(ckpt, rope_scaling={"type": "dynamic", "factor": 2.0})
    _raises(ckpt, "config.json: rope type 'dynamic' is not supported")


# --- malformed files must surface as CheckpointError (errors.py: anything else is a bug) ---------------


def test_sharded_index_with_invalid_json(ckpt):
    _shard(ckpt)
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {')
    _raises(ckpt, "model.safetensors.index.json", "not valid JSON")


def test_index_naming_a_tensor_its_shard_lacks(ckpt):
    _shard(ckpt)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][ATTN_WEIGHT]
    tensors = load_file(ckpt / shard)
    del tensors[ATTN_WEIGHT]
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    _raises(ckpt, shard, ATTN_WEIGHT)


def test_corrupt_safetensors_file_is_named(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    _raises(ckpt, "model.safetensors")


def test_config_json_that_is_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[]")
    _raises(ckpt, "config.json")


def test_architectures_as_a_string_is_named_whole(ckpt):
    _update_config(ckpt, architectures="LlamaForCausalLM", model_type="llama")
    _raises(ckpt, "architecture LlamaForCausalLM is not supported")


def test_preset_config_does_not_share_nested_dicts():
    config = preset_config("direct-q-yarn")
    assert config["rope_scaling"] is not PRESETS["direct-q-yarn"]["rope_scaling"]
