"""`graphc calibrate` writes this host as a device file the step model reads, every measured value
marked so; `graphc profile` times each program of a one-rank compile beside its prediction, fits
the fixed cost a layer on request, and refuses artifacts that are not the config's one-rank compile."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from graphc.cli import cli
from graphc.perf.device import load_device
from support import one_line_refusal


@pytest.fixture(scope="module")
def host_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("host") / "host.yaml"
    result = CliRunner().invoke(cli, ["calibrate", "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


@pytest.mark.multirank
def test_calibrate_writes_a_device_file_of_measured_values(host_file):
    device = load_device(path=host_file)
    measured = {name for name, value in device.sourced().items() if value.provenance == "measured"}
    assert {"hbm_gbs", "tflops.float32", "tflops.bfloat16", "links.chip.latency_us", "links.chip.gbs"} <= measured
    assert device.hbm.value > 1e9 and device.flops["float32"].value > 1e9 and device.links["chip"].latency.value > 0
    assert device.layer_fixed.provenance == "assumed"  # until graphc profile --fit


@pytest.mark.multirank
def test_profile_times_each_program_beside_its_prediction_and_fits_the_layer_cost(host_file, compiled, tmp_path):
    artifacts = compiled("lora-groups", "export", "small")
    own = tmp_path / "host.yaml"
    own.write_text(host_file.read_text())
    result = CliRunner().invoke(cli, ["profile", str(artifacts.parent / "model.yaml"), str(artifacts),
                                      "--device-file", str(own), "--repeats", "3", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["bucket"]: r for r in json.loads(result.stdout)}
    assert set(rows) == {"prefill-8", "decode-2"}
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows.values())
    fitted = CliRunner().invoke(cli, ["profile", str(artifacts.parent / "model.yaml"), str(artifacts),
                                      "--device-file", str(own), "--repeats", "3", "--fit"])
    assert fitted.exit_code == 0, fitted.output
    value = yaml.safe_load(own.read_text())["layer_fixed_us"]
    assert value["provenance"] == "calibrated" and value["value"] > 0 and str(artifacts) in value["source"]


@pytest.mark.multirank
@pytest.mark.parametrize("case, says", [
    ("two ranks", "error: graphc profile: "),
    ("another config", "error: graphc profile: artifacts "),
])
def test_profile_refuses_what_is_not_the_configs_one_rank_compile(host_file, compiled, tmp_path, case, says):
    if case == "two ranks":
        artifacts = compiled("wide-16e", "export", "small", 2, 2)
        model_yaml = artifacts.parent / "model.yaml"
    else:
        artifacts = compiled("lora-groups", "export", "small")
        other = yaml.safe_load((artifacts.parent / "model.yaml").read_text())
        other["buckets"]["context_limit"] *= 2
        model_yaml = tmp_path / "model.yaml"
        model_yaml.write_text(yaml.safe_dump(other))
    result = CliRunner().invoke(cli, ["profile", str(model_yaml), str(artifacts), "--device-file", str(host_file)])
    line = one_line_refusal(result)
    assert line.startswith(says)
    assert ("compiled for 2 ranks" in line) if case == "two ranks" else ("compiled with buckets.context_limit" in line)
