"""The stand-in runtime's executing mode (nrt_standin.c, GRAPHC_STANDIN_NRT_EXECUTE=1): its
nrt_execute calls `execute` with the NEFF's module (the stand-in compiler's XLA:CPU form of the
Neuron module, neuronx_cc.py) and the stand-in's own tensor buffers, and the module runs on
XLA:CPU as graphc's runner compiles it (`xla_runner.compile_on_cpu`; collectives over gloo, jax's
distributed runtime joined once a process as the runner joins it). Tests only.

What it shows: every byte graphc hands the runtime (weights, the pool, each step's inputs, the
sampler's noise) reaches the program bound where the NEFF's tensor table says, and the results
come back through nrt_tensor_read; not a Neuron device's numerics or speed.
"""

from __future__ import annotations

import hashlib

import numpy as np

_compiled: dict[bytes, tuple] = {}
"""By the module's sha256: (its executable, its parameters' and results' shapes)."""


def _executable(module: bytes, world: int) -> tuple:
    key = hashlib.sha256(module).digest()
    if key not in _compiled:
        import jax
        from jax._src.lib import xla_client

        from graphc.runtime.xla_runner import compile_on_cpu, start_distributed

        if world > 1:
            start_distributed()  # jax's distributed runtime over the job's ranks, gloo collectives
        devices = sorted(jax.devices("cpu"), key=lambda d: d.process_index)
        shape = xla_client._xla.XlaComputation(module).program_shape()
        _compiled[key] = (compile_on_cpu(module, devices[:world]), shape.parameter_shapes(),
                          shape.result_shape().tuple_shapes())
    return _compiled[key]


def execute(module: bytes, rank: int, world: int, inputs: list[memoryview], outputs: list[memoryview]) -> None:
    """Run `module` on this rank's inputs; write each result into its output buffer (the pool's is
    its input's own buffer: the NEFF aliases them)."""
    import jax

    executable, parameters, results = _executable(module, world)
    if jax.process_index() != rank:
        raise RuntimeError(f"the NEFF was loaded as rank {rank}, in jax's process {jax.process_index()}")
    device = jax.local_devices(backend="cpu")[0]
    arguments = [jax.device_put(np.frombuffer(view, dtype=shape.numpy_dtype()).reshape(shape.dimensions()).copy(),
                                device) for view, shape in zip(inputs, parameters, strict=True)]
    values = executable.execute_sharded(arguments).disassemble_into_single_device_arrays()
    for view, shards, shape in zip(outputs, values, results, strict=True):
        result = np.ascontiguousarray(np.asarray(shards[0]), dtype=shape.numpy_dtype())
        np.frombuffer(view, dtype=np.uint8)[:] = result.reshape(-1).view(np.uint8)
