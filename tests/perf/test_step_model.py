"""The step model (`graphc.perf`): device files as data, its arithmetic term by term, the busiest
rank of the router, the one calibration reproducible from its source, and the released
DeepSeek-V3's work counted from its shapes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from graphc.buckets.selection import Bucket
from graphc.cli import cli
from graphc.config import load_config
from graphc.perf.device import PROVENANCES, SHIPPED, load_device, shipped
from graphc.perf.reference import NXD_V3, nxd_v3_work
from graphc.perf.routing import busiest_rank
from graphc.perf.step_time import Matmul, RuntimeCollective, StepWork, fit_layer_fixed, step_time
from graphc.perf.work import config_work
from support import TEST_BUCKETS, model_yaml, one_line_refusal

RELEASED = Path(__file__).resolve().parents[2] / "examples" / "released"
TRN2 = load_device("trn2")


def test_every_shipped_device_loads_with_each_value_sourced():
    assert shipped() == ["trn1", "trn2", "trn2-lnc1", "trn3"]
    for name in shipped():
        device = load_device(name)
        for key, value in device.sourced().items():
            assert value.provenance in PROVENANCES and value.source, (name, key)
    # A rank of trn2 at LNC 2 is a quarter of the chip the data sheet gives.
    assert TRN2.memory.value == 96 * 2**30 / 4 and TRN2.hbm.value == 2.9e12 / 4
    assert TRN2.flops["bfloat16"].value == 667e12 / 4
    assert TRN2.span([0, 1, 2, 3]) == "chip" and TRN2.span([0, 4]) == "node" and TRN2.span([0, 64]) == "network"


def _work(**changes) -> StepWork:
    work = StepWork("decode-2", 2, 3, "bfloat16", 1e9, 5e8, 2.5e8,
                    (Matmul(2, 7168, 64), Matmul(2, 32, 7168, 58)),
                    (RuntimeCollective("all_reduce", 64, "node", 28672, 122),
                     RuntimeCollective("all_gather", 4, "chip", 1000, 1)))
    return dataclasses.replace(work, **changes)


def test_each_term_is_its_formula():
    time = step_time(_work(), TRN2)
    assert time.memory == pytest.approx(1.75e9 / 725e9)
    # 7168 x 64 fills half of a 128-wide array, 32 x 7168 a quarter.
    rate = 667e12 / 4
    assert time.flops == pytest.approx(2 * 2 * 7168 * 64 / (rate * 0.5) + 2 * 2 * 32 * 7168 * 58 / (rate * 0.25))
    assert time.fixed == pytest.approx(3 * TRN2.layer_fixed.value)
    assert time.collectives == pytest.approx(122 * (24e-6 + 2 * 63 / 64 * 28672 / 256e9) + (5e-6 + 3 * 1000 / 725e9))
    device = max(time.memory, time.flops) + time.fixed + time.collectives
    assert time.straggler == pytest.approx(device * 0.05 / 0.95)
    assert time.step == pytest.approx(device / 0.95 + 440e-6)
    assert time.collective_calls == 123
    assert sum(time.shares().values()) == pytest.approx(1.0)


def test_memory_and_flops_overlap_and_the_larger_is_paid():
    compute_bound = step_time(_work(matmuls=(Matmul(4096, 7168, 7168, 100),)), TRN2)
    assert compute_bound.flops > compute_bound.memory
    assert compute_bound.device == pytest.approx(compute_bound.flops + compute_bound.fixed + compute_bound.collectives)
    assert compute_bound.shares()["memory"] == 0


def test_the_fit_inverts_the_model():
    work = _work()
    fixed = fit_layer_fixed(work, TRN2, 20e-3)
    refitted = dataclasses.replace(TRN2, layer_fixed=dataclasses.replace(TRN2.layer_fixed, value=fixed))
    assert step_time(work, refitted).step == pytest.approx(20e-3)


def test_the_busiest_rank_is_busier_than_the_mean_and_the_group_limit_concentrates_routes():
    experts, per_token, ranks = 256, 8, 64
    one_token = busiest_rank(1, experts, per_token, 8, 4, ranks)
    assert 1 < one_token.routes <= per_token and one_token.experts == one_token.routes  # one token: each route its own expert
    eight = busiest_rank(8, experts, per_token, 8, 4, ranks)
    assert eight.routes > 8 * per_token / ranks  # above the mean rank's
    # One group a token, a group a rank's experts (8 ranks of 32): a token's 8 routes land on one rank.
    assert busiest_rank(1, experts, per_token, 8, 1, 8).routes == per_token
    assert busiest_rank(1, experts, per_token, 1, 1, 8).routes < per_token
    assert busiest_rank(8, experts, per_token, 8, 4, ranks) == eight  # seeded


def test_the_calibrated_layer_cost_is_the_fit_on_nxd_inferences_tpot():
    """The trn2 file's one calibrated value is reproducible from its source: fitted on NxD
    Inference's DeepSeek-V3 TPOT with every other constant from the file (never refitted)."""
    config = load_config(RELEASED / "v3-trn2.yaml")
    work = nxd_v3_work(config.model_args, config.model.checkpoint, Bucket("decode", 1))
    assert TRN2.layer_fixed.provenance == "calibrated"
    assert fit_layer_fixed(work, TRN2, NXD_V3["tpot_ms"] * 1e-3) * 1e6 == pytest.approx(TRN2.layer_fixed.value * 1e6,
                                                                                           abs=0.05)
    # Its layout as NxD Inference describes it: 123 collectives, the hit experts' 64th each.
    assert work.collective_calls == 123 and work.layers == 61


