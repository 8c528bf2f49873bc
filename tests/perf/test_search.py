"""`graphc plan --search`: every compilable layout of a tiny model on a small device file, priced as
`graphc plan` prices it, its Pareto front undominated, the chosen layout written as a model.yaml
that loads, plans to the same TPOT and compiles; the bad searches refused in one line."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from graphc.artifacts.directory import read_manifest
from graphc.cli import cli
from graphc.compiler.pipeline import CompileOptions, compile
from graphc.config import load_config
from graphc.perf.device import SHIPPED, load_device
from graphc.perf.search import Limits, _stored, _tensors, layouts, pareto, search
from support import FP8_PRESETS, TEST_BUCKETS, V4_FP4_EXPERTS, model_yaml, one_line_refusal


def _device_file(tmp_path, ranks_per_chip: int = 2, chips: int = 2):
    data = yaml.safe_load((SHIPPED / "trn2.yaml").read_text())
    data.update(name="small")
    data["ranks_per_chip"]["value"], data["chips_per_node"]["value"] = ranks_per_chip, chips
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _model(tmp_path, checkpoint, backend: str = "export"):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(model_yaml(checkpoint, TEST_BUCKETS["small"], backend)))
    return path


def test_every_layout_is_one_graphc_compiles_and_the_front_is_undominated(tiny_checkpoints, tmp_path):
    config = load_config(_model(tmp_path, tiny_checkpoints["wide-16e"]))
    found = layouts(config, 4)
    # dp x cp x tp = 4, ep | 4 (and | 16 experts); wide-16e is served at tp 1 or 2 (its FFN widths), data
    # parallelism with each of the lowerings where tokens travel.
    assert {(t.dp, t.cp, t.tp, t.ep) for t, _, _ in found} >= {(1, 4, 1, 4), (1, 2, 2, 4), (4, 1, 1, 4), (2, 2, 1, 2)}
    assert {lowering for t, lowering, _ in found if t.dp == 4 and t.ep == 4} == {"ag_rs", "a2a_even", "a2a_v"}
    device = load_device(path=_device_file(tmp_path))
    priced = search(config, device, Limits(64, 8))
    front = pareto(priced)
    assert front and all(not (o.user_tokens_per_second > c.user_tokens_per_second
                              and o.instance_tokens_per_second(1) > c.instance_tokens_per_second(1))
                         for c in front for o in priced)
    assert {c.batch for c in priced} <= {1, 2, 4, 8}


@pytest.mark.parametrize("preset", [*FP8_PRESETS, V4_FP4_EXPERTS])
def test_a_ranks_tensors_cut_by_ep_are_those_it_stores(fp8_checkpoints, tmp_path, preset):
    config = model_yaml(fp8_checkpoints[preset], TEST_BUCKETS["small"], dtype="bfloat16")
    config["model"]["weights"] = "as-stored"
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    loaded = load_config(tmp_path / "model.yaml")
    assert _tensors(loaded, 2, 1) == _stored(loaded, 2, 1)


@pytest.mark.compiles
def test_the_chosen_layout_is_written_plans_to_its_tpot_and_compiles(tiny_checkpoints, tmp_path):
    device, written = _device_file(tmp_path), tmp_path / "chosen.yaml"
    result = CliRunner().invoke(cli, ["plan", str(_model(tmp_path, tiny_checkpoints["wide-16e"])), "--device-file",
                                      str(device), "--search", "--objective", "throughput", "--batch", "8",
                                      "--write-yaml", str(written), "--json"])
    assert result.exit_code == 0, result.output
    chosen = json.loads(result.stdout)["chosen"]
    config = load_config(written)
    t = config.topology
    assert (t.dp, t.cp, t.tp, t.ep, config.buckets.decode) == (chosen["dp"], chosen["cp"], chosen["tp"], chosen["ep"],
                                                             [chosen["batch"]])
    planned = CliRunner().invoke(cli, ["plan", str(written), "--device-file", str(device), "--json"])
    steps = {s["bucket"]: s for s in json.loads(planned.stdout)["steps"]}
    assert steps[f"decode-{chosen['batch']}"]["step_ms"] == pytest.approx(chosen["tpot_ms"])
    compile(config, tmp_path / "artifacts", CompileOptions(show_progress=False))
    assert read_manifest(tmp_path / "artifacts").topology == t


@pytest.mark.parametrize("flags, says", [
    (["--search"], "error: --search prices layouts with a device's constants: pass --device or --device-file"),
    (["--device", "trn2", "--search", "--tpot-ms", "0.001"], "error: --search: no feasible layout meets --tpot-ms "
                                                             "0.001; the fastest TPOT is"),
    (["--device", "trn2", "--device-memory", "0.0001", "--search"], "error: --search: no layout of "
                                                                    "DeepseekV3ForCausalLM fits 1 instance(s) of trn2"),
])
def test_a_search_with_nothing_to_find_is_a_one_line_error(tiny_checkpoints, tmp_path, flags, says):
    result = CliRunner().invoke(cli, ["plan", str(_model(tmp_path, tiny_checkpoints["lora-groups"])), *flags])
    assert one_line_refusal(result).startswith(says)


@pytest.mark.parametrize("flags, says", [
    (["--device", "trn2", "--batch", "8"], "error: --batch goes with --search"),
    (["--device", "trn2", "--search", "--artifacts", "build"], "error: --artifacts plans the config's own layout; "
                                                               "--search prices every layout without it"),
])
def test_flags_of_the_other_mode_are_refused(tiny_checkpoints, tmp_path, flags, says):
    result = CliRunner().invoke(cli, ["plan", str(_model(tmp_path, tiny_checkpoints["lora-groups"])), *flags])
    assert one_line_refusal(result) == says
