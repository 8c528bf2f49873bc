"""Jobs that span hosts, each host simulated in its own mount and IPC namespace with its own
/dev/shm (`multihost.py`): one rank's tokens, greedy and sampled, at cp / ep topologies (V3,
V4.1) and a dp one (V3; the V4 family has no data-parallel attention); `graphc serve` and
`graphc sweep` across hosts; a host lost or never joining named by the others."""

from __future__ import annotations

import json
import re
import time

import pytest

from graphc.runtime import Engine, Request
from graphc.sampling import Sampling
from multihost import Host, free_port, namespaces_or_skip, start_hosts

pytestmark = [pytest.mark.multirank, pytest.mark.compiles]

PROMPTS = [([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], None), ([2, 7], None), ([1, 8, 2, 8, 1, 8], 0.9), ([6, 6, 6], 1.3)]
"""(prompt ids, temperature): greedy rows and sampled ones (seeded) in one job."""
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _namespaces():
    namespaces_or_skip()


def _prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt_ids": ids, **({"temperature": t, "seed": 7 + i} if t else {})}
             for i, (ids, t) in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _one_rank_tokens(artifacts) -> list[list[int]]:
    requests = [Request(ids, NEW_TOKENS, stop_at_eos=False,
                        sampling=Sampling(temperature=t, seed=7 + i) if t else Sampling())
                for i, (ids, t) in enumerate(PROMPTS)]
    return [r.output_ids for r in Engine(artifacts).generate(requests)]


