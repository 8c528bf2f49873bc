"""`graphc probe`: one layer, compiled vs float64 reference, op by op.

A deliberately perturbed op is named (an ATen op of the compiled graph, and a graphc op whose
backend lowering is wrong); the sparse attention's bf16 P is found and labelled a known rounding
point; an fp32 model at reference numerics shows no op beyond the tolerance; FP8 weights are listed.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from click.testing import CliRunner

from graphc.buckets.selection import Bucket
from graphc.cli import cli
from graphc.weights.checkpoint import load_model
from graphc.weights.tiny import make_tiny_checkpoint
from graphc.passes import inline_reference_kernels
from graphc.passes.registry import layer_passes
from graphc.tools.probe import capture_layer, compare, compile_layer, probe_prompt, run_reference, ProbeReport
from support import SPARSE_V32, TEST_BUCKETS, model_yaml


def _yaml(tmp_path, checkpoint, **model):
    config = model_yaml(checkpoint, TEST_BUCKETS["standard"])
    config["model"].update(model)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _probe(path, *args):
    return CliRunner().invoke(cli, ["probe", str(path), *args])


def test_fp32_at_reference_numerics_differs_nowhere(tmp_path, tiny_checkpoints):
    result = _probe(_yaml(tmp_path, tiny_checkpoints[SPARSE_V32], sparse_probabilities="fp32"), "--layer", "1")
    assert result.exit_code == 0, result.output
    assert "a prefill of 32 tokens" in result.output  # the largest prefill bucket: more keys than index_topk
    assert "no op differs beyond the tolerance" in result.output


def test_bf16_probabilities_are_found_and_labelled(tmp_path, tiny_checkpoints):
    result = _probe(_yaml(tmp_path, tiny_checkpoints[SPARSE_V32], sparse_probabilities="bf16"), "--layer", "1")
    assert result.exit_code == 0, result.output  # a known rounding point is not a failure
    lines = result.output.splitlines()
    first = lines.index(next(l for l in lines if l.startswith("first op beyond the tolerance")))
    assert "[inlined from graphc::sparse_mla_attention]" in lines[first + 1]
    relative = float(lines[first + 2].rsplit("relative ", 1)[1])
    assert 1e-5 < relative < 2.0**-8  # above fp32 noise, within one bf16 rounding of P
    assert lines[first + 3] == "  known rounding point: bf16 P in sparse attention"


def test_a_perturbed_aten_op_is_named(tiny_checkpoints):
    model = load_model(tiny_checkpoints[SPARSE_V32])
    program, inputs = capture_layer(model, 1, probe_prompt(24, model.args.vocab_size), 8)
    compiled = compile_layer(program, layer_passes("export"), Bucket("prefill", 24), 3)
    silu = next(n for n in compiled.graph.nodes if n.target is torch.ops.aten.silu.default)
    silu.target = lambda x: torch.ops.aten.silu.default(x) * (1 + 1e-3)  # a lowering 0.1% off
    report = compare(compiled, program, run_reference(program, inputs), inputs, ProbeReport(1, torch.float32, 1e-5, 24))
    assert report.first is not None and report.first.node == silu.name
    assert report.first.rounding_point is None
    assert report.first.relative == pytest.approx(1e-3, rel=0.05)
    assert "swiglu(gate, up" in report.first.source and "models/layers.py" in report.first.source


def test_a_wrongly_lowered_graphc_op_is_named_and_fails(tmp_path, tiny_checkpoints, monkeypatch):
    kernels = dict(inline_reference_kernels.REFERENCE_KERNELS)
    exact = kernels["graphc::paged_indexer_logits"]
    kernels["graphc::paged_indexer_logits"] = lambda *args: exact(*args) * 1.01  # the backend's kernel is off
    monkeypatch.setattr(inline_reference_kernels, "REFERENCE_KERNELS", kernels)
    result = _probe(_yaml(tmp_path, tiny_checkpoints[SPARSE_V32], sparse_probabilities="fp32"), "--layer", "0")
    assert result.exit_code == 1, result.output
    assert "[inlined from graphc::paged_indexer_logits]" in result.output
    assert "known rounding point: no" in result.output


def test_fp8_weights_are_listed(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "fp8", preset="v32", fp8_block=32)
    result = _probe(_yaml(tmp_path, checkpoint), "--layer", "2", "--tokens", "8")
    assert result.exit_code == 0, result.output
    listed = result.output.split("FP8 weights (quantised offline, dequantised exactly on load): ")[1].split(", ")
    assert "self_attn.indexer.wq_b.weight" in listed and "self_attn.q_a_proj.weight" in listed
    assert not any("weights_proj" in name or "norm" in name for name in listed)


def test_a_layer_out_of_range_is_refused(tmp_path, tiny_checkpoints):
    result = _probe(_yaml(tmp_path, tiny_checkpoints["lora-groups"]), "--layer", "3")
    assert result.exit_code == 2
    assert result.output.strip().endswith("error: --layer 3: the model has 3 decoder layers; choose 0..2")


def test_v41_layers_are_refused_with_a_pointer_to_compare(tmp_path, tiny_checkpoints):
    result = _probe(_yaml(tmp_path, tiny_checkpoints["v41"]), "--layer", "1")
    assert result.exit_code == 2 and "use `graphc compare` against its reference" in result.output


@pytest.mark.parametrize("layer", [0, 1, 2])  # CSA (hash-routed), HCA (hash-routed), sliding only
def test_v4_layers_at_reference_numerics_differ_nowhere(layer, tmp_path, tiny_checkpoints):
    result = _probe(_yaml(tmp_path, tiny_checkpoints["v4"]), "--layer", str(layer))
    assert result.exit_code == 0, result.output
    assert "no op differs beyond the tolerance" in result.output


def test_a_perturbed_v4_window_pool_is_named(tiny_checkpoints):
    model = load_model(tiny_checkpoints["v4"])
    program, inputs = capture_layer(model, 0, probe_prompt(24, model.args.vocab_size), 8)
    compiled = compile_layer(program, layer_passes("export"), Bucket("prefill", 24), 3)
    pool_lse = next(n for n in compiled.graph.nodes if n.target is torch.ops.aten.logsumexp.default)
    pool_lse.target = lambda *args: torch.ops.aten.logsumexp.default(*args) + 1e-3
    report = compare(compiled, program, run_reference(program, inputs), inputs, ProbeReport(0, torch.float32, 1e-5, 24))
    assert report.first is not None and report.first.node == pool_lse.name
    # export records `forward` frames only: the line of the attention that pools the windows
    assert "models/deepseek_v4/model.py" in report.first.source and "self._entries(" in report.first.source
