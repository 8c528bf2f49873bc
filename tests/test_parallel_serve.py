"""Compiled multi-rank graphs, served by `graphc.runtime.launch.serve` (one process per rank under
torchrun's agent, gloo collectives, the shared-memory step channel), give the single-rank tokens
(fp32). Every rank runs its own specialised graphs: its KV shard, its experts; followers have
no sampler and take each step from the leader."""

from __future__ import annotations

import pytest
import yaml

from graphc.artifact import read_manifest
from graphc.config import load_config
from graphc.pipeline import CompileOptions, compile
from graphc.runtime import Engine, Request
from graphc.runtime.launch import serve
from support import TEST_BUCKETS, model_yaml

PRESET = "wide-16e"
PROMPTS = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (1, 9, 40)]  # 40: chunked (32 + 8)
NEW_TOKENS = 12
TOPOLOGIES = [  # (cp, ep, static MoE)
    (2, 1, True), (2, 2, True), (2, 2, False), (4, 4, True),  # (4, 2): tests/test_parallel_eager.py
]


@pytest.fixture(scope="module")
def parallel_artifacts(tmp_path_factory, tiny_checkpoints):
    made = {}

    def get(cp, ep, static):
        if (cp, ep, static) not in made:
            root = tmp_path_factory.mktemp(f"cp{cp}-ep{ep}-{'static' if static else 'generic'}")
            config = {**model_yaml(tiny_checkpoints[PRESET], TEST_BUCKETS["standard"]), "topology": {"cp": cp, "ep": ep}}
            (root / "model.yaml").write_text(yaml.safe_dump(config))
            disabled = frozenset() if static else frozenset({"static_moe"})
            compile(load_config(root / "model.yaml"), root / "artifacts",
                    CompileOptions(verify_passes=True, show_progress=False, disabled_passes=disabled))
            made[cp, ep, static] = root / "artifacts"
        return made[cp, ep, static]

    return get


@pytest.mark.parametrize("cp, ep, static", TOPOLOGIES)
def test_every_rank_serves_the_single_rank_tokens(cp, ep, static, compiled, parallel_artifacts):
    requests = [Request(p, NEW_TOKENS, stop_at_eos=False) for p in PROMPTS]
    expected = Engine(compiled(PRESET, "export")).generate(requests)
    [results] = serve(parallel_artifacts(cp, ep, static), [requests], world=cp)
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]


@pytest.mark.parametrize("static", [True, False])
def test_graph_structure_per_rank(static, parallel_artifacts):
    manifest = read_manifest(parallel_artifacts(2, 2, static))
    counts = manifest.extra["op_counts"]
    for rank in (0, 1):
        for bucket in ("prefill-8", "decode-4"):
            ops = counts[f"{bucket} rank {rank}"]
            assert ("graphc::sample" in ops) == (rank == 0)  # followers take the leader's tokens
            assert ops["graphc::attention_combine"] == 3  # one per layer, over the cp group
            if static:  # the static form: no dispatch, one all-reduce per MoE layer
                assert ops["graphc::all_reduce"] == 3 and "graphc::moe_dispatch" not in ops
            else:
                assert ops["graphc::moe_dispatch"] == ops["graphc::moe_combine"] == 3 and "graphc::all_reduce" not in ops
    assert [r.samples for r in manifest.ranks] == [True, False]
    # Ranks 0 and 1 hold different experts: different weight files.
    assert manifest.ranks[0].weights != manifest.ranks[1].weights


def test_single_rank_engine_refuses_multi_rank_artifacts(parallel_artifacts):
    from graphc.errors import GraphcError

    with pytest.raises(GraphcError, match=r"compiled for 2 ranks \(cp=2, ep=2\); serve it with `graphc run`"):
        Engine(parallel_artifacts(2, 2, True))
