"""A stand-in for `neuronx-cc compile neuron.hlo.pb ... --output neuron.neff` (tests only): writes
the stand-in NEFF the stand-in runtime (nrt_standin.c) reads: the module's tensor table as a NEFF
compiled from XLA names it (the Neuron SDK's "runtime developer guide": `input<N>` for parameter N,
`output<N>` for result N), each tensor's bytes, dtype and shape; an input the module aliases to an
output named `input<N>.must_alias_input`; whether the module has collectives. The table comes
from the HLO module itself, as the real compiler's does; no code is compiled.

The table is written in an order that is not the parameters' (outputs first, last to first; then
inputs by their names as strings: input0, input1, input10, ...): a runtime binding that matches
tensors by position rather than by name breaks on it.

GRAPHC_STANDIN_NEURONX_CC_LOG: a file each call's arguments are appended to.
GRAPHC_STANDIN_NEURONX_CC_BREAK=<name>: that tensor's size is written one element too large (a
NEFF that does not match its program).
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

NRT_DTYPES = {"float32": (1, 4), "bfloat16": (3, 2), "int8": (4, 1), "uint8": (5, 1), "int32": (8, 4),
              "bool": (5, 1)}
"""numpy dtype name -> (nrt.h's nrt_dtype_t, bytes per element)."""
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def main(argv: list[str]) -> int:
    if log := os.environ.get("GRAPHC_STANDIN_NEURONX_CC_LOG"):
        with open(log, "a") as handle:
            handle.write(" ".join(argv) + "\n")
    source, output = Path(argv[1]), Path(argv[argv.index("--output") + 1])
    if argv[0] != "compile" or not source.is_file():
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
    output.write_text("\n".join(["STANDIN-NEFF 1", f"collectives {int(bool(COLLECTIVE.search(text)))}", *table,
                                 *alias_lines]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
