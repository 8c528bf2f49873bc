"""`graphc compare`: golden tokens from the reference, the compiled artifacts teacher-forced on
them, judged against the reference's noise floor (the V4.1 reference here: transformers has no V4.1)."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from graphc.artifacts.directory import read_manifest
from graphc.cli import cli
from graphc.weights.tiny import make_tiny_checkpoint
from support import TEST_BUCKETS, model_yaml

pytestmark = pytest.mark.compiles
PROMPTS = ["5,17,42,99,3,250,7", "9,8,7,6,5,4,3,2"]


def _yaml(tmp_path, checkpoint) -> str:
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(model_yaml(checkpoint, TEST_BUCKETS["small"])))
    return str(path)


def _compare(tmp_path, checkpoint, artifacts, *extra):
    args = ["compare", _yaml(tmp_path, checkpoint), str(artifacts), "--new-tokens", "20", "--seeds", "2",
            "--json", str(tmp_path / "report.json"), *extra]
    for prompt in PROMPTS:
        args += ["--prompt-ids", prompt]
    return CliRunner().invoke(cli, args)


def test_fp32_artifacts_match_every_golden_token(tmp_path, compiled, tiny_checkpoints):
    result = _compare(tmp_path, tiny_checkpoints["v41"], compiled("v41", "export", "small"))
    assert result.exit_code == 0, result.output
    reports = json.loads((tmp_path / "report.json").read_text())
    assert [r["matched"] for r in reports] == [20, 20] and all(not r["mismatches"] for r in reports)
    for r in reports:  # fp32: the same function up to rounding, far inside the floor
        assert min(r["cosine"]) > 0.999999 and max(r["relative_error"]) < 1e-5
        assert len(r["floor"]) == 20 and min(r["floor"]) > 0
        assert r["cosine"][r["worst_step"]] == min(r["cosine"])
        assert r["reference_matched"] == [20, 20]  # one fp32 ulp moves no argmax of this model
    assert "greedy tokens matched 20/20" in result.output and "noise floor" in result.output
    assert "the perturbed reference itself keeps 20-20/20" in result.output


def test_artifacts_of_other_weights_fail_outside_the_floor(tmp_path, compiled, tiny_checkpoints):
    """The golden tokens of other weights: every step compared, mismatches flagged, exit 1."""
    other = make_tiny_checkpoint(tmp_path / "other", preset="v41", seed=1)
    result = _compare(tmp_path, other, compiled("v41", "export", "small"))
    assert result.exit_code == 1, result.output
    reports = json.loads((tmp_path / "report.json").read_text())
    outside = [m for r in reports for m in r["mismatches"] if not m["inside_floor"]]
    assert outside and all(m["margin"] > 2 * m["floor"] for m in outside)
    # The reference is the other weights' model: perturbing it by one ulp keeps far more of its
    # own golden tokens than the artifacts of different weights do.
    assert all(min(r["reference_matched"]) > r["matched"] for r in reports)
    assert "OUTSIDE" in result.output


@pytest.mark.multirank
@pytest.mark.parametrize("preset, buckets, dp, cp, ep", [
    # Context-parallel KV shards (the V4.1 reference is the slowest): the nightly tier's.
    pytest.param("v41", "small", 1, 2, 2, marks=pytest.mark.slow),
    ("lora-groups", "dp", 2, 1, 2),  # data-parallel replicas: the second one's rows all padding
])
def test_multi_rank_fp32_artifacts_match_every_golden_token(tmp_path, compiled, tiny_checkpoints, preset, buckets,
                                                            dp, cp, ep):
    result = _compare(tmp_path, tiny_checkpoints[preset], compiled(preset, "export", buckets, cp, ep, dp=dp))
    assert result.exit_code == 0, result.output
    reports = json.loads((tmp_path / "report.json").read_text())
    assert [r["matched"] for r in reports] == [20, 20]
    assert min(min(r["cosine"]) for r in reports) > 0.999999 and max(max(r["relative_error"]) for r in reports) < 1e-5


@pytest.mark.multirank
def test_bf16_tensor_parallel_artifacts_stay_inside_the_floor(tmp_path, compiled, tiny_checkpoints):
    """Heads, FFN widths, embedding and vocabulary split over 2 ranks in bf16, judged against the
    reference's own bf16 noise floor (a broken split misses golden tokens by margins far outside
    it: see the other-weights test)."""
    split = compiled("lora-groups", "export", "small", 1, 2, tp=2, dtype="bfloat16")
    assert read_manifest(split).model.dtype == "bfloat16"
    result = _compare(tmp_path, tiny_checkpoints["lora-groups"], split)
    assert result.exit_code == 0, result.output
    reports = json.loads((tmp_path / "report.json").read_text())
    assert all(m["inside_floor"] for r in reports for m in r["mismatches"])
    assert max(max(r["relative_error"]) for r in reports) > 1e-3  # bf16's rounding, not fp32's


@pytest.mark.slow
def test_bf16_v41_neuron_artifacts_stay_inside_the_floor(tmp_path, compiled, tiny_checkpoints):
    """V4.1 (Engram) lowered to XLA and served on XLA:CPU in bf16, judged against the V4.1
    reference's own bf16 noise floor (measured with the defaults, 3 x 27 tokens: 25, 25, 25
    matched, every miss inside)."""
    artifacts = compiled("v41", "neuron", "small", dtype="bfloat16")
    result = _compare(tmp_path, tiny_checkpoints["v41"], artifacts)
    assert result.exit_code == 0, result.output
    reports = json.loads((tmp_path / "report.json").read_text())
    assert all(m["inside_floor"] for r in reports for m in r["mismatches"])
    assert max(max(r["relative_error"]) for r in reports) > 1e-3  # bf16's rounding, not fp32's


def test_transformers_is_the_reference_where_it_has_the_architecture(tmp_path, compiled, tiny_checkpoints):
    result = _compare(tmp_path, tiny_checkpoints["lora-groups"], compiled("lora-groups", "export", "small"))
    assert result.exit_code == 0, result.output
    reports = json.loads((tmp_path / "report.json").read_text())
    assert [r["matched"] for r in reports] == [20, 20] and min(min(r["cosine"]) for r in reports) > 0.999999
