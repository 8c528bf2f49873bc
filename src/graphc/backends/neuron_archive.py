"""A neuron program's archive (a stored zip: hashed and shipped as one file) and neuronx-cc, which
turns its Neuron HLO into a NEFF.

    program.json     the parameter / result names, shapes and dtypes (`ProgramSignature`), the
                     world size, and the neuronx-cc command that makes (or made) the NEFF
    neuron.hlo.pb    the HloModuleProto for neuronx-cc (`xla.variants.NEURON`)
    neuron.stablehlo.mlirbc
                     the same module as StableHLO, the portable artifact (versioned MLIR bytecode,
                     at the version program.json names): the form the Neuron SDK's own frameworks
                     now lower through. It is what the HLO is made from (jaxlib's
                     `mlir_module_to_xla_computation` of it gives neuron.hlo.pb's module), so a
                     toolchain that takes StableHLO compiles the very module linted here
    cpu.hlo.pb       the same module in the form XLA:CPU runs (`xla.variants.CPU`): what `graphc
                     run` serves here, to validate the graphs token for token
    neuron.neff      where `neuronx-cc` was on PATH at compile time, or after `graphc
                     neuron-finish` on a Neuron host

An archive is input (artifacts travel between hosts, and whoever tampers with one can update the
manifest's hash), so `read_archive` trusts nothing in it: the zip's directory is checked before
zipfile parses it (entries, size), members by name and declared size before any is read (bounds
derived from the manifest's program: `member_limits`), each read size-limited; program.json
through its schema (`graphc.typed.build`) and against the manifest (world, parameter names, the
step inputs' shapes and dtypes, the vocabulary, the weights being bound); each module member read
is parsed (the StableHLO one deserialized and converted to HLO), its program shape must be the
signature's, and the CPU one may reach nothing beyond itself (`HOST_OPCODES`). Every refusal is
one ArtifactError line.

Light on purpose (no torch; jaxlib imported only to parse an HLO member): the compiler, the
runners, the lint and `graphc neuron-finish` share it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from graphc.artifacts.manifest import ArtifactError, GraphContext, Manifest
from graphc.errors import GraphcError
from graphc.step import STEP_INPUTS, score_top, step_outputs
from graphc.typed import build

NEURONX_CC = "neuronx-cc"
NEURON_TARGETS = ("trn1", "trn2", "trn3")
NEURON_TARGET = "trn2"
"""The Neuron generation NEFFs are compiled for by default (`neuronx-cc --target`)."""
LNC_TARGETS = ("trn2", "trn3")
"""The generations whose NeuronCores pair into logical ones: `--lnc` (the CLI reference's
`--logical-nc-config` / `-lnc`) is for them only; trn1 refuses an LNC configuration (NCC_EARG001).
The runtime's NEURON_LOGICAL_NC_CONFIG must equal it ("Logical NeuronCore configuration")."""
LNCS = (1, 2)
DEFAULT_LNC = 2
"""The compiler's and runtime's default on trn2 (and trn3): two physical cores a rank."""
Phase = Literal["context_encoding", "token_generation"]
PROGRAM_JSON, NEURON_HLO, CPU_HLO, NEFF = "program.json", "neuron.hlo.pb", "cpu.hlo.pb", "neuron.neff"
NEURON_STABLEHLO = "neuron.stablehlo.mlirbc"
MODULES = (NEURON_HLO, NEURON_STABLEHLO, CPU_HLO)
REQUIRED = (PROGRAM_JSON, *MODULES)
MEMBERS = (*REQUIRED, NEFF)
DIRECTORY_BYTES = 4096
"""The most bytes a program archive's zip directory may declare (an entry takes some 60)."""
JSON_BYTES, JSON_BYTES_PER_PARAMETER = 64 * 2**10, 2**10
HLO_BYTES, HLO_BYTES_PER_PARAMETER = 16 * 2**20, 256 * 2**10
"""program.json and each HLO member may declare a base plus an allowance per parameter: the
compiler writes some 60 and 3,000 bytes per parameter (the module grows with the layers, as the
weights do; its constants are small), so the allowances are some 15 and 85 times that."""
NEFF_BYTES = 2 * 2**30
"""The most bytes a NEFF may declare: a step program's code and the constants neuronx-cc folds
(weights are parameters, never folded), tens to hundreds of MB for a full model."""

