"""A stand-in for `neuronx-cc compile neuron.hlo.pb ... --output neuron.neff` (tests only): writes
the stand-in NEFF the stand-in runtime (nrt_standin.c) reads: the module's tensor table as a NEFF
compiled from XLA names it (the Neuron SDK's "runtime developer guide": `input<N>` for parameter N,
`output<N>` for result N), each tensor's bytes, dtype and shape; an input the module aliases to an
output named `input<N>.must_alias_input`; whether the module has collectives. The table comes
from the HLO module itself, as the real compiler's does; no code is compiled.

The table is written in an order that is not the parameters' (outputs first, last to first; then
inputs by their names as strings: input0, input1, input10, ...): a runtime binding that matches
tensors by position rather than by name breaks on it.

What the stand-in runtime executes (its executing mode) is the module itself, "compiled" for
XLA:CPU the way a compiler lowers what its target has no instruction for: the one custom call
graphc's Neuron modules hold, `AwsNeuronTopK` (float values, u32 indices), becomes XLA's `topk`
(s32 indices, converted). It follows the table, as `module <bytes>` and the serialized module.

GRAPHC_STANDIN_NEURONX_CC_LOG: a file each call's arguments are appended to.
GRAPHC_STANDIN_NEURONX_CC_BREAK=<name>: that tensor's size is written one element too large (a
NEFF that does not match its program).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

NRT_DTYPES = {"float32": (1, 4), "bfloat16": (3, 2), "int8": (4, 1), "uint8": (5, 1), "int32": (8, 4),
              "bool": (5, 1)}
"""numpy dtype name -> (nrt.h's nrt_dtype_t, bytes per element)."""
NEURON_TOPK = re.compile(r'^(\s*)(ROOT )?(\S+) = \((f32\[[\d,]*\])(\{[\d,]*\})?, u32(\[[\d,]*\])(\{[\d,]*\})?\) '
                         r'custom-call\((\S+)\), custom_call_target="AwsNeuronTopK", backend_config="(\d+)"$')
"""An `AwsNeuronTopK` instruction as the HLO text prints it: indent, ROOT, name, values' type and
layout, indices' dims and layout, operand, k."""
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def _command_line() -> argparse.ArgumentParser:
    """`neuronx-cc compile`'s options graphc may pass, as the CLI reference defines them; any
    other option is refused, as the compiler refuses it."""
    parser = argparse.ArgumentParser(prog="neuronx-cc", allow_abbrev=False)
    parser.add_argument("command", choices=["compile"])
    parser.add_argument("model", type=Path)
    parser.add_argument("--framework", required=True, choices=["XLA", "TENSORFLOW", "PYTORCH"])
    parser.add_argument("--target", required=True, choices=["inf2", "trn1", "trn1n", "trn2", "trn3"])
    parser.add_argument("--lnc", "--logical-nc-config", "-lnc", type=int, choices=[1, 2])
    parser.add_argument("-O", dest="optimization", type=int, choices=[1, 2, 3])
    parser.add_argument("--model-type", choices=["generic", "transformer", "unet-inference"])
    parser.add_argument("--auto-cast", choices=["none", "matmult", "all"])
    parser.add_argument("--tensorizer-options")
    parser.add_argument("--internal-hlo2tensorizer-options")
    parser.add_argument("--output", required=True, type=Path)
    return parser


def main(argv: list[str]) -> int:
    if log := os.environ.get("GRAPHC_STANDIN_NEURONX_CC_LOG"):
        with open(log, "a") as handle:
            handle.write(" ".join(argv) + "\n")
    options = _command_line().parse_args(argv)  # exits 2 naming an unknown option
    if options.lnc is not None and options.target not in ("trn2", "trn3"):
        print(f"neuronx-cc stand-in: --lnc with --target {options.target}: logical NeuronCores are trn2 and trn3's "
              "(NCC_EARG001)", file=sys.stderr)
        return 2
    source, output = options.model, options.output
    if not source.is_file():
        print(f"neuronx-cc stand-in: no module {source}", file=sys.stderr)
        return 3
    from jax._src.lib import xla_client

    computation = xla_client._xla.XlaComputation(source.read_bytes())
    text = computation.as_hlo_text()
    header = text.splitlines()[0]
    aliases = {int(output): int(parameter) for output, parameter in
               re.findall(r"\{(\d+)\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}
    shape = computation.program_shape()
    broken = os.environ.get("GRAPHC_STANDIN_NEURONX_CC_BREAK")

    def line(name: str, usage: int, array) -> str:
        dims, (dtype, itemsize) = list(array.dimensions()), NRT_DTYPES[array.numpy_dtype().name]
        size = (math.prod(dims) + (name == broken)) * itemsize
        return f"tensor {name} {usage} {size} {dtype} {len(dims)} {' '.join(map(str, dims))}".rstrip()

    inputs = {(f"input{i}" + (".must_alias_input" if i in aliases.values() else "")): s
              for i, s in enumerate(shape.parameter_shapes())}
    outputs = {f"output{i}": s for i, s in enumerate(shape.result_shape().tuple_shapes())}
    table = [line(name, 1, s) for name, s in reversed(outputs.items())] + \
        [line(name, 0, inputs[name]) for name in sorted(inputs)]
    alias_lines = [f"alias output{o} input{p}.must_alias_input" for o, p in sorted(aliases.items())]
    module = xla_client._xla.hlo_module_from_text("\n".join(map(_for_cpu, text.splitlines())))
    executable = module.as_serialized_hlo_module_proto()
    output.write_bytes(("\n".join(["STANDIN-NEFF 1", f"collectives {int(bool(COLLECTIVE.search(text)))}", *table,
                                   *alias_lines, f"module {len(executable)}"]) + "\n").encode() + executable)
    return 0


def _for_cpu(line: str) -> str:
    """`line` of the HLO text, an `AwsNeuronTopK` call lowered to XLA's `topk` with its indices as
    the call's u32."""
    call = NEURON_TOPK.match(line)
    if not call:
        return line
    indent, root, name, values, values_layout, dims, layout, operand, k = call.groups()
    values, indices = f"{values}{values_layout or ''}", f"{dims}{layout or ''}"
    return "\n".join([f"{indent}{name}.topk = ({values}, s32{indices}) topk({operand}), k={k}, largest=true",
                      f"{indent}{name}.values = {values} get-tuple-element({name}.topk), index=0",
                      f"{indent}{name}.s32 = s32{indices} get-tuple-element({name}.topk), index=1",
                      f"{indent}{name}.u32 = u32{indices} convert({name}.s32)",
                      f"{indent}{root or ''}{name} = ({values}, u32{indices}) tuple({name}.values, {name}.u32)"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
