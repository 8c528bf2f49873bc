"""DeepSeek-V4: the tiny preset's features, both checkpoint layouts, the cache's chunk
independence, and the loader's errors. (Logits and greedy tokens against transformers, prefill +
decode against one forward, and bf16 against the noise floor run for every preset, v4 included:
test_model_vs_hf.py, test_bf16.py.)"""

from __future__ import annotations

import itertools
import json
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from graphc.errors import CheckpointError
from graphc.weights.checkpoint import check_checkpoint, expected_tensors, load_model
from graphc.models.registry import load_model_args
from graphc.models.deepseek_v4.model import DeepseekV4
from graphc.models.deepseek_v4.args import CSA, HASH_MOE, HCA, SLIDING, v4_args_from_hf_config
from graphc.models.deepseek_v4.layout import graphc_name, released_name
from graphc.models.step_model import Parallelism, StepInputs
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata
from support import load_hf

PROMPT = torch.randint(2, 256, (41,), generator=torch.Generator().manual_seed(11)).tolist()


def _logits(model: DeepseekV4, tokens: list[int], splits: list[int], block_size: int = 4) -> torch.Tensor:
    """[T, V] logits of `tokens` run as steps cut at `splits` over a fresh pool."""
    blocks = -(-len(tokens) // block_size)
    pool = model.new_kv_pool(blocks + 2, block_size)
    seq = SequenceBlocks(block_size)
    seq.reserve(len(tokens), BlockAllocator(blocks + 2))
    bounds = [0, *splits, len(tokens)]
    pieces = []
    with torch.no_grad():
        for start, end in itertools.pairwise(bounds):
            ids, positions, table, slots, _ = step_metadata([(seq, tokens[start:end], start)], end - start, blocks)
            pieces.append(model(ids, positions, table, slots, pool)[0])
    return torch.cat(pieces)


def test_the_preset_has_every_feature(tiny_checkpoints):
    path = tiny_checkpoints["v4"]
    args = load_model_args(path)
    assert set(args.layer_types) == {SLIDING, CSA, HCA}
    assert HASH_MOE in args.mlp_layer_types and "moe" in args.mlp_layer_types
    assert args.hc_mult == 4 and args.compress_rope.yarn_factor is not None
    # Short prompts close windows of both kinds and slide past the window; the indexer keeps
    # fewer entries than a 41-token prompt closes.
    assert max(args.csa_rate, args.hca_rate, args.sliding_window) * 2 < len(PROMPT)
    assert args.index_topk < len(PROMPT) // args.csa_rate
    stored = load_file(path / "model.safetensors")
    assert any(name.startswith("mtp.") for name in stored)
    for suffix in ("attn_sink", "compressor.ape", "hc_attn_base", "hc_head_base", "gate.bias"):
        values = torch.cat([t.flatten() for n, t in stored.items() if n.endswith(suffix) and not n.startswith("mtp.")])
        assert (values != 0).all() and values.unique().numel() == values.numel(), suffix
    for name, table in stored.items():
        if name.endswith("tid2eid"):
            assert all(len(set(row)) == len(row) for row in table.tolist()), name  # distinct experts per token
            assert table.unique().numel() == args.n_routed_experts


def test_both_layouts_load_the_same_model(tiny_checkpoints, tmp_path):
    released = tiny_checkpoints["v4"]
    load_hf(released).save_pretrained(tmp_path / "transformers")
    saved = load_file(tmp_path / "transformers" / "model.safetensors")
    assert "model.embed_tokens.weight" in saved and "embed.weight" not in saved  # really another layout
    ours, theirs = load_model(released), load_model(tmp_path / "transformers")
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(theirs.state_dict()[name], value, rtol=0, atol=0, msg=name)
    stored = load_file(released / "model.safetensors")
    gate_up = ours.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(gate_up.shape[0]):  # gate rows, then up rows, per expert
        expected = torch.cat([stored[f"layers.1.ffn.experts.{e}.w1.weight"], stored[f"layers.1.ffn.experts.{e}.w3.weight"]])
        torch.testing.assert_close(gate_up[e], expected, rtol=0, atol=0)
    assert ours.state_dict()["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(ours.state_dict()["model.layers.0.mlp.gate.tid2eid"], stored["layers.0.ffn.gate.tid2eid"])


def test_transformers_reads_every_released_name_graphc_writes(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["v4"], output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]


def test_released_names_round_trip(tiny_checkpoints):
    args = load_model_args(tiny_checkpoints["v4"])
    names = [name for name in expected_tensors(args) if not re.search(r"\.experts\.\d+\.", name)]
    assert len(names) > 50
    for name in names:
        assert released_name(graphc_name(name)) == name


@pytest.mark.parametrize("splits", [[4], [7, 8, 20], [13] + list(range(14, 40)), [1, 2, 3, 30]])
def test_chunked_steps_equal_one_forward(splits, tiny_checkpoints):
    """Chunks that end inside compressor windows and inside the sliding window, decode steps, and
    windows closed by a step's first or last token: every split gives the one-step logits."""
    model = load_model(tiny_checkpoints["v4"])
    full = _logits(model, PROMPT, [])
    chunked = _logits(model, PROMPT, splits)
    scale = full.abs().max().item()
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5 * scale)


def test_block_size_does_not_change_logits(tiny_checkpoints):
    model = load_model(tiny_checkpoints["v4"])
    small, large = _logits(model, PROMPT, [9], block_size=2), _logits(model, PROMPT, [9], block_size=16)
    torch.testing.assert_close(small, large, rtol=1e-5, atol=1e-5 * large.abs().max().item())


def test_compressed_entries_change_the_output(tiny_checkpoints):
    """The entries are attended to: with every layer sliding only, the logits past the first closed
    window differ (so the comparisons above test them)."""
    path = tiny_checkpoints["v4"]
    model = load_model(path)
    sliding = load_model(path)
    for layer in sliding.model.layers:
        layer.self_attn.kind = SLIDING
    ours, theirs = _logits(model, PROMPT, []), _logits(sliding, PROMPT, [])
    closes = min(load_model_args(path).csa_rate, load_model_args(path).hca_rate) - 1
    torch.testing.assert_close(ours[:closes], theirs[:closes], rtol=1e-5, atol=1e-5 * ours.abs().max().item())
    assert (ours[closes:] - theirs[closes:]).abs().amax(-1).min() > 1e-3


def _drop_an_expert(tensors):
    del tensors["layers.2.ffn.experts.5.w3.weight"]


def _float_token_table(tensors):
    tensors["layers.0.ffn.gate.tid2eid"] = tensors["layers.0.ffn.gate.tid2eid"].float()


def _expert_out_of_range(tensors):  # n_routed_experts is 8
    tensors["layers.1.ffn.gate.tid2eid"][3, 1] = 8


def _expert_twice(tensors):  # a token's two experts the same one
    table = tensors["layers.1.ffn.gate.tid2eid"]
    table[5, 1] = table[5, 0]


def _kv_norm_twice(tensors):  # the released and the save_pretrained names of one parameter
    tensors["model.layers.0.attn.norm.weight"] = tensors["layers.0.attn.kv_norm.weight"].clone()


@pytest.mark.parametrize("break_it, says", [
    (_drop_an_expert, r"missing tensor\(s\) layers\.2\.ffn\.experts\.5\.w3\.weight"),
    (_float_token_table, r"tid2eid has dtype torch.float32; supported: int64, int32"),
    (_kv_norm_twice, r"are both model\.layers\.0\.self_attn\.kv_norm\.weight"),
    (_expert_out_of_range, r"^model\.safetensors: tensor layers\.1\.ffn\.gate\.tid2eid names expert 8; expected routed "
                           r"experts 0\.\.7 \(n_routed_experts 8\)$"),
    (_expert_twice, r"^model\.safetensors: tensor layers\.1\.ffn\.gate\.tid2eid gives token 5 the experts \[\d+, \d+\], "
                    r"one of them twice; a token's experts must be distinct$"),
])
def test_a_broken_checkpoint_is_refused_by_name(break_it, says, tiny_checkpoints, tmp_path):
    path = shutil.copytree(tiny_checkpoints["v4"], tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    break_it(tensors)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=says):
        check_checkpoint(path)


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries; num_hidden_layers is 4"),
    ({"layer_types": ["full_attention"] * 4}, r"layer_types \['full_attention'\] unknown"),
    ({"num_key_value_heads": 2}, "num_key_value_heads is 2"),
    ({"o_groups": 3}, r"o_groups \(3\) must divide"),
    ({"layer_types": "sliding_attention"}, r"layer_types is 'sliding_attention'; expected a list of layer kinds"),
    ({"mlp_layer_types": [["moe"]] * 4}, r"mlp_layer_types is \[\['moe'\], .*expected a list of layer kinds"),
    ({"compress_rates": {"compressed_sparse_attention": "4"}}, r"compress_rates is .*expected \{kind: tokens"),
    ({"compress_ratios": [0, 4, -1, 128], "layer_types": None}, r"compress_ratios is \[0, 4, -1, 128\]; expected a list"),
    ({"sliding_window": 0}, r"sliding_window is 0; expected an integer >= 1"),
])
def test_bad_v4_configs_are_refused(change, message, tiny_checkpoints):
    config = {**json.loads((tiny_checkpoints["v4"] / "config.json").read_text()), **change}
    with pytest.raises(CheckpointError, match=message):
        v4_args_from_hf_config(config)