def _run_on_hosts(tmp_path, artifacts, nnodes):
    """Host 0 takes the prompts; the other hosts' commands name only the artifacts."""
    port, prompts = free_port(), _prompts_file(tmp_path)
    leader = ("--prompts-file", str(prompts), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json")
    hosts = [Host(tmp_path / f"host{h}-shm", h, nnodes, port, "run", str(artifacts), *(leader if h == 0 else ()))
             for h in range(nnodes)]
    codes = [host.wait() for host in hosts]
    assert codes == [0] * nnodes, [host.errors() for host in hosts]
    assert all(host.out == [] for host in hosts[1:]), "only the leader's host prints results"
    assert all(host.segments() == [] for host in hosts)
    return [json.loads(line)["output_ids"] for line in hosts[0].out]


@pytest.mark.parametrize("preset, buckets, dp, cp, ep, nnodes", [
    ("lora-groups", "small", 1, 2, 2, 2),  # cp x ep, one rank a host
    # Engram's tables and token-id digits over ep, the cp halo (one host: test_v41_serve.py per commit)
    pytest.param("v41", "small", 1, 2, 2, 2, marks=pytest.mark.slow),
    ("lora-groups", "dp", 2, 2, 4, 2),  # two replicas, one a host: replica 1's leader returns tokens across
    pytest.param("lora-groups", "dp", 2, 2, 4, 4, marks=pytest.mark.slow),  # followers and a replica leader alone
    pytest.param("v41", "small", 1, 4, 4, 2, marks=pytest.mark.slow),
    pytest.param("v41", "small", 1, 4, 4, 4, marks=pytest.mark.slow),
], ids=["v3-cp2-ep2-2x1", "v41-cp2-ep2-2x1", "v3-dp2-cp2-ep4-2x2", "v3-dp2-cp2-ep4-4x1", "v41-cp4-ep4-2x2",
        "v41-cp4-ep4-4x1"])
def test_a_job_over_hosts_gives_one_ranks_tokens(preset, buckets, dp, cp, ep, nnodes, compiled, tmp_path):
    expected = _one_rank_tokens(compiled(preset, "export", buckets))
    assert _run_on_hosts(tmp_path, compiled(preset, "export", buckets, cp, ep, True, dp), nnodes) == expected


def test_serve_over_two_hosts_answers_with_one_ranks_completions(compiled, tmp_path):
    import openai

    expected = _one_rank_tokens(compiled("lora-groups", "export", "small"))
    hosts = start_hosts(tmp_path, 2, "serve", str(compiled("lora-groups", "export", "small", 2, 2)), "--port", "0")
    try:
        deadline = time.monotonic() + 120
        while not (address := re.search(r"on (http://\S+)", "".join(hosts[0].err))) and time.monotonic() < deadline:
            assert all(host.process.poll() is None for host in hosts), [host.errors() for host in hosts]
            time.sleep(0.2)
        assert address, hosts[0].errors()
        assert not any("serving" in line for line in hosts[1].err), "only host 0 serves HTTP"
        client = openai.OpenAI(base_url=f"{address.group(1)}/v1", api_key="unused", max_retries=0, timeout=120)
        for (ids, temperature), tokens in zip(PROMPTS, expected):
            sampling = {"temperature": temperature, "seed": 7 + PROMPTS.index((ids, temperature))} if temperature \
                else {"temperature": 0.0}
            completion = client.completions.create(model="artifacts", prompt=ids, max_tokens=NEW_TOKENS,
                                                   extra_body={"ignore_eos": True}, **sampling)
            assert completion.choices[0].model_extra["token_ids"] == tokens
    finally:
        hosts[0].process.send_signal(15)
    assert [host.wait(90) for host in hosts] == [0, 0], [host.errors() for host in hosts]
    assert all(host.segments() == [] for host in hosts)


def _long_job(compiled):
    prompts = [arg for i in range(200) for arg in ("--prompt-ids", f"3,1,{i % 250 + 2}")]  # minutes of work
    return ("run", str(compiled("lora-groups", "export", "small", 2, 2)), *prompts, "--max-new-tokens", "60",
            "--ignore-eos")


def _wait_until_generating(hosts) -> None:
    """Until every host's rank is up (a process its command spawned), then a few seconds of steps."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert all(host.process.poll() is None for host in hosts), [host.errors() for host in hosts]
        if all(len(host.ranks()) == 1 for host in hosts):
            break
        time.sleep(0.2)
    time.sleep(5)
    assert all(host.process.poll() is None for host in hosts), [host.errors() for host in hosts]


@pytest.mark.parametrize("lost", [1, pytest.param(0, marks=pytest.mark.slow)])  # a follower's host, the leader's
def test_a_lost_host_is_named_by_the_others_within_30_s(lost, compiled, tmp_path):
    hosts = start_hosts(tmp_path, 2, *_long_job(compiled))
    _wait_until_generating(hosts)
    hosts[lost].kill()
    killed_at = time.monotonic()
    [survivor] = [host for host in hosts if host is not hosts[lost]]
    assert survivor.wait(60) == 2
    assert time.monotonic() - killed_at < 30
    who = "host 1 (rank 1)" if lost == 1 else "host 0 (rank 0, the leader)"
    [line] = survivor.errors()
    assert line.startswith(f"error: {who} was lost: ") and line.endswith("; the other ranks were stopped"), line
    assert survivor.segments() == []


@pytest.mark.slow
def test_an_idle_servers_lost_host_stops_the_server_within_30_s(compiled, tmp_path):
    hosts = start_hosts(tmp_path, 2, "serve", str(compiled("lora-groups", "export", "small", 2, 2)), "--port", "0")
    deadline = time.monotonic() + 120
    while not any("serving" in line for line in hosts[0].err) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # idle, between requests
    hosts[1].kill()
    killed_at = time.monotonic()
    assert hosts[0].wait(60) == 2
    assert time.monotonic() - killed_at < 30
    assert hosts[0].errors()[-1].startswith("error: host 1 (rank 1) was lost: "), hosts[0].errors()
    assert hosts[0].segments() == []


def test_a_host_that_never_joins_is_named(compiled, tmp_path):
    """Host 0 alone waits for host 1; host 1 alone waits for host 0's store: each names the other."""
    artifacts = str(compiled("lora-groups", "export", "small", 2, 2))
    port = free_port()
    leader = Host(tmp_path / "alone0", 0, 2, port, "run", artifacts, "--prompt-ids", "3,1", "--join-timeout", "3")
    assert leader.wait(60) == 2
    assert leader.errors() == [
        f"error: host 1 (rank 1) never joined within 3 s (rendezvous at 127.0.0.1:{port}); start `--node-rank 1` "
        "there, or raise --join-timeout"]
    follower = Host(tmp_path / "alone1", 1, 2, free_port(), "run", artifacts, "--prompt-ids", "3,1",
                    "--join-timeout", "3")
    assert follower.wait(60) == 2
    [line] = follower.errors()
    assert line.startswith("error: host 0 (rank 0, the leader) did not answer at 127.0.0.1:"), line


@pytest.mark.slow
def test_a_sweep_over_two_hosts_passes_and_host_0_reports(tiny_checkpoints, tmp_path):
    import yaml

    from support import TEST_BUCKETS, model_yaml

    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump(model_yaml(tiny_checkpoints["lora-groups"], TEST_BUCKETS["small"])))
    port = free_port()
    hosts = [Host(tmp_path / f"host{h}-shm", h, 2, port, "sweep", str(config), "--topologies", "2x2", "--out",
                  str(tmp_path / f"out{h}"), env={"GRAPHC_CACHE_DIR": str(tmp_path / f"cache{h}")})
             for h in range(2)]
    assert [host.wait(600) for host in hosts] == [0, 0], [host.errors()[-5:] for host in hosts]
    report = json.loads((tmp_path / "out0" / "sweep.json").read_text())
    assert [s["topology"] for s in report] == ["1x1", "2x2"]
    assert all(case["failures"] == [] for stage in report for case in stage["cases"])
    assert any("serving" in line and "over 2 hosts" in line for line in hosts[0].err)
    assert hosts[1].errors()[-1] == "host 1: its part of every stage served; host 0 checks and reports"
    assert not (tmp_path / "out1" / "sweep.json").exists()


def test_hosts_serving_the_model_at_another_topology_each_exit_2_naming_it(compiled, tmp_path):
    """Host 1's artifacts: the same checkpoint, world, buckets and pool at dp 2 x ep 2, against host
    0's cp 2 x ep 2: every host stops with the fields that differ, rather than both hanging."""
    port = free_port()
    hosts = [Host(tmp_path / "host0-shm", 0, 2, port, "run", str(compiled("lora-groups", "export", "small", 2, 2)),
                  "--prompt-ids", "3,1"),
             Host(tmp_path / "host1-shm", 1, 2, port, "run",
                  str(compiled("lora-groups", "export", "small", 1, 2, True, 2)))]
    assert [host.wait(120) for host in hosts] == [2, 2], [host.errors() for host in hosts]
    says = "rank 1 disagrees with the leader on the serving parameters: topology.cp: 1 here, 2 on the leader; "
    lines = [host.errors() for host in hosts]
    assert [len(host_lines) for host_lines in lines] == [1, 1], lines
    assert lines[0][0].startswith("error: host 1 (rank 1) stopped: rank 1 failed") and says in lines[0][0], lines
    assert lines[1][0].startswith("error: rank 1 failed") and says in lines[1][0], lines
    assert all(host.segments() == [] for host in hosts)