NOISE = "noise"
SCORE_DTYPES = ["float32", "float32", "int32"]
"""The dtypes of a score program's `SCORE_OUTPUTS` (int64 ids are int32 in a program)."""
Dtype = Literal["float32", "bfloat16", "int32", "bool", "uint8", "int8"]
"""A parameter's or result's dtype: what the lowering emits and the XLA:CPU runner binds (uint8: an
FP8 weight kept as stored, as its bytes; int8: an FP4 one's bytes, `models/fp4.PAIRS`)."""
_PROGRAM_DTYPES = {"int64": "int32", "float8_e4m3fn": "uint8"}
"""A torch dtype's name -> its values' dtype in a program (`xla.interpret.JAX_DTYPES`: no jax x64 mode;
FP8 weights as bytes, `xla.aten.FP8_BITS`)."""
HOST_OPCODES = ("custom-call", "infeed", "outfeed", "send", "send-done", "recv", "recv-done")
"""Instructions that reach beyond the module: a custom call runs whatever native function its
target names (jaxlib registers Python callbacks among them), the others move data to or from the
host. No CPU variant holds one (`xla.variants`), so none is ever run."""
_HOST_CALL = re.compile(r"(?<![\w.\-])(" + "|".join(HOST_OPCODES) + r")\(")
"""One of them anywhere in a module's text: an instruction's own line could be split by a name
that holds a line break, and no name or metadata of a compiled program spells one."""
_STDERR_HELD = threading.Lock()
_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


@dataclass(frozen=True)
class ProgramSignature:
    """What the runtime binds to the module's parameters and reads from its results."""

    parameters: list[str]
    """Input names in parameter order: `weight.<i>` for each weight, then the step inputs
    (`graphc.step.STEP_INPUTS`), then `noise` if sampling (`parameter_names`)."""
    shapes: list[list[int]]
    dtypes: list[Dtype]
    outputs: list[str]
    """Result names in order: `program_outputs` of its bucket's kind."""
    output_dtypes: list[Dtype]
    samples: bool
    """Whether the program draws from noise (the sampler, or a speculative step's verdict) and so
    takes the `noise` input."""


@dataclass(frozen=True)
class ProgramDescription:
    """program.json."""

    signature: ProgramSignature
    world: int
    """The ranks the module's collectives span (the manifest's topology.world)."""
    neuronx_cc: list[str]
    """The command that makes (or made) the NEFF, run in a folder holding neuron.hlo.pb."""
    stablehlo_version: str
    """The StableHLO version neuron.stablehlo.mlirbc is serialized at: any consumer whose
    StableHLO is this version or newer reads it (`xla.lower.STABLEHLO_COMPATIBILITY`)."""


def program_outputs(kind: str) -> tuple[str, ...]:
    """The results of a program of bucket kind `kind`: the written pool, then the step's outputs."""
    return ("kv_pool", *step_outputs(kind))


def result_shapes(context: GraphContext) -> list[list[int]]:
    """Each result's shape (`program_outputs` order) as the manifest says the program returns them:
    the pool's; tokens [rows], or a speculative step's verdict [rows, returned_width]; logits [rows,
    vocab]; a score program's [rows, width] and twice [rows, width, N] (`graphc.step.score_top`)."""
    manifest, graph = context.manifest, context.graph
    rows, width = graph.inputs["input_ids"].shape
    vocab, verdict = manifest.model.vocab_size, manifest.buckets.returned_width
    pool = [manifest.kv_cache.num_blocks if size == -1 else size for size in graph.inputs["kv_pool"].shape]
    scores = [[rows, width], *[[rows, width, score_top(vocab)]] * 2] if graph.kind == "score" else []
    return [pool, [rows] if verdict == 1 else [rows, verdict], [rows, vocab], *scores]


