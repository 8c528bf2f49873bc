"""The neuron backend end to end: artifacts compiled to per-program Neuron / CPU HLO, served here on
XLA:CPU (one process per rank, gloo collectives), give the export backend's tokens, greedy and
sampled with seeds, at every topology, V3, V3.2 (sparse), V4 and V4.1 (Engram), every bucket kind (prefill, decode,
prompt-as-decode) at one rank and prefill and decode at several; each bucket's logits agree with
the export graph's to 1e-5 relative on a step."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import zipfile

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from graphc.artifacts.directory import read_manifest
from graphc.backends import BACKENDS
from graphc.backends.neuron_archive import NEURON_HLO, program_contexts, read_archive
from graphc.backends.xla import graphc_ops
from graphc.backends.xla.lint import module_text
from graphc.backends.xla.memory import program_memory
from graphc.cli import cli
from graphc.compiler.pipeline import CompileOptions, compile
from graphc.config import load_config
from graphc.errors import GraphcError
from graphc.runtime import Engine, Request
from graphc.runtime.launch import serve
from graphc.runtime.loader import load_rank
from graphc.sampling import Sampling
from graphc.step import PADDING_SLOT
from graphc.tools.lint import lint_artifacts
from support import SPARSE_V32, TEST_BUCKETS, model_yaml

pytestmark = [pytest.mark.compiles]

BUCKETS = "prompt_as_decode_small"  # prefill-32, decode-4 and the prompt-as-decode decode-4x4
MULTI_RANK_BUCKETS = "small"
"""prefill-8 and decode-2: the collectives every bucket kind issues, at a third fewer programs to
lower and load per rank (each costs seconds on two cores); every kind runs at one rank."""
EVERY_BUCKET_KIND = ("lora-groups", SPARSE_V32)
"""Presets run at every bucket kind at one rank; V4 runs prefill and decode only (what it adds is its
layers, and a prompt-as-decode program costs another ~25 s to lower and serve on two cores)."""
PROMPTS = [[(7 * i + n) % 250 + 3 for i in range(n)] for n in (1, 3, 9, 40)]
SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=11)
NEW_TOKENS = 6
CASES = [  # (preset, cp, ep, tp); (2, 2) holds every collective (2, 1) would
    ("lora-groups", 1, 1, 1), ("wide-16e", 2, 2, 1), ("wide-16e", 4, 4, 1),
    (SPARSE_V32, 1, 1, 1), (SPARSE_V32, 2, 2, 1),
    (SPARSE_V32, 1, 2, 2),  # tensor parallelism: its all-reduces and gathers over tp groups
    ("v4", 1, 1, 1), ("v4", 2, 2, 1),  # compressed attention, hyper-connections, hash-routed layers
    ("v41", 1, 1, 1), ("v41", 2, 2, 1),  # Engram: its 64-bit hash, the table over ep, the id halo over cp
]


def _requests() -> list[Request]:
    return [Request(p, NEW_TOKENS, sampling, stop_at_eos=False)
            for p in PROMPTS for sampling in (Sampling(), SAMPLED)]


# Per commit: V4.1 at one rank (every bucket kind; the V4 family's compressors and Sinkhorn
# hyper-connections, V4.1's index sources and Engram) and wide-16e at (2, 2) (the collectives);
# the rest is the slow tier's (the nightly full suite; the sparse model's and V4's ops have their
# rules checked per commit, test_aten_rules.py).
@pytest.mark.parametrize("preset, cp, ep, tp", [
    pytest.param(*case, marks=([pytest.mark.multirank] if case[1] * case[3] > 1 else [])
                 + ([pytest.mark.slow] if case in ((SPARSE_V32, 1, 1, 1), ("v4", 1, 1, 1), ("lora-groups", 1, 1, 1),
                                                   ("wide-16e", 4, 4, 1),
                                                   (SPARSE_V32, 2, 2, 1), (SPARSE_V32, 1, 2, 2),
                                                   ("v4", 2, 2, 1), ("v41", 2, 2, 1)) else []))
    for case in CASES])
def test_neuron_artifacts_serve_the_export_tokens(preset, cp, ep, tp, compiled):
    world = cp * tp
    requests, buckets = _requests(), BUCKETS if world == 1 and preset in EVERY_BUCKET_KIND else MULTI_RANK_BUCKETS
    expected = Engine(compiled(preset, "export", buckets)).generate(requests)
    artifacts = compiled(preset, "neuron", buckets, cp, ep, tp=tp)
    if world == 1:
        results = Engine(artifacts).generate(requests)
    else:
        [outcome] = serve(artifacts, [requests])
        results = outcome.results
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]
    lint = CliRunner().invoke(cli, ["inspect", str(artifacts), "--lint"])  # every program, linted again
    programs = len(read_manifest(artifacts).ranks[0].graphs)
    assert lint.exit_code == 0 and f"lint: {programs} program(s), no problem(s)" in lint.stdout, lint.output
    # One program a bucket, whatever the world: every rank names the same file.
    manifest = read_manifest(artifacts)
    leader, *followers = manifest.ranks
    for index, graph in enumerate(leader.graphs):
        assert {graph.file} | {f.graphs[index].file for f in followers} == {graph.file}
        with zipfile.ZipFile(artifacts / graph.file) as archive:
            assert {"program.json", "neuron.hlo.pb", "cpu.hlo.pb"} <= set(archive.namelist())
            assert json.loads(archive.read("program.json"))["signature"]["samples"]


@pytest.mark.multirank
@pytest.mark.parametrize("preset, dp, cp, ep, lowering", [
    pytest.param("lora-groups", 2, 1, 2, "a2a_v", marks=pytest.mark.slow),  # compiled as a2a_even, saying so
    pytest.param("lora-groups", 2, 1, 2, "ag_rs", marks=pytest.mark.slow),  # all-gather, route, reduce-scatter
    pytest.param("wide-16e", 2, 2, 4, "auto", marks=pytest.mark.slow),  # `auto` pads the group of 4
])
def test_data_parallel_neuron_artifacts_serve_the_export_tokens_over_their_exchange(preset, dp, cp, ep, lowering,
                                                                                   compiled):
    """Two replicas, each sampling its own rows (the program's tokens kept on its first rank), the experts over the
    world reached by HLO all-to-alls (ag_rs: all-gathers and reduce-scatters); a batch of one leaves the second
    replica all padding."""
    requests = _requests()
    expected = Engine(compiled(preset, "export", "dp")).generate(requests)  # one rank's: what dp serves too
    artifacts = compiled(preset, "neuron", "dp", cp, ep, True, dp, lowering)
    got, alone = serve(artifacts, [requests, requests[:1]])
    assert [r.output_ids for r in got.results] == [r.output_ids for r in expected]
    assert alone.results[0].output_ids == expected[0].output_ids
    manifest = read_manifest(artifacts)
    assert {g.moe_exchange for rank in manifest.ranks for g in rank.graphs} == {"ag_rs" if lowering == "ag_rs" else "a2a_even"}
    assert [rank.samples for rank in manifest.ranks] == [r % (cp) == 0 for r in range(dp * cp)]
    lint = CliRunner().invoke(cli, ["inspect", str(artifacts), "--lint"])
    assert lint.exit_code == 0 and "no problem(s)" in lint.stdout, lint.output
    note = f"note: {BACKENDS['neuron'].exchange('a2a_v', manifest.topology)[1]}"
    assert manifest.extra.get("notes", []) == ([note.removeprefix("note: ")] if lowering == "a2a_v" else [])
    assert (note in lint.stdout) == (lowering == "a2a_v")


def test_the_lint_catches_ranks_that_do_not_share_a_program(compiled):
    artifacts = compiled("wide-16e", "neuron", MULTI_RANK_BUCKETS, 2, 2)
    manifest = read_manifest(artifacts)
    assert lint_artifacts(artifacts, manifest) == []
    leader, follower = manifest.ranks
    # A third rank whose first bucket runs the second bucket's program.
    other = dataclasses.replace(follower, rank=2, graphs=[leader.graphs[1], *follower.graphs[1:]])
    three = dataclasses.replace(manifest, ranks=[leader, follower, other])
    assert lint_artifacts(artifacts, three) == [
        f"{leader.graphs[0].bucket.name}: the ranks run 2 different files; one program serves every rank"]


def test_one_steps_logits_and_kv_writes_match_the_export_graph(compiled):
    """Each bucket of the same model, on the same step inputs (with padding slots): logits to
    1e-5 relative, the pool's written slots exactly up to fp32 rounding, the scratch block aside."""
    export = load_rank(compiled("lora-groups", "export", BUCKETS))
    neuron = load_rank(compiled("lora-groups", "neuron", BUCKETS))
    kv = export.manifest.kv_cache
    generator = torch.Generator().manual_seed(0)
    for bucket, runner in neuron.runners.items():
        shapes = runner.shapes
        rows, width = shapes["input_ids"]
        inputs = {
            "input_ids": torch.randint(0, 256, (rows, width), generator=generator),
            "positions": torch.arange(width).repeat(rows, 1) + 5,
            "block_table": torch.randint(0, kv.num_blocks - 1, shapes["block_table"], generator=generator),
            "slot_mapping": torch.randperm((kv.num_blocks - 1) * kv.block_size, generator=generator)[
                : rows * width].view(rows, width),
            "logits_index": torch.full((rows,), width - 1),
            "temperature": torch.zeros(rows), "top_k": torch.zeros(rows, dtype=torch.int64),
            "top_p": torch.ones(rows), "seed": torch.zeros(rows, dtype=torch.int64),
            "coordinates": torch.tensor([0, 0, 1], dtype=torch.int32),
        }
        inputs["slot_mapping"][-1, -1] = PADDING_SLOT
        pool = torch.randn(shapes["kv_pool"], generator=generator)
        outputs = {}
        for name, loaded in (("export", export), ("neuron", neuron)):
            step = {**inputs, "kv_pool": pool.clone()}
            tokens, logits = loaded.runners[bucket](loaded.weights, step)
            outputs[name] = tokens, logits.float(), step["kv_pool"]
        (tokens, logits, written), (ref_tokens, ref_logits, ref_written) = outputs["neuron"], outputs["export"]
        assert torch.equal(tokens, ref_tokens), bucket.name
        assert (logits - ref_logits).abs().max() <= 1e-5 * ref_logits.abs().max(), bucket.name
        torch.testing.assert_close(written[:, :-1], ref_written[:, :-1], rtol=0, atol=1e-5)


def test_the_pool_size_is_fixed_at_compile_time(compiled, monkeypatch):
    artifacts = compiled("lora-groups", "neuron", BUCKETS)
    monkeypatch.setenv("GRAPHC_NUM_KV_BLOCKS", "32")
    with pytest.raises(GraphcError, match=r"GRAPHC_NUM_KV_BLOCKS='32': neuron artifacts fix the pool at compile "
                                          r"time \(kv_cache.num_blocks 64\)"):
        Engine(artifacts)
    monkeypatch.setenv("GRAPHC_NUM_KV_BLOCKS", "64")  # the compiled size itself is accepted
    Engine(artifacts)




def test_inspect_memory_and_the_device_plan_read_each_programs_buffer_assignment(compiled, tmp_path):
    """`inspect --memory`: per bucket, XLA's bytes for the program's parameters (every weight and
    step input of its signature), its results (the pool's in the pool parameter's buffer) and its
    temporaries; export artifacts are refused in one line. `plan --device --artifacts`: the
    activations are the largest program's temporaries, not the estimate; artifacts of another
    config are refused, naming the field."""
    artifacts = compiled("lora-groups", "neuron", "prompt_as_decode_small")
    manifest = read_manifest(artifacts)
    programs = program_memory(artifacts, manifest)
    for name, context in program_contexts(manifest).items():
        signature = read_archive(artifacts / name, context, ())[0].signature
        sizes = [math.prod(shape) * np.dtype(dtype).itemsize
                 for shape, dtype in zip(signature.shapes, signature.dtypes)]
        pool = sizes[signature.parameters.index("kv_pool")]
        assert programs[name].parameters == sum(sizes) and programs[name].aliased == pool
        assert programs[name].results > pool and programs[name].temporaries > 0
    shown = CliRunner().invoke(cli, ["inspect", str(artifacts), "--memory"])
    assert shown.exit_code == 0 and len([line for line in shown.stdout.splitlines() if line.startswith("memory: ")]) \
        == len(manifest.ranks[0].graphs)
    refused = CliRunner().invoke(cli, ["inspect", str(compiled("lora-groups", "export", "prompt_as_decode_small")),
                                       "--memory"])
    assert refused.exit_code == 2 and refused.output == ("error: --memory reads a compiler's buffer assignment, which "
                                                         "export artifacts do not have; backends with one: neuron\n")

    model_yaml = artifacts.parent / "model.yaml"
    estimated = json.loads(CliRunner().invoke(cli, ["plan", str(model_yaml), "--device", "trn2", "--json"]).stdout)
    planned = CliRunner().invoke(cli, ["plan", str(model_yaml), "--device", "trn2", "--json", "--artifacts", str(artifacts)])
    assert planned.exit_code == 0, planned.output
    measured = json.loads(planned.stdout)
    assert estimated["activation_source"] == "estimate" and "buffer assignment" in measured["activation_source"]
    largest = max(p.temporaries for p in programs.values())
    assert measured["activation_bytes"] == largest != estimated["activation_bytes"]
    assert measured["total_bytes"] - estimated["total_bytes"] == largest - estimated["activation_bytes"]
    other = yaml.safe_load(model_yaml.read_text())
    other["buckets"]["context_limit"] *= 2
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(other))
    refused = CliRunner().invoke(cli, ["plan", str(tmp_path / "model.yaml"), "--device", "trn2", "--artifacts",
                                       str(artifacts)])
    assert refused.exit_code == 2 and refused.output.startswith(f"error: --artifacts {str(artifacts)!r}: compiled "
                                                                "with buckets.context_limit ")

