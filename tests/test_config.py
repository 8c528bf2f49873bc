"""The strict `model.yaml` loader: every bad key, type or value is a `ConfigError` naming the key path
and the offending value; a valid file loads with relative paths resolved against the YAML's dir."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from graphc.config import (
    GraphcConfig,
    KVCacheSection,
    RuntimeSection,
    load_config,
    parse_config,
)
from graphc.errors import ConfigError, GraphcError
from graphc.sampling import Sampling
from graphc.topology import Topology
from support import DELETE, override, rewrite_config

"""Passed as a value to `override`: remove the key instead of setting it."""


def valid_data(checkpoint: Path | str) -> dict:
    """A complete, valid `model.yaml` as a dict (the shape of examples/tiny.yaml)."""
    return {
        "model": {"checkpoint": str(checkpoint), "dtype": "float32"},
        "topology": {"cp": 1, "ep": 1},
        "buckets": {"prefill": [16, 64], "decode": [1, 4, 8], "prompt_as_decode": 4, "context_limit": 256},
        "kv_cache": {"block_size": 16, "num_blocks": 64},
        "runtime": {
            "max_num_prefilling_tokens": 64,
            "max_new_tokens": 16,
            "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0},
        },
        "backend": "export",
    }


@pytest.fixture
def ckpt(tiny_checkpoints) -> Path:
    """An 8-routed-expert tiny checkpoint (max_position_embeddings 512)."""
    return tiny_checkpoints["lora-groups"]


@pytest.fixture
def data(ckpt) -> dict:
    return valid_data(ckpt)


def parse(data: dict, base_dir: Path | None = None) -> GraphcConfig:
    return parse_config(data, base_dir or Path("/nonexistent-base-dir"))


# --- valid files ---------------------------------------------------------------------------------


def test_valid_yaml_loads_with_checkpoint_relative_to_yaml_dir(tmp_path, ckpt, monkeypatch):
    yaml_dir = tmp_path / "configs" / "nested"
    yaml_dir.mkdir(parents=True)
    relative = os.path.relpath(ckpt, yaml_dir)
    assert not Path(relative).is_absolute()
    data = valid_data(relative)
    data["buckets"]["prefill"] = [64, 16, 32]
    data["buckets"]["decode"] = [8, 1, 4]
    path = yaml_dir / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    # A cwd from which the relative checkpoint path would *not* resolve.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    config = load_config(path)

    assert config.model.checkpoint == ckpt.resolve()
    assert config.model.checkpoint.is_absolute()
    assert config.model.dtype == "float32"
    assert config.buckets.prefill == [16, 32, 64]
    assert config.buckets.decode == [1, 4, 8]
    assert config.buckets.prompt_as_decode == 4
    assert config.buckets.context_limit == 256
    assert config.kv_cache == KVCacheSection(block_size=16, num_blocks=64)
    assert config.runtime.max_new_tokens == 16
    assert config.backend == "export"
    assert config.source == path


def test_relative_yaml_path_resolves_checkpoint_against_yaml_dir(tmp_path, ckpt, monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "model.yaml").write_text(yaml.safe_dump(valid_data(os.path.relpath(ckpt, tmp_path / "cfg"))))
    monkeypatch.chdir(tmp_path)
    config = load_config("cfg/model.yaml")
    assert config.model.checkpoint == ckpt.resolve()


def test_defaults_fill_omitted_sections(tmp_path, ckpt):
    minimal = {
        "model": {"checkpoint": str(ckpt)},
        "buckets": {"prefill": [32], "decode": [2, 1], "context_limit": 128},
    }
    config = parse(minimal, tmp_path)
    assert config.model.dtype == "float32"
    assert config.topology == Topology(cp=1, ep=1)
    assert config.kv_cache == KVCacheSection(block_size=16, num_blocks=256)
    assert config.runtime == RuntimeSection()
    assert config.runtime.sampling == Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    assert config.runtime.max_num_prefilling_tokens == 512
    assert config.buckets.prompt_as_decode == 0
    assert config.buckets.decode == [1, 2]
    assert config.backend == "export"
    assert config.source is None


def test_integer_accepted_for_float_and_converted(data):
    config = parse(override(data, **{"runtime.sampling.temperature": 1, "runtime.sampling.top_p": 1}))
    assert config.runtime.sampling.temperature == 1.0
    assert isinstance(config.runtime.sampling.temperature, float)
    assert isinstance(config.runtime.sampling.top_p, float)


@pytest.mark.parametrize(
    "changes",
    [
        {"buckets.context_limit": 512},  # == max_position_embeddings
        {"buckets.prefill": [256], "buckets.prompt_as_decode": 256},  # == context_limit
        {"kv_cache.num_blocks": 16},  # 16 * 16 == context_limit exactly
        {"topology.cp": 4, "topology.ep": 2},
        {"topology.cp": 8, "topology.ep": 8},
        {"runtime.sampling.top_p": 1.0, "runtime.sampling.top_k": 5, "runtime.sampling.temperature": 0.7},
        {"model.dtype": "bfloat16", "backend": "neuron"},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_boundary_values_are_accepted(data, changes):
    parse(override(data, **changes))


def test_ep_16_accepted_on_16_expert_preset(tiny_checkpoints):
    data = override(valid_data(tiny_checkpoints["wide-16e"]), **{"topology.cp": 16, "topology.ep": 16})
    assert parse(data).topology == Topology(cp=16, ep=16)


# --- unknown keys --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"modle": {}}, r"^modle: unknown key; allowed here: model, buckets, topology, kv_cache, runtime, backend$"),
        # `source` is set by the loader, not a key of the file.
        ({"source": "x.yaml"}, r"^source: unknown key; allowed here: model, buckets, topology,"),
        (
            {"buckets.prefil": [16], "buckets.prefill": DELETE},
            r"^buckets\.prefil: unknown key; allowed here: context_limit, prefill, decode, prompt_as_decode, auto$",
        ),
        ({"model.path": "x"}, r"^model\.path: unknown key; allowed here: checkpoint, dtype, weights, sparse_probabilities, moe_form, moe_lowering, speculative$"),
        (
            {"runtime.sampling.temprature": 0.5},
            r"^runtime\.sampling\.temprature: unknown key; allowed here: temperature, top_k, top_p, seed$",
        ),
    ],
    ids=["top-level", "source", "buckets.prefil", "model.path", "runtime.sampling.temprature"],
)
def test_unknown_key(data, changes, match):
    with pytest.raises(ConfigError, match=match):
        parse(override(data, **changes))


def test_unknown_non_string_key(data):
    data[1] = "x"
    with pytest.raises(ConfigError, match=r"^1: unknown key; allowed here: model, "):
        parse(data)


def test_unknown_keys_of_mixed_types(data):
    data[1] = "x"
    data["zzz"] = "y"
    with pytest.raises(ConfigError, match=r"unknown key"):
        parse(data)


# --- wrong types ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("buckets.context_limit", "256", r"^buckets\.context_limit: expected an integer, got '256'$"),
        ("kv_cache.block_size", True, r"^kv_cache\.block_size: expected an integer, got True$"),
        ("buckets.prefill", [16, True], r"^buckets\.prefill\[1\]: expected an integer, got True$"),
        ("topology", [1, 2], r"^topology: expected a mapping, got \[1, 2\]$"),
        ("runtime.sampling", "greedy", r"^runtime\.sampling: expected a mapping, got 'greedy'$"),
        ("model", None, r"^model: expected a mapping, got None$"),
        ("kv_cache.num_blocks", 64.0, r"^kv_cache\.num_blocks: expected an integer, got 64\.0$"),
        ("buckets.decode", [1, 2.5], r"^buckets\.decode\[1\]: expected an integer, got 2\.5$"),
        ("buckets.prefill", 16, r"^buckets\.prefill: expected a list of an integer, got 16$"),
        ("buckets.decode", {"a": 1}, r"^buckets\.decode: expected a list of an integer, got \{'a': 1\}$"),
        ("model.dtype", "float16", r"^model\.dtype: 'float16' is not allowed; expected one of 'float32', 'bfloat16'$"),
        ("model.sparse_probabilities", "fp16",
         r"^model\.sparse_probabilities: 'fp16' is not allowed; expected one of 'bf16', 'fp32'$"),
        (
            "backend",
            "tensorrt",
            r"^backend: 'tensorrt' is not allowed; expected one of 'export', 'inductor', 'neuron'$",
        ),
        ("runtime.sampling.temperature", "hot", r"^runtime\.sampling\.temperature: expected a number, got 'hot'$"),
        ("runtime.sampling.top_p", True, r"^runtime\.sampling\.top_p: expected a number, got True$"),
        ("model.checkpoint", 5, r"^model\.checkpoint: expected a path string, got 5$"),
        ("model.checkpoint", "", r"^model\.checkpoint: expected a path string, got ''$"),
        ("runtime.prefix_caching", "yes", r"^runtime\.prefix_caching: expected true or false, got 'yes'$"),
    ],
    ids=[
        "str-for-int", "bool-for-int", "bool-in-list", "list-for-mapping", "str-for-mapping", "none-for-mapping",
        "float-for-int", "float-in-list", "int-for-list", "mapping-for-list", "bad-dtype", "bad-sparse-probabilities", "bad-backend",
        "str-for-float", "bool-for-float", "int-for-path", "empty-path", "str-for-bool",
    ],
)
def test_wrong_type(data, key, value, match):
    with pytest.raises(ConfigError, match=match):
        parse(override(data, **{key: value}))


# --- missing required keys -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, match",
    [
        ("buckets.context_limit", r"^buckets\.context_limit: required key is missing \(an integer\)$"),
        ("buckets.prefill", r"^buckets\.prefill: required key is missing \(a list of sizes, or plan them with buckets\.auto\)$"),
        ("model.checkpoint", r"^model\.checkpoint: required key is missing \(a path\)$"),
        ("buckets", r"^buckets: required key is missing \(a mapping\)$"),
        ("model", r"^model: required key is missing \(a mapping\)$"),
    ],
)
def test_missing_required_key(data, key, match):
    with pytest.raises(ConfigError, match=match):
        parse(override(data, **{key: DELETE}))


# --- impossible values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        pytest.param(
            {"buckets.prefill": [16, 512]},
            r"^buckets\.prefill\[1\]: 512 is larger than buckets\.context_limit \(256\)",
            id="prefill>context_limit",
        ),
        pytest.param(
            {"buckets.context_limit": 0}, r"^buckets\.context_limit: 0 must be a positive integer$", id="context_limit=0"
        ),
        pytest.param(
            {"buckets.context_limit": -8},
            r"^buckets\.context_limit: -8 must be a positive integer$",
            id="context_limit<0",
        ),
        pytest.param(
            {"kv_cache.block_size": 0}, r"^kv_cache\.block_size: 0 must be a positive integer$", id="block_size=0"
        ),
        pytest.param(
            {"kv_cache.num_blocks": -1}, r"^kv_cache\.num_blocks: -1 must be a positive integer$", id="num_blocks<0"
        ),
        pytest.param(
            {"buckets.decode": [1, 0, 8]}, r"^buckets\.decode\[1\]: 0 must be a positive integer$", id="decode=0"
        ),
        pytest.param(
            {"buckets.prefill": [16, -16]}, r"^buckets\.prefill\[1\]: -16 must be a positive integer$", id="prefill<0"
        ),
        pytest.param(
            {"buckets.prefill": []}, r"^buckets\.prefill: must list at least one size$", id="prefill-empty"
        ),
        pytest.param(
            {"buckets.decode": [1, 4, 8, 4]},
            r"^buckets\.decode: size 4 is listed twice; sizes must be unique$",
            id="decode-duplicate",
        ),
        pytest.param(
            {"buckets.prefill": [64, 16, 64]},
            r"^buckets\.prefill: size 64 is listed twice",
            id="prefill-duplicate",
        ),
        pytest.param(
            {"buckets.prompt_as_decode": 257},
            r"^buckets\.prompt_as_decode: 257 must be in 0\.\.context_limit \(256\)$",
            id="prompt_as_decode>context_limit",
        ),
        pytest.param(
            {"buckets.prompt_as_decode": -1},
            r"^buckets\.prompt_as_decode: -1 must be in 0\.\.context_limit \(256\)$",
            id="prompt_as_decode<0",
        ),
        pytest.param(
            {"kv_cache.num_blocks": 15},
            r"^kv_cache\.num_blocks: 15 blocks \* block_size 16 = 240 tokens cannot hold one sequence of "
            r"context_limit 256; need at least 16 blocks$",
            id="kv-pool-too-small",
        ),
        pytest.param(
            {"kv_cache.num_blocks": 8, "kv_cache.block_size": 30},
            r"^kv_cache\.num_blocks: 8 blocks \* block_size 30 = 240 tokens .* need at least 9 blocks$",
            id="kv-pool-too-small-rounds-up",
        ),
        pytest.param(
            {"topology.cp": 4, "topology.ep": 3},
            r"^topology\.ep: 3 must divide the world size \(dp \* cp \* tp = 4\); 4 % 3 = 1$",
            id="ep-not-dividing-cp",
        ),
        pytest.param(
            {"topology.dp": 3, "topology.cp": 2, "topology.ep": 4},
            r"^topology\.ep: 4 must divide the world size \(dp \* cp \* tp = 6\); 6 % 4 = 2$",
            id="ep-not-dividing-dp*cp",
        ),
        pytest.param({"topology.dp": 0}, r"^topology\.dp: 0 must be a positive integer$", id="dp=0"),
        pytest.param({"model.moe_lowering": "a2a"},
                     r"^model\.moe_lowering: 'a2a' is not allowed; expected one of 'auto', 'ag_rs', 'a2a_even', 'a2a_v'", id="moe_lowering"),
        pytest.param(
            {"topology.cp": 3, "topology.ep": 3},
            r"^topology\.ep: 3 must divide the checkpoint's n_routed_experts \(8\); 8 % 3 = 2$",
            id="ep-not-dividing-experts",
        ),
        pytest.param(
            {"topology.cp": 16, "topology.ep": 16},
            r"^topology\.ep: 16 must divide the checkpoint's n_routed_experts \(8\)",
            id="ep-more-than-experts",
        ),
        pytest.param({"topology.cp": 0}, r"^topology\.cp: 0 must be a positive integer$", id="cp=0"),
        pytest.param({"topology.tp": 0}, r"^topology\.tp: 0 must be a positive integer$", id="tp=0"),
        pytest.param({"topology.tp": 3},
                     r"^topology\.tp: 3 must divide the checkpoint's num_attention_heads \(4\); 4 % 3 = 1$",
                     id="tp-not-dividing-heads"),
        pytest.param({"topology.tp": 8},
                     r"^topology\.tp: 8 must divide the checkpoint's num_attention_heads \(4\); 4 % 8 = 4$",
                     id="tp-more-than-heads"),
        pytest.param({"topology.tp": 2, "topology.ep": 4},
                     r"^topology\.ep: 4 must divide the world size \(dp \* cp \* tp = 2\); 2 % 4 = 2$",
                     id="ep-wider-than-the-tp-world"),
        pytest.param({"topology.ep": 0}, r"^topology\.ep: 0 must be a positive integer$", id="ep=0"),
        pytest.param(
            {"buckets.context_limit": 1024, "kv_cache.num_blocks": 64},
            r"^buckets\.context_limit: 1024 exceeds the checkpoint's max_position_embeddings \(512\)$",
            id="context_limit>max_positions",
        ),
        pytest.param(
            {"runtime.sampling.temperature": -0.5},
            r"^runtime\.sampling\.temperature: -0\.5 must be a finite number >= 0",
            id="temperature<0",
        ),
        pytest.param(
            {"runtime.sampling.top_p": 0.0}, r"^runtime\.sampling\.top_p: 0\.0 must be a number in \(0, 1\]$", id="top_p=0"
        ),
        pytest.param(
            {"runtime.sampling.top_p": 1.5}, r"^runtime\.sampling\.top_p: 1\.5 must be a number in \(0, 1\]$", id="top_p>1"
        ),
        pytest.param(
            {"runtime.sampling.top_p": float("nan")},
            r"^runtime\.sampling\.top_p: nan must be a number in \(0, 1\]$",
            id="top_p=nan",
        ),
        pytest.param(
            {"runtime.sampling.top_k": -1}, r"^runtime\.sampling\.top_k: -1 must be an integer in 0\.\.2147483647", id="top_k<0"
        ),
        pytest.param(
            {"runtime.max_new_tokens": 0}, r"^runtime\.max_new_tokens: 0 must be a positive integer$", id="max_new=0"
        ),
        pytest.param(
            {"runtime.max_num_prefilling_tokens": -4},
            r"^runtime\.max_num_prefilling_tokens: -4 must be a positive integer$",
            id="max_prefilling<0",
        ),
        pytest.param(
            {"runtime.sampling.temperature": float("nan")},
            r"^runtime\.sampling\.temperature: nan must be",
            id="temperature=nan",
        ),
    ],
)
def test_impossible_value(data, changes, match):
    with pytest.raises(ConfigError, match=match):
        parse(override(data, **changes))


def test_missing_checkpoint_dir(tmp_path, data):
    data = override(data, **{"model.checkpoint": "no-such-ckpt"})
    missing = tmp_path / "no-such-ckpt"
    with pytest.raises(ConfigError, match=rf"^model\.checkpoint: .*{re.escape(repr(str(missing)))} does not exist"):
        parse(data, tmp_path)


def test_checkpoint_dir_without_config_json(tmp_path, data):
    (tmp_path / "empty-ckpt").mkdir()
    with pytest.raises(ConfigError, match=r"^model\.checkpoint: .*empty-ckpt/config\.json: missing"):
        parse(override(data, **{"model.checkpoint": "empty-ckpt"}), tmp_path)


# --- file-level errors ---------------------------------------------------------------------------


def test_invalid_yaml_syntax(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  checkpoint: [unclosed\nbuckets: {prefill: [16]\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("text", ["", "- just\n- a list\n", "42\n"], ids=["empty", "list", "scalar"])
def test_yaml_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"^<top level>: expected a mapping, got "):
        load_config(path)


def test_config_file_does_not_exist(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(GraphcError, match=rf"^config file {re.escape(repr(str(path)))} does not exist$"):
        load_config(path)


def test_config_path_is_a_directory(tmp_path):
    with pytest.raises(GraphcError, match=r"does not exist$"):
        load_config(tmp_path)


def test_load_config_reports_value_errors_with_key_path(tmp_path, ckpt):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(override(valid_data(ckpt), **{"buckets.prefill": [16, 512]})))
    with pytest.raises(ConfigError, match=r"buckets\.prefill\[1\]: 512"):
        load_config(path)


# --- buckets: auto ---------------------------------------------------------------------------------


def _auto(data, tmp_path, lengths="3\n5 10\n40 # a comment\n\n120 2\n", **auto):
    (tmp_path / "lengths.txt").write_text(lengths)
    buckets = {"context_limit": 256, "auto": {"workload": "lengths.txt", "graphs": 6, "max_decode_batch": 4, **auto}}
    return override(data, buckets=buckets)


def test_auto_buckets_are_planned_from_the_workload(data, tmp_path):
    from graphc.buckets.planner import plan_buckets

    config = parse(_auto(data, tmp_path), base_dir=tmp_path)
    plan = plan_buckets({3: 1, 5: 10, 40: 1, 120: 2}, 6, 256, 64, 4)
    b = config.buckets
    assert (b.prefill, b.decode, b.prompt_as_decode) == (plan.prefill, plan.decode, plan.prompt_as_decode)
    assert b.prefill[-1] == 64  # the largest chunk the runtime makes: max_num_prefilling_tokens
    assert plan.graphs <= 6 and b.decode[-1] == 4


@pytest.mark.parametrize("changes, lengths, match", [
    ({"graphs": 1}, "5\n", r"^buckets\.auto: a budget of 1 graphs cannot hold one prefill and one decode graph"),
    ({"graphs": 0}, "5\n", r"^buckets\.auto\.graphs: 0 must be a positive integer$"),
    ({}, "5\nfive\n", r"^buckets\.auto\.workload: .*lengths\.txt:2: expected a prompt length or `length count`"),
    ({}, "300\n", r"^buckets\.auto: prompt length 300 is outside 1\.\.255 \(context_limit 256\)$"),
    ({}, "# nothing\n", r"^buckets\.auto\.workload: .*no prompt lengths in the file$"),
    ({"workload": "missing.txt"}, "5\n", r"^buckets\.auto\.workload: cannot read .*missing\.txt'"),
])
def test_bad_auto_buckets_name_the_key(data, tmp_path, changes, lengths, match):
    with pytest.raises(ConfigError, match=match):
        parse(_auto(data, tmp_path, lengths, **changes), base_dir=tmp_path)


def test_auto_and_explicit_lists_together_are_refused(data, tmp_path):
    both = override(_auto(data, tmp_path), **{"buckets.prefill": [16]})
    with pytest.raises(ConfigError, match=r"^buckets\.prefill: give either buckets\.auto or the bucket lists, not both$"):
        parse(both, base_dir=tmp_path)


# --- speculative decoding ----------------------------------------------------------------------


def test_speculative_decoding_serves_the_mtp_layer(data):
    config = parse(override(data, **{"model.speculative": {"method": "mtp", "tokens": 3}}))
    assert config.draft_tokens == 3 and config.model_args.draft_layers == 1
    assert config.model_args.cache_layers == config.model_args.num_hidden_layers + 1


@pytest.mark.parametrize(
    "changes, match",
    [
        pytest.param({"model.speculative": {"method": "eagle", "tokens": 2}}, r"^model\.speculative\.method: ",
                     id="unknown-method"),
        pytest.param({"model.speculative": {"method": "mtp", "tokens": 0}},
                     r"^model\.speculative\.tokens: 0 must be in 1\.\.254 ", id="no-tokens"),
        pytest.param({"model.speculative": {"method": "mtp", "tokens": 255}},
                     r"^model\.speculative\.tokens: 255 must be in 1\.\.254 \(a verify row of 1 \+ tokens must fit",
                     id="tokens-past-the-context"),
        pytest.param({"model.speculative": {"method": "mtp", "tokens": 2}, "buckets.prefill": [1]},
                     r"^buckets\.prefill: speculative decoding runs each prompt chunk's last token again", id="chunk-of-1"),
    ],
)
def test_speculative_decoding_refusals_name_the_field(data, changes, match):
    with pytest.raises(ConfigError, match=match):
        parse(override(data, **changes))


def test_speculative_decoding_needs_the_checkpoints_draft_layers(tmp_path, ckpt, tiny_checkpoints):
    without = shutil.copytree(ckpt, tmp_path / "no-mtp")
    rewrite_config(without, num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match=r"^model\.speculative: method 'mtp' needs the checkpoint's draft layers "
                                          r"\(multi-token prediction\), and .*no-mtp has none \(config\.json "
                                          r"num_nextn_predict_layers is 0\)$"):
        parse(override(valid_data(without), **{"model.speculative": {"method": "mtp", "tokens": 2}}))
    v41 = valid_data(tiny_checkpoints["v41"])
    with pytest.raises(ConfigError, match=r"^model\.speculative\.method: DeepseekV41ForCausalLM drafts with 'dspark', "
                                          r"not 'mtp'$"):
        parse(override(v41, **{"model.speculative": {"method": "mtp", "tokens": 2}}))
    with pytest.raises(ConfigError, match=r"^model\.speculative\.method: DeepseekV3ForCausalLM drafts with 'mtp', "
                                          r"not 'dspark'$"):
        parse(override(valid_data(ckpt), **{"model.speculative": {"method": "dspark", "tokens": 2}}))
    with pytest.raises(ConfigError, match=r"^model\.speculative\.tokens: 5 exceeds the DSpark block \(config\.json "
                                          r"dspark_block_size 4\), the tokens one pass drafts$"):
        parse(override(v41, **{"model.speculative": {"method": "dspark", "tokens": 5}}))
    assert parse(override(v41, **{"model.speculative": {"method": "dspark", "tokens": 4}})).model_args.draft_layers == 3
