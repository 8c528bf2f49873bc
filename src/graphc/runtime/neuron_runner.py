"""Serve neuron artifacts' NEFFs on a Neuron device through the Neuron runtime (libnrt), selected
with GRAPHC_NEURON_DEVICE=1 (otherwise neuron artifacts are served on XLA:CPU: xla_runner.py).

No Neuron device can be reached from the hosts this project is built on: the binding is written
against the Neuron SDK's documented C API (nrt.h; the "Neuron Runtime configuration guide"; the
"runtime developer guide") and tested against a stand-in libnrt that enforces that contract and
records every call (tests/runtime/standin_nrt/), which shows what graphc asks of the runtime, not
numerics.

One process per rank (`graphc run`'s launcher), each:
1. before `nrt_init`, restricts the runtime to its own NeuronCore: by default the runtime
   initializes every core and reserves them for the process, so a second rank's `nrt_init` would
   fail ("Neuron Runtime configuration guide", NEURON_RT_VISIBLE_CORES). The core is the local
   rank (`GRAPHC_LOCAL_DEVICE`, set by launch.py), or the local rank's entry of a
   NEURON_RT_VISIBLE_CORES the user set for the job; the process then addresses it as vnc 0.
   With several ranks it sets NEURON_RT_ROOT_COMM_ID (mandatory for programs with collectives) to
   rank 0's host and a port rank 0 picks, and on a job that spans hosts the EFA variables
   (`runtime_environment`); a value the user set is kept, as is NEURON_RT_EXEC_TIMEOUT;
2. `nrt_init(NRT_FRAMEWORK_TYPE_NO_FW, "", "")` once, `nrt_close` at exit (atexit), after
   freeing every tensor, tensor set and model it made;
3. per program, `nrt_load_collectives` of its NEFF on vnc 0 with (rank, world) under a watchdog
   (GRAPHC_NEURON_LOAD_TIMEOUT), its tensor table read and freed, each NEFF tensor bound by its
   name's index (`input<N>` to parameter N, `output<N>` to result N; an aliased input may be named
   `input<N>.must_alias_input`) and checked against the program's signature, the tensor sets built
   once; weights and the KV pool (zeros) written to device tensors once per rank, at load. The
   pool is bound as input and output (the HLO aliases them), so it stays on the device.
Each step writes the step inputs, executes, and reads tokens and logits at the signature's shapes.
A runtime error status reaches the user as one line: `rank R: <call> returned <status> (<name>)`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import re
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from graphc.artifacts.manifest import ArtifactError, GraphContext
from graphc.backends.neuron_archive import NEFF, NOISE, ProgramSignature, read_archive, result_shapes
from graphc.errors import GraphcError
from graphc.ops.sampler import step_noise

DEVICE_ENV = "GRAPHC_NEURON_DEVICE"
LOCAL_DEVICE_ENV = "GRAPHC_LOCAL_DEVICE"
"""This rank's device on its host: its local rank (launch.py's `_worker`); unset: 0."""
LOAD_TIMEOUT_ENV = "GRAPHC_NEURON_LOAD_TIMEOUT"
LOAD_TIMEOUT_SECONDS = 900.0
"""How long a rank waits in `nrt_load_collectives` (which returns once every rank of the program
has loaded it) before it names itself and exits: generous, a large NEFF takes minutes to load."""
LIBNRT = "libnrt.so.1"
SDK_LIBRARY_DIR = Path("/opt/aws/neuron/lib")
"""Where the Neuron SDK installs libnrt, when it is not on the loader's path."""

# The runtime's environment ("Neuron Runtime configuration guide"; EFA: "runtime developer guide").
VISIBLE_CORES, ROOT_COMM_ID = "NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID"
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
EFA_ENVIRONMENT = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
"""What collectives across hosts need (a job over one host leaves them unset)."""

