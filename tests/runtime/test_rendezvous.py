"""The hosts' rendezvous and watch, in one process (each host a handler of its own on one
store): joining, naming a host that never joins, a lost host, a failed one, one that ended; what
a party without the job secret can write to the store, and a node rank taken twice."""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

import graphc.runtime.rendezvous as rendezvous
from graphc.errors import GraphcError
from graphc.runtime.hosts import HostOptions
from graphc.runtime.rendezvous import HostRendezvous
from multihost import free_port


MADE: list[HostRendezvous] = []
SECRET = "test-secret-of-this-job"


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch):
    monkeypatch.setattr(rendezvous, "LOST_SECONDS", 1.5)
    monkeypatch.setattr(rendezvous, "BEAT_SECONDS", 0.1)
    yield
    for handler in MADE:  # no watch outlives its test (their stores go with it)
        if handler.watch is not None:
            handler.watch._stopped.set()
    MADE.clear()


def _hosts(nnodes: int, join_timeout: float = 10.0):
    """A handler per host, each recording what it was told was lost."""
    port = free_port()
    told = {h: [] for h in range(nnodes)}
    handlers = []
    for host in range(nnodes):
        options = HostOptions(nnodes=nnodes, node_rank=host, master_port=port, join_timeout=join_timeout,
                              secret=SECRET)
        handlers.append(HostRendezvous(options, options.layout(nnodes), f"test-{host}", told[host].append))
    MADE.extend(handlers)
    return handlers, told


def _join(handlers):
    """Every host's `next_rendezvous`, concurrently (each waits for the others); host 0 first, as it serves."""
    infos, errors = {}, {}

    def join(handler):
        try:
            infos[handler.host] = handler.next_rendezvous()
        except GraphcError as e:
            errors[handler.host] = str(e)

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join(30)
    return infos, errors


def test_hosts_join_with_their_node_rank_as_group_rank_and_share_host_0s_store():
    handlers, _ = _hosts(3)
    infos, errors = _join(handlers)
    assert errors == {}
    assert [(infos[h].rank, infos[h].world_size) for h in range(3)] == [(0, 3), (1, 3), (2, 3)]
    infos[2].store.set("from-host-2", "x")
    assert infos[0].store.get("from-host-2") == b"x"
    for handler in reversed(handlers):
        handler.leave("ok", agent_exited_normally=True)


def test_a_host_that_never_joins_is_named_by_those_that_did():
    handlers, _ = _hosts(3, join_timeout=1.0)
    infos, errors = _join(handlers[:2])
    assert infos == {}
    assert errors[0].startswith("host 2 (rank 2) never joined within 1 s (rendezvous at 127.0.0.1:")
    assert errors[1] == errors[0]


def test_a_host_whose_store_never_answers_is_named():
    handlers, _ = _hosts(2, join_timeout=0.5)
    _, errors = _join(handlers[1:])
    assert errors[1].startswith("host 0 (rank 0, the leader) did not answer at 127.0.0.1:")


def test_a_host_that_stops_beating_is_lost_and_only_its_watchers_are_told():
    handlers, told = _hosts(3)
    _join(handlers)
    handlers[2].watch._stopped.set()  # host 2's launcher is gone (killed): no beat, no word
    time.sleep(3)
    lost = r"host 2 \(rank 2\) was lost: no sign of it for \d s \(its processes died or its network is gone\)"
    assert [len(told[h]) for h in range(3)] == [1, 1, 0]
    assert re.fullmatch(lost, told[0][0]) and re.fullmatch(lost, told[1][0])
    assert handlers[0].watch.lost == told[0][0] and handlers[0].watch.gone == {2}


def test_a_host_that_left_with_a_failure_is_named_with_it_and_one_that_ended_never_is():
    handlers, told = _hosts(3)
    _join(handlers)
    handlers[1].leave("ok", agent_exited_normally=True)
    time.sleep(2.5)  # past LOST_SECONDS: ended normally, so never lost
    assert told[0] == [] and told[2] == []
    handlers[2].leave("rank 2 failed with exit code 1: RuntimeError: boom", agent_exited_normally=False)
    time.sleep(0.5)
    assert told[0] == ["host 2 (rank 2) stopped: rank 2 failed with exit code 1: RuntimeError: boom"]


def test_after_a_local_failure_the_verdict_waits_for_the_others_signs_of_life():
    handlers, _ = _hosts(3)
    _join(handlers)
    started = time.monotonic()
    assert handlers[0].watch.verdict() is None  # both others beat on: the failure was this host's own
    assert time.monotonic() - started < 1.0
    handlers[1].watch._stopped.set()
    assert handlers[0].watch.verdict().startswith("host 1 (rank 1) was lost")


