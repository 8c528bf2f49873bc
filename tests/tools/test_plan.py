"""`graphc plan`: the dry run before capture. Its collective counts are held to compiled graphs."""

from __future__ import annotations


import pytest
import yaml
from click.testing import CliRunner

from graphc.artifacts.directory import read_manifest
from graphc.buckets.selection import Bucket
from graphc.cli import EXIT_BAD_INPUT, cli
from graphc.config import load_config
from graphc.models.registry import load_model_args
from graphc.tools.plan import step_collectives
from graphc.topology import Topology
from support import SPARSE_V32, TEST_BUCKETS, model_yaml

OPS = {name: f"graphc::{name}" for name in ("attention_combine", "all_reduce", "all_reduce_max", "moe_dispatch",
                                             "moe_combine", "index_topk_combine", "moe_a2a_dispatch",
                                             "moe_a2a_combine", "gather_columns")}


@pytest.mark.parametrize("preset, dp, cp, ep, exchange, tp", [
    ("wide-16e", 1, 2, 1, "local", 1), ("wide-16e", 1, 2, 2, "static", 1), ("wide-16e", 1, 2, 2, "ag_rs", 1),
    ("wide-16e", 1, 4, 4, "static", 1),
    (SPARSE_V32, 1, 2, 2, "static", 1),  # sparse attention: a top-k combine per layer too
    ("lora-groups", 2, 1, 2, "a2a_even", 1), ("lora-groups", 2, 2, 4, "a2a_v", 1),  # data-parallel attention
    ("v4", 1, 2, 2, "static", 1),  # DeepSeek-V4: window pools and CSA's top-k combined too
    ("v41", 1, 2, 2, "static", 1), ("v41", 1, 2, 2, "ag_rs", 1),  # V4.1: candidate blocks, Engram lookups
    (SPARSE_V32, 1, 2, 4, "static", 2),  # tensor parallelism with cp: the indexer's scores all-reduced too
    ("v4", 1, 1, 2, "static", 2),  # V4's, ep = tp: the shared experts summed in the MoE's all-reduce
    ("v41", 1, 1, 2, "static", 2),  # V4.1's: its index layers' scores
])
def test_collectives_per_step_are_those_of_the_compiled_graphs(preset, dp, cp, ep, exchange, tp, compiled,
                                                              tiny_checkpoints):
    static = exchange != "ag_rs"
    # The data-parallel artifacts are the serving tests' (runtime/test_data_parallel.py).
    artifacts = compiled(preset, "export", "dp" if dp > 1 else "small", cp, ep, static, dp, tp=tp)
    _assert_planned_as_compiled(artifacts, load_model_args(tiny_checkpoints[preset]), exchange)


@pytest.mark.multirank
@pytest.mark.parametrize("preset, buckets, dp, cp, tp, exchange", [
    ("trained", "prompt_as_decode_small", 1, 2, 1, "static"), ("trained", "dp", 2, 1, 1, "a2a_even"),
    pytest.param("v4", "small", 1, 2, 2, "static", marks=pytest.mark.slow),  # the MTP module's tp collectives
    pytest.param("v41", "small", 1, 2, 1, "static", marks=pytest.mark.slow),  # DSpark's stages over a block
])
def test_a_speculative_steps_collectives_are_those_of_the_compiled_graphs(preset, buckets, dp, cp, tp, exchange,
                                                                         compiled):
    """With drafts (k = 2): the verify positions' head, then the MTP layer over the step's tokens
    and once more over a token a row, or DSpark's stages over a block a row (the serving tests'
    artifacts, runtime/test_speculative.py)."""
    artifacts = compiled(preset, "export", buckets, cp=cp, ep=2, dp=dp, tp=tp, speculative=2)
    args = load_config(artifacts.parent / "model.yaml").model_args  # with the draft layers it serves
    _assert_planned_as_compiled(artifacts, args, exchange, draft_tokens=2)


