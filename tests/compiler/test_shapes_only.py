"""Shapes-only compiles: a checkpoint of config.json alone (or `--shapes-only`) compiles every
program with abstract weights: the very programs a compile with the weights makes, a manifest
marked shapes-only whose weights entries list names, shapes and dtypes, and which `graphc run`
refuses in one line. A two-layer slice of the released DeepSeek-V3 at its real width compiles so
on export and neuron (lint clean), its weights as `graphc plan --device` counts them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors import safe_open

from graphc.artifacts.directory import read_manifest
from graphc.cli import cli
from graphc.compiler.pipeline import CompileOptions, compile
from graphc.config import load_config
from graphc.tools.device_plan import DEVICES, plan_device
from support import model_yaml, one_line_refusal

pytestmark = pytest.mark.compiles
BUCKETS = {"prefill": [8], "decode": [1], "prompt_as_decode": 0, "context_limit": 64}
RELEASED_V3 = Path(__file__).resolve().parents[2] / "examples" / "released" / "deepseek-v3" / "config.json"


def _compile(tmp_path: Path, name: str, checkpoint: Path, backend: str = "export", **options) -> Path:
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(model_yaml(checkpoint, BUCKETS, backend, dtype="bfloat16")))
    compile(load_config(tmp_path / f"{name}.yaml"), tmp_path / name, CompileOptions(show_progress=False, **options))
    return tmp_path / name


def test_a_config_alone_compiles_the_programs_a_checkpoint_does(fp8_checkpoints, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(fp8_checkpoints["lora-groups"] / "config.json", config_only)
    full = _compile(tmp_path, "full", fp8_checkpoints["lora-groups"])
    for abstract in (_compile(tmp_path, "abstract", config_only),
                     _compile(tmp_path, "flagged", fp8_checkpoints["lora-groups"], shapes_only=True)):
        manifest, real = read_manifest(abstract), read_manifest(full)
        assert manifest.shapes_only and not real.shapes_only
        assert [g.sha256 for g in manifest.ranks[0].graphs] == [g.sha256 for g in real.ranks[0].graphs]
        listed = json.loads((abstract / manifest.ranks[0].weights).read_text())
        with safe_open(full / real.ranks[0].weights, "pt") as f:
            stored = [{"name": n, "shape": list(f.get_slice(n).get_shape()),
                       "dtype": str(f.get_tensor(n).dtype).removeprefix("torch.")} for n in real.ranks[0].weight_names]
        assert listed == stored and manifest.ranks[0].weight_names == real.ranks[0].weight_names
        result = CliRunner().invoke(cli, ["run", str(abstract), "--prompt-ids", "1,2"])
        assert one_line_refusal(result) == (f"error: {abstract}: compiled shapes-only (from a config.json without "
                                            "weights): nothing to serve; compile the checkpoint with its weights to run it")


@pytest.mark.parametrize("backend", ["export", "neuron"])
def test_a_two_layer_slice_of_the_released_v3_compiles_at_its_real_width(tmp_path, backend):
    config = json.loads(RELEASED_V3.read_text())
    config.update(num_hidden_layers=2, first_k_dense_replace=1)  # one dense layer, one MoE layer
    (tmp_path / "v3-slice").mkdir()
    (tmp_path / "v3-slice" / "config.json").write_text(json.dumps(config))
    data = {**model_yaml(tmp_path / "v3-slice", BUCKETS, backend, dtype="bfloat16"), "topology": {"cp": 2, "ep": 2}}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    loaded = load_config(tmp_path / "model.yaml")
    compile(loaded, tmp_path / "artifacts", CompileOptions(show_progress=False))
    manifest = read_manifest(tmp_path / "artifacts")
    assert manifest.shapes_only and len(manifest.ranks) == 2
    listed = json.loads((tmp_path / "artifacts" / manifest.ranks[0].weights).read_text())
    shapes = {t["name"]: (t["shape"], t["dtype"]) for t in listed}
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == ([128, 4096, 7168], "float8_e4m3fn")
    assert shapes["model.layers.1.mlp.experts.gate_up_proj_scale_inv"] == ([128, 32, 56], "float32")
    assert shapes["model.embed_tokens.weight"] == ([129280, 7168], "bfloat16")
    stored = sum(torch.Size(shape).numel() * getattr(torch, dtype).itemsize for shape, dtype in shapes.values())
    assert sum(plan_device(loaded, DEVICES["trn2"]).weights_bytes.values()) == stored
    if backend == "neuron":
        result = CliRunner().invoke(cli, ["inspect", "--lint", str(tmp_path / "artifacts")])
        assert result.exit_code == 0 and "no problem(s)" in result.stdout, result.output
