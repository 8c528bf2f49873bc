"""The structural lint of a Neuron-variant HLO module: what neuronx-cc refuses or mis-serves,
checked on the module text before it leaves this host.

Rules (each names the instruction that breaks it):
- no s64 / u64 values (int32 indices only);
- no f8e4m3fn values: trn1 / trn2's neuronx-cc refuses them (NCC_EVRF051); FP8 weights enter as
  their bytes and are decoded with integer ops (`aten.FP8_BITS`);
- no variadic reduce (a `reduce` producing a tuple: jnp.argmax's form);
- no `while`, `rng`, `rng-bit-generator` or `rng-get-and-update-state`;
- `custom-call` targets only from neuronx-cc's recognised list;
- `sort` comparators rooted in an LT / LE / GT / GE compare;
- static shapes (no bounded-dynamic `<=` dims);
- the KV pool parameter aliased to its result (`input_output_alias`);
- every collective's `replica_groups` are the topology's groups of some kind (cp / world or ep).

`lint_archives` checks every program archive of a neuron artifacts directory (`graphc inspect
--lint`, through the backend's record): its Neuron HLO by these rules, and its StableHLO by being
that same module (converted to HLO, the text is the Neuron HLO's: every rule holds of it too).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from jax._src.lib import xla_client

from graphc.backends.neuron_archive import (NEURON_HLO, NEURON_STABLEHLO, program_contexts, read_archive,
                                           stablehlo_to_hlo)
from graphc.errors import GraphcError
from graphc.topology import GROUPS, Topology

if TYPE_CHECKING:
    from graphc.artifacts.manifest import Manifest

NEURON_CUSTOM_CALLS = frozenset({
    "AwsNeuronTopK", "AwsNeuronArgMax", "AwsNeuronArgMin", "AwsNeuronSoftmax", "AwsNeuronRmsNorm", "AwsNeuronGelu",
    "AwsNeuronSilu", "AwsNeuronErf", "AwsNeuronCustomNativeKernel", "AwsNeuronCollectiveMatmul",
})
"""custom-call targets neuronx-cc recognises that graphc may emit (the AWS Neuron SDK's list
of `AwsNeuron*` targets)."""

FORBIDDEN_OPCODES = ("while", "rng", "rng-bit-generator", "rng-get-and-update-state")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
SORT_DIRECTIONS = {"LT", "LE", "GT", "GE"}

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s(?P<opcode>[\w\-]+)\((?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?(?P<name>[\w.\-]+)\s.*\{\s*$")


class LintError(GraphcError):
    """A Neuron-variant module breaks a rule of this module's docstring."""


def module_text(proto: bytes) -> str:
    return xla_client._xla.XlaComputation(proto).as_hlo_text()


def _computations(text: str) -> dict[str, list[dict]]:
    computations, current = {}, None
    for line in text.splitlines():
        if line.startswith(("HloModule", "}")) or not line.strip():
            continue
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{", 1)[0]:
            current = computations.setdefault(header.group("name"), [])
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction and current is not None:
            current.append({**instruction.groupdict(), "line": line.strip(), "root": line.lstrip().startswith("ROOT")})
    return computations


def lint_neuron_module(proto: bytes, topology: Topology, pool_parameter: int) -> list[str]:
    """Every rule the module breaks, one line each (empty: clean)."""
    text = module_text(proto)
    header = text.splitlines()[0]
    computations = _computations(text)
    allowed_groups = {_groups_text(topology, group) for group in GROUPS}
    problems = []
    if not re.search(r"input_output_alias=\{.*?\(%d," % pool_parameter, header):
        problems.append(f"the KV pool (parameter {pool_parameter}) is not aliased to a result: {header[:200]}")
    for instructions in computations.values():
        for ins in instructions:
            line, opcode, shape = ins["line"], ins["opcode"], ins["shape"]
            if re.search(r"\b[su]64\[", shape):
                problems.append(f"64-bit integer value: {line}")
            if re.search(r"\bf8e4m3fn\[", shape):
                problems.append(f"f8e4m3fn value (trn1 / trn2 take none): {line}")
            if opcode in FORBIDDEN_OPCODES:
                problems.append(f"forbidden instruction {opcode}: {line}")
            if opcode == "reduce" and shape.startswith("("):
                problems.append(f"variadic reduce: {line}")
            if "<=" in shape:
                problems.append(f"dynamic shape: {line}")
            if opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                if target is None or target.group(1) not in NEURON_CUSTOM_CALLS:
                    problems.append(f"custom-call target not recognised by neuronx-cc: {line}")
            if opcode == "sort":
                comparator = re.search(r"to_apply=([\w.\-]+)", line)
                root = next((i for i in computations.get(comparator.group(1) if comparator else "", []) if i["root"]), None)
                direction = re.search(r"direction=(\w+)", root["line"]) if root else None
                if direction is None or direction.group(1) not in SORT_DIRECTIONS:
                    problems.append(f"sort comparator not an LT/LE/GT/GE compare: {line}")
            if opcode in COLLECTIVES:
                groups = re.search(r"replica_groups=(\{[^=]*?\}\})", line)
                if groups is None or groups.group(1).replace(" ", "") not in allowed_groups:
                    problems.append(f"replica groups are not the topology's ({sorted(allowed_groups)}): {line}")
    return problems


def _groups_text(topology: Topology, group: str) -> str:
    groups = sorted({tuple(topology.group_ranks(group, rank)) for rank in range(topology.world)})
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


def check_neuron_module(proto: bytes, topology: Topology, pool_parameter: int) -> None:
    """Refuse a module that breaks a rule, naming every break."""
    problems = lint_neuron_module(proto, topology, pool_parameter)
    if problems:
        raise LintError(f"the Neuron HLO breaks {len(problems)} rule(s): " + "; ".join(problems[:10]))


def lint_archives(artifacts: Path, manifest: Manifest) -> list[str]:
    """Every rule broken by the Neuron HLO of each distinct program archive, and each StableHLO
    member that is not that module, one line each."""
    topology = manifest.topology
    problems = []
    for name, context in program_contexts(manifest).items():
        path = artifacts / name
        description, files = read_archive(path, context, (NEURON_HLO, NEURON_STABLEHLO))
        pool = description.signature.parameters.index("kv_pool")
        problems += [f"{name}: {problem}" for problem in lint_neuron_module(files[NEURON_HLO], topology, pool)]
        if module_text(stablehlo_to_hlo(path, files[NEURON_STABLEHLO])) != module_text(files[NEURON_HLO]):
            problems.append(f"{name}: {NEURON_STABLEHLO} is not the module of {NEURON_HLO} (converted to HLO, "
                            "its text differs): a toolchain taking StableHLO would compile an unlinted module")
    return problems
