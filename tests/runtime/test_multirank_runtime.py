"""The multi-rank runtime: `graphc run` on multi-rank artifacts, many generations in one job on
the inductor backend, and what happens when a rank dies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from graphc.errors import GraphcError
from graphc.runtime import Engine, Request
from graphc.runtime.launch import FAULT_ENV, serve
from graphc.runtime.loader import NUM_KV_BLOCKS_ENV
from graphc.topology import Topology
from multirank import channel_segments, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.compiles]

PRESET = "lora-groups"
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]  # 11 tokens: two prefill chunks
NEW_TOKENS = 10


@pytest.fixture
def small_artifacts(compiled):
    """Artifacts with one prefill and one decode bucket (shared with test_parallel_serve.py)."""
    return lambda backend, cp=2, ep=2: compiled(PRESET, backend, "small", cp, ep)


def _requests():
    return [Request(p, NEW_TOKENS, stop_at_eos=False) for p in PROMPTS]


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_ranks_run_twenty_generations_in_one_job_without_a_hang(small_artifacts):
    expected = [r.output_ids for r in Engine(small_artifacts("inductor", 1, 1)).generate(_requests())]
    outcomes = serve(small_artifacts("inductor"), [_requests() for _ in range(20)])
    assert len(outcomes) == 20
    for outcome in outcomes:
        assert [r.output_ids for r in outcome.results] == expected


def _graphc_run(artifacts, *extra, env=None) -> list[list[int]]:
    script = Path(sys.executable).parent / "graphc"
    done = subprocess.run([str(script), "run", str(artifacts), "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "6",
                           "--ignore-eos", "--json", *extra], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line)["output_ids"] for line in done.stdout.splitlines()]


def test_graphc_run_serves_multi_rank_artifacts_like_one_rank(small_artifacts):
    single = _graphc_run(small_artifacts("export", 1, 1))
    assert _graphc_run(small_artifacts("export")) == single and len(single[0]) == 6


def test_kv_pool_override_on_the_launcher_reaches_every_rank(small_artifacts):
    """Followers whose pool differed from the leader's would refuse to start (next test), so a
    run that completes with the override shows every rank received it."""
    single = _graphc_run(small_artifacts("export", 1, 1))
    assert _graphc_run(small_artifacts("export"), env={NUM_KV_BLOCKS_ENV: "40"}) == single


@pytest.mark.parametrize("lost", [1, 0])
def test_a_dead_rank_stops_the_job_names_itself_and_leaves_no_segment(lost, small_artifacts, monkeypatch):
    artifacts = small_artifacts("export")
    before = channel_segments()
    monkeypatch.setenv(FAULT_ENV, f"{lost}:3")  # that rank SIGKILLs itself at its 4th step
    start = time.monotonic()
    with pytest.raises(GraphcError, match=rf"rank {lost} failed with exit code -9 \(signal 9\); the other ranks were stopped"):
        serve(artifacts, [_requests()])
    assert time.monotonic() - start < 30 + 20  # within 30 s of the death (plus start-up)
    assert channel_segments() <= before


def test_two_jobs_on_one_host_do_not_collide(small_artifacts):
    script = Path(sys.executable).parent / "graphc"
    cmd = [str(script), "run", str(small_artifacts("export")), "--prompt-ids", "9,2,6", "--max-new-tokens", "5",
           "--ignore-eos"]
    jobs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [job.communicate(timeout=180) for job in jobs]
    assert all(job.returncode == 0 for job in jobs), [err[-1500:] for _, err in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()


def _open_with_kv_blocks(rank, topology, artifacts, channel_name, blocks_per_rank):
    from graphc.artifacts.directory import read_manifest
    from graphc.runtime.launch import open_engine

    os.environ[NUM_KV_BLOCKS_ENV] = str(blocks_per_rank[rank])
    try:
        engine = open_engine(str(artifacts), read_manifest(artifacts), rank, channel_name)
    except GraphcError as e:
        return str(e)
    engine.channel.close()
    return engine.startup_info()["kv_blocks"]


def test_ranks_that_disagree_on_the_kv_pool_refuse_to_start(small_artifacts):
    """GRAPHC_NUM_KV_BLOCKS set on the launcher reaches every rank (a `graphc run` test in
    test_cli_serve.py); here the ranks were given different pools, and the follower refuses."""
    channel_name = f"graphc-test-{uuid.uuid4().hex[:8]}"
    leader, follower = run_ranks(Topology(2, 2), _open_with_kv_blocks, small_artifacts("export"), channel_name, [48, 40])
    assert leader == 48
    assert follower == ("rank 1 disagrees with the leader on the serving parameters: kv_blocks: 40 here, 48 on the "
                        "leader; GRAPHC_NUM_KV_BLOCKS must be set alike for every rank")
    assert not Path("/dev/shm", channel_name).exists()


def _agree(rank, topology, artifacts):
    from graphc.artifacts.directory import read_manifest
    from graphc.runtime.launch import agree_on_artifacts

    try:
        agree_on_artifacts(read_manifest(artifacts[rank]), rank)
    except GraphcError as e:
        return str(e)
    return "agreed"


def test_ranks_given_the_same_model_at_another_topology_refuse_to_start(small_artifacts, compiled):
    """The same checkpoint, world, buckets and pool, compiled at cp 2 x ep 2 for the leader and
    dp 2 x ep 2 for the follower: the follower names the fields instead of both hanging."""
    artifacts = [small_artifacts("export"), compiled(PRESET, "export", "small", 1, 2, True, 2)]
    leader, follower = run_ranks(Topology(2, 2), _agree, artifacts)
    assert leader == "agreed"
    assert follower.startswith("rank 1 disagrees with the leader on the serving parameters: topology.cp: 1 here, 2 "
                               "on the leader; topology.dp: 2 here, 1 on the leader; ")
    assert follower.endswith("; every host must serve the same compile's artifacts") and "\n" not in follower


@pytest.mark.parametrize("signum, status", [(2, 130), (15, 143)])  # SIGINT, SIGTERM
def test_an_interrupted_multi_rank_run_exits_with_one_line_and_leaves_nothing(small_artifacts, signum, status):
    """The signal goes to the whole process group, as a terminal's Ctrl-C does: every rank and the
    launcher get it."""
    import signal as signals

    script = Path(sys.executable).parent / "graphc"
    before = channel_segments()
    prompts = [arg for i in range(200) for arg in ("--prompt-ids", f"3,1,{i % 250 + 2}")]  # minutes of work
    job = subprocess.Popen([str(script), "run", str(small_artifacts("export")), *prompts, "--max-new-tokens", "60",
                            "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    time.sleep(12)  # ranks started and generating
    assert job.poll() is None, job.stderr.read()
    os.killpg(job.pid, signum)
    _, stderr = job.communicate(timeout=60)
    lines = [line for line in stderr.splitlines() if not line.startswith("loading ")]
    assert job.returncode == status, stderr
    assert lines == [f"error: stopped by {signals.Signals(signum).name}; every rank was stopped"], stderr
    assert channel_segments() == before
    deadline = time.monotonic() + 15  # multiprocessing's resource tracker exits a moment after its parent
    while (leftover := subprocess.run(["pgrep", "-g", str(job.pid)], capture_output=True, text=True).stdout) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover == "", subprocess.run(["ps", "-o", "pid,cmd", "-g", str(job.pid)], capture_output=True, text=True).stdout


def test_a_bad_kv_pool_override_is_refused_before_any_rank_starts(small_artifacts):
    script = Path(sys.executable).parent / "graphc"
    for value, says in [("abc", "is not an integer"), ("1000000000", "exceeds this host's")]:
        done = subprocess.run([str(script), "run", str(small_artifacts("export")), "--prompt-ids", "3,1,4"],
                              capture_output=True, text=True, timeout=60, env={**os.environ, NUM_KV_BLOCKS_ENV: value})
        lines = [line for line in done.stderr.splitlines() if not line.startswith("loading ")]
        assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
