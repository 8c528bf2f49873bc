"""DeepSeek-V4.1's eager reference (`models/deepseek_v41/reference.py`), its config (`args.py`) and the tiny
released-layout checkpoint: the parts V4.1 keeps from V4 against transformers' `deepseek_v4`
modules, causality, every feature of the tiny model at work, and the loader's refusals."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphc.errors import CheckpointError
from graphc.models.deepseek_v41 import reference
from graphc.models.registry import model_args_from_hf_config
from graphc.weights.checkpoint import check_checkpoint, load_model, load_reference
from graphc.weights.tiny import PRESETS

PROMPT = torch.tensor([[(37 * i + 11) % 250 + 3 for i in range(45)]])


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_reference(tiny_checkpoints["v41"])


def args_with(**text_changes):
    config = copy.deepcopy(PRESETS["v41"])
    config["text_config"].update(text_changes)
    return model_args_from_hf_config(config)


def test_layer_roles_of_the_tiny_config():
    args = args_with()
    assert [args.kv_source(i) for i in (2, 3, 4, 5)] == [2, 2, 4, 4]
    assert [args.index_source(i) for i in (2, 3, 4, 5)] == [2, 2, 4, 5]
    assert [args.uses_candidates(i) for i in (2, 4, 5)] == [False, False, True]
    assert args.engram.table_rows() == {1: 6126, 4: 6332} and args.compress_ratios == (0, 0, 2, 2, 1, 1)


@pytest.mark.parametrize("changes, message", [
    ({"kv_source_layer_ids": [4], "index_source_layer_ids": [4, 5]},
     "layer 2 (compress ratio 2) has no kv_source_layer_ids entry of its ratio at or before it"),
    ({"kv_source_layer_ids": [1]}, "kv_source_layer_ids [1] are not compressed layers"),
    ({"candidate_source_layer_id": 5}, "candidate_source_layer_id 5 must be -1 or a KV source layer"),
    ({"engram_num_embeddings": [6126, 6000]}, "engram_num_embeddings [6126, 6000] are not the hash tables' sizes"),
    ({"engram_compressed_vocab_size": 300}, "engram_compressed_vocab_size 300 is not in 1..vocab_size 256"),
    ({"engram_head_dim": None}, "engram_layer_ids is set but text_config lacks engram_head_dim"),
    # what a hand-edited config gets wrong: one-line errors, never an IndexError or TypeError
    ({"compress_ratios": [0, 0, 2]}, "config.json: compress_ratios has 3 entries for 6 layers"),
    ({"compress_ratios": 2}, "config.json: text_config: compress_ratios is 2; expected a list of integers >= 0"),
    ({"kv_source_layer_ids": [2, "4"]}, "kv_source_layer_ids is [2, '4']; expected a list of integers >= 0"),
    ({"index_source_layer_ids": [2, 4, 4, 5]}, "index_source_layer_ids [2, 4, 4, 5] lists a layer twice"),
    ({"engram_layer_ids": [1, 9]}, "engram_layer_ids [1, 9] are not all layers of 0..5"),
    ({"candidate_source_layer_id": "4"}, "candidate_source_layer_id is '4'; expected a layer id or -1"),
    ({"engram_max_ngram_size": 1}, "engram_max_ngram_size is 1; Engram hashes n-grams of orders 2..N"),
    ({"engram_pad_token_id": 256}, "engram_pad_token_id 256 is not a token id of 0..255"),
    ({"candidate_block_size": 0}, "candidate_block_size is 0; expected an integer >= 1"),
    ({"hc_mult": 2.5}, "hc_mult is 2.5; expected an integer >= 1"),
])
def test_config_errors_name_the_field(changes, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        args_with(**changes)


def test_a_folded_vocabulary_is_planned_but_not_loaded(tmp_path):
    """The release folds token ids into a compressed vocabulary before hashing (a tokenizer-derived
    map graphc does not build): the config parses (plan, shapes-only), a checkpoint is refused."""
    config = copy.deepcopy(PRESETS["v41"])
    config["text_config"]["engram_compressed_vocab_size"] = 200
    assert model_args_from_hf_config(config).engram.compressed_vocab == 200
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape("engram_compressed_vocab_size 200 differs from vocab_size 256: "
                                                        "Engram hashes token ids folded")):
        check_checkpoint(tmp_path)


def test_a_flat_config_is_refused():
    config = {k: v for k, v in PRESETS["v41"].items() if k != "text_config"}
    with pytest.raises(CheckpointError, match="nests the text model under 'text_config'"):
        model_args_from_hf_config(config)


def test_logits_are_causal(model):
    """A prefix's logits do not depend on what follows (entries close, selections and candidate
    blocks see only visible entries)."""
    with torch.no_grad():
        whole = model(PROMPT)
        for length in (1, 7, 16, 29):
            torch.testing.assert_close(model(PROMPT[:, :length]), whole[:, :length], rtol=1e-5, atol=1e-5)


def record_published(model, monkeypatch):
    """The selection and candidates each compressed layer leaves, per layer."""
    seen = {}
    forward = reference.Attention._selected_entries

    def spy(self, x, q_latent, published):
        out = forward(self, x, q_latent, published)
        seen[self.layer] = (out[1].clone(), None if published.candidates is None else published.candidates.clone())
        return out

    monkeypatch.setattr(reference.Attention, "_selected_entries", spy)
    with torch.no_grad():
        model(PROMPT)
    return seen


def test_every_feature_of_the_tiny_model_is_at_work(model, monkeypatch):
    seen = record_published(model, monkeypatch)
    attended = {layer: mask[0] for layer, (mask, _) in seen.items()}  # [T, E]
    topk = model.args.index_topk
    # Selections keep index_topk of more visible entries, from 2 * topk tokens on (rate 2) / topk (rate 1).
    assert (attended[2].sum(-1) == ((torch.arange(45) + 1) // 2).clamp(max=topk)).all()
    assert (attended[4].sum(-1) == (torch.arange(45) + 1).clamp(max=topk)).all()
    assert torch.equal(attended[3], attended[2])  # layer 3 reuses layer 2's entries and selection
    # Layer 5 re-indexes among the candidate blocks: inside them, and not layer 4's choice.
    candidates = seen[5][1][0]
    assert candidates.sum(-1).max() == 12 and (attended[5] <= candidates).all()
    assert not torch.equal(attended[5], attended[4])
    # Engram: gates spread, and the memory changes the logits.
    context = reference.ngram_context(PROMPT, model.args.engram.max_ngram, model.args.engram.pad_id)
    engram = model.layers[1].engram
    streams = torch.randn(1, 45, model.args.hc_mult, model.args.hidden_size)
    added = engram(streams, context) - streams
    assert added.abs().amax() > 0.1
    with torch.no_grad():
        base = model(PROMPT)
        closed = torch.zeros(1, 45, dtype=torch.bool)  # every gate 0
        for layer in (1, 4):
            engram = model.layers[layer].engram
            monkeypatch.setattr(engram, "forward", lambda s, c, e=engram: type(e).forward(e, s, c, closed))
        without = model(PROMPT)
    assert (base - without).abs().amax() > 0.05


def v4_config(args):
    """transformers' DeepseekV4Config of the tiny V4.1 model's shared shapes (no compression)."""
    from transformers import DeepseekV4Config

    text = PRESETS["v41"]["text_config"]
    return DeepseekV4Config(
        vocab_size=text["vocab_size"], hidden_size=args.hidden_size, moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=1, num_attention_heads=args.num_attention_heads, num_key_value_heads=1,
        head_dim=args.head_dim, q_lora_rank=args.q_lora_rank, partial_rotary_factor=args.rope_head_dim / args.head_dim,
        n_routed_experts=args.n_routed_experts, num_experts_per_tok=args.num_experts_per_tok,
        routed_scaling_factor=args.routed_scaling_factor, layer_types=["sliding_attention"], mlp_layer_types=["moe"],
        sliding_window=args.sliding_window, o_groups=args.o_groups, o_lora_rank=args.o_lora_rank,
        index_n_heads=args.index_n_heads, index_head_dim=args.index_head_dim, index_topk=args.index_topk,
        hc_mult=args.hc_mult, hc_sinkhorn_iters=args.hc_sinkhorn_iters, hc_eps=args.hc_eps,
        swiglu_limit=args.swiglu_limit, rms_norm_eps=1e-6, scoring_func="sqrtsoftplus", attn_implementation="eager")


def randomised(module, seed=0):
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    for name, buffer in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(std=0.3)
    return module.float().eval()


def test_moe_equals_transformers_v4(model):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    theirs = randomised(hf.DeepseekV4SparseMoeBlock(v4_config(model.args), 0))
    ours = reference.MoE(model.args)
    intermediate = model.args.moe_intermediate_size
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.gate.bias.copy_(theirs.gate.e_score_correction_bias)
        for e, expert in enumerate(ours.experts):
            expert.w1.weight.copy_(theirs.experts.gate_up_proj[e, :intermediate])
            expert.w3.weight.copy_(theirs.experts.gate_up_proj[e, intermediate:])
            expert.w2.weight.copy_(theirs.experts.down_proj[e])
        for mine, hf_name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            getattr(ours.shared_experts, mine).weight.copy_(getattr(theirs.shared_experts, hf_name).weight)
        x = torch.randn(2, 9, model.args.hidden_size)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_stream_mixes_equal_transformers_v4(model):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = v4_config(model.args)
    config.rms_norm_eps = model.args.rms_norm_eps
    theirs = randomised(hf.DeepseekV4HyperConnection(config))
    block = model.layers[0]
    with torch.no_grad():
        block.hc_attn_fn.copy_(theirs.fn), block.hc_attn_base.copy_(theirs.base), block.hc_attn_scale.copy_(theirs.scale)
        streams = torch.randn(2, 5, model.args.hc_mult, model.args.hidden_size)
        pre, post, comb = block.mixes(streams, "attn")
        their_post, their_comb, collapsed = theirs(streams)
    torch.testing.assert_close(post, their_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, their_comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reference.collapse(streams, pre), collapsed, rtol=1e-5, atol=1e-6)


def test_sliding_attention_equals_transformers_v4_without_its_q_norm(model):
    """V4.1 drops V4's weightless per-head q norm; the rest of a sliding layer is V4's."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = v4_config(model.args)
    config.rms_norm_eps = model.args.rms_norm_eps
    theirs = randomised(hf.DeepseekV4Attention(config, 0))
    theirs.q_b_norm = torch.nn.Identity()
    ours = reference.Attention(model.args, 0)
    names = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj", "kv_norm": "kv_norm",
             "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
    with torch.no_grad():
        for mine, hf_name in names.items():
            getattr(ours, mine).weight.copy_(getattr(theirs, hf_name).weight)
        ours.attn_sink.copy_(theirs.sinks)
        tokens = 13
        x = torch.randn(1, tokens, model.args.hidden_size)
        rope = hf.DeepseekV4RotaryEmbedding(config)
        positions = torch.arange(tokens)[None]
        query, key = positions[0, :, None], positions[0, None, :]
        visible = (key <= query) & (key > query - model.args.sliding_window)
        mask = torch.zeros(1, 1, tokens, tokens).masked_fill(~visible, float("-inf"))
        theirs_out = theirs(x, {"main": rope(x, positions, "main")}, positions, mask)[0]
        torch.testing.assert_close(ours(x, reference.Published()), theirs_out, rtol=1e-5, atol=1e-5)


