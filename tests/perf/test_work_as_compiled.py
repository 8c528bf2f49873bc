"""The step model's work held to the neuron programs graphc compiles: the runtime collectives of
each program, by kind, and the routed experts' weight bytes its instructions read."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from graphc.artifacts.directory import read_manifest
from graphc.backends.neuron_archive import NEURON_HLO, program_contexts, read_archive
from graphc.backends.xla import graphc_ops
from graphc.backends.xla.aten import Out
from graphc.backends.xla.lint import COLLECTIVES, module_text
from graphc.backends.xla.lower import Lowering
from graphc.backends.xla.variants import CPU
from graphc.config import load_config
from graphc.perf.device import load_device, neuron_grouped_block
from graphc.models.layers import STACKED_EXPERT
from graphc.models.moe_forms import expert_blocks
from graphc.perf.work import config_work, rank_tensors
from graphc.topology import Topology

KIND = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
        "all-to-all": "all_to_all"}
_OPCODE = re.compile(r"=\s*\S+\s([\w\-]+)\(")


def _programs(artifacts) -> dict[str, str]:
    """Each bucket's Neuron module, as text."""
    manifest = read_manifest(artifacts)
    texts = {}
    for name, context in program_contexts(manifest).items():
        _, files = read_archive(artifacts / name, context, (NEURON_HLO,))
        texts[context.graph.bucket.name] = module_text(files[NEURON_HLO])
    return texts


@pytest.mark.multirank
def test_each_programs_runtime_collectives_are_the_step_models(compiled):
    artifacts = compiled("wide-16e", "neuron", "small", 2, 2)  # the neuron backend test's (2, 2) programs
    config = load_config(artifacts.parent / "model.yaml")
    works = {w.bucket: w for w in config_work(config, load_device("trn2"))}
    for bucket, text in _programs(artifacts).items():
        in_program: dict[str, int] = {}
        for line in text.splitlines():
            opcode = _OPCODE.search(line)
            if opcode and opcode.group(1) in COLLECTIVES:
                in_program[KIND[opcode.group(1)]] = in_program.get(KIND[opcode.group(1)], 0) + 1
        modelled: dict[str, int] = {}
        for c in works[bucket].collectives:
            modelled[c.kind] = modelled.get(c.kind, 0) + c.count
        assert in_program == modelled, bucket


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\w+)\[(?P<dims>[\d,]*)\]\S*\s"
                          r"(?P<opcode>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attributes>.*)$")
PASS_THROUGH = ("transpose", "bitcast", "reshape", "convert", "copy")
WIDTH = {"f32": 4, "bf16": 2, "f8e4m3fn": 1}


def _instructions(text: str) -> tuple[list[dict], dict[str, list[dict]]]:
    instructions = [m.groupdict() for m in map(_INSTRUCTION.match, text.splitlines()) if m]
    users: dict[str, list[dict]] = {}
    for ins in instructions:
        for operand in ins["operands"].split(","):
            users.setdefault(operand.strip(), []).append(ins)
    return instructions, users


def _dims(ins: dict) -> list[int]:
    return [int(d) for d in ins["dims"].split(",") if d]


def _experts(instructions: list[dict], expert_shapes: set[tuple[int, ...]]) -> list[dict]:
    return [ins for ins in instructions if ins["opcode"] == "parameter" and tuple(_dims(ins)) in expert_shapes]


def expert_bytes_read(text: str, expert_shapes: set[tuple[int, ...]]) -> int:
    """The bytes of the routed experts' weight parameters a module's instructions read: a gather
    reads its output's elements, a dot (through layout changes) the whole stack."""
    instructions, users = _instructions(text)

    def size(ins: dict) -> int:
        return math.prod(_dims(ins)) * WIDTH[ins["type"]]

    def read(name: str, whole: int) -> int:
        total = 0
        for user in users.get(name, []):
            if user["opcode"] == "gather":
                total += size(user)
            elif user["opcode"] in PASS_THROUGH:
                total += read(user["name"], whole)
            else:
                total += whole
        return total

    return sum(read(ins["name"], size(ins)) for ins in _experts(instructions, expert_shapes))


def expert_flops(text: str, expert_shapes: set[tuple[int, ...]]) -> int:
    """The FLOPs of the products of the routed experts' weights: a dot's 2 x output x contracted
    size, a multiply (the gather form's multiply-and-sum) 2 x its output."""
    instructions, users = _instructions(text)
    named = {ins["name"]: ins for ins in instructions}

    def flops(name: str) -> int:
        total = 0
        for user in users.get(name, []):
            if user["opcode"] in (*PASS_THROUGH, "gather"):
                total += flops(user["name"])
            elif user["opcode"] == "dot":
                lhs = named[user["operands"].split(",")[0].strip()]
                [contracted] = re.search(r"lhs_contracting_dims=\{(\d+)\}", user["attributes"]).groups()
                total += 2 * math.prod(_dims(user)) * _dims(lhs)[int(contracted)]
            elif user["opcode"] == "multiply":
                total += 2 * math.prod(_dims(user))
        return total

    return sum(flops(ins["name"]) for ins in _experts(instructions, expert_shapes))


@pytest.mark.multirank
def test_each_programs_expert_reads_and_flops_are_the_step_models(compiled):
    """Prefill's grouped GEMM in the form its cost picks; decode's gather one expert per route."""
    artifacts = compiled("wide-16e", "neuron", "small", 2, 2)
    config = load_config(artifacts.parent / "model.yaml")
    shapes = {tuple(t.shape) for t in rank_tensors(config) if STACKED_EXPERT.match(t.name)}
    works = {w.bucket: w for w in config_work(config, load_device("trn2"))}
    programs = _programs(artifacts)
    assert set(programs) == {"prefill-8", "decode-2"}
    for bucket, text in programs.items():
        assert expert_bytes_read(text, shapes) == works[bucket].expert_bytes > 0, bucket
        assert expert_flops(text, shapes) == works[bucket].routed_flops > 0, bucket


def test_the_blocked_grouped_gemm_reads_and_computes_what_the_step_model_counts():
    """A compute-bound call (1,024 rows, E' = 4) takes the blocked form: its module gathers one
    matrix a block and multiplies the blocks' padded rows, as `_expert_work` counts them."""
    rows, experts, dim, width, local = 1024, 4, 512, 512, 1024
    block = neuron_grouped_block(local, rows, experts, dim, width, 4)
    assert block, "the shapes of a compute-bound call"
    lowering = Lowering(Topology(1, 1), CPU)
    text = jax.jit(lambda r, w, o: graphc_ops.grouped_mm(lowering, Out((rows, width), np.float32), r, w, o, local)
                   ).lower(jnp.zeros((rows, dim)), jnp.zeros((experts, dim, width)),
                           jnp.zeros(experts, jnp.int32)).compiler_ir("hlo").as_hlo_text()
    blocks = expert_blocks(local, experts, block)
    assert expert_bytes_read(text, {(experts, dim, width)}) == blocks * dim * width * 4
    assert expert_flops(text, {(experts, dim, width)}) == 2 * blocks * block * dim * width < 2 * experts * rows * dim * width