def parameter_names(weights: int, samples: bool) -> list[str]:
    """A program's parameter names: its `weights` weights, the step inputs, and `noise` if it samples."""
    return [f"weight.{i}" for i in range(weights)] + list(STEP_INPUTS) + ([NOISE] if samples else [])


def default_lnc(target: str) -> int | None:
    """`--lnc` when none is given: DEFAULT_LNC where the target has logical cores, else none."""
    return DEFAULT_LNC if target in LNC_TARGETS else None


def check_flags(target: str, lnc: int | None) -> None:
    """Refuse, in one line, a target neuronx-cc does not name or an LNC it would refuse."""
    if target not in NEURON_TARGETS:
        raise GraphcError(f"--target {target!r}: neuronx-cc targets are {', '.join(NEURON_TARGETS)}")
    if lnc is not None and target not in LNC_TARGETS:
        raise GraphcError(f"--lnc {lnc} with --target {target}: logical NeuronCores are {' and '.join(LNC_TARGETS)} "
                          f"only; leave --lnc out for {target}")
    if lnc is not None and lnc not in LNCS:
        raise GraphcError(f"--lnc {lnc}: neuronx-cc takes {' or '.join(map(str, LNCS))}")


def phase(signature: ProgramSignature) -> Phase:
    """Which of NxD Inference's two compiles a program is: context encoding (a prefill chunk: one
    row of several tokens) or token generation (decode rows, prompt-as-decode and speculative
    steps included). A program is shared by every bucket of its shape, so its shape decides: a
    [1, P] prompt-as-decode step is a chunk's program (the same one, where both buckets exist)."""
    rows, width = signature.shapes[signature.parameters.index("input_ids")]
    return "context_encoding" if rows == 1 and width > 1 else "token_generation"


def neuronx_cc_command(target: str = NEURON_TARGET, lnc: int | None = None,
                       step: Phase = "token_generation") -> list[str]:
    """neuronx-cc's invocation for one Neuron HLO module, run in a folder holding it: the CLI
    reference's form (`compile <model> --framework XLA --target --lnc -O --output`) with the
    options NxD Inference's model wrapper (neuronx-distributed-inference,
    models/model_wrapper.py, `get_compiler_args`) passes for the same kind of program. `lnc`:
    `default_lnc(target)` if None."""
    check_flags(target, lnc)
    lnc = default_lnc(target) if lnc is None else lnc
    decode = step == "token_generation"
    return [NEURONX_CC, "compile", NEURON_HLO, "--framework", "XLA", "--target", target,
            *(["--lnc", str(lnc)] if lnc is not None else []),
            # NxD Inference: -O2 for token generation (small, latency-bound graphs run every step),
            # -O1 for context encoding (large graphs: compile time, and they are compute-bound).
            "-O2" if decode else "-O1",
            # NxD Inference (and the CLI reference): a transformer's scheduling heuristics; numerics
            # kept as compiled (graphc's dtypes are the model's: no bf16 auto-cast of fp32 math).
            "--model-type", "transformer", "--auto-cast", "none",
            # NxD Inference's token-generation tensorizer options: collectives overlapped with
            # compute, no pipeline tiling of them (one token a row is too small to tile), strided
            # DMAs vectorized (the KV pool's block gathers).
            *(["--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=1 "
                "--vectorize-strided-dma"] if decode else []),
            # NxD Inference, every program: neuronx-cc's HLO verifier before its tensorizer.
            "--internal-hlo2tensorizer-options=--verify-hlo=true",
            # Not passed: NxD's --experimental-unsafe-fp8e4m3fn-as-fp8e4m3, for programs holding
            # F8E4M3FN values: graphc's hold none (FP8 weights enter as their bytes, u8, decoded
            # with integer ops: `xla.aten.FP8_BITS`; `xla/lint.py` refuses an f8e4m3fn value).
            "--output", NEFF]


