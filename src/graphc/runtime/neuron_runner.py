"""Serve neuron artifacts' NEFFs on a Neuron device through the Neuron runtime (libnrt), selected
with GRAPHC_NEURON_DEVICE=1 (otherwise neuron artifacts are served on XLA:CPU: xla_runner.py).

UNTESTED: no Neuron device or runtime can be installed on the hosts this project is built and
tested on, so this module is the minimum, written against the Neuron SDK's documented C API
(nrt.h, nrt_experimental.h), and refuses clearly where the runtime or a NEFF is missing. What it
does: `nrt_init` once; per program, `nrt_load_collectives` of its NEFF on this rank's NeuronCore
with (rank, world); each NEFF input bound to the program's parameter of the same name (or, where
neuronx-cc numbered them, `input<N>` to parameter N); weights written to device tensors once per
rank; the KV pool one device tensor, bound as input and output (the HLO aliases them), so it stays
on the device; tokens and logits read back each step.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import Callable

import torch

from graphc.artifacts.manifest import GraphContext
from graphc.backends.neuron_archive import NEFF, NOISE, read_archive
from graphc.errors import GraphcError
from graphc.ops.sampler import step_noise

DEVICE_ENV = "GRAPHC_NEURON_DEVICE"
LIBNRT = "libnrt.so.1"
NRT_FRAMEWORK_NO_FW, NRT_PLACEMENT_DEVICE, NRT_USAGE_INPUT = 0, 0, 0


class TensorInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 256), ("usage", ctypes.c_int), ("size", ctypes.c_size_t),
                ("dtype", ctypes.c_int), ("shape", ctypes.POINTER(ctypes.c_uint32)), ("ndim", ctypes.c_uint32)]


_runtime: ctypes.CDLL | None = None
_device_tensors: dict[int, tuple[object, dict]] = {}
"""By the identity of a rank's weight list: (the list, its device tensors by parameter name)."""


def _nrt() -> ctypes.CDLL:
    global _runtime
    if _runtime is None:
        try:
            library = ctypes.CDLL(LIBNRT)
        except OSError:
            raise GraphcError(f"{DEVICE_ENV}=1: the Neuron runtime ({LIBNRT}) is not installed on this host; unset "
                              f"{DEVICE_ENV} to serve the artifacts on XLA:CPU") from None
        library.nrt_tensor_get_size.restype = ctypes.c_size_t
        _check(library.nrt_init(NRT_FRAMEWORK_NO_FW, b"", b""), "nrt_init")
        _runtime = library
    return _runtime


def _check(status: int, call: str) -> None:
    if status != 0:
        raise GraphcError(f"Neuron runtime: {call} failed with NRT_STATUS {status}")


def _device_tensor(name: str, size: int):
    tensor = ctypes.c_void_p()
    core = int(os.environ.get("GRAPHC_LOCAL_DEVICE", "0"))
    _check(_nrt().nrt_tensor_allocate(NRT_PLACEMENT_DEVICE, core, ctypes.c_size_t(size), name.encode(),
                                      ctypes.byref(tensor)), f"nrt_tensor_allocate({name})")
    return tensor


def _write(tensor, value: torch.Tensor) -> None:
    data = value.contiguous()
    _check(_nrt().nrt_tensor_write(tensor, ctypes.c_void_p(data.data_ptr()), ctypes.c_size_t(0),
                                   ctypes.c_size_t(data.numel() * data.element_size())), "nrt_tensor_write")


def _parameter_of(neff_name: str, parameters: list[str]) -> str:
    if neff_name in parameters:
        return neff_name
    numbered = re.fullmatch(r"input(\d+)", neff_name)
    if numbered and int(numbered.group(1)) < len(parameters):
        return parameters[int(numbered.group(1))]
    raise GraphcError(f"NEFF input {neff_name!r} matches no program parameter ({len(parameters)} of them)")