def test_released_config_fields_fold_like_transformers():
    """The legacy fields DeepSeek's configs ship (`compress_ratios`, `num_hash_layers`,
    `qk_rope_head_dim`) give what transformers' config derives from them."""
    from transformers import DeepseekV4Config

    legacy = {"vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 16,
              "index_topk": 4, "compress_ratios": [0, 4, 128], "num_hash_layers": 1, "qk_rope_head_dim": 8}
    ours = v4_args_from_hf_config({"architectures": ["DeepseekV4ForCausalLM"], **legacy})
    theirs = DeepseekV4Config(**legacy)
    assert list(ours.layer_types) == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.rope_head_dim == theirs.qk_rope_head_dim


def test_fp8_released_weights_load_dequantised(tmp_path):
    """DeepSeek's FP8 layout for V4: the attention projections and experts as float8_e4m3fn with
    block scales (dequantised exactly on load), the compressors' and indexer's in full precision."""
    from graphc.weights.fp8 import SCALE_SUFFIX, dequantize
    from graphc.weights.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "fp8", preset="v4", fp8_block=16)
    stored = load_file(path / "model.safetensors")
    quantised = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert "layers.0.attn.wq_b.weight" in quantised and "layers.1.ffn.experts.3.w2.weight" in quantised
    assert "layers.0.ffn.shared_experts.w1.weight" in quantised
    assert not [n for n in quantised if "compressor" in n or "indexer" in n]
    state = load_model(path).state_dict()
    wq_b = dequantize(stored["layers.0.attn.wq_b.weight"], stored["layers.0.attn.wq_b.weight" + SCALE_SUFFIX], (16, 16))
    torch.testing.assert_close(state["model.layers.0.self_attn.q_b_proj.weight"], wq_b, rtol=0, atol=0)
    down = dequantize(stored["layers.1.ffn.experts.3.w2.weight"], stored["layers.1.ffn.experts.3.w2.weight" + SCALE_SUFFIX],
                      (16, 16))
    torch.testing.assert_close(state["model.layers.1.mlp.experts.down_proj"][3], down, rtol=0, atol=0)
    torch.testing.assert_close(state["model.layers.0.self_attn.compressor.kv_proj.weight"],
                               stored["layers.0.attn.compressor.wkv.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("preset, backend, topology, options, says", [
    ("v4", "export", {"dp": 2, "cp": 1, "ep": 2}, [], r"^topology\.dp: 2; DeepseekV4ForCausalLM is served with dp = 1"),
    ("v41", "neuron", {"dp": 2, "cp": 1, "ep": 2}, [], r"^topology\.dp: 2; DeepseekV41ForCausalLM is served with dp = 1"),
    ("v4", "export", {"cp": 2, "ep": 2}, ["--disable-pass", "static_moe"],
     r"^model\.moe_lowering: ag_rs routes the tokens it gathers, but DeepSeek-V4's hash-routed layers"),
])
def test_what_v4_cannot_compile_yet_is_refused_before_any_work(preset, backend, topology, options, says, tmp_path,
                                                               tiny_checkpoints):
    import yaml
    from click.testing import CliRunner

    from graphc.cli import cli
    from support import TEST_BUCKETS, model_yaml

    config = {**model_yaml(tiny_checkpoints[preset], TEST_BUCKETS["small"], backend), "topology": topology}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["compile", str(tmp_path / "model.yaml"), "-o", str(tmp_path / "out"), *options])
    assert result.exit_code == 2, result.output
    assert re.search(says, result.stderr.removeprefix("error: ")) and result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def _draft_logits(model: DeepseekV4, tokens: list[int], next_ids: list[int], splits: list[int],
                  block_size: int = 4) -> torch.Tensor:
    """[T, V] the MTP module's logits at every position of `tokens` (token i + 1 at i: `next_ids`),
    run as steps cut at `splits` over a fresh pool, as speculative decoding runs it."""
    blocks = -(-len(tokens) // block_size)
    pool = model.new_kv_pool(blocks + 2, block_size)
    seq = SequenceBlocks(block_size)
    seq.reserve(len(tokens), BlockAllocator(blocks + 2))
    pieces = []
    with torch.no_grad():
        for start, end in itertools.pairwise([0, *splits, len(tokens)]):
            ids, positions, table, slots, _ = step_metadata([(seq, tokens[start:end], start)], end - start, blocks)
            step = StepInputs(positions, table, slots, pool, Parallelism())
            hidden = model.final_hidden(ids, step)
            pieces.append(model.draft_logits(model.draft_hidden(hidden, torch.tensor([next_ids[start:end]]), step))[0])
    return torch.cat(pieces)


@pytest.mark.parametrize("splits", [[], [7, 8, 20]])
def test_the_mtp_module_predicts_as_deepseeks_reference(splits, tiny_checkpoints, tmp_path):
    """The served MTP module against DeepSeek's `MTPBlock` built from the checkpoint by
    transformers: a model of L + 1 layers reading `mtp.0`'s layer tensors as layer L (through
    transformers' own renames) and its stream head and norm as the final ones, layer L's input
    replaced (a pre-hook) by MTPBlock's: e_proj(enorm(embed(token i + 1))) added to every stream
    of h_proj(hnorm(streams)). Both give, at each position i, the logits of token i + 2."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["v4"]
    ours = load_model(path, checked=check_checkpoint(path, draft_layers=1))
    layers, eps = ours.args.num_hidden_layers, ours.args.rms_norm_eps
    stored = load_file(path / "model.safetensors")
    mixing = {name: stored.pop(f"mtp.0.{name}.weight") for name in ("e_proj", "h_proj", "enorm", "hnorm")}
    for name in [n for n in stored if n.startswith("mtp.0.")]:
        tail = name.removeprefix("mtp.0.")
        target = tail if tail.startswith(("hc_head_", "norm.")) else f"layers.{layers}.{tail}"
        stored[target] = stored.pop(name)
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=layers + 1, num_nextn_predict_layers=0,
                  layer_types=[*config["layer_types"], *ours.args.draft_layer_types],
                  mlp_layer_types=[*config["mlp_layer_types"], "moe"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    next_ids = PROMPT[1:] + [7]

    def rms(x, weight):
        return x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps) * weight

    def mtp_block_input(module, args, kwargs):
        embedded = reference.model.embed_tokens(torch.tensor([next_ids]))
        mixed = (F.linear(rms(embedded, mixing["enorm"]), mixing["e_proj"])[:, :, None]
                 + F.linear(rms(args[0], mixing["hnorm"]), mixing["h_proj"]))
        return (mixed, *args[1:]), kwargs

    reference.model.layers[layers].register_forward_pre_hook(mtp_block_input, with_kwargs=True)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([PROMPT])).logits[0]
    got = _draft_logits(ours, PROMPT, next_ids, splits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_the_mtp_modules_tensors_are_what_the_served_module_loads():
    """What tiny checkpoints store under `mtp.0.` (`draft_shapes`, from the main layers' shapes)
    is exactly what a model serving the module expects, in the released layout: per-expert
    weights, `norm`, `hc_head_*`."""
    import dataclasses

    from graphc.models.deepseek_v4.layout import draft_shapes
    from graphc.weights.tiny import preset_config

    args = v4_args_from_hf_config(preset_config("v4"))
    served = {name: shape for name, shape in expected_tensors(dataclasses.replace(args, draft_layers=1)).items()
              if name.startswith("mtp.")}
    assert draft_shapes(args, expected_tensors(args)) == served
    assert {"mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.e_proj.weight", "mtp.0.ffn.experts.7.w2.weight"} <= set(served)