def test_the_released_v3s_expert_work_is_the_neuron_grouped_gemms_form():
    config = load_config(RELEASED / "v3-trn2-tp16.yaml")
    [prefill, decode, *_] = config_work(config, TRN2)
    # cp 4 x tp 16 x ep 64: 4 local experts of 58 MoE layers, FP8 gate-up and down with fp32 scales.
    expert = 3 * 7168 * 2048 + 2 * (7168 // 128) * (2048 // 128) * 4 + (4096 // 128) * (7168 // 128) * 4
    assert decode.expert_bytes == pytest.approx(4 * 58 * expert, rel=0.01)
    # 61 attention combines, 64 tp all-reduces (attention, 3 dense FFNs; the shared experts ride the
    # ep all-reduce), 58 ep all-reduces, the embedding's and the logits' gathers: 185 a decode step
    # (each combine one all-gather); a 256-token chunk's combines are two all-reduces each (246).
    assert decode.collective_calls == 185 and prefill.collective_calls == 246
    # The grouped GEMM in blocks (`grouped_block`): decode-1's 4 routes a rank can hold in 4 blocks
    # of 4 (every local expert read once, 16 rows where expert-major computed E' x T x K = 32); a
    # 256-token chunk's 1,024 in 7 blocks of 256 (7 reads, 1,792 rows; expert-major 8,192).
    assert [m.rows for m in decode.matmuls[-2:]] == [16, 16] and [m.rows for m in prefill.matmuls[-2:]] == [1792, 1792]
    assert prefill.expert_bytes == pytest.approx(7 * 58 * expert, rel=0.01)


def test_plan_prints_each_buckets_time_split_and_its_constants():
    result = CliRunner().invoke(cli, ["plan", str(RELEASED / "v3-trn2-tp16.yaml"), "--device", "trn2"])
    assert result.exit_code == 0, result.output
    assert "step model on the busiest rank" in result.stdout and "TTFT " in result.stdout
    assert "layer_fixed_us               calibrated" in result.stdout
    as_json = CliRunner().invoke(cli, ["plan", str(RELEASED / "v3-trn2-tp16.yaml"), "--device", "trn2", "--json"])
    steps = {s["bucket"]: s for s in json.loads(as_json.stdout)["steps"]}
    decode = steps["decode-1"]
    parts = ("memory_ms", "flops_ms")
    assert decode["step_ms"] == pytest.approx(max(decode[p] for p in parts) + decode["fixed_ms"] + decode["collectives_ms"]
                                              + decode["straggler_ms"] + decode["host_ms"])
    assert decode["collective_calls"] == 185


def _device_file(tmp_path, edit) -> Path:
    data = yaml.safe_load((SHIPPED / "trn2.yaml").read_text())
    edit(data)
    path = tmp_path / "device.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.pop("hbm_gbs"), "hbm_gbs is missing"),
    (lambda d: d["links"]["node"]["latency_us"].update(value=-1), "links.node.latency_us.value -1 must be positive"),
    (lambda d: d["straggler_share"].update(value=1.5), "straggler_share.value 1.5 must be in [0, 1)"),
    (lambda d: d["tflops"]["bfloat16"].update(provenance="guess"), "tflops.bfloat16.provenance 'guess' must be one of"),
    (lambda d: d["pe_width"].update(value="wide"), "pe_width.value 'wide' must be a number"),
])
def test_a_bad_device_file_is_a_one_line_error_naming_the_value(tiny_checkpoints, tmp_path, edit, says):
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["lora-groups"], TEST_BUCKETS["small"])))
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "model.yaml"), "--device-file",
                                      str(_device_file(tmp_path, edit))])
    assert says in one_line_refusal(result)


def test_a_device_file_of_ones_own_plans_as_the_shipped_one(tiny_checkpoints, tmp_path):
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["lora-groups"], TEST_BUCKETS["small"])))
    own = _device_file(tmp_path, lambda d: d.update(name="mine"))
    runs = [CliRunner().invoke(cli, ["plan", str(tmp_path / "model.yaml"), *flags, "--json"])
            for flags in (["--device", "trn2"], ["--device-file", str(own)])]
    shipped_plan, own_plan = (json.loads(r.stdout) for r in runs)
    assert own_plan["device"] == "mine" and own_plan["steps"] == shipped_plan["steps"]