def load_neff(path: Path, rank: int, world: int, context: GraphContext) -> Callable:
    """The runner of one program archive's NEFF (the archive checked against `context` first):
    `(weights, inputs) -> (tokens, logits)`."""
    description, files = read_archive(path, context, (NEFF,))
    if NEFF not in files:
        raise GraphcError(f"{path.name}: no NEFF; run `graphc neuron-finish` on a Neuron host first")
    library, neff, model = _nrt(), files[NEFF], ctypes.c_void_p()
    core = int(os.environ.get("GRAPHC_LOCAL_DEVICE", "0"))
    _check(library.nrt_load_collectives(neff, ctypes.c_size_t(len(neff)), core, 1, rank, world, ctypes.byref(model)),
           "nrt_load_collectives")
    info = ctypes.c_void_p()
    _check(library.nrt_get_model_tensor_info(model, ctypes.byref(info)), "nrt_get_model_tensor_info")
    count = ctypes.c_uint64.from_address(info.value).value
    tensors = (TensorInfo * count).from_address(info.value + ctypes.sizeof(ctypes.c_uint64))
    signature = description.signature
    parameters, results = signature.parameters, signature.outputs
    inputs = {t.name.decode(): _parameter_of(t.name.decode(), parameters) for t in tensors if t.usage == NRT_USAGE_INPUT}
    outputs = [(t.name.decode(), t.size) for t in tensors if t.usage != NRT_USAGE_INPUT]
    if len(outputs) != len(results):
        raise GraphcError(f"{path.name}: the NEFF has {len(outputs)} outputs, the program {len(results)} ({results})")
    step_tensors = {}  # this program's step inputs and its token / logits outputs, on the device
    for neff_name, parameter in inputs.items():
        if not parameter.startswith("weight.") and parameter != "kv_pool":
            step_tensors[parameter] = _device_tensor(neff_name, next(t.size for t in tensors
                                                                     if t.name.decode() == neff_name))
    for (neff_name, size), result in zip(outputs, results):
        if result != "kv_pool":
            step_tensors[result] = _device_tensor(neff_name, size)
    noise_shape = signature.shapes[parameters.index(NOISE)] if signature.samples else None
    logits_dtype = getattr(torch, signature.output_dtypes[results.index("logits")])

    def run(weights: list[torch.Tensor], step: dict[str, torch.Tensor]):
        source, device = _device_tensors.get(id(weights), (None, None))
        if source is not weights:
            device = {f"weight.{i}": _device_tensor(f"weight.{i}", w.numel() * w.element_size())
                      for i, w in enumerate(weights)}
            for i, w in enumerate(weights):
                _write(device[f"weight.{i}"], w)
            device["kv_pool"] = _device_tensor("kv_pool", step["kv_pool"].numel() * step["kv_pool"].element_size())
            _write(device["kv_pool"], step["kv_pool"])  # once: afterwards the pool lives on the device
            _device_tensors[id(weights)] = weights, device
        values = dict(step)
        if signature.samples:
            values["noise"] = step_noise(step["seed"], step["temperature"], noise_shape)
        input_set, output_set = ctypes.c_void_p(), ctypes.c_void_p()
        _check(library.nrt_allocate_tensor_set(ctypes.byref(input_set)), "nrt_allocate_tensor_set")
        _check(library.nrt_allocate_tensor_set(ctypes.byref(output_set)), "nrt_allocate_tensor_set")
        try:
            for neff_name, parameter in inputs.items():
                tensor = device.get(parameter) or step_tensors[parameter]
                if parameter in step_tensors:
                    value = values[parameter]
                    _write(tensor, value.to(torch.int32) if value.dtype == torch.int64 else value)
                _check(library.nrt_add_tensor_to_tensor_set(input_set, neff_name.encode(), tensor), "add input")
            for (neff_name, _), result in zip(outputs, results):
                tensor = device["kv_pool"] if result == "kv_pool" else step_tensors[result]
                _check(library.nrt_add_tensor_to_tensor_set(output_set, neff_name.encode(), tensor), "add output")
            _check(library.nrt_execute(model, input_set, output_set), "nrt_execute")
        finally:
            library.nrt_destroy_tensor_set(ctypes.byref(input_set))
            library.nrt_destroy_tensor_set(ctypes.byref(output_set))
        tokens = _read(step_tensors["tokens"], torch.int32, step["seed"].shape)
        logits = _read(step_tensors["logits"], logits_dtype, (len(step["seed"]), -1))
        return tokens.to(torch.int64), logits

    return run


def _read(tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    size = _nrt().nrt_tensor_get_size(tensor)
    out = torch.empty(size // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
    _check(_nrt().nrt_tensor_read(tensor, ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(0), ctypes.c_size_t(size)),
           "nrt_tensor_read")
    return out.view(*shape)
