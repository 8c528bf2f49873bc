"""The collective-schedule check: every rank's collectives as one happens-before graph, refused
when a group's members would enter different collectives, miss one, or wait in a cycle."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.compiler.capture import capture_bucket
from graphc.errors import GraphcError
from graphc.weights.checkpoint import load_rank_shard
from graphc.models.step_model import Parallelism
from graphc.passes.collective_schedule import Collective, check_collective_schedule, program_collectives
from graphc.passes.graph import graphc_op
from graphc.topology import Topology
from support import BLOCK_SIZE, BLOCKS_PER_ROW, NUM_BLOCKS, copy_program

BUCKET = Bucket("decode", 2)
DATA_PARALLEL = Topology(cp=2, ep=4, dp=2)  # replicas [0, 1] and [2, 3]; one EP group over all four


@pytest.fixture(scope="module")
def all_to_all_program(tiny_checkpoints):
    model = load_rank_shard(tiny_checkpoints["lora-groups"], DATA_PARALLEL, 0, torch.float32)
    return capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE,
                          Parallelism(cp=2, ep=4, moe_exchange="a2a_v"))


def test_reads_every_collective_with_its_group_lowering_and_shapes(all_to_all_program):
    issued = program_collectives(all_to_all_program.graph_module)
    assert [c.op for c in issued[:3]] == ["attention_combine", "attention_combine", "moe_a2a_dispatch"]
    dispatch = issued[2]
    assert dispatch.group == "ep" and dict(dispatch.arguments) == {"num_experts": 8, "group_size": 4, "lowering": "a2a_v"}
    assert dispatch.inputs == (("float32", (2, 64)), ("int64", (2, 2)), ("float32", (2, 2)), ("bool", (2,)))


def test_one_program_on_every_rank_of_a_data_parallel_topology_is_accepted(all_to_all_program):
    issued = program_collectives(all_to_all_program.graph_module)
    check_collective_schedule(DATA_PARALLEL, BUCKET.name, {rank: issued for rank in range(4)})


@pytest.mark.parametrize("change, what", [
    (lambda c: dataclasses.replace(c, arguments=(("num_experts", 8), ("group_size", 4), ("lowering", "a2a_even"))),
     "lowering=a2a_even"),
    (lambda c: dataclasses.replace(c, inputs=(("float32", (4, 64)), *c.inputs[1:])), "float32\\[4, 64\\]"),
])
def test_a_rank_with_another_lowering_or_capacity_is_refused(all_to_all_program, change, what):
    issued = program_collectives(all_to_all_program.graph_module)
    other = [change(c) if c.op == "moe_a2a_dispatch" else c for c in issued]
    with pytest.raises(GraphcError, match=r"decode-2: collective #0 on group \[0, 1, 2, 3\]: the members disagree "
                                          rf"\(rank 0: moe_a2a_dispatch.*rank 3: moe_a2a_dispatch\(ep; .*{what}.*"
                                          r"the group would hang"):
        check_collective_schedule(DATA_PARALLEL, BUCKET.name, {0: issued, 1: issued, 2: issued, 3: other})


def test_a_rank_that_skips_a_collective_is_refused(tiny_checkpoints):
    topology = Topology(2, 2)
    model = load_rank_shard(tiny_checkpoints["lora-groups"], topology, 0, torch.float32)
    program = capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE,
                             Parallelism(cp=2, ep=2, moe_exchange="static"))
    skipping = copy_program(program)
    reduce = next(n for n in skipping.graph.nodes if graphc_op(n) == "graphc::all_reduce")
    reduce.replace_all_uses_with(reduce.args[0])
    skipping.graph.erase_node(reduce)
    with pytest.raises(GraphcError, match=r"decode-2: collective #\d+ on group \[0, 1\]: the members disagree "
                                          r"\(rank 0: all_reduce\(ep; .*rank 1: attention_combine\(cp; .*hang"):
        check_collective_schedule(topology, BUCKET.name, {0: program_collectives(program.graph_module),
                                                          1: program_collectives(skipping.graph_module)})


def test_a_tensor_parallel_rank_that_skips_an_all_reduce_is_refused_on_its_tp_group(tiny_checkpoints):
    topology = Topology(cp=2, ep=2, dp=1, tp=2)  # tp groups [0, 1], [2, 3]; cp groups [0, 2], [1, 3]
    model = load_rank_shard(tiny_checkpoints["lora-groups"], topology, 0, torch.float32)
    program = capture_bucket(model, BUCKET, BLOCKS_PER_ROW, NUM_BLOCKS, BLOCK_SIZE,
                             Parallelism(cp=2, ep=2, moe_exchange="static"))
    issued = list(program_collectives(program.graph_module))
    assert {c.group for c in issued} == {"cp", "tp", "ep"}
    check_collective_schedule(topology, BUCKET.name, {rank: issued for rank in range(4)})
    first = next(i for i, c in enumerate(issued) if c.group == "tp" and c.op == "all_reduce")
    skipped = issued[:first] + issued[first + 1:]
    with pytest.raises(GraphcError, match=r"decode-2: collective #\d+ on group \[2, 3\]: the members disagree "
                                          r"\(rank 2: all_reduce\(tp; .*hang"):
        check_collective_schedule(topology, BUCKET.name, {0: issued, 1: issued, 2: issued, 3: skipped})


def _call(op: str, group: str) -> Collective:
    return Collective(op, group, (), (("float32", (2, 8)),))


def test_collectives_waiting_on_each_other_in_a_cycle_are_refused():
    """dp = 2, cp = 2, ep = 2 over ranks [0, 1] and [2, 3] would be replicas; take ep = 4 with
    cp groups [0, 1], [2, 3]: rank 1 enters its replica's combine before the EP exchange, rank 0
    the other way round: 0 waits in the exchange for 1, 1 in the combine for 0."""
    combine, exchange = _call("attention_combine", "cp"), _call("moe_a2a_combine", "ep")
    ok = [combine, exchange]
    check_collective_schedule(DATA_PARALLEL, BUCKET.name, {rank: ok for rank in range(4)})
    with pytest.raises(GraphcError, match=r"decode-2: the ranks' collectives wait on each other in a cycle: "
                                          r"#0 on \[0, 1, 2, 3\] \(moe_a2a_combine\) -> #0 on \[0, 1\] "
                                          r"\(attention_combine\) -> .*the job would hang"):
        check_collective_schedule(DATA_PARALLEL, BUCKET.name, {0: [exchange, combine], 1: ok, 2: ok, 3: ok})


def test_a_rank_that_never_reaches_a_groups_collective_is_refused():
    combine = _call("attention_combine", "cp")
    with pytest.raises(GraphcError, match=r"decode-2: collective #1 on group \[2, 3\]: ranks \[3\] never issue it "
                                          r"\(rank 2: attention_combine\(cp; float32\[2, 8\]\)\); the group would hang"):
        check_collective_schedule(DATA_PARALLEL, BUCKET.name,
                                  {0: [combine], 1: [combine], 2: [combine, combine], 3: [combine]})