def test_the_blocked_grouped_gemm_serves_the_export_tokens(compiled, tiny_checkpoints, tmp_path, monkeypatch):
    """Blocks of 4 rows forced on every grouped GEMM (the tiny shapes' costs pick expert-major; the
    released models' prefill chunks pick blocks): the export tokens, every program linted."""
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path / "cache"))  # not the session's programs
    monkeypatch.setattr(graphc_ops, "neuron_grouped_block", lambda *shapes: 4)  # compiled in this process (workers=1)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["wide-16e"],
                                                                   TEST_BUCKETS[MULTI_RANK_BUCKETS], "neuron")))
    compile(load_config(tmp_path / "model.yaml"), tmp_path / "artifacts", CompileOptions(show_progress=False, workers=1))
    requests = _requests()
    expected = Engine(compiled("wide-16e", "export", MULTI_RANK_BUCKETS)).generate(requests)
    assert [r.output_ids for r in Engine(tmp_path / "artifacts").generate(requests)] == [r.output_ids for r in expected]
    assert lint_artifacts(tmp_path / "artifacts", read_manifest(tmp_path / "artifacts")) == []
    prefill = next(g.file for g in read_manifest(tmp_path / "artifacts").ranks[0].graphs if g.bucket.kind == "prefill")
    with zipfile.ZipFile(tmp_path / "artifacts" / prefill) as archive:
        text = module_text(archive.read(NEURON_HLO))
    # 8 tokens of 4 routes over 16 experts: 32 rows in ceil(32 / 4) + 15 = 23 blocks of 4, a matrix read a block.
    assert re.search(r"f32\[23,4,64\]\S* dot\(", text) and not re.search(r"f32\[16,64,32\]\S* dot\(", text)