def manifest_extras(target: str = NEURON_TARGET, lnc: int | None = None) -> dict:
    """What a neuron manifest records beside its graphs: the hand-off, how each program's HLO
    becomes a NEFF on a Neuron host (the target, the LNC its NEFFs need the runtime to run at,
    and the command of each phase)."""
    return {"neuronx_cc": {
        "target": target, "lnc": default_lnc(target) if lnc is None else lnc,
        **{step: shlex.join(neuronx_cc_command(target, lnc, step)) for step in ("context_encoding", "token_generation")},
    }}


def available() -> bool:
    return shutil.which(NEURONX_CC) is not None


def toolchain() -> str:
    """What decides whether a compile makes NEFFs (part of the compile cache's key: an archive
    cached without a NEFF must not be reused where neuronx-cc is installed, nor the reverse)."""
    return f"{NEURONX_CC} at {shutil.which(NEURONX_CC)}; members {', '.join(REQUIRED)}"  # a new member: a new key


NEURONX_CC_LOGFILE = "log-neuron-cc.txt"
"""Where neuronx-cc writes its log by default (the CLI reference's `--logfile`), in its folder."""


def neff_of(neuron_hlo: bytes, command: list[str]) -> tuple[bytes, str]:
    """neuronx-cc's NEFF of a Neuron-variant module, and its log (`run_neuronx_cc`)."""
    with tempfile.TemporaryDirectory(prefix="graphc-neuronx-cc-") as scratch:
        (Path(scratch) / NEURON_HLO).write_bytes(neuron_hlo)
        return run_neuronx_cc(Path(scratch), command)


def run_neuronx_cc(folder: Path, command: list[str]) -> tuple[bytes, str]:
    """Run neuronx-cc in `folder` (which holds the HLO); the NEFF and the compiler's log (the
    command, its stdout, its stderr and its log file), or an error naming the reason."""
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    logfile = folder / NEURONX_CC_LOGFILE
    sections = (("command", shlex.join(command)), ("exit status", str(done.returncode)), ("stdout", done.stdout),
                ("stderr", done.stderr),
                (NEURONX_CC_LOGFILE, logfile.read_text(errors="replace") if logfile.is_file() else "(none written)"))
    log = "".join(f"== {title}\n{text.rstrip()}\n" for title, text in sections)
    if done.returncode != 0 or not (folder / NEFF).is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise GraphcError(f"{' '.join(command)} failed (exit {done.returncode}): " + " | ".join(tail))
    return (folder / NEFF).read_bytes(), log


def write_archive(out: Path, description: ProgramDescription, files: dict[str, bytes]) -> None:
    members = {PROGRAM_JSON: json.dumps(dataclasses.asdict(description), indent=1).encode(), **files}
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            # A fixed date (zipfile would stamp the time of writing): the same program, the same
            # archive bytes, so its content-named file is the same from one compile to the next.
            member = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            member.external_attr = 0o600 << 16
            archive.writestr(member, data)


def program_contexts(manifest: Manifest) -> dict[str, GraphContext]:
    """Each distinct program archive of `manifest` (file -> the first rank and graph naming it),
    for what reads archives without running them (the lint, neuron-finish)."""
    contexts: dict[str, GraphContext] = {}
    for rank in manifest.ranks:
        for graph in rank.graphs:
            contexts.setdefault(graph.file, GraphContext(manifest, rank, graph))
    return dict(sorted(contexts.items()))


