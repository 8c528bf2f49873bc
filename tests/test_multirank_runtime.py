"""The multi-rank runtime: `graphc run` on multi-rank artifacts, many generations in one job on
the inductor backend, and what happens when a rank dies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from graphc.config import load_config
from graphc.errors import GraphcError
from graphc.pipeline import CompileOptions, compile
from graphc.runtime import Engine, Request
from graphc.runtime.launch import FAULT_ENV, serve
from support import model_yaml

PRESET = "lora-groups"
SMALL_BUCKETS = {"prefill": [8], "decode": [2], "prompt_as_decode": 0, "context_limit": 64}
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]  # 11 tokens: two prefill chunks
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def small_artifacts(tmp_path_factory, tiny_checkpoints):
    made = {}

    def get(backend, cp=2, ep=2):
        if (backend, cp, ep) not in made:
            root = tmp_path_factory.mktemp(f"small-{backend}-cp{cp}-ep{ep}")
            config = {**model_yaml(tiny_checkpoints[PRESET], SMALL_BUCKETS, backend), "topology": {"cp": cp, "ep": ep}}
            (root / "model.yaml").write_text(yaml.safe_dump(config))
            compile(load_config(root / "model.yaml"), root / "artifacts",
                    CompileOptions(show_progress=False, verify_passes=True, workers=2))
            made[backend, cp, ep] = root / "artifacts"
        return made[backend, cp, ep]

    return get


def _requests():
    return [Request(p, NEW_TOKENS, stop_at_eos=False) for p in PROMPTS]


def _graphc_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("graphc-*")}


def test_inductor_ranks_run_twenty_generations_in_one_job_without_a_hang(small_artifacts):
    expected = [r.output_ids for r in Engine(small_artifacts("inductor", 1, 1)).generate(_requests())]
    batches = serve(small_artifacts("inductor"), [_requests() for _ in range(20)], world=2)
    assert len(batches) == 20
    for results in batches:
        assert [r.output_ids for r in results] == expected


def test_graphc_run_serves_multi_rank_artifacts_like_one_rank(small_artifacts):
    script = Path(sys.executable).parent / "graphc"
    args = [str(script), "run", None, "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "6", "--ignore-eos", "--json"]
    outputs = []
    for artifacts in (small_artifacts("export", 1, 1), small_artifacts("export")):
        args[2] = str(artifacts)
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append([json.loads(line)["output_ids"] for line in done.stdout.splitlines()])
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 6


@pytest.mark.parametrize("lost", [1, 0])
def test_a_dead_rank_stops_the_job_names_itself_and_leaves_no_segment(lost, small_artifacts, monkeypatch):
    artifacts = small_artifacts("export")
    before = _graphc_segments()
    monkeypatch.setenv(FAULT_ENV, f"{lost}:3")  # that rank SIGKILLs itself at its 4th step
    start = time.monotonic()
    with pytest.raises(GraphcError, match=rf"rank {lost} failed with exit code -9 \(signal 9\); the other ranks were stopped"):
        serve(artifacts, [_requests()], world=2)
    assert time.monotonic() - start < 30 + 20  # within 30 s of the death (plus start-up)
    assert _graphc_segments() <= before


def test_two_jobs_on_one_host_do_not_collide(small_artifacts):
    script = Path(sys.executable).parent / "graphc"
    cmd = [str(script), "run", str(small_artifacts("export")), "--prompt-ids", "9,2,6", "--max-new-tokens", "5",
           "--ignore-eos"]
    jobs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [job.communicate(timeout=180) for job in jobs]
    assert all(job.returncode == 0 for job in jobs), [err[-1500:] for _, err in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()
