"""The `graphc` CLI: bad input is one `error: ...` line on stderr and exit status 2; `generate` agrees
with the typed API; the installed console script works."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from graphc.cli import cli
from graphc.weights.checkpoint import expected_tensors
from graphc.models.registry import load_model_args
from graphc.weights.tiny import PRESETS
from support import DELETE, override

EXIT_BAD_INPUT = 2


def model_yaml(checkpoint: Path | str, **changes) -> dict:
    """A valid model.yaml dict for `checkpoint`; dotted keys in `changes` override (DELETE removes)."""
    data = {
        "model": {"checkpoint": str(checkpoint), "dtype": "float32"},
        "topology": {"cp": 1, "ep": 1},
        "buckets": {"prefill": [2, 4], "decode": [1, 4], "prompt_as_decode": 2, "context_limit": 64},
        "kv_cache": {"block_size": 16, "num_blocks": 64},
        "runtime": {"max_num_prefilling_tokens": 64, "max_new_tokens": 4},
        "backend": "export",
    }
    return override(data, **changes)


def write_yaml(directory: Path, checkpoint: Path | str, name: str = "model.yaml", **changes) -> Path:
    """Write `model_yaml(checkpoint, **changes)` into `directory`; returns the file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(yaml.safe_dump(model_yaml(checkpoint, **changes), sort_keys=False))
    return path


def copy_checkpoint(src: Path, tmp_path: Path) -> Path:
    """A private copy of a session checkpoint, safe to modify."""
    return Path(shutil.copytree(src, tmp_path / f"{src.name}-copy"))


def rewrite_tensors(checkpoint: Path, edit) -> None:
    """Load model.safetensors, let `edit(tensors)` change the dict in place, write it back."""
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def error_line(result: Result) -> str:
    """Assert `result` is a bad-input exit: status 2 and exactly one stderr line, `error: ...`."""
    assert result.exit_code == EXIT_BAD_INPUT, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{result.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def ckpt(tiny_checkpoints) -> Path:
    return tiny_checkpoints["lora-groups"]


# --- bad input: one line, exit 2 -----------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, expected",
    [
        pytest.param({"buckets.prefil": [4]}, "error: buckets.prefil: unknown key; allowed here: context_limit, prefill,", id="unknown-key"),
        pytest.param({"modle": {}}, "error: modle: unknown key", id="unknown-top-level-key"),
        pytest.param(
            {"kv_cache.block_size": "16"}, "error: kv_cache.block_size: expected an integer, got '16'", id="wrong-type"
        ),
        pytest.param(
            {"buckets.context_limit": True}, "error: buckets.context_limit: expected an integer, got True", id="bool"
        ),
        pytest.param(
            {"buckets.prefill": [4, 128]},
            "error: buckets.prefill[1]: 128 is larger than buckets.context_limit (64)",
            id="impossible-value",
        ),
        pytest.param(
            {"topology.cp": 3, "topology.ep": 3},
            "error: topology.ep: 3 must divide the checkpoint's n_routed_experts (8)",
            id="ep-vs-experts",
        ),
        pytest.param(
            {"buckets.context_limit": DELETE},
            "error: buckets.context_limit: required key is missing",
            id="missing-key",
        ),
    ],
)
def test_validate_rejects_bad_yaml(tmp_path, ckpt, changes, expected):
    path = write_yaml(tmp_path, ckpt, **changes)
    line = error_line(invoke("validate", path))
    assert line.startswith(expected), line


