"""`neuron` backend: per-program XLA HLO for neuronx-cc (Neuron and CPU variants, and the Neuron
one's StableHLO, in one archive: `neuron_archive.py`), and NEFFs where neuronx-cc is installed.

The Neuron variant is linted (`xla/lint.py`) before anything is written: a construct neuronx-cc
refuses fails the compile here, not on the Neuron host.
"""

from __future__ import annotations

from pathlib import Path

import graphc.ops  # noqa: F401  (graphs call graphc:: ops: register them before loading)
from graphc.backends.neuron_archive import (CPU_HLO, NEFF, NEURON_HLO, NEURON_STABLEHLO, ProgramDescription,
                                           available, neff_of, neuronx_cc_command, phase, write_archive)
from graphc.backends.xla.lint import check_neuron_module
from graphc.backends.xla.lower import lower_to_hlo
from graphc.backends.xla.variants import CPU, NEURON
from graphc.program_io import load_exported_program
from graphc.topology import Topology


def compile_program(program: Path, out: Path, topology: Topology) -> None:
    exported = load_exported_program(program)
    (neuron, cpu), signature = lower_to_hlo(exported, topology, (NEURON, CPU))
    check_neuron_module(neuron.hlo, topology, signature.parameters.index("kv_pool"))
    # The default target and LNC (`graphc neuron-finish --target --lnc` compiles for others).
    command = neuronx_cc_command(step=phase(signature))
    description = ProgramDescription(signature, topology.world, command, neuron.stablehlo_version)
    neff = neff_of(neuron.hlo, command)[0] if available() else None
    write_archive(out, description, {NEURON_HLO: neuron.hlo, NEURON_STABLEHLO: neuron.stablehlo, CPU_HLO: cpu.hlo,
                                     **({NEFF: neff} if neff else {})})