def member_limits(context: GraphContext) -> dict[str, int]:
    """The most bytes each member may declare, for the program of `context` (see `HLO_BYTES`)."""
    parameters = len(context.rank.weight_names) + len(STEP_INPUTS) + 1
    hlo = HLO_BYTES + HLO_BYTES_PER_PARAMETER * parameters
    return {PROGRAM_JSON: JSON_BYTES + JSON_BYTES_PER_PARAMETER * parameters, **dict.fromkeys(MODULES, hlo),
            NEFF: NEFF_BYTES}


def read_archive(path: Path, context: GraphContext,
                 members: tuple[str, ...]) -> tuple[ProgramDescription, dict[str, bytes]]:
    """program.json, checked against `context`, and each of `members` the archive holds (by name),
    a module member parsed and checked against the signature; otherwise one ArtifactError line."""
    limits = member_limits(context)
    try:
        with open(path, "rb") as handle:
            _check_directory(path, handle)
            with zipfile.ZipFile(handle) as archive:
                infos = _check_members(path, archive, limits)
                description = _description(path, _read(path, archive, infos[PROGRAM_JSON]), context)
                files = {name: _read(path, archive, infos[name]) for name in members if name in infos}
    # zipfile's refusals of a damaged directory, header or stream: what it cannot parse, decode (a
    # UTF-8 name), seek to, decompress, or does not implement (a version or flag beyond deflate).
    except (zipfile.BadZipFile, UnicodeDecodeError, zlib.error, EOFError, OSError, NotImplementedError) as e:
        raise _refused(path, f"not a readable zip archive ({e})") from None
    for name in MODULES:
        if name in files:
            data = stablehlo_to_hlo(path, files[name]) if name == NEURON_STABLEHLO else files[name]
            _check_module(path, name, data, description.signature, context)
    return description, files


def stablehlo_to_hlo(path: Path, artifact: bytes) -> bytes:
    """The HloModuleProto of a StableHLO portable artifact (as graphc makes neuron.hlo.pb from
    it); refused in one line if it does not deserialize or convert."""
    from jax._src.lib import _jax, xla_client
    from jax.interpreters import mlir

    try:
        with native_log_held(), mlir.make_ir_context():
            module = _jax.mlir.deserialize_portable_artifact(artifact)
            computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
                mlir.module_to_bytecode(module), use_tuple_args=False, return_tuple=True)
    except RuntimeError as e:  # jaxlib's errors (JaxRuntimeError, XlaRuntimeError) are RuntimeErrors
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise _refused(path, f"{NEURON_STABLEHLO}: not a StableHLO portable artifact jaxlib reads ({first})") from None
    return computation.as_serialized_hlo_module_proto()


def _refused(path: Path, message: str) -> ArtifactError:
    # A key program.json spells may hold a line break: the refusal stays one line.
    return ArtifactError(f"{path}: {message}".translate(_LINE_BREAKS))


def _check_directory(path: Path, handle) -> None:
    """Refuse a zip directory larger than a program archive's before zipfile reads it whole (one
    of millions of entries would cost seconds and gigabytes)."""
    end = zipfile._EndRecData(handle)  # zipfile's own reader of the end record, zip64 included
    if end is None:
        raise _refused(path, "not a zip archive (no end of central directory record)")
    entries, size = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]
    if entries > len(MEMBERS) or size > DIRECTORY_BYTES:
        raise _refused(path, f"the zip directory declares {entries} entries in {size} bytes; a program archive "
                             f"has at most {len(MEMBERS)} ({', '.join(MEMBERS)}) in {DIRECTORY_BYTES}")


def _check_members(path: Path, archive: zipfile.ZipFile, limits: dict[str, int]) -> dict[str, zipfile.ZipInfo]:
    """The members by name, once each, only the known ones, stored or deflated, each declaring at
    most its limit."""
    infos = archive.infolist()
    names = [info.filename for info in infos]
    if len(set(names)) != len(names) or not set(REQUIRED) <= set(names) <= set(MEMBERS):
        raise _refused(path, f"members {names}; a program archive holds {', '.join(REQUIRED)} and optionally "
                             f"{NEFF}, each once")
    for info in infos:
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 0x1:
            raise _refused(path, f"{info.filename}: compression method {info.compress_type}"
                                 f"{' (encrypted)' if info.flag_bits & 0x1 else ''}; members are stored or deflated")
        if info.file_size > limits[info.filename]:
            raise _refused(path, f"{info.filename}: declares {info.file_size} bytes; at most "
                                 f"{limits[info.filename]} for this manifest's program")
    return dict(zip(names, infos))