def _assert_planned_as_compiled(artifacts, args, exchange: str, draft_tokens: int = 0) -> None:
    manifest = read_manifest(artifacts)
    topology = manifest.topology
    slots = manifest.kv_cache.blocks_per_row * manifest.kv_cache.block_size
    for rank in manifest.ranks:
        for graph in rank.graphs:
            bucket = graph.bucket
            counts = manifest.extra["op_counts"][bucket.name]
            in_graph = {op: n for op, n in counts.items() if op in OPS.values()}
            assert graph.moe_exchange == exchange
            planned = {}
            for c in step_collectives(args, topology, bucket, "float32", exchange, context_slots=slots,
                                      block_size=manifest.kv_cache.block_size, draft_tokens=draft_tokens):
                planned[OPS[c.op]] = planned.get(OPS[c.op], 0) + c.count
            assert planned == in_graph, (bucket.name, rank.rank)


def test_payloads_follow_the_tokens_of_the_bucket(tiny_checkpoints):
    args = load_model_args(tiny_checkpoints["wide-16e"])  # hidden 64, 4 heads, kv_lora_rank 32
    [attention, moe] = step_collectives(args, Topology(2, 2), Bucket("decode", 4, 3), "bfloat16", "static")
    assert attention.bytes_in == 12 * 4 * 33 * 4  # [T, H, R] + [T, H], fp32
    assert (moe.op, moe.bytes_in) == ("all_reduce", 12 * 64 * 2)
    generic = step_collectives(args, Topology(2, 2), Bucket("prefill", 8), "float32", "ag_rs")
    assert [(c.op, c.bytes_in) for c in generic[1:]] == [("moe_dispatch", 8 * 64 * 4), ("moe_combine", 2 * 8 * 64 * 4)]
    routes = 2 * 8 * 2 * 4 * 4  # [ep, T, 2K] fp32 (K = 4)
    even = step_collectives(args, Topology(1, 2, 2), Bucket("prefill", 8), "float32", "a2a_even")
    assert [(c.op, c.bytes_in) for c in even] == [("moe_a2a_dispatch", 2 * 8 * 64 * 4 + routes),
                                                  ("moe_a2a_combine", 2 * 8 * 64 * 4)]
    [v_dispatch, _] = step_collectives(args, Topology(1, 2, 2), Bucket("prefill", 8), "float32", "a2a_v")
    assert v_dispatch.bytes_in == even[0].bytes_in + 2 * 8  # and the int64 split counts
    heads = {kind: [c.bytes_in for c in step_collectives(args, Topology(tp=2), Bucket(kind, 8), "float32", "local")
                    if c.op == "gather_columns"][-1] for kind in ("prefill", "score")}
    assert heads == {"prefill": args.vocab_size // 2 * 4, "score": 8 * args.vocab_size // 2 * 4}  # every position's


def test_tensor_parallel_payloads_are_the_split_slices_and_the_whole_partial_sums(tiny_checkpoints):
    args = load_model_args(tiny_checkpoints[SPARSE_V32])  # hidden 64, vocab 256, 3 layers, 1 dense
    calls = step_collectives(args, Topology(2, 1, 1, 2), Bucket("decode", 4, 3), "bfloat16", "local",
                             context_slots=5 * 16, block_size=16)
    tp = [(c.op, c.count, c.bytes_in) for c in calls if c.group == "tp"]
    assert tp == [("gather_columns", 1, 12 * 32 * 2),  # the embedding's [T, D / tp]
                  ("all_reduce", 3, 12 * 3 * 16 * 4),  # the indexer's fp32 [T, K]: 3 of the 5 blocks on a cp shard
                  ("all_reduce", 6, 12 * 64 * 2),  # after o_proj and the FFN, every layer
                  ("gather_columns", 1, 4 * 128 * 2)]  # the LM head's [B, V / tp]
    # With the EP groups the tp groups, the MoE layers' all-reduce over ep sums the shared experts too.
    fused = step_collectives(args, Topology(1, 2, 1, 2), Bucket("decode", 4, 3), "bfloat16", "static",
                             context_slots=5 * 16, block_size=16)
    assert [(c.op, c.group, c.count) for c in fused if c.op == "all_reduce"] == [
        ("all_reduce", "tp", 3), ("all_reduce", "tp", 3 + 1), ("all_reduce", "ep", 2)]


def test_sparse_attention_adds_the_top_k_candidates(tiny_checkpoints):
    args = load_model_args(tiny_checkpoints[SPARSE_V32])  # index_topk 16
    [topk, attention, _] = step_collectives(args, Topology(2, 2), Bucket("prefill", 8), "float32", "static",
                                            context_slots=64)
    assert (topk.op, topk.group, topk.count) == ("index_topk_combine", "cp", 3)
    assert topk.bytes_in == 8 * 16 * (8 + 4)  # [T, k] int64 positions + fp32 scores
    [short, *_] = step_collectives(args, Topology(2, 2), Bucket("prefill", 8), "float32", "static", context_slots=8)
    assert short.bytes_in == 8 * 8 * 12  # k is capped by the context the block table holds


def test_v4_attention_combines_pools_candidates_and_partials(tiny_checkpoints):
    args = load_model_args(tiny_checkpoints["v4"])  # CSA, HCA, sliding, CSA; head_dim 32, index_head_dim 16
    calls = step_collectives(args, Topology(2, 1), Bucket("prefill", 8), "float32", "local", context_slots=64)
    assert [(c.op, c.count, c.bytes_in) for c in calls] == [
        ("attention_combine", 1, 8 * 32 * 2 * 4),  # the HCA layer's pool and its lse
        ("attention_combine", 2, 8 * (32 + 16) * 2 * 4),  # the CSA layers' pools, the indexer's too
        ("index_topk_combine", 2, 8 * 3 * 12),  # k = index_topk = 3 of 64 / 4 entries
        ("attention_combine", 4, 8 * 4 * 33 * 4),  # every layer's attention partials
    ]


@pytest.fixture
def auto_yaml(tmp_path, tiny_checkpoints):
    (tmp_path / "lengths.txt").write_text("".join(f"{(i * 37) % 120 + 1}\n" for i in range(200)))
    config = model_yaml(tiny_checkpoints["lora-groups"], TEST_BUCKETS["standard"])
    config["buckets"] = {"context_limit": 128, "auto": {"workload": "lengths.txt", "graphs": 6, "max_decode_batch": 4}}
    config["topology"] = {"cp": 2, "ep": 2}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "model.yaml"


def test_plan_prints_buckets_waste_graphs_and_collectives_and_plots(auto_yaml, tmp_path):
    result = CliRunner().invoke(cli, ["plan", str(auto_yaml), "--plot", str(tmp_path / "out" / "plan.png")])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "planned from" in out and "budget 6 graphs per rank" in out
    assert "expected prefill padding over 200 prompts" in out and "vs power-of-two ladder" in out
    assert "per rank x 2 rank(s) = 12 in all, 6 distinct (one program per bucket, every rank" in out
    assert "x attention_combine(cp)" in out and "x all_reduce(ep)" in out
    assert "groups (dp=1, cp=2, tp=1, ep=2; MoE exchange static):" in out and "cp    1 x 2 rank(s): [0, 1]" in out
    assert (tmp_path / "out" / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_a_workload_is_an_error(tmp_path, tiny_checkpoints):
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["lora-groups"], TEST_BUCKETS["standard"])))
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "model.yaml"), "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == EXIT_BAD_INPUT
    assert result.stderr.strip() == ("error: --plot needs a workload or a device: pass --workload (or set "
                                     "buckets.auto.workload) or --device")
    assert result.stdout == ""  # refused before any report
    assert not (tmp_path / "p.png").exists()


def test_the_shipped_example_plots_with_the_shipped_workload(tmp_path, tiny_checkpoints):
    """examples/tiny.yaml (its checkpoint pointed at a test one) with examples/tiny-workload.txt,
    the two commands the README shows."""
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    config = yaml.safe_load((examples / "tiny.yaml").read_text())
    config["model"]["checkpoint"] = str(tiny_checkpoints["lora-groups"])
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    plot = tmp_path / "plan.png"
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "tiny.yaml"), "--workload",
                                      str(examples / "tiny-workload.txt"), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert "expected prefill padding over 283 prompts" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