def test_validate_rejects_invalid_yaml_syntax_exit_2(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("model: {checkpoint: [\n")
    result = invoke("validate", path)
    assert result.exit_code == EXIT_BAD_INPUT, (result.output, result.exception)
    assert result.stderr.startswith(f"error: {path}: not valid YAML"), result.stderr
    assert result.stdout == ""


def test_validate_rejects_invalid_yaml_syntax_one_line(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("model: {checkpoint: [\n")
    line = error_line(invoke("validate", path))
    assert line.startswith(f"error: {path}: not valid YAML"), line


def test_validate_rejects_missing_config_file(tmp_path):
    line = error_line(invoke("validate", tmp_path / "nope.yaml"))
    assert line == f"error: config file {str(tmp_path / 'nope.yaml')!r} does not exist"


def test_validate_prints_resolved_config(tmp_path, ckpt):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    path = write_yaml(cfg, os.path.relpath(ckpt, cfg))
    result = invoke("validate", path)
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        f"model      {ckpt.resolve()} (float32)",
        "topology   dp=1 cp=1 tp=1 ep=1",
        "buckets    prefill=[2, 4] decode=[1, 4] prompt_as_decode=2 context_limit=64",
        "kv_cache   64 blocks x 16 tokens",
        "backend    export",
        f"checkpoint {len(expected_tensors(load_model_args(ckpt)))} tensors in 1 file(s): names, dtypes, shapes and "
        "byte ranges checked",
    ]


def test_generate_missing_checkpoint_dir(tmp_path):
    path = write_yaml(tmp_path, "./no-such-ckpt")
    line = error_line(invoke("generate", path, "--prompt-ids", "1,2,3"))
    missing = str(tmp_path / "no-such-ckpt")
    assert line == f"error: model.checkpoint: checkpoint dir {missing!r} does not exist"


def test_generate_unsupported_architecture(tmp_path, ckpt):
    copy = copy_checkpoint(ckpt, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    (copy / "config.json").write_text(json.dumps(config))
    line = error_line(invoke("generate", write_yaml(tmp_path, copy), "--prompt-ids", "1,2,3"))
    assert line.startswith("error: model.checkpoint: config.json: architecture Qwen3MoeForCausalLM is not supported"), line
    assert "DeepseekV3ForCausalLM" in line  # says what is supported


def _drop_norm(tensors):
    del tensors["model.norm.weight"]


def _reshape_norm(tensors):
    tensors["model.norm.weight"] = torch.ones(tensors["model.norm.weight"].shape[0] + 1)


TENSOR_DAMAGE = [
    pytest.param(_drop_norm, "missing tensor(s) model.norm.weight", id="missing-tensor"),
    pytest.param(
        _reshape_norm,
        "model.safetensors: tensor model.norm.weight has shape [65], expected [64] from config.json",
        id="wrong-shape",
    ),
]


@pytest.mark.parametrize("damage, expected", TENSOR_DAMAGE)
def test_generate_bad_checkpoint_tensors_exit_2(tmp_path, ckpt, damage, expected):
    """Exit 2 and the last stderr line is the one `error:` line (the resolved config may precede it)."""
    copy = copy_checkpoint(ckpt, tmp_path)
    rewrite_tensors(copy, damage)
    result = invoke("generate", write_yaml(tmp_path, copy), "--prompt-ids", "1,2,3")
    assert result.exit_code == EXIT_BAD_INPUT, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]], result.stderr
    assert expected in lines[-1], lines[-1]
    assert result.stdout == ""


@pytest.mark.parametrize("damage, expected", TENSOR_DAMAGE)
def test_generate_bad_checkpoint_tensors_one_line(tmp_path, ckpt, damage, expected):
    copy = copy_checkpoint(ckpt, tmp_path)
    rewrite_tensors(copy, damage)
    line = error_line(invoke("generate", write_yaml(tmp_path, copy), "--prompt-ids", "1,2,3"))
    assert expected in line


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("1,256,3", "error: prompt 0: token id 256 is outside the vocabulary 0..255"),
        ("-1,2", "error: prompt 0: token id -1 is outside the vocabulary 0..255"),
    ],
    ids=["too-large", "negative"],
)
def test_generate_token_outside_vocabulary(tmp_path, ckpt, prompt, expected):
    line = error_line(invoke("generate", write_yaml(tmp_path, ckpt), f"--prompt-ids={prompt}"))
    assert line == expected


def test_generate_token_outside_vocabulary_names_prompt_index(tmp_path, ckpt):
    line = error_line(invoke("generate", write_yaml(tmp_path, ckpt), "--prompt-ids", "1,2", "--prompt-ids", "3 999"))
    assert line == "error: prompt 1: token id 999 is outside the vocabulary 0..255"


def test_generate_prompt_longer_than_context_limit(tmp_path, ckpt):
    prompt = ",".join(["5"] * 62)
    line = error_line(invoke("generate", write_yaml(tmp_path, ckpt), "--prompt-ids", prompt, "--max-new-tokens", "3"))
    assert line == "error: prompt 0: 62 tokens + 3 new tokens exceed buckets.context_limit (64)"


# --- checkpoint make-tiny ------------------------------------------------------------------------