def _read(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    # Never more than the declared size (already bounded), whatever the data holds.
    with archive.open(info) as member:
        data = member.read(info.file_size + 1)
    if len(data) != info.file_size:
        raise _refused(path, f"{info.filename}: holds {len(data)} bytes, not the {info.file_size} it declares")
    return data


def _description(path: Path, data: bytes, context: GraphContext) -> ProgramDescription:
    try:
        raw = json.loads(data.decode())  # UTF-8, as written (json.loads would guess among UTF-16 and -32)
    except (ValueError, RecursionError) as e:
        raise _refused(path, f"{PROGRAM_JSON}: not JSON ({e})") from None
    try:
        description = build(ProgramDescription, raw, ArtifactError)
    except ArtifactError as e:
        raise _refused(path, f"{PROGRAM_JSON}: {e}") from None
    problem = _signature_problem(description, context)
    if problem:
        raise _refused(path, f"{PROGRAM_JSON}: {problem}")
    return description


def _program_dtype(dtype) -> str:
    """A torch dtype (or its name, as the manifest writes it) as the program's values have it."""
    name = str(dtype).removeprefix("torch.")
    return _PROGRAM_DTYPES.get(name, name)


def expected_parameters(context: GraphContext) -> dict[str, tuple[list[int], str] | None]:
    """Each parameter's shape and dtype as the manifest says the program takes them: the step
    inputs' from the graph entry (the pool's block count fixed at compile time), noise [rows,
    vocab] fp32, the weights' from the tensors bound (None where none are: any shape and dtype)."""
    manifest, rank, graph, weights = context.manifest, context.rank, context.graph, context.weights
    names = parameter_names(len(rank.weight_names), samples=True)
    expected = dict.fromkeys(names[:len(rank.weight_names)]) if weights is None else {
        name: (list(w.shape), _program_dtype(w.dtype)) for name, w in zip(names, weights)}
    for name, spec in graph.inputs.items():
        shape = [manifest.kv_cache.num_blocks if size == -1 else size for size in spec.shape]
        expected[name] = shape, _program_dtype(spec.dtype)
    positions = [1 + manifest.buckets.draft_tokens] if manifest.buckets.draft_tokens else []
    expected[NOISE] = [graph.inputs["seed"].shape[0], *positions, manifest.model.vocab_size], "float32"
    return expected


def _signature_problem(description: ProgramDescription, context: GraphContext) -> str | None:
    signature, rank, world = description.signature, context.rank, context.manifest.topology.world
    if description.world != world:
        return f"world: {description.world}; the manifest's topology has {world} rank(s)"
    if not signature.samples:
        return "signature.samples: false; every step program samples (its tokens kept where a rank samples)"
    expected = expected_parameters(context)
    names, weights = list(expected), len(rank.weight_names)
    if signature.parameters != names:
        at = next((i for i, (a, b) in enumerate(zip(signature.parameters, names)) if a != b),
                  min(len(names), len(signature.parameters)))
        return (f"signature.parameters: {len(signature.parameters)} names, [{at}] "
                f"{signature.parameters[at] if at < len(signature.parameters) else 'missing'!r}; expected "
                f"{len(names)}: weight.0 .. weight.{weights - 1}, then {', '.join(names[weights:])}")
    for field in ("shapes", "dtypes"):
        if len(getattr(signature, field)) != len(names):
            return f"signature.{field}: {len(getattr(signature, field))} entries for {len(names)} parameters"
    for i, (name, shape, dtype) in enumerate(zip(names, signature.shapes, signature.dtypes)):
        if expected[name] is None and not all(0 < size < 2**31 for size in shape):
            return f"signature.shapes[{i}] ({name}): {shape}; sizes are from 1 to 2**31 - 1"
        if expected[name] is not None and (shape, dtype) != expected[name]:
            return (f"signature.shapes[{i}], dtypes[{i}] ({name}): {shape} {dtype}; the manifest's program takes "
                    f"{expected[name][0]} {expected[name][1]}")
    pool_dtype, outputs = expected["kv_pool"][1], list(program_outputs(context.graph.kind))
    scores = SCORE_DTYPES if context.graph.kind == "score" else []
    dtypes = signature.output_dtypes
    if signature.outputs != outputs or len(dtypes) != len(outputs) or dtypes[:2] != [pool_dtype, "int32"] \
            or dtypes[2] not in ("float32", "bfloat16") or dtypes[3:] != scores:
        return (f"signature.outputs, output_dtypes: {signature.outputs} {dtypes}; expected "
                f"{outputs} [{', '.join([pool_dtype, 'int32', 'float32 or bfloat16', *scores])}]")
    return None


def _check_module(path: Path, name: str, data: bytes, signature: ProgramSignature, context: GraphContext) -> None:
    """Parse an HLO member (jaxlib's HloModuleProto reader, the module built whole) and refuse it
    unless its parameters and results are the signature's, and the CPU one if it reaches beyond
    itself (`HOST_OPCODES`)."""
    from jax._src.lib import xla_client

    try:
        with native_log_held():
            computation = xla_client._xla.XlaComputation(data)
            computation.get_hlo_module()
            shape = computation.program_shape()
            parameters = [_shape_of(s) for s in shape.parameter_shapes()]
            results = [_shape_of(s) for s in shape.result_shape().tuple_shapes()] \
                if shape.result_shape().is_tuple() else [_shape_of(shape.result_shape())]
            text = computation.as_hlo_text() if name == CPU_HLO else ""
    except xla_client.XlaRuntimeError as e:
        raise _refused(path, f"{name}: not an HLO module XLA reads ({str(e).splitlines()[0]})") from None
    found = sorted(set(_HOST_CALL.findall(text)))
    if found:
        raise _refused(path, f"{name}: holds {', '.join(found)}; the CPU variant runs none of {', '.join(HOST_OPCODES)}")
    for kind, names, got, want in (
            ("parameter", signature.parameters, parameters, [*zip(signature.shapes, signature.dtypes)]),
            ("result", signature.outputs, results, [*zip(result_shapes(context), signature.output_dtypes)])):
        if len(got) != len(want):
            raise _refused(path, f"{name}: the module has {len(got)} {kind}s, program.json's signature {len(want)}")
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if at is not None:
            raise _refused(path, f"{name}: the module's {kind} {at} ({names[at]}) is {_text(got[at])}, program.json's "
                                 f"signature's {_text(want[at])}")


def _shape_of(shape) -> tuple[list[int], str] | str:
    """An array shape as the signature writes one; anything else (a tuple, a token) as its text."""
    return (list(shape.dimensions()), shape.numpy_dtype().name) if shape.is_array() else str(shape)


def _text(shape: tuple[list[int], str] | str) -> str:
    return shape if isinstance(shape, str) else f"{shape[1]}{shape[0]}"


@contextlib.contextmanager
def native_log_held() -> Iterator[None]:
    """Hold what native code writes to file descriptor 2 until the block ends: written out if the
    block succeeds, dropped if it raises (jaxlib logs a malformed module's RET_CHECK failure
    with a C++ stack trace there; the refusal says what failed, in one line). One block at a
    time: the descriptor is the process's (neuron-finish reads archives from several threads)."""
    with _STDERR_HELD, tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        with open(2, "wb", closefd=False) as stderr:
            stderr.write(held.read())