def test_a_job_that_has_left_frees_its_port_and_the_next_one_starts_afresh():
    """In one process (a sweep's stages, a library's jobs): the next rendezvous on the same port
    gets a new store, not the last job's keys."""
    handlers, _ = _hosts(2)
    port = handlers[0].options.master_port
    _join(handlers)
    for handler in reversed(handlers):
        handler.leave("ok", agent_exited_normally=True)
    again = [HostRendezvous(HostOptions(nnodes=2, node_rank=h, master_port=port, join_timeout=10.0, secret=SECRET),
                            HostOptions(nnodes=2).layout(2), f"again-{h}", [].append) for h in range(2)]
    MADE.extend(again)
    _, errors = _join(again)
    assert errors == {}
    assert not again[0].store.check(["graphc/left/1"])  # the first job's word is not in the new store


def test_values_without_the_jobs_tag_are_named_once_and_never_acted_on(caplog):
    """A client without the secret (the store answers anyone) says host 1 stopped, and keeps a
    dead host 2 beating with made-up and replayed counters: nobody stops, host 2 is still lost."""
    handlers, told = _hosts(3)
    _join(handlers)
    port = handlers[0].options.master_port
    intruder = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
    intruder.set("graphc/left/1", "made-up reason")
    with handlers[0].watch._lock:
        assert handlers[0].watch._look() is None
    assert told[0] == [] and told[2] == []
    handlers[2].watch._stopped.set()
    genuine = intruder.get("graphc/beat/2")
    deadline = time.monotonic() + 5
    while not (told[0] and told[1]) and time.monotonic() < deadline:  # each watcher in its own time
        for forged in (b"1000", genuine):  # a counter of its own, then host 2's last beat replayed
            intruder.set("graphc/beat/2", forged)
            time.sleep(0.05)
    assert told[0][0].startswith("host 2 (rank 2) was lost: no sign of it")
    assert told[1][0].startswith("host 2 (rank 2) was lost: no sign of it")
    foreign = [r.getMessage() for r in caplog.records if "graphc/left/1" in r.getMessage()]
    assert set(foreign) == {f"ignored graphc/left/1 in the rendezvous store at 127.0.0.1:{port} does not carry this "
                            "job's tag: another party wrote it, or the hosts were given different job secrets"}
    assert len(foreign) <= 2  # once by each watcher that saw it (host 0; host 2 if it looked before it stopped)


def test_hosts_given_different_secrets_are_each_refused_in_one_line():
    handlers, _ = _hosts(2)
    other = dataclasses.replace(handlers[1].options, secret="another-secret-entirely")
    handlers[1] = HostRendezvous(other, handlers[1].layout, "test-other", [].append)
    MADE.append(handlers[1])
    infos, errors = _join(handlers)
    assert infos == {}
    says = ("in the rendezvous store at 127.0.0.1:{port} does not carry this job's tag: another party wrote it, or "
            "the hosts were given different job secrets: give every host the same job secret (GRAPHC_JOB_SECRET or "
            "--job-secret-file), and keep the rendezvous port private").format(port=other.master_port)
    assert errors == {0: f"graphc/joined/1 {says}", 1: f"graphc/joined/0 {says}"}


def test_a_party_without_the_secret_cannot_join_as_a_host():
    handlers, _ = _hosts(2)
    intruder_joins = threading.Timer(0.5, lambda: TCPStore(
        "127.0.0.1", handlers[0].options.master_port, None, False, timedelta(seconds=5)).set("graphc/joined/1", "1"))
    intruder_joins.start()
    infos, errors = _join(handlers[:1])
    intruder_joins.join()
    assert infos == {} and errors[0].startswith("graphc/joined/1 in the rendezvous store at 127.0.0.1:")


def test_a_second_host_with_a_node_rank_already_taken_is_refused_in_one_line():
    handlers, _ = _hosts(2)
    _join(handlers)
    again = HostRendezvous(handlers[1].options, handlers[1].layout, "test-again", [].append)
    MADE.append(again)
    with pytest.raises(GraphcError) as refused:
        again.next_rendezvous()
    assert str(refused.value) == (f"host 1 (rank 1) has already joined the job at {handlers[1].options.endpoint}: "
                                  "another `--node-rank 1` command runs; give each host its own --node-rank")


def test_the_store_listens_on_the_master_address_alone():
    handlers, _ = _hosts(2)
    store = handlers[0]._connect()
    port = handlers[0].options.master_port
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):  # another address of this host: not served
        socket.create_connection(("127.0.0.2", port), timeout=5)
    del store
