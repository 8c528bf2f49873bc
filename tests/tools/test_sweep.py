"""`graphc sweep`: every bucket at every topology, checked against one rank and transformers;
and it fails, naming the bucket, when a bucket's tokens are wrong."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import yaml
from click.testing import CliRunner

from graphc.buckets.selection import all_buckets
from graphc.cli import cli
from graphc.config import load_config
from graphc.errors import GraphcError
from graphc.runtime.engine import Engine
from graphc.tools.sweep import bucket_table, parse_topologies, stage_hosts, stage_name, sweep
from graphc.topology import Topology
from support import TEST_BUCKETS, model_yaml

pytestmark = pytest.mark.compiles

BUCKETS = TEST_BUCKETS["prompt_as_decode"]  # prefill 8, 32; decode 1, 4; P = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tiny_checkpoints):
    root = tmp_path_factory.mktemp("sweep")
    (root / "model.yaml").write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["lora-groups"], BUCKETS)))
    return root / "model.yaml"


@pytest.fixture(scope="module")
def clean_run(model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep-out")
    result = CliRunner().invoke(cli, ["sweep", str(model_path), "--topologies", "2x2", "--out", str(out)])
    return result, out


@pytest.mark.multirank
def test_sweep_passes_and_every_bucket_ran_at_every_topology(clean_run):
    result, out = clean_run
    assert result.exit_code == 0, result.output
    report = json.loads((out / "sweep.json").read_text())
    assert [s["topology"] for s in report] == ["1x1", "2x2"]  # 1x1 added first: the reference
    expected = {b.name for b in all_buckets(BUCKETS["prefill"], BUCKETS["decode"], BUCKETS["prompt_as_decode"])}
    for stage in report:
        ran = {bucket for case in stage["cases"] for bucket in case["buckets"]}
        assert ran == expected, stage["topology"]
        assert all(case["failures"] == [] for case in stage["cases"])
    suites = ET.parse(out / "sweep.xml").getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == ["export 1x1", "export 2x2"]
    assert all(s.get("failures") == "0" and int(s.get("tests")) >= 8 for s in suites)
    markdown = (out / "sweep.md").read_text()
    assert "| decode-4x4 | ✓" in markdown and "All cases matched." in markdown
    assert "external reference: transformers" in result.stderr


def test_a_wrong_bucket_fails_the_sweep_and_is_named(model_path, tmp_path, monkeypatch):
    original = Engine._run

    def wrong_in_decode_4(self, bucket, inputs):
        tokens, logits = original(self, bucket, inputs)
        return ((tokens + 1) % 256 if bucket.name == "decode-4" else tokens), logits

    monkeypatch.setattr(Engine, "_run", wrong_in_decode_4)
    result = CliRunner().invoke(cli, ["sweep", str(model_path), "--topologies", "1x1", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "case(s) differ" in result.stderr
    failures = ET.parse(tmp_path / "sweep.xml").getroot().iter("failure")
    messages = [f.get("message") for f in failures]
    assert messages and all("decode-4" in m and "differ from transformers" in m for m in messages)
    markdown = (tmp_path / "sweep.md").read_text()
    assert "| decode-4 | ✗ decode-4x4: 3 short prompt(s) with a running decode; decode-4 full; decode-4 padded ·" in markdown
    # decode-4x4 ran only in a case that also needed decode-4: both are suspects, nothing else is
    assert "Suspect buckets (run only by failing cases):\n- export 1x1: decode-4, decode-4x4\n" in markdown
    assert "| decode-1x4 | ✓" in markdown  # a bucket only passing cases ran stays green


def test_buckets_the_runtime_cannot_reach_are_reported(tmp_path, tiny_checkpoints, monkeypatch):
    """prefill-32 above a prefilling budget of 16: prompts are chunked by 8, so nothing runs it."""
    config = model_yaml(tiny_checkpoints["lora-groups"], {**BUCKETS, "prompt_as_decode": 0})
    config["runtime"]["max_num_prefilling_tokens"] = 16
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    stages = sweep(load_config(tmp_path / "model.yaml"), tmp_path / "work", [Topology()], ["export"],
                   log=lambda line: None)
    assert stages[0].unexercised == ["prefill-32"]
    from graphc.tools.sweep import markdown

    assert "Compiled but never run" in markdown(stages) and "- export 1x1: prefill-32" in markdown(stages)


def test_topologies_parse_sorted_with_the_reference_first():
    assert parse_topologies("4x4, 2x1,2x1x2,2x2,1x2x2x4") == [
        Topology(), Topology(2, 1), Topology(2, 2), Topology(1, 2, 2), Topology(2, 4, 1, 2), Topology(4, 4)]
    assert stage_name(Topology(2, 4, 1, 2)) == "1x2x2x4" and stage_name(Topology(1, 2, 2)) == "2x1x2"
    for bad, says in [("2by2", "is not CPxEP, DPxCPxEP or DPxCPxTPxEP"), ("2x4", "topology.ep: 4 must divide the world"),
                      ("0x0", "must be a positive integer"), ("2x2x2x2x2", "is not CPxEP, DPxCPxEP or DPxCPxTPxEP"),
                      ("1x1x0x1", "topology.tp: 0 must be a positive integer")]:
        with pytest.raises(GraphcError, match=says):
            parse_topologies(bad)


def test_an_impossible_stage_is_refused_before_any_work(model_path, tmp_path):
    with pytest.raises(GraphcError, match=r"topology\.ep: 3 must divide"):
        sweep(load_config(model_path), tmp_path, [Topology(), Topology(3, 3)], ["export"], log=lambda line: None)
    assert not any(tmp_path.iterdir())


def test_bucket_table_sums_stats_per_bucket_and_marks_failures():
    from graphc.tools.sweep import CaseResult, Stage

    stats = {"steps": 2, "tokens": 6, "padding": 2, "seconds": 0.5}
    stage = Stage("export", "1x1", [CaseResult("a", [[1]], {"decode-4": stats}),
                                    CaseResult("b", [[1]], {"decode-4": stats}, ["differs"])], None)
    cell = bucket_table([stage])["decode-4"]["export 1x1"]
    assert cell == {"matched": False, "failed_cases": ["b"], "steps": 4, "tokens": 12, "padding": 4, "seconds": 1.0}


@pytest.mark.multirank
@pytest.mark.slow
def test_data_parallel_sweep_stages_at_world_8_and_16(tmp_path, tiny_checkpoints):
    """wide-16e (16 experts) with every bucket kind in three graphs: 4 replicas of 2 ranks with
    the experts over all 8 (a2a_v), and 2 replicas of 8 context-parallel ranks with one expert
    per rank over all 16 (a2a_even): every bucket matches the 1x1 stage and transformers. (The
    job's wall time is the ranks' start-up and steps on oversubscribed cores.)"""
    buckets = TEST_BUCKETS["dp"]
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["wide-16e"], buckets)))
    result = CliRunner().invoke(cli, ["sweep", str(tmp_path / "model.yaml"), "--topologies", "4x2x8,2x8x16",
                                      "--new-tokens", "4", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [s["topology"] for s in report] == ["1x1", "4x2x8", "2x8x16"]
    expected = {b.name for b in all_buckets(buckets["prefill"], buckets["decode"], buckets["prompt_as_decode"])}
    for stage in report:
        assert {bucket for case in stage["cases"] for bucket in case["buckets"]} == expected, stage["topology"]
        assert all(case["failures"] == [] for case in stage["cases"])
    assert "external reference: transformers" in result.stderr


def test_a_stage_spans_the_hosts_where_its_ranks_divide_among_them_else_runs_on_host_0():
    from graphc.runtime.hosts import HostOptions

    leader, other = (HostOptions(nnodes=2, node_rank=h, master_port=29500) for h in (0, 1))
    spanning = stage_hosts(other, Topology(cp=2, ep=2), index=3)
    assert (spanning.nnodes, spanning.node_rank, spanning.master_port) == (2, 1, 29503)  # a store per stage
    assert stage_hosts(leader, Topology(), index=0) == HostOptions()  # 1x1: host 0 alone
    assert stage_hosts(other, Topology(), index=0) is None  # ... and the other host sits it out
    assert stage_hosts(HostOptions(), Topology(cp=2, ep=2), index=1) == HostOptions()