def test_loader_names_missing_and_unknown_engram_tensors(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["v41"]
    tensors = load_file(source / "model.safetensors")
    for name, change in (("missing", lambda t: t.pop("layers.4.engram.wkv.weight")),
                         ("unknown", lambda t: t.update({"layers.2.engram.q_weight": torch.ones(4, 64)}))):
        broken = tmp_path / name
        broken.mkdir()
        (broken / "config.json").write_text((source / "config.json").read_text())
        edited = dict(tensors)
        change(edited)
        save_file(edited, broken / "model.safetensors")
        expected = "layers.4.engram.wkv.weight" if name == "missing" else "layers.2.engram.q_weight"
        with pytest.raises(CheckpointError, match=f"{name if name == 'missing' else 'unexpected'} tensor.*{expected}"):
            load_reference(broken)


def test_loader_skips_the_vision_tower_and_draft_layers(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["v41"]
    tensors = load_file(source / "model.safetensors")
    assert any(n.startswith("mtp.0.") for n in tensors)
    tensors |= {"vision.blocks.0.attn.weight": torch.ones(2, 2), "image_newline": torch.ones(64)}
    (tmp_path / "config.json").write_text(json.dumps(json.loads((source / "config.json").read_text())))
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_reference(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT[:, :9]), load_reference(source)(PROMPT[:, :9]))


def test_fp8_ue8m0_checkpoint_loads_exactly(tmp_path):
    """`--fp8-block 32`: V4.1's release format, power-of-two scales in `X.scale` (float8_e8m0fnu),
    the Engram tables scaled per row; dequantised exactly, the same weights in both models."""
    from safetensors import safe_open

    from graphc.weights.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "fp8", preset="v41", fp8_block=32)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        weight, scale = f.get_tensor("layers.2.attn.wq_a.weight"), f.get_tensor("layers.2.attn.wq_a.scale")
        table_scale = f.get_tensor("layers.1.engram.embed.scale")
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert tuple(scale.shape) == (1, 2) and tuple(table_scale.shape) == (6126, 1)  # [32, 64] in 32 x 32; rows x 16
    reference, paged = load_reference(path), load_model(path)
    expected = weight.float() * scale.float().repeat_interleave(32, dim=1)[:, :64]
    assert torch.equal(reference.layers[2].attn.wq_a.weight, expected)
    assert torch.equal(paged.model.layers[2].attn.wq_a.weight, expected)
    with torch.no_grad():
        torch.testing.assert_close(paged(*_one_step(paged, PROMPT[0, :20].tolist()))[0], reference(PROMPT[:, :20])[0, -1],
                                   rtol=1e-5, atol=1e-5)


def _one_step(model, prompt):
    from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata

    sequence = SequenceBlocks(8)
    sequence.reserve(len(prompt), BlockAllocator(8))
    ids, positions, table, slots, last = step_metadata([(sequence, prompt, 0)], len(prompt), 4)
    return ids, positions, table, slots, model.new_kv_pool(8, 8), last


def test_an_expert_shard_loads_only_its_engram_rows(tiny_checkpoints):
    """ep = 2: shard 1 holds rows [R, 2R) of each table, R = ceil(rows / 2), and no others."""
    whole = load_model(tiny_checkpoints["v41"]).model.layers[1].engram.embed.weight  # [6126, 16]
    half = load_model(tiny_checkpoints["v41"], experts=range(4, 8)).model.layers[1].engram.embed.weight
    assert tuple(half.shape) == (3063, 16) and torch.equal(half, whole[3063:])
