"""A job's hosts: the multi-node options as every host's command takes them, refused in one line
naming the option when they do not fit the artifacts; which host runs which ranks; the job secret."""

from __future__ import annotations

import pytest

from graphc.errors import GraphcError
from graphc.runtime.hosts import SECRET_ENV, HostLayout, HostOptions

SECRET = "0123456789abcdef0123"


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)


def _options(nnodes=2, node_rank=0, master_addr=None, master_port=None, rdzv_endpoint=None, nproc_per_node=None,
             job_secret_file=None):
    return HostOptions.from_cli(nnodes, node_rank, master_addr, master_port, rdzv_endpoint, nproc_per_node, 30.0,
                                job_secret_file)


def test_ranks_are_laid_out_host_by_host_with_the_leader_on_host_0():
    layout = _options(nnodes=2).layout(4)
    assert layout == HostLayout(2, 2)
    assert [layout.host_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.first_rank(h) for h in range(2)] == [0, 2]
    assert list(layout.ranks(1)) == [2, 3]
    assert layout.describe(0) == "host 0 (ranks 0-1, the leader)"
    assert HostLayout(4, 1).describe(3) == "host 3 (rank 3)"
    assert _options(nnodes=4, nproc_per_node=2).layout(8) == HostLayout(4, 2)


def test_the_rendezvous_address_comes_from_an_endpoint_or_an_address_and_port():
    assert _options().endpoint == "127.0.0.1:29500"  # torchrun's defaults
    assert _options(master_addr="10.0.0.5", master_port=1234).endpoint == "10.0.0.5:1234"
    given = _options(rdzv_endpoint="[::1]:4321")
    assert (given.master_addr, given.master_port, given.endpoint) == ("::1", 4321, "[::1]:4321")


@pytest.mark.parametrize("options, world, says", [
    (dict(node_rank=2), 4, "--node-rank: 2 must be in 0..1 (--nnodes 2)"),
    (dict(nnodes=3), 4, "the artifacts need 4 ranks, the same number on every host; --nnodes 3 does not divide them "
                        "(4 % 3 = 1)"),
    (dict(nproc_per_node=3), 4, "the artifacts need 4 ranks, the same number on every host; --nproc-per-node 3 x "
                                "--nnodes 2 = 6"),
    (dict(nnodes=4), 2, "--nnodes: 4 hosts for artifacts of 2 rank(s); a host runs at least one rank"),
    (dict(rdzv_endpoint="host"), 4, "--rdzv-endpoint: 'host' must be HOST:PORT with a port in 1..65535"),
    (dict(rdzv_endpoint="host:70000"), 4, "--rdzv-endpoint: 'host:70000' must be HOST:PORT"),
    (dict(rdzv_endpoint="a:1", master_port=2), 4, "--rdzv-endpoint names the rendezvous address and port: give it "
                                                  "or --master-addr / --master-port, not both"),
])
def test_options_that_do_not_fit_are_refused_naming_the_option(options, world, says):
    with pytest.raises(GraphcError) as refused:
        _options(**options).layout(world)
    assert str(refused.value).startswith(says)


def test_the_job_secret_comes_from_the_environment_or_a_file_and_stays_out_of_reprs(monkeypatch, tmp_path):
    assert _options().secret == SECRET
    monkeypatch.delenv(SECRET_ENV)
    (tmp_path / "secret").write_text("fedcba9876543210fedcba\n")
    given = _options(job_secret_file=tmp_path / "secret")
    assert given.secret == "fedcba9876543210fedcba" and "fedcba" not in repr(given)
    assert _options(nnodes=1).secret is None  # one host: no rendezvous to protect


@pytest.mark.parametrize("env, file_text, says", [
    (None, None, f"a job that spans hosts needs a secret every host is given: set {SECRET_ENV} or pass "
                 "--job-secret-file F (e.g. from `openssl rand -hex 32`)"),
    (SECRET, SECRET, f"--job-secret-file and {SECRET_ENV} both give the job secret: give one"),
    ("short", None, f"{SECRET_ENV}: the job secret has 5 characters; at least 16 are needed"),
    (None, "  tiny \n", "--job-secret-file: the job secret has 4 characters; at least 16 are needed"),
])
def test_a_missing_doubled_or_short_job_secret_is_refused_in_one_line(env, file_text, says, monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV)
    if env is not None:
        monkeypatch.setenv(SECRET_ENV, env)
    path = None
    if file_text is not None:
        path = tmp_path / "secret"
        path.write_text(file_text)
    with pytest.raises(GraphcError) as refused:
        _options(job_secret_file=path)
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
