"""Serve `neuron` artifacts on this host: each program's CPU-variant HLO compiled by XLA:CPU
(jaxlib), one process per rank, collectives over gloo.

This is how the Neuron graphs are validated token for token here; it is not a fast path. The KV
pool lives in the engine's torch tensor and round-trips through the program each step (on a
Neuron device it stays in device memory, aliased in place); weights are placed once per rank.
With several ranks, jax's distributed runtime is started in every rank's process before anything
else touches jax, rank 0 hosting its coordinator on a port it picks and shares over the job's
torch.distributed group (already up under `graphc run`'s launcher).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import torch

from graphc.artifacts.manifest import ArtifactError, GraphContext
from graphc.backends.neuron_archive import CPU_HLO, NOISE, native_log_held, read_archive
from graphc.errors import GraphcError
from graphc.ops.sampler import step_noise
from graphc.runtime.opened_programs import opened_once

_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int32": np.int32, "bool": np.bool_,
                 "uint8": np.uint8, "int8": np.int8}
_BIT_VIEWS = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16), torch.float8_e4m3fn: (torch.uint8, np.uint8)}
"""Tensors numpy cannot take from torch directly, handed over as their bits: bf16 (numpy has it
through ml_dtypes) and FP8 weights (programs take their bytes: `xla.aten.FP8_BITS`)."""
_placed_weights: dict[int, tuple[list, list]] = {}
"""By the identity of a rank's weight list: (the list, its tensors placed on the XLA device), shared
by every bucket's program."""


def _jax():
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    return jax


def start_distributed() -> None:
    """Join this rank's process to jax's distributed runtime (once; before any jax computation)."""
    import torch.distributed as dist

    jax = _jax()
    if jax.distributed.is_initialized():
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    port = [None]
    if rank == 0:
        with socket.socket() as probe:  # a free port for the coordinator
            probe.bind(("127.0.0.1", 0))
            port[0] = probe.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    # The preemption service (a TPU job's sync point) installs a SIGTERM handler of its own over
    # the process's: a server's ranks would then never see the stop that drains them, and the
    # launcher would kill them, exit handlers unrun, when its wait ran out.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(f"{address}:{port[0]}", num_processes=world, process_id=rank)


def _to_device(tensor: torch.Tensor, dtype: str, device):
    jax = _jax()
    if tensor.dtype in _BIT_VIEWS:
        bits, numpy_dtype = _BIT_VIEWS[tensor.dtype]
        array = tensor.contiguous().view(bits).numpy().view(numpy_dtype)
    else:
        array = tensor.contiguous().numpy()
    return jax.device_put(np.asarray(array, dtype=_NUMPY_DTYPES[dtype]), device)


def _to_torch(array, like: torch.dtype) -> torch.Tensor:
    host = np.asarray(array)
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy()).to(like)


def load_xla(path: Path, collectives: bool, context: GraphContext) -> Callable:
    """The runner of one program archive (checked against `context` first, compiled at its first
    step): `(weights, inputs) -> (tokens, logits, ...)` (a score program's prompt scores after them),
    writing the program's KV pool result back into `inputs["kv_pool"]`."""
    jax = _jax()
    from jax._src.lib import xla_client

    description, files = read_archive(path, context, (CPU_HLO,))
    signature, world = description.signature, description.world
    if collectives:
        start_distributed()
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    if len(devices) != world:
        raise GraphcError(f"{path.name}: compiled for {world} ranks, but jax sees {len(devices)} devices")

    def compile_program():
        try:
            return compile_on_cpu(files[CPU_HLO], devices)
        except xla_client.XlaRuntimeError as e:
            raise ArtifactError(f"{path}: {CPU_HLO}: XLA:CPU cannot compile it ({str(e).splitlines()[0]})") from None

    executable = opened_once(("neuron", context.graph.sha256, collectives), compile_program)
    device = jax.local_devices()[0]
    names, dtypes = signature.parameters, signature.dtypes
    weight_count = sum(name.startswith("weight.") for name in names)
    noise_shape = signature.shapes[names.index(NOISE)] if signature.samples else None

    def run(weights: list[torch.Tensor], inputs: dict[str, torch.Tensor]):
        source, placed = _placed_weights.get(id(weights), (None, None))
        if source is not weights:
            placed = [_to_device(w, d, device) for w, d in zip(weights, dtypes)]
            _placed_weights[id(weights)] = weights, placed
        values = dict(inputs)
        if signature.samples:
            values["noise"] = step_noise(inputs["seed"], inputs["temperature"], noise_shape)
        arguments = placed[:weight_count] + [_to_device(values[name], dtype, device)
                                             for name, dtype in zip(names[weight_count:], dtypes[weight_count:])]
        pool, *results = (shards[0] for shards in
                          executable().execute_sharded(arguments).disassemble_into_single_device_arrays())
        inputs["kv_pool"].copy_(_to_torch(pool, inputs["kv_pool"].dtype))
        return tuple(_to_torch(r, torch.int64 if np.issubdtype(r.dtype, np.integer) else torch.float32)
                     for r in results)

    return run


def compile_on_cpu(hlo: bytes, devices: list):
    """XLA:CPU's executable of `hlo` over `devices` (one replica each); what XLA logs of a module it
    refuses is held back (`native_log_held`)."""
    import jax.extend
    from jax._src.lib import xla_client

    options = xla_client.CompileOptions()
    build = options.executable_build_options
    build.num_replicas, build.num_partitions = len(devices), 1
    build.device_assignment = xla_client.DeviceAssignment.create(np.array([[d.id] for d in devices]))
    with native_log_held():
        return jax.extend.backend.get_backend("cpu").compile_and_load(
            xla_client._xla.mlir.hlo_to_stablehlo(hlo), xla_client.DeviceList(tuple(devices)), options)
