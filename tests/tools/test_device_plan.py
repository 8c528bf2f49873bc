"""`graphc plan --device`: a rank's memory and decode bytes. Its weights are held to what the
compiler writes, byte for byte, for every family, FP8 kept or not, at one and two EP shards (and
two tensor-parallel ones); the
released DeepSeek-V3 config's numbers to the arithmetic of its shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from graphc.cli import cli
from graphc.compiler.capture import model_weights
from graphc.config import load_config
from graphc.weights.checkpoint import load_rank_shard
from graphc.tools.device_plan import DEVICES, plan_device, rank_tensors
from support import FP8_PRESETS, TEST_BUCKETS, V4_FP4_EXPERTS, model_yaml, one_line_refusal

RELEASED = Path(__file__).resolve().parents[2] / "examples" / "released"


@pytest.mark.parametrize("preset, tp", [*((p, 1) for p in (*FP8_PRESETS, V4_FP4_EXPERTS)), ("lora-groups", 2),
                                         ("v32", 2), ("v4", 2), ("v41", 2)])
@pytest.mark.parametrize("weights", ["as-stored", "dequantized"])
@pytest.mark.parametrize("ep", [1, 2])
def test_the_planned_weights_are_those_the_compiler_writes(fp8_checkpoints, tmp_path, preset, tp, weights, ep):
    config = model_yaml(fp8_checkpoints[preset], TEST_BUCKETS["small"], dtype="bfloat16")
    config["model"]["weights"] = weights
    config["topology"] = {"cp": ep, "ep": ep, "tp": tp}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    loaded = load_config(tmp_path / "model.yaml")
    planned = {t.name: t for t in rank_tensors(loaded)}
    topology = loaded.topology
    for rank in {topology.weight_shard(r): r for r in range(topology.world)}.values():  # every shard is as planned
        model = load_rank_shard(loaded.model.checkpoint, topology, rank, torch.bfloat16,
                                as_stored=weights == "as-stored")
        written = model_weights(model)
        scales = {name: written.pop(q.scale) for name, q in model.quantized_weights.items()}
        assert sorted(written) == sorted(planned)
        for name, tensor in written.items():
            assert (planned[name].shape, planned[name].dtype) == (tuple(tensor.shape), tensor.dtype), name
            assert planned[name].scale_shape == (tuple(scales[name].shape) if name in scales else None), name
            if name in scales:
                assert planned[name].scale_dtype == scales[name].dtype, name
                assert planned[name].quantized == model.quantized_weights[name]


def _released_arithmetic(cp_ep: int) -> float:
    """Bytes of one rank of the released DeepSeek-V3 at cp = ep = `cp_ep`, from its shapes: FP8
    projections (1 byte; scales left out: 1/4096 of them), bf16 embedding and head, fp32 routers."""
    d, heads, layers, dense, experts, width = 7168, 128, 61, 3, 256, 2048
    attention = d * 1536 + 1536 * heads * 192 + d * 576 + 512 * heads * 256 + heads * 128 * d
    routed = (layers - dense) * (experts // cp_ep) * 3 * d * width
    return (layers * attention + dense * 3 * d * 18432 + (layers - dense) * 3 * d * width + routed
            + 2 * 2 * 129280 * d + 4 * (layers - dense) * experts * d)


def test_the_released_v3_on_trn2_at_cp_ep_64_does_not_fit_and_says_why():
    plan = plan_device(load_config(RELEASED / "v3-trn2.yaml"), DEVICES["trn2"])
    weights = sum(plan.weights_bytes.values())
    assert abs(weights / _released_arithmetic(64) - 1) < 0.02
    assert 29e9 < weights < 30e9 and plan.weights_bytes["float8_e4m3fn"] > 25e9
    assert not plan.fits and "exceed the device's 24.0 GiB" in plan.reason and plan.kv_tokens_fit == 0
    decode = {d.rows: d for d in plan.decode}
    # Batch 1 reads every replicated weight (~17.4 GB) and few routed experts: a ~24 ms roofline.
    assert 17e9 < decode[1].weights_read < 18e9 and decode[1].experts_expected < decode[1].experts_worst
    assert decode[1].step_ms == pytest.approx(decode[1].step_bytes / DEVICES["trn2"].bandwidth * 1e3)
    dequantized = load_config(RELEASED / "v3-trn2.yaml")
    object.__setattr__(dequantized.model, "weights", "dequantized")
    assert sum(plan_device(dequantized, DEVICES["trn2"]).weights_bytes.values()) > 1.8 * weights


@pytest.mark.parametrize("released, experts, layers, hidden, width", [
    ("v4-flash-trn2.yaml", 256, 43, 4096, 2048), ("v41-flash-trn2.yaml", 384, 40, 5120, 2304)])
def test_the_released_v4_flash_and_v41_flash_fit_a_trn2_rank_with_their_experts_fp4(released, experts, layers, hidden,
                                                                                    width):
    """Their config.json says `expert_dtype: fp4`: a rank's routed experts (experts / 64 of each
    layer's, gate, up and down) are half a byte a value plus an e8m0 byte per 32; V4.1's Engram
    tables stay FP8 with a scale per row and 32 columns, each rank holding 1 / 64 of their rows."""
    config = load_config(RELEASED / released)
    plan = plan_device(config, DEVICES["trn2"])
    assert plan.fits, plan.reason
    assert plan.weights_bytes["float4_e2m1"] == experts // 64 * layers * 3 * hidden * width * (1 / 2 + 1 / 32)
    tables = [t for t in rank_tensors(config) if ".engram.embed." in t.name]
    assert len(tables) == (2 if "v41" in released else 0)
    for table in tables:
        assert table.dtype == torch.float8_e4m3fn and table.quantized.by_row and table.quantized.block == (1, 32)
        assert table.shape[0] * 64 >= config.model_args.engram.table_rows()[int(table.name.split(".")[2])]


@pytest.mark.parametrize("k", [1, 2])
def test_a_speculative_step_reads_the_mtp_layer_and_the_head_again_for_each_draft(tmp_path, k):
    """The released V3 at tp 16 with its MTP layer (61) drafting k tokens: a verify step reads the
    main weights once for B (1 + k) tokens, then per MTP pass that layer's weights and the LM head
    again (one pass over the step's tokens, k - 1 over a token a row); it costs more than one plain
    step and less than 1 + k of them, and yields up to 1 + k tokens a row."""
    config = yaml.safe_load((RELEASED / "v3-trn2-tp16.yaml").read_text())
    config["model"]["checkpoint"] = str(RELEASED / config["model"]["checkpoint"])
    config["model"]["speculative"] = {"method": "mtp", "tokens": k}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    speculative = load_config(tmp_path / "model.yaml")
    plain = plan_device(load_config(RELEASED / "v3-trn2-tp16.yaml"), DEVICES["trn2"]).decode
    tensors = {t.name: t.nbytes for t in rank_tensors(speculative)}
    mtp_layer = sum(n for name, n in tensors.items() if name.startswith("model.layers.61.") and ".experts." not in name)
    embedding_row = tensors["model.embed_tokens.weight"] // 129280
    for step, without in zip(plan_device(speculative, DEVICES["trn2"]).decode, plain, strict=True):
        rows = step.rows
        assert step.bucket == f"decode-{rows}x{1 + k}"
        passes = rows * (1 + k) + rows * (k - 1)
        assert step.weights_read == (without.weights_read + k * (mtp_layer + tensors["lm_head.weight"])
                                     + embedding_row * (rows * (1 + k) - rows + passes))
        assert without.step_ms < step.step_ms < (1 + k) * without.step_ms
        assert step.tokens_per_second_accepted == pytest.approx((1 + k) * step.tokens_per_second)


def test_the_released_v41_flash_drafting_with_dspark_fits_and_reads_its_stages_once_a_step():
    """DeepSeek-V4.1-Flash with its three DSpark stages drafting 5 tokens (cp = ep = 64): a rank
    holds 128 / 64 of each stage's experts, FP4 like the main layers'; a verify step reads the
    main weights once for B x 6 tokens, then the stages' other weights and the LM head once for
    the block of 5 a row (and the block's embedding rows)."""
    speculative = load_config(RELEASED / "v41-flash-dspark.yaml")
    plain = plan_device(load_config(RELEASED / "v41-flash-trn2.yaml"), DEVICES["trn2"])
    plan = plan_device(speculative, DEVICES["trn2"])
    assert plan.fits, plan.reason
    stage_experts = 3 * 128 // 64 * 3 * 5120 * 2304 * (1 / 2 + 1 / 32)
    assert plan.weights_bytes["float4_e2m1"] == plain.weights_bytes["float4_e2m1"] + stage_experts
    tensors = {t.name: t.nbytes for t in rank_tensors(speculative)}
    stages = sum(n for name, n in tensors.items() if name.startswith("model.mtp.") and ".experts." not in name)
    embedding_row = tensors["model.embed_tokens.weight"] // 129280
    for step, without in zip(plan.decode, plain.decode, strict=True):
        rows = step.rows
        assert step.bucket == f"decode-{rows}x6"
        assert step.weights_read == (without.weights_read + stages + tensors["lm_head.weight"]
                                     + embedding_row * (rows * 6 - rows + rows * 5))
        assert without.step_ms < step.step_ms < 6 * without.step_ms


def test_the_cli_prints_json_and_exits_2_when_a_rank_does_not_fit(tmp_path):
    result = CliRunner().invoke(cli, ["plan", str(RELEASED / "v3-trn2.yaml"), "--device", "trn2", "--json"])
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert report["fits"] is False and report["device"] == "trn2" and report["weights_total_bytes"] > 29e9
    assert [d["bucket"] for d in report["decode"]] == ["decode-1", "decode-8"]
    assert result.stderr.startswith("error: a rank does not fit the trn2 device (24.0 GiB): the rank's weights alone")


def test_a_device_that_holds_the_tiny_model_fits_and_plots(tiny_checkpoints, tmp_path):
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["lora-groups"], TEST_BUCKETS["small"])))
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "model.yaml"), "--device", "trn1",
                                      "--plot", str(tmp_path / "plan.png")])
    assert result.exit_code == 0, result.output
    assert "per rank on trn1 (16.0 GiB, 440 GB/s):" in result.stdout and ": fits (" in result.stdout
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags, says", [
    (["--device", "trn9"], "error: --device 'trn9': unknown device; devices: trn1, trn2, trn2-lnc1, trn3 (or "
                           "--device-file F, or --device-memory and --device-bandwidth for another)"),
    (["--device-memory", "16"], "error: a custom device needs both --device-memory (GiB) and --device-bandwidth "
                                "(GB/s); or --device trn1 | trn2 | trn2-lnc1 | trn3, or --device-file F"),
    (["--device", "trn2", "--device-file", "trn2.yaml"], "error: --device and --device-file: pass one"),
    (["--device-file", "no-such.yaml"], "error: --device-file 'no-such.yaml': cannot read it: No such file"),
    (["--device", "trn2", "--device-bandwidth", "0"], "error: --device-bandwidth 0.0: must be a positive number"),
    (["--json"], "error: --json prints the device plan: pass --device (or --device-memory and --device-bandwidth)"),
    (["--artifacts", "build"],
     "error: --artifacts measures the device plan: pass --device (or --device-memory and --device-bandwidth)"),
    (["--device-memory", "0.001", "--device-bandwidth", "100"],  # the tiny model's weights, not its pool too
     "error: a rank does not fit the custom device (1.0 MiB): weights 878.8 KiB + KV pool "),
])
def test_bad_devices_are_one_line_errors(tiny_checkpoints, tmp_path, flags, says):
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["lora-groups"], TEST_BUCKETS["small"])))
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "model.yaml"), *flags])
    assert one_line_refusal(result).startswith(says)