# nrt.h
NRT_FRAMEWORK_TYPE_NO_FW = 1  # nrt_framework_type_t: 0 is NRT_FRAMEWORK_TYPE_INVALID
NRT_TENSOR_PLACEMENT_DEVICE = 0  # nrt_tensor_placement_t
NRT_TENSOR_USAGE_INPUT, NRT_TENSOR_USAGE_OUTPUT = 0, 1  # nrt_tensor_usage_t
NRT_TENSOR_NAME_MAX = 256
NRT_STATUS = {0: "NRT_SUCCESS", 1: "NRT_FAILURE", 2: "NRT_INVALID", 3: "NRT_INVALID_HANDLE", 4: "NRT_RESOURCE",
              5: "NRT_TIMEOUT", 6: "NRT_HW_ERROR", 7: "NRT_QUEUE_FULL", 9: "NRT_LOAD_NOT_ENOUGH_NC",
              10: "NRT_UNSUPPORTED_NEFF_VERSION", 11: "NRT_FAIL_HOST_MEM_ALLOC", 13: "NRT_UNINITIALIZED",
              14: "NRT_CLOSED", 15: "NRT_QUEUE_EMPTY", 1002: "NRT_EXEC_BAD_INPUT",
              1003: "NRT_EXEC_COMPLETED_WITH_NUM_ERR", 1004: "NRT_EXEC_COMPLETED_WITH_ERR", 1005: "NRT_EXEC_NC_BUSY",
              1006: "NRT_EXEC_OOB", 1100: "NRT_COLL_PENDING", 1200: "NRT_EXEC_HW_ERR_COLLECTIVES",
              1201: "NRT_EXEC_HW_ERR_HBM_UE"}
"""nrt_status.h's NRT_STATUS values, by number (for messages)."""
MUST_ALIAS_SUFFIX = ".must_alias_input"


class TensorInfo(ctypes.Structure):
    """nrt.h's nrt_tensor_info_t."""

    _fields_ = [("name", ctypes.c_char * NRT_TENSOR_NAME_MAX), ("usage", ctypes.c_int), ("size", ctypes.c_size_t),
                ("dtype", ctypes.c_int), ("shape", ctypes.POINTER(ctypes.c_uint32)), ("ndim", ctypes.c_uint32)]


class TensorInfoArrayHeader(ctypes.Structure):
    """nrt.h's nrt_tensor_info_array_t before its flexible array of `tensor_count` TensorInfo."""

    _fields_ = [("tensor_count", ctypes.c_uint64)]


