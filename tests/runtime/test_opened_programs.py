"""Programs open at their bucket's first step, once per process for each graph file."""

from __future__ import annotations

import threading

import pytest

import graphc.runtime.graph_loaders as graph_loaders
from graphc.runtime import opened_programs
from graphc.runtime.engine import Engine, Request
from graphc.runtime.opened_programs import opened_once

PRESET = "lora-groups"


@pytest.fixture
def fresh_cache(monkeypatch):
    """An empty process cache, so what this test opens is counted from nothing."""
    monkeypatch.setattr(opened_programs, "_OPENED", {})


def test_a_program_opens_at_its_first_use_once_per_key(fresh_cache):
    opened = []
    first = opened_once("a", lambda: opened.append("a") or object())
    again = opened_once("a", lambda: opened.append("a again") or object())
    other = opened_once("b", lambda: opened.append("b") or object())
    assert opened == []  # nothing opens until a step asks
    program = first()
    assert again() is program and first() is program and opened == ["a"]
    assert other() is not program and opened == ["a", "b"]


def test_threads_asking_at_once_open_it_once(fresh_cache):
    opened, gate = [], threading.Event()

    def slow_open():
        gate.wait(5)
        opened.append(1)
        return object()

    getters = [opened_once("k", slow_open) for _ in range(4)]
    results = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, getters[i]())) for i in range(4)]
    for thread in threads:
        thread.start()
    gate.set()
    for thread in threads:
        thread.join(10)
    assert opened == [1] and all(result is results[0] for result in results)


@pytest.fixture
def counted_opens(fresh_cache, monkeypatch):
    """The `.pt2` files the export loader opens, in order."""
    opened = []
    real = graph_loaders.load_exported_program

    def counting(path):
        opened.append(path.name)
        return real(path)

    monkeypatch.setattr(graph_loaders, "load_exported_program", counting)
    return opened


def test_an_engine_opens_only_the_buckets_its_steps_run(compiled, counted_opens):
    artifacts = compiled(PRESET, "export")
    engine = Engine(artifacts)
    assert counted_opens == []  # four programs listed, checked, none opened
    [result] = engine.generate([Request([5, 6, 7], 3, stop_at_eos=False)])  # prefill-8, then decode-1
    assert len(result.output_ids) == 3
    by_bucket = {graph.file.rsplit("/", 1)[-1]: graph.bucket.name for graph in engine.loaded.rank.graphs}
    assert sorted(by_bucket[name] for name in counted_opens) == ["decode-1", "prefill-8"]


def test_engines_of_one_process_share_opened_programs(compiled, counted_opens):
    artifacts = compiled(PRESET, "export")
    prompt = Request([5, 6, 7], 3, stop_at_eos=False)
    [first] = Engine(artifacts).generate([prompt])
    opened = list(counted_opens)
    [second] = Engine(artifacts).generate([prompt])  # a second engine (own pool, own weights' mapping)
    assert counted_opens == opened and second.output_ids == first.output_ids
