"""`graphc inspect --memory`: each neuron program's bytes as XLA's buffer assignment lays them out.

The archive's CPU variant (the module `graphc run` compiles here; it differs from the Neuron one
only in the router's top-k call) is compiled by XLA:CPU over as many host devices as the program
has ranks, and its buffer assignment read back: the parameters (weights, step inputs, the KV
pool), the results (the pool's aliases its parameter), and the temporaries, every value in
between, which are what the program needs beyond its inputs: its activations. These are the
lowered program's figures, not a device's: neuronx-cc assigns the Neuron variant's buffers
itself, and XLA:CPU computes bf16 dots in fp32, holding fp32 copies of the bf16 operands they
read (weights included), which a device with bf16 matmuls does not: a bf16 program's
temporaries are overstated by those. `graphc plan --device` estimates activations before any
lowering (`tools/device_plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graphc.artifacts.manifest import Manifest
from graphc.backends.neuron_archive import CPU_HLO, program_contexts, read_archive
from graphc.errors import GraphcError


@dataclass(frozen=True)
class ProgramMemory:
    parameters: int
    results: int
    aliased: int
    """Of the results, the bytes that reuse a parameter's buffer (the KV pool)."""
    temporaries: int


def program_memory(artifacts: Path, manifest: Manifest) -> dict[str, ProgramMemory]:
    """Each distinct program archive's buffer assignment (file -> its bytes).

    Raises:
        GraphcError: jax's CPU backend already runs with fewer devices than the programs have ranks
            (the count is fixed when it is first used: run this in a fresh process).
    """
    import jax

    from graphc.runtime.xla_runner import compile_on_cpu

    world = manifest.topology.world
    jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_num_cpu_devices", world)
    except RuntimeError:  # the backend is up already, its device count fixed: usable if it has enough
        pass
    devices = jax.devices("cpu")
    if len(devices) < world:
        raise GraphcError(f"--memory compiles the programs over {world} host devices, and jax's CPU backend "
                          f"already runs {len(devices)}: run it in a fresh process")
    out = {}
    for name, context in program_contexts(manifest).items():
        _, files = read_archive(artifacts / name, context, (CPU_HLO,))
        stats = compile_on_cpu(files[CPU_HLO], devices[:world]).get_compiled_memory_stats()
        out[name] = ProgramMemory(stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                                  stats.temp_size_in_bytes)
    return out