def test_make_tiny_refuses_existing_output_without_force(tmp_path):
    out = tmp_path / "tiny"
    first = invoke("checkpoint", "make-tiny", out)
    assert first.exit_code == 0, first.output
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert f"to {out}" in first.stdout

    second = invoke("checkpoint", "make-tiny", out)
    assert error_line(second) == f"error: output {str(out)!r} already exists; pass --force to replace it"

    forced = invoke("checkpoint", "make-tiny", out, "--force", "--seed", "1", "--preset", "wide-16e")
    assert forced.exit_code == 0, forced.output
    assert json.loads((out / "config.json").read_text())["n_routed_experts"] == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no staging dirs left behind


def test_make_tiny_unknown_preset_lists_presets(tmp_path):
    line = error_line(invoke("checkpoint", "make-tiny", tmp_path / "x", "--preset", "huge"))
    assert line == f"error: preset 'huge' is unknown; available: {', '.join(PRESETS)}"
    assert not (tmp_path / "x").exists()


def test_make_tiny_index_topk_only_for_presets_with_an_indexer(tmp_path):
    line = error_line(invoke("checkpoint", "make-tiny", tmp_path / "x", "--index-topk", "8"))
    assert line == "error: --index-topk: preset 'lora-groups' has no sparse-attention indexer; presets with one: v32, v4"
    assert not (tmp_path / "x").exists()


def test_the_v32_example_generates_with_sparse_attention(tmp_path):
    """examples/tiny-v32.yaml with the checkpoint its header says how to make."""
    made = invoke("checkpoint", "make-tiny", tmp_path / "build" / "tiny-v32-ckpt", "--preset", "v32", "--index-topk", "32")
    assert made.exit_code == 0 and "index_topk 32" in made.stdout, made.output
    assert json.loads((tmp_path / "build" / "tiny-v32-ckpt" / "config.json").read_text())["index_topk"] == 32
    (tmp_path / "examples").mkdir()
    example = shutil.copy(Path(__file__).parents[1] / "examples" / "tiny-v32.yaml", tmp_path / "examples")
    result = invoke("generate", example, "--prompt-ids", ",".join(str(i % 250 + 2) for i in range(80)),
                    "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.strip().splitlines()[-1].split()) == 4  # the 4 new token ids


# --- happy path ----------------------------------------------------------------------------------


def test_generate_json_matches_api(tmp_path, ckpt):
    from graphc.tools.generate import generate
    from graphc.weights.checkpoint import load_model

    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11]]  # the second is prefilled in chunks of 4
    new_tokens = 6
    path = write_yaml(tmp_path, ckpt)
    args = ["generate", path, "--max-new-tokens", str(new_tokens), "--json"]
    for prompt in prompts:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    result = invoke(*args)
    assert result.exit_code == 0, (result.output, result.exception)

    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == len(prompts)
    assert [r["prompt_ids"] for r in records] == prompts
    assert all(len(r["output_ids"]) == new_tokens for r in records)

    expected = generate(load_model(ckpt), prompts, new_tokens, prefill_chunk=4, stop_at_eos=True)
    assert [r["output_ids"] for r in records] == expected
    # The resolved config goes to stderr, keeping stdout machine-readable.
    assert "prefill=[2, 4]" in result.stderr
    assert "error" not in result.stderr

    plain = invoke(*[a for a in args if a != "--json"])
    assert plain.exit_code == 0, plain.output
    assert plain.stdout.splitlines() == [" ".join(map(str, tokens)) for tokens in expected]


def test_generate_default_max_new_tokens_from_yaml(tmp_path, ckpt):
    result = invoke("generate", write_yaml(tmp_path, ckpt, **{"runtime.max_new_tokens": 3}), "--prompt-ids", "4,5", "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    assert len(json.loads(result.stdout)["output_ids"]) == 3


# --- the installed console script ----------------------------------------------------------------


def test_console_script_reports_bad_yaml(tmp_path, ckpt):
    script = Path(sys.executable).parent / "graphc"
    assert script.is_file(), f"console script not installed at {script}"
    path = write_yaml(tmp_path, ckpt, **{"buckets.prefill": [4, 128]})
    proc = subprocess.run([str(script), "validate", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_BAD_INPUT, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: buckets.prefill[1]: 128 is larger than buckets.context_limit (64)"), lines[0]