_HANDLE, _OUT = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
_STATUS = ctypes.c_int
_API = {  # nrt.h: name -> (restype, argtypes)
    "nrt_init": (_STATUS, [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]),
    "nrt_close": (None, []),
    "nrt_load_collectives": (_STATUS, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32,
                                       ctypes.c_uint32, ctypes.c_uint32, _OUT]),
    "nrt_unload": (_STATUS, [_HANDLE]),
    "nrt_get_model_tensor_info": (_STATUS, [_HANDLE, _OUT]),
    "nrt_free_model_tensor_info": (_STATUS, [_HANDLE]),
    "nrt_tensor_allocate": (_STATUS, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, _OUT]),
    "nrt_tensor_free": (None, [_OUT]),
    "nrt_tensor_write": (_STATUS, [_HANDLE, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_tensor_read": (_STATUS, [_HANDLE, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_allocate_tensor_set": (_STATUS, [_OUT]),
    "nrt_destroy_tensor_set": (None, [_OUT]),
    "nrt_add_tensor_to_tensor_set": (_STATUS, [_HANDLE, ctypes.c_char_p, _HANDLE]),
    "nrt_execute": (_STATUS, [_HANDLE, _HANDLE, _HANDLE]),
}
_BYTES = {"float32": 4, "bfloat16": 2, "int32": 4, "bool": 1, "uint8": 1, "int8": 1}
"""A signature dtype's bytes per element."""


def parse_cores(spec: str) -> list[int]:
    """The cores a NEURON_RT_VISIBLE_CORES value names: "3", "0-3", or a comma list of either."""
    cores = []
    for part in spec.split(","):
        bounds = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not bounds or int(bounds.group(2) or bounds.group(1)) < int(bounds.group(1)):
            raise GraphcError(f"{VISIBLE_CORES}={spec!r}: not a core, a range (0-3) or a comma list of them")
        cores.extend(range(int(bounds.group(1)), int(bounds.group(2) or bounds.group(1)) + 1))
    return cores


def runtime_environment(environ: Mapping[str, str], world: int, root_port: int | None,
                        lnc: int | None = None) -> dict[str, str]:
    """What a rank's process sets before `nrt_init` (from its `environ`; `root_port`: the port rank
    0 chose for the collectives' root, with several ranks; `lnc`: the logical core size the NEFFs
    were compiled at, as the manifest records it):
    - NEURON_RT_VISIBLE_CORES: this rank's one core, the local rank's (GRAPHC_LOCAL_DEVICE), or
      its entry of the NEURON_RT_VISIBLE_CORES the job was given (the cores its ranks take, in
      local-rank order);
    - with several ranks, NEURON_RT_ROOT_COMM_ID: rank 0's host (MASTER_ADDR, the job's
      rendezvous address, where rank 0 runs) and `root_port`, unless set;
    - on a job over several hosts (torchrun's GROUP_WORLD_SIZE: its agents, one a host), the EFA
      variables not set;
    - NEURON_LOGICAL_NC_CONFIG: `lnc`, which the runtime's must equal ("Logical NeuronCore
      configuration"); one the user set to another value is refused in one line."""
    local = int(environ.get(LOCAL_DEVICE_ENV, "0"))
    given = environ.get(VISIBLE_CORES)
    if given is not None:
        cores = parse_cores(given)
        if local >= len(cores):
            raise GraphcError(f"{VISIBLE_CORES}={given!r} names {len(cores)} core(s); this host runs local rank "
                              f"{local}: name a core for each of this host's ranks, or unset it")
        core = cores[local]
    else:
        core = local
    changes = {VISIBLE_CORES: str(core)}
    if world > 1 and ROOT_COMM_ID not in environ:
        changes[ROOT_COMM_ID] = f"{environ.get('MASTER_ADDR', '127.0.0.1')}:{root_port}"
    if int(environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        changes.update({key: value for key, value in EFA_ENVIRONMENT.items() if key not in environ})
    if lnc is not None:
        given_lnc = environ.get(LNC_ENV)
        if given_lnc is not None and given_lnc.strip() != str(lnc):
            raise GraphcError(f"{LNC_ENV}={given_lnc!r}: the NEFFs were compiled at --lnc {lnc}, and the runtime must "
                              f"run them at that logical core size; unset it, or run `graphc neuron-finish --lnc "
                              f"{given_lnc.strip()}`")
        changes[LNC_ENV] = str(lnc)
    return changes


def _root_port(world: int) -> int | None:
    """A port for the collectives' root: rank 0 asks its OS for a free one and shares it over the
    job's process group (as xla_runner's coordinator does); MASTER_PORT + 1 would be no one's
    promise of a free port (a second job on the host, or the store's neighbour, may hold it)."""
    if world == 1:
        return None
    import torch.distributed as dist

    port = torch.zeros(1, dtype=torch.int64)  # a tensor, not a pickled object: nothing received is unpickled
    if dist.get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port[0] = probe.getsockname()[1]
    dist.broadcast(port, src=0)
    return int(port[0])


def _open_library() -> ctypes.CDLL:
    for candidate in (LIBNRT, str(SDK_LIBRARY_DIR / LIBNRT)):
        try:
            library = ctypes.CDLL(candidate)
            break
        except OSError:
            continue
    else:
        raise GraphcError(f"{DEVICE_ENV}=1: the Neuron runtime ({LIBNRT}) is not installed on this host (not on the "
                          f"loader's path, nor in {SDK_LIBRARY_DIR}); unset {DEVICE_ENV} to serve the artifacts on "
                          "XLA:CPU")
    for name, (restype, argtypes) in _API.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


@dataclass
class _Program:
    model: ctypes.c_void_p
    tensor_sets: list[ctypes.c_void_p] = field(default_factory=list)


class _Runtime:
    """This process's Neuron runtime: initialized once for its rank, closed at exit, with every
    handle it made freed first."""

    def __init__(self, rank: int, world: int, lnc: int | None):
        self.rank = rank
        self.library = _open_library()  # first: a host without the runtime keeps its environment as it was
        os.environ.update(runtime_environment(os.environ, world, _root_port(world), lnc))
        self.programs: list[_Program] = []
        self.tensors: list[ctypes.c_void_p] = []
        self.call("nrt_init", NRT_FRAMEWORK_TYPE_NO_FW, b"", b"")
        atexit.register(self.close)

    def call(self, name: str, *args) -> None:
        status = getattr(self.library, name)(*args)
        if status != 0:
            named = NRT_STATUS.get(status, "unknown status")
            raise GraphcError(f"rank {self.rank}: {name} returned {status} ({named})")

    def tensor(self, name: str, size: int) -> ctypes.c_void_p:
        tensor = ctypes.c_void_p()
        self.call("nrt_tensor_allocate", NRT_TENSOR_PLACEMENT_DEVICE, 0, size, name.encode(), ctypes.byref(tensor))
        self.tensors.append(tensor)
        return tensor

    def write(self, tensor: ctypes.c_void_p, value: torch.Tensor) -> None:
        data = value.contiguous()
        self.call("nrt_tensor_write", tensor, data.data_ptr(), 0, data.numel() * data.element_size())

    def read(self, tensor: ctypes.c_void_p, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.call("nrt_tensor_read", tensor, out.data_ptr(), 0, out.numel() * out.element_size())
        return out

    def tensor_set(self, program: _Program, bound: dict[str, ctypes.c_void_p]) -> ctypes.c_void_p:
        tensor_set = ctypes.c_void_p()
        self.call("nrt_allocate_tensor_set", ctypes.byref(tensor_set))
        program.tensor_sets.append(tensor_set)
        for name, tensor in bound.items():
            self.call("nrt_add_tensor_to_tensor_set", tensor_set, name.encode(), tensor)
        return tensor_set

    def close(self) -> None:
        """Free what this process made, then `nrt_close` ("runtime developer guide")."""
        for program in self.programs:
            for tensor_set in program.tensor_sets:
                self.library.nrt_destroy_tensor_set(ctypes.byref(tensor_set))
            self.library.nrt_unload(program.model)
        for tensor in self.tensors:
            self.library.nrt_tensor_free(ctypes.byref(tensor))
        self.programs, self.tensors = [], []
        self.library.nrt_close()


_runtime: _Runtime | None = None
_device_weights: dict[int, tuple[list, dict[str, ctypes.c_void_p]]] = {}
"""By the identity of a rank's weight list: (the list, the device tensors of each weight and of the
KV pool, by parameter name), shared by every program of the rank."""


def _runtime_for(rank: int, world: int, lnc: int | None) -> _Runtime:
    global _runtime
    if _runtime is None:
        _runtime = _Runtime(rank, world, lnc)
    return _runtime


@contextlib.contextmanager
def _watchdog(rank: int, what: str, seconds: float):
    """Name this rank and exit (the launcher then stops every rank) if the block has not ended in
    `seconds`: a collective load waits for every rank of the program."""
    def expire():
        sys.stderr.write(f"rank {rank}: {what} has not returned in {seconds:g} s ({LOAD_TIMEOUT_ENV}): every rank "
                         f"must load the same programs, reaching {ROOT_COMM_ID}={os.environ.get(ROOT_COMM_ID, '-')}; "
                         "stopping the job\n")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _load_timeout() -> float:
    text = os.environ.get(LOAD_TIMEOUT_ENV, str(LOAD_TIMEOUT_SECONDS))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1
    if not seconds > 0:
        raise GraphcError(f"{LOAD_TIMEOUT_ENV}={text!r}: seconds, a number above 0")
    return seconds


def _index(path: Path, name: str, kind: str, names: list[str] | tuple[str, ...]) -> int:
    """The parameter (kind "input") or result ("output") a NEFF tensor's name binds to."""
    base = name.removesuffix(MUST_ALIAS_SUFFIX) if kind == "input" else name
    if base in names:
        return names.index(base)
    numbered = re.fullmatch(rf"{kind}(\d+)", base)
    if numbered and int(numbered.group(1)) < len(names):
        return int(numbered.group(1))
    raise ArtifactError(f"{path}: the NEFF's {kind} {name!r} is none of the program's {len(names)} {kind}s")


def _tensor_table(runtime: _Runtime, model: ctypes.c_void_p) -> list[tuple[str, int, int]]:
    """The NEFF's tensors (name, usage, bytes) in its order; the runtime's copy freed."""
    info = ctypes.c_void_p()
    runtime.call("nrt_get_model_tensor_info", model, ctypes.byref(info))
    try:
        count = TensorInfoArrayHeader.from_address(info.value).tensor_count
        tensors = (TensorInfo * count).from_address(info.value + ctypes.sizeof(TensorInfoArrayHeader))
        return [(t.name.decode(), t.usage, t.size) for t in tensors]
    finally:
        runtime.call("nrt_free_model_tensor_info", info)


def _bind(path: Path, table: list[tuple[str, int, int]], signature: ProgramSignature,
          context: GraphContext) -> tuple[dict[str, str], dict[str, str]]:
    """Each NEFF input's parameter and each NEFF output's result, by name; refused in one line
    where a tensor is not the program's, or not at its size."""
    parameter_bytes = [math.prod(shape) * _BYTES[dtype] for shape, dtype in zip(signature.shapes, signature.dtypes)]
    result_bytes = [math.prod(shape) * _BYTES[dtype]
                    for shape, dtype in zip(result_shapes(context), signature.output_dtypes)]
    bound = {"input": {}, "output": {}}
    for name, usage, size in table:
        kind = "input" if usage == NRT_TENSOR_USAGE_INPUT else "output"
        names, sizes = (signature.parameters, parameter_bytes) if kind == "input" else (signature.outputs, result_bytes)
        index = _index(path, name, kind, names)
        if names[index] in bound[kind].values():
            raise ArtifactError(f"{path}: the NEFF binds the program's {kind} {names[index]} twice (at {name!r})")
        if size != sizes[index]:
            raise ArtifactError(f"{path}: the NEFF's {kind} {name!r} ({names[index]}) holds {size} bytes; the "
                                f"program's holds {sizes[index]}: the NEFF is not this program's; run `graphc "
                                "neuron-finish` again")
        bound[kind][name] = names[index]
    missing = [result for result in signature.outputs if result not in bound["output"].values()]
    if missing:
        raise ArtifactError(f"{path}: the NEFF has no output for the program's {', '.join(missing)}")
    return bound["input"], bound["output"]


def _place(runtime: _Runtime, weights: list[torch.Tensor], signature: ProgramSignature) -> dict[str, ctypes.c_void_p]:
    """This rank's weights and KV pool (zeros, as the engine's) on the device, once for all its
    programs."""
    source, device = _device_weights.get(id(weights), (None, None))
    if source is weights:
        return device
    device = {}
    for i, weight in enumerate(weights):
        device[f"weight.{i}"] = runtime.tensor(f"weight.{i}", weight.numel() * weight.element_size())
        runtime.write(device[f"weight.{i}"], weight)
    at = signature.parameters.index("kv_pool")
    pool = torch.zeros(signature.shapes[at], dtype=getattr(torch, signature.dtypes[at]))
    device["kv_pool"] = runtime.tensor("kv_pool", pool.numel() * pool.element_size())
    runtime.write(device["kv_pool"], pool)
    _device_weights[id(weights)] = weights, device
    return device


def load_neff(path: Path, rank: int, world: int, context: GraphContext) -> Callable:
    """The runner of one program archive's NEFF (the archive checked against `context` first, the
    NEFF loaded and its tensors bound now): `(weights, inputs) -> (tokens, logits, ...)`, a score
    program's prompt scores after them."""
    description, files = read_archive(path, context, (NEFF,))
    if NEFF not in files:
        raise GraphcError(f"{path.name}: no NEFF; run `graphc neuron-finish` on a Neuron host first")
    if context.weights is None:
        raise GraphcError(f"{path.name}: the device runner needs the rank's weights")
    lnc = context.manifest.extra.get("neuronx_cc", {}).get("lnc")  # what neuron-finish compiled at
    runtime, neff, model = _runtime_for(rank, world, lnc), files[NEFF], ctypes.c_void_p()
    with _watchdog(rank, f"nrt_load_collectives of {path.name}", _load_timeout()):
        runtime.call("nrt_load_collectives", neff, len(neff), 0, 1, rank, world, ctypes.byref(model))
    program = _Program(model)
    runtime.programs.append(program)
    signature = description.signature
    inputs, outputs = _bind(path, _tensor_table(runtime, model), signature, context)
    device = _place(runtime, context.weights, signature)
    step_tensors = {}  # the program's step inputs and its outputs but the pool, on the device
    dtypes = dict(zip(signature.parameters, signature.dtypes))
    for neff_name, parameter in inputs.items():
        if parameter not in device:
            shape = signature.shapes[signature.parameters.index(parameter)]
            step_tensors[parameter] = runtime.tensor(neff_name, math.prod(shape) * _BYTES[dtypes[parameter]])
    shapes = dict(zip(signature.outputs, result_shapes(context)))
    output_dtypes = dict(zip(signature.outputs, signature.output_dtypes))
    for neff_name, result in outputs.items():
        if result != "kv_pool":
            step_tensors[result] = runtime.tensor(neff_name, math.prod(shapes[result]) * _BYTES[output_dtypes[result]])
    input_set = runtime.tensor_set(program, {name: device[p] if p in device else step_tensors[p]
                                             for name, p in inputs.items()})
    output_set = runtime.tensor_set(program, {name: device["kv_pool"] if r == "kv_pool" else step_tensors[r]
                                              for name, r in outputs.items()})
    written = [(parameter, step_tensors[parameter]) for parameter in signature.parameters if parameter in step_tensors]
    noise_shape = signature.shapes[signature.parameters.index(NOISE)]
    read = [(result, getattr(torch, output_dtypes[result])) for result in signature.outputs[1:]]

    def run(weights: list[torch.Tensor], step: dict[str, torch.Tensor]):
        if _device_weights[id(context.weights)][0] is not weights:
            raise GraphcError(f"{path.name}: run with weights other than those placed on the device at load")
        values = {**step, NOISE: step_noise(step["seed"], step["temperature"], noise_shape)}
        for parameter, tensor in written:
            value = values[parameter]
            runtime.write(tensor, value.to(torch.int32) if value.dtype == torch.int64 else value)
        runtime.call("nrt_execute", model, input_set, output_set)
        results = [runtime.read(step_tensors[result], dtype, shapes[result]) for result, dtype in read]
        return tuple(r.to(torch.int64) if r.dtype == torch.int32 else r for r in results)

    return run
