"""The structural lint of a Neuron-variant HLO module: what neuronx-cc refuses or mis-serves,
checked on the module text before it leaves this host.

Rules (each names the instruction that breaks it):
- no s64 / u64 values (int32 indices only);
- no f8e4m3fn values: trn1 / trn2's neuronx-cc refuses them (NCC_EVRF051); FP8 weights enter as
  their bytes and are decoded with integer ops (`aten.FP8_BITS`);
- no variadic reduce (a `reduce` producing a tuple: jnp.argmax's form);
- no `while`, `conditional`, `rng`, `rng-bit-generator` or `rng-get-and-update-state` (neuronx-cc
  refuses a `conditional`; graphc's programs have static control flow: a branch is a select);
- no `call`: nested computations are inlined before the module is serialized (`lower.inline_calls`);
- the rejections of neuronx-cc's error-code pages, where the module shows them:
  - no integer `scatter` with a combiner (its computation's root anything but the update
    parameter: add, multiply, min, max), NCC_EVRF060 (by default; run in f32 otherwise);
  - no `dot` with an integer operand, NCC_EVRF035 (trn2 and later; int64 everywhere);
  - no integer `all-reduce` or `reduce-scatter`, NCC_EVRF061 (their reduction runs in f32);
  - no `shift-right-arithmetic` on other than 32-bit values, NCC_EVRF022;
  - no `gather` / `scatter` whose indices are an `iota` (through reshapes, broadcasts, converts)
    reaching beyond the operand's dimension, NCC_EVRF031;
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

FORBIDDEN_OPCODES = ("while", "conditional", "call", "rng", "rng-bit-generator", "rng-get-and-update-state")
INTEGER = re.compile(r"\b[su](8|16|32|64)\[")
"""An integer value's type in a shape's text."""
INTEGER_REDUCING_COLLECTIVES = ("all-reduce", "reduce-scatter")
INDEX_PASS_THROUGH = ("reshape", "bitcast", "convert", "copy", "broadcast")
"""Instructions an iota's values pass through unchanged on their way to a gather's / scatter's indices."""
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
        named = {ins["name"]: ins for ins in instructions}
        for ins in instructions:
            line, opcode, shape = ins["line"], ins["opcode"], ins["shape"]
            problems += [f"{problem}: {line}" for problem in _documented_rejections(ins, named, computations)]
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


def _operands(ins: dict) -> list[str]:
    """The names of an instruction's operands (the text up to its operand list's closing parenthesis)."""
    return re.findall(r"[\w.\-]+", ins["rest"].split(")", 1)[0])


def _dims(shape: str) -> list[int] | None:
    """An array shape's static sizes (None for anything else: a tuple, a bounded-dynamic size)."""
    found = re.fullmatch(r"\w+\[([\d,]*)\](?:\{.*\})?", shape.strip())
    return [int(d) for d in found.group(1).split(",") if d] if found else None


def _documented_rejections(ins: dict, named: dict[str, dict], computations: dict[str, list[dict]]) -> list[str]:
    """The rejections of neuronx-cc's error-code pages that `ins` shows (module docstring)."""
    opcode, shape = ins["opcode"], ins["shape"]
    operands = [named.get(name) for name in _operands(ins)]
    problems = []
    if opcode == "scatter" and INTEGER.search(shape):
        combiner = re.search(r"to_apply=([\w.\-]+)", ins["line"])
        root = next((i for i in computations.get(combiner.group(1) if combiner else "", []) if i["root"]), None)
        if root is None or root["opcode"] != "parameter":
            problems.append("integer scatter with a combiner (NCC_EVRF060)")
    if opcode == "dot" and any(o is not None and INTEGER.search(o["shape"]) for o in operands):
        problems.append("integer dot (NCC_EVRF035)")
    if opcode in INTEGER_REDUCING_COLLECTIVES and INTEGER.search(shape):
        problems.append(f"integer {opcode} (NCC_EVRF061)")
    if opcode == "shift-right-arithmetic" and not re.match(r"\(?[su]32\[", shape):
        problems.append("shift-right-arithmetic on other than 32-bit values (NCC_EVRF022)")
    if opcode in ("gather", "scatter") and len(operands) >= 2 and None not in operands[:2]:
        problem = _iota_out_of_range(ins, operands[0], operands[1], named)
        problems += [problem] if problem else []
    return problems


def _iota_out_of_range(ins: dict, operand: dict, indices: dict, named: dict[str, dict]) -> str | None:
    """An iota's values as a gather's / scatter's one index per row, beyond the dimension they index."""
    while indices["opcode"] in INDEX_PASS_THROUGH and _operands(indices) and _operands(indices)[0] in named:
        indices = named[_operands(indices)[0]]
    mapped = re.search(r"(?:start_index_map|scatter_dims_to_operand_dims)=\{(\d+)\}", ins["line"])
    iota_dim = re.search(r"iota_dimension=(\d+)", indices["line"])
    if indices["opcode"] != "iota" or mapped is None or iota_dim is None:
        return None
    iota_dims, operand_dims = _dims(indices["shape"]), _dims(operand["shape"])
    if iota_dims is None or operand_dims is None:
        return None
    largest, size = iota_dims[int(iota_dim.group(1))] - 1, operand_dims[int(mapped.group(1))]
    if largest < size:
        return None
    return f"{ins['opcode']} indices from an iota up to {largest}, beyond the operand's dimension of {size} (NCC_EVRF031)"


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
