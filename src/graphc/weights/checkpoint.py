"""Load checkpoints (`config.json` + safetensors) into their family's step model, or, for a family
with a graphc reference (DeepSeek-V4.1's), into that reference by the released names
(`load_reference`). What differs per family (which stored tensors make a parameter, what is kept
fp32, what is skipped) is its record's hooks (`family.Family`); this module does the rest.

The on-disk names are the HF / DeepSeek ones. graphc's module uses the same names except the routed
experts, which it stacks in the layout the compiled graphs read: `model.layers.{i}.mlp.experts.{e}.
gate_proj.weight` and `up_proj.weight` for e in 0..E-1 become `model.layers.{i}.mlp.experts.gate_up_proj`
[E, 2I, D] (each expert's gate rows, then its up rows), and `down_proj.weight` becomes `down_proj`
[E, D, I]. FP8 block-quantised weights (DeepSeek's
release format: a float8_e4m3fn `X.weight` with its `X.weight_scale_inv`) and FP4 ones (V4.1's
routed experts: `weights/fp4.py`) are dequantised exactly on load, or, for step graphs
(`as_stored`), kept as stored: the parameter holds the FP8 values and a buffer
`<parameter>_scale_inv` their fp32 scales (FP4: both as bytes; `fp8.QuantizedWeight`). A
tensor-parallel rank (`tp_shard`) reads only its slice of each weight its family splits
(`Family.tensor_parallel.dims`, `tensor_shard.TensorShard`), FP8 ones with their slice's scales.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from graphc.errors import CheckpointError
from graphc.weights import fp4
from graphc.models.family import Family, Sources
from graphc.weights.fp8 import (FP8, SCALE_SUFFIX, UE8M0_SUFFIX, QuantizedWeight, dequantize, scale_grid,
                               scale_name, scaled_weight)
from graphc.weights.hf_config import read_hf_config
from graphc.models.layers import STACKED_EXPERT
from graphc.models.registry import family_of, family_of_config
from graphc.models.step_model import ModelArgs, StepModel
from graphc.weights.tensor_shard import TensorShard
from graphc.topology import Topology

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def build_model(args: ModelArgs, local_experts: int | None = None, sparse_probabilities: str = "fp32",
                tp: int = 1) -> StepModel:
    """The module of `args`'s family, one of `tp` tensor-parallel ranks (weights uninitialised;
    build it under a meta device)."""
    return family_of(args).build(args, local_experts, sparse_probabilities, tp)


def _parameter_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every graphc parameter (and persistent buffer) of the whole model, with its shape."""
    with torch.device("meta"):
        model = build_model(args)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (name == "lm_head.weight" and args.tie_word_embeddings)}


def _stored_per_expert(family: Family, name: str, groups: list[list[str]]) -> bool:
    """Whether parameter `name` is a stacked expert parameter stored one tensor (or more) per expert."""
    return bool(STACKED_EXPERT.match(name)) and not family.stored.stored_stacked(groups[0][0])


def _expected_shapes(args: ModelArgs, sources: Sources) -> dict[str, tuple[int, ...]]:
    """The shape each stored source of a parameter must have."""
    expected, family = {}, family_of(args)
    for name, shape in _parameter_shapes(args).items():
        groups = sources.get(name, [])
        if groups and _stored_per_expert(family, name, groups):
            expected.update({n: (shape[1] // len(parts), shape[2]) for parts in groups for n in parts})
        else:
            expected.update({n: shape for parts in groups for n in parts})
    return expected


def expected_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `args` holds for the main layers, with its shape, in the
    family's released layout (what graphc's tiny checkpoints are written in)."""
    return _expected_shapes(args, family_of(args).stored.released_sources(args, list(_parameter_shapes(args))))


def _stored_names(path: Path) -> list[str]:
    """Tensor names in one safetensors file (reads the header only)."""
    try:
        with safe_open(path, "pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error type for corrupt headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _tensor_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Map each stored tensor name to its safetensors file (single file or sharded index)."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            index_data = json.loads(index.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: not valid JSON ({e})") from None
        weight_map = index_data.get("weight_map") if isinstance(index_data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: checkpoint_dir / shard for name, shard in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"{index}: shard {path.name!r} is missing")
            listed = {name for name, shard in files.items() if shard == path}
            absent = sorted(listed - set(_stored_names(path)))
            if absent:
                raise CheckpointError(f"{index}: shard {path.name!r} lacks tensor(s) {_summarise(absent)} "
                                      "that the weight_map places there")
        return files
    single = checkpoint_dir / "model.safetensors"
    if single.is_file():
        return {name: single for name in _stored_names(single)}
    raise CheckpointError(
        f"checkpoint dir {str(checkpoint_dir)!r} has no model.safetensors and no model.safetensors.index.json"
    )


def holds_weights(checkpoint_dir: Path) -> bool:
    """Whether the checkpoint directory has tensors (a safetensors file or a sharded index), not
    config.json alone (a released config planned or compiled shapes-only)."""
    return (checkpoint_dir / "model.safetensors").is_file() or (checkpoint_dir / "model.safetensors.index.json").is_file()


def _summarise(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def load_rank_shard(checkpoint_dir: Path, topology: Topology, rank: int, dtype: torch.dtype,
                    sparse_probabilities: str | None = None, as_stored: bool = False,
                    draft_layers: int = 0, checked: CheckedCheckpoint | None = None) -> StepModel:
    """The model of `rank`'s weights: its routed experts (all of them when ep = 1) and its
    tensor-parallel slice of the split weights; ranks with the same `topology.weight_shard` hold
    the same. `draft_layers`: the MTP layers it serves as speculative decoding's draft. `checked`:
    the checkpoint's `check_checkpoint` with those draft layers, where the caller loads several
    shards (config.json and the headers read once)."""
    checked = checked or check_checkpoint(Path(checkpoint_dir), draft_layers)
    ep_rank, tp_rank = topology.weight_shard(rank)
    experts = topology.experts(ep_rank, checked.args.n_routed_experts)
    return load_model(checkpoint_dir, dtype=dtype, experts=experts, sparse_probabilities=sparse_probabilities,
                      checked=checked, as_stored=as_stored, tp_shard=TensorShard(tp_rank, topology.tp))


QUANTIZED_WEIGHTS = "quantized_weights"
"""The attribute of a loaded model naming its parameters kept as stored ({name: QuantizedWeight};
empty where everything was dequantised on load)."""


def load_model(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               experts: range | None = None, sparse_probabilities: str | None = None,
               checked: CheckedCheckpoint | None = None, as_stored: bool = False,
               tp_shard: TensorShard = TensorShard()) -> StepModel:
    """Build the checkpoint's family's step model from it.

    Args:
        checkpoint_dir: directory with config.json and model.safetensors (or a sharded index).
        dtype: parameter dtype; the router stays fp32.
        device: where the parameters go; every tensor is checked to be there afterwards.
        experts: the routed experts to load (an expert-parallel rank's share); all by default.
        sparse_probabilities: P's precision in sparse attention (V3.2 only): "bf16" as FlashMLA's
            kernel, "fp32" as the reference; by default "bf16" for a bfloat16 model, else "fp32".
        checked: the checkpoint's `check_checkpoint`, where the caller has it already.
        as_stored: keep FP8 weights as stored, with their scales (`QUANTIZED_WEIGHTS`): for step
            graphs, which dequantise them in the graph; the module itself cannot run eagerly then.
        tp_shard: the tensor-parallel rank to load: only its slice of each split weight is read.

    Raises:
        CheckpointError: unsupported architecture, missing/unexpected tensor, wrong shape or dtype.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if torch.device(device).type == "meta":
        raise CheckpointError("device 'meta' holds no data; load onto a real device (e.g. 'cpu')")
    if dtype not in SUPPORTED_DTYPES:
        raise CheckpointError(f"dtype {dtype} is not supported; supported: float32, bfloat16, float16")
    checked = checked or check_checkpoint(checkpoint_dir)
    args, family, files, expected, sources = checked.args, checked.family, checked.files, checked.expected, checked.sources

    experts = experts if experts is not None else range(args.n_routed_experts)
    if experts.start < 0 or experts.stop > args.n_routed_experts or not len(experts):
        raise CheckpointError(f"experts {experts} are not a share of the checkpoint's {args.n_routed_experts}")
    with torch.device("meta"):
        model = build_model(args, len(experts), sparse_probabilities or default_sparse_probabilities(dtype),
                            tp_shard.size)
    split_dim = family.tensor_parallel_dim if tp_shard.size > 1 else lambda name: None
    tied_split = args.tie_word_embeddings and tp_shard.size > 1  # the head's rows, the embedding's columns
    state: dict[str, Tensor] = {}
    scales: dict[str, tuple[Tensor, QuantizedWeight]] = {}
    with contextlib.ExitStack() as stack:
        # pread, not a mapping: the tensors are copied anyway, and a mapped checkpoint's touched
        # pages would count in this process's resident memory on top of the copies (measured: a
        # cp=ep=4 compile of the 1 B model peaked at 2.27x a rank's weights with the mapping).
        handles = {path: stack.enter_context(safe_open(path, "pt", backend="pread"))
                   for path in sorted(set(files.values()))}
        for name in model.state_dict():
            if name == "lm_head.weight" and args.tie_word_embeddings and not tied_split:
                continue
            target = (torch.int64 if name.endswith(family.stored.index_tensors) else
                      torch.float32 if family.stored.keeps_fp32(name, args) else dtype)
            dim = split_dim(name)
            shard = (dim, tp_shard) if dim is not None else None

            def read(stored: str, dtype: torch.dtype = target) -> Tensor:
                return _read_tensor(handles, checked, stored, expected[stored], shard=shard).to(device=device,
                                                                                                   dtype=dtype)

            groups = sources[name] if name != "lm_head.weight" or not tied_split else sources["model.embed_tokens.weight"]
            held = _expert_share(args, experts, len(groups)) if _stored_per_expert(family, name, groups) else experts
            kept = _kept_as_stored(handles, checked, name, groups, held, shard) if as_stored else None
            if kept is not None:
                weight, scale, block = kept
                state[name] = weight.to(device)
                scales[name] = scale.to(device), QuantizedWeight(name + SCALE_SUFFIX, block, target,
                                                                  by_row=name.endswith(family.stored.row_sharded_tables))
            elif name.endswith(family.stored.row_sharded_tables) and len(experts) < args.n_routed_experts:
                state[name] = _table_rows(handles, checked, groups[0][0], experts).to(device=device, dtype=target)
            elif _stored_per_expert(family, name, groups):
                state[name] = torch.stack([torch.cat([read(n) for n in groups[e]]) for e in held])
            elif STACKED_EXPERT.match(name):  # stored stacked: this rank's rows
                state[name] = read(groups[0][0])[experts.start:experts.stop]
            else:
                state[name] = read(groups[0][0])
    if args.tie_word_embeddings and not tied_split:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for name in scales:
        hold_as_stored(model, name, state[name])
    model.load_state_dict(state, strict=True, assign=True)
    for name, (scale, quantized) in scales.items():
        owner, _, attribute = quantized.scale.rpartition(".")
        model.get_submodule(owner).register_buffer(attribute, scale)
    setattr(model, QUANTIZED_WEIGHTS, {name: quantized for name, (_, quantized) in scales.items()})
    model.to(device)  # the buffers built from the config on the CPU (RoPE's, hashes'), not in the state dict
    _check_device(model, torch.device(device))
    return model.requires_grad_(False).eval()  # inference only: no autograd bookkeeping


def _expert_share(args: ModelArgs, experts: range, total: int) -> range:
    """The experts of a stacked parameter of `total` experts that the rank holding `experts` of
    the main layers' holds: the same share (V4.1's DSpark stages route over fewer experts)."""
    if total == args.n_routed_experts:
        return experts
    start, held = experts.start * total // args.n_routed_experts, len(experts) * total // args.n_routed_experts
    return range(start, start + held)


def hold_as_stored(model: nn.Module, name: str, stored: Tensor) -> None:
    """Declare parameter `name` (of a module on the meta device) with the shape and dtype it is
    kept in, so `load_state_dict(assign=True)` takes it: an FP4 weight is half its columns, in bytes."""
    owner, _, attribute = name.rpartition(".")
    empty = torch.empty(stored.shape, dtype=stored.dtype, device="meta")
    model.get_submodule(owner).register_parameter(attribute, nn.Parameter(empty, requires_grad=False))


def _kept_as_stored(handles: dict, checked: "CheckedCheckpoint", name: str, groups: list[list[str]],
                    experts: range, shard: tuple[int, TensorShard] | None = None
                    ) -> tuple[Tensor, Tensor, tuple[int, int]] | None:
    """Parameter `name` as its FP8 values and fp32 scales (FP4: both as bytes) and scale block,
    where every tensor it is made of is stored FP8, or every one FP4 (stacked experts); None where
    not (it is dequantised on load then). A row-sharded table (V4.1's Engram) keeps the shard's
    rows, each with its own scales (`_table_rows_as_stored`).

    Stacked experts stack their scales too; where a part's rows are not a whole number of scale
    blocks (gate and up fused into one matrix), each row gets its block's scale (block rows 1).
    `shard` (split dim, tensor-parallel rank) keeps the rank's slice and its scales
    (`TensorShard.scales`).
    """
    parts = [n for group in groups for n in group]
    if name.endswith(checked.family.stored.row_sharded_tables):
        return _table_rows_as_stored(handles, checked, parts[0], experts)
    if all(n in checked.fp4_bytes for n in parts) and _stored_per_expert(checked.family, name, groups):
        weights = torch.stack([torch.cat([_fp4_pairs(checked, n) for n in groups[e]]) for e in experts])
        grids = torch.stack([torch.cat([_fp4_scale(handles, checked, n) for n in groups[e]]) for e in experts])
        return weights, grids, fp4.BLOCK
    if not all(handles[checked.files[n]].get_slice(n).get_dtype() == "F8_E4M3" for n in parts):
        return None
    block = checked.fp8_block

    def values(stored: str) -> Tensor:
        return handles[checked.files[stored]].get_slice(stored)[:]

    def scale(stored: str, rows: int) -> Tensor:
        name = scale_name(stored, checked.ue8m0)
        grid = handles[checked.files[name]].get_slice(name)[:].float()
        return grid if rows == block[0] else grid.repeat_interleave(block[0], dim=0)[:checked.expected[stored][0]]

    if not _stored_per_expert(checked.family, name, groups):
        if len(parts) != 1 or STACKED_EXPERT.match(name):  # no release stores these FP8: dequantised on load
            return None
        if shard is None:
            return values(parts[0]), scale(parts[0], block[0]), block
        dim, tp_shard = shard
        length = checked.expected[parts[0]][dim]
        weight = handles[checked.files[parts[0]]].get_slice(parts[0])[tp_shard.index(dim, length)]
        return weight, *tp_shard.scales(scale(parts[0], block[0]), block, dim, length)
    rows = block[0] if all(checked.expected[n][0] % block[0] == 0 for n in groups[0]) else 1
    weights = torch.stack([torch.cat([values(n) for n in groups[e]]) for e in experts])
    grids = torch.stack([torch.cat([scale(n, rows) for n in groups[e]]) for e in experts])
    return weights, grids, (rows, block[1])


def _table_rows_as_stored(handles: dict, checked: "CheckedCheckpoint", name: str, experts: range
                          ) -> tuple[Tensor, Tensor, tuple[int, int]] | None:
    """A row-sharded table's rows this expert shard holds as stored: FP8, with their per-row fp32
    scales (`_table_rows`' rows, zero past the table's end alike); None where it is not FP8."""
    stored = handles[checked.files[name]].get_slice(name)
    if stored.get_dtype() != "F8_E4M3":
        return None
    scale = scale_name(name, checked.ue8m0)
    rows, held = _held_rows(checked, name, experts)
    values = stored[rows].view(torch.uint8)
    scales = handles[checked.files[scale]].get_slice(scale)[rows].float()
    pad = held - values.shape[0]
    return (torch.nn.functional.pad(values, (0, 0, 0, pad)).view(FP8), torch.nn.functional.pad(scales, (0, 0, 0, pad)),
            (1, checked.fp8_block[1]))


def _held_rows(checked: "CheckedCheckpoint", name: str, experts: range) -> tuple[slice, int]:
    """The stored rows of a row-sharded table (V4.1's Engram tables) this expert shard holds, and
    how many it holds: shard s of ep holds rows [s R, (s + 1) R), R = ceil(rows / ep), the last
    one zero past the table's end (`deepseek_v41/engram.py`)."""
    shards = checked.args.n_routed_experts // len(experts)  # experts are a contiguous, even share
    shard = experts.start // len(experts)
    rows = checked.expected[name][0]
    held = -(-rows // shards)
    return slice(shard * held, min((shard + 1) * held, rows)), held


def _table_rows(handles: dict, checked: "CheckedCheckpoint", name: str, experts: range) -> Tensor:
    """The rows of a row-sharded table this expert shard holds, dequantised (`_held_rows`; read
    alone: tables are the largest tensors of V4.1)."""
    rows, held = _held_rows(checked, name, experts)
    part = _read_tensor(handles, checked, name, checked.expected[name], rows)
    return torch.nn.functional.pad(part, (0, 0, 0, held - part.shape[0]))


def load_reference(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32, draft_layers: int = 0) -> nn.Module:
    """The family's eager graphc reference (`Family.reference.model`, read by the released names)
    from a checkpoint, on the CPU, checked as `load_model` checks it; with the draft layers it serves."""
    checked = check_checkpoint(Path(checkpoint_dir), draft_layers)
    if checked.family.reference.model is None:
        raise CheckpointError(f"{checkpoint_dir}: {checked.args.architecture} has no graphc reference model; "
                              "transformers implements it")
    with torch.device("meta"):
        model = checked.family.reference.model(checked.args)
    state = {}
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, "pt", backend="pread"))
                   for path in sorted(set(checked.files.values()))}
        for name, parameter in model.state_dict().items():
            tensor = _read_tensor(handles, checked, name, tuple(parameter.shape))
            state[name] = tensor.to(torch.float32 if checked.family.stored.keeps_fp32(name, checked.args) else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def _fp4_pairs(checked: "CheckedCheckpoint", name: str) -> Tensor:
    """An FP4 tensor's bytes [R, C / 2] as `fp4.PAIRS`, read from its byte range: safetensors 0.8
    sizes an F4 read as one byte per value (its `get_slice` and pread `get_tensor` fail on one)."""
    path, start, stop = checked.fp4_bytes[name]
    rows, columns = checked.expected[name]
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), stop - start, start)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(rows, columns // 2).view(fp4.PAIRS)


def _fp4_scale(handles: dict, checked: "CheckedCheckpoint", name: str) -> Tensor:
    """An FP4 tensor's scales as their float8_e8m0fnu bytes (`fp4.EXPONENTS`)."""
    scale = scale_name(name, checked.ue8m0)
    return handles[checked.files[scale]].get_slice(scale)[:].view(fp4.EXPONENTS)


@dataclass(frozen=True)
class CheckedCheckpoint:
    args: ModelArgs
    family: Family
    files: dict[str, Path]
    """Each stored tensor's safetensors file."""
    fp8_block: tuple[int, int] | None
    expected: dict[str, tuple[int, ...]]
    """Each tensor of the main layers with its shape."""
    sources: Sources
    """The stored tensors of each graphc parameter."""
    fp4_bytes: dict[str, tuple[Path, int, int]] = dataclasses.field(default_factory=dict)
    """Each FP4 tensor's file and byte range (`_fp4_pairs`)."""
    ue8m0: bool = False
    """FP8 scales named and stored as DeepSeek-V4's releases do (`fp8.UE8M0_SUFFIX`: `_ue8m0_names`)."""


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                      "F8_E8M0": torch.float8_e8m0fnu, "F4": torch.float4_e2m1fn_x2}
"""safetensors' dtype names (an F4 tensor's shape counts values, two to a byte)."""
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F8_E4M3", "F4")
"""What a weight may be stored as (FP8 and FP4 with their block scales)."""
QUANTIZED = {"F8_E4M3": "float8_e4m3fn", "F4": "float4_e2m1 (F4)"}
"""The block-scaled dtypes: their scale tensor is required."""
SUPPORTED_WEIGHTS = ("float32, bfloat16, float16, and float8_e4m3fn (or float4_e2m1, two values a byte: F4, or "
                     "I8 where config.json says expert_dtype fp4) with block scales")
INDEX_DTYPES = ("I64", "I32")
"""What an index table (V4's `tid2eid`) may be stored as."""


def check_checkpoint(checkpoint_dir: Path, draft_layers: int = 0) -> CheckedCheckpoint:
    """Everything the files' headers tell, without reading tensor data: config.json; the tensor
    names (missing, unexpected, scales of no weight); every tensor's dtype and shape; every byte
    range against its file's length (a truncated or corrupt file). `graphc validate` runs it;
    `load_model` starts with it.

    Raises:
        CheckpointError: naming the file, the tensor and what is wrong.
    """
    config = read_hf_config(checkpoint_dir)
    family = family_of_config(config)
    args = family.args_from_hf_config(config)
    family.support.check_loadable(args)
    if draft_layers:  # the served MTP layer's tensors are expected, not skipped
        args = dataclasses.replace(args, draft_layers=draft_layers)
    files = _tensor_files(checkpoint_dir)
    ue8m0 = family.stored.ue8m0_scales or _ue8m0_names(files)
    packs_fp4 = fp4.experts_in_fp4(config)
    block = _fp8_block(checkpoint_dir, config, files, ue8m0)
    stored = {n for n in files if not family.stored.skips(n, args)}
    scales = {n for n in stored if scaled_weight(n, ue8m0) is not None}
    stored -= scales
    if args.tie_word_embeddings:  # a tied head may be stored too; the embedding is what counts
        stored -= {"lm_head.weight", "head.weight"}
    parameters = list(_parameter_shapes(args))
    if family.stored.stored_sources is not None:
        sources, missing, unexpected = family.stored.stored_sources(args, parameters, stored)
    else:
        sources = family.stored.released_sources(args, parameters)
        named = {n for groups in sources.values() for parts in groups for n in parts}
        missing, unexpected = sorted(named - stored), sorted(stored - named)
    weights = {n for groups in sources.values() for parts in groups for n in parts}
    stray_scales = sorted(n for n in scales if scaled_weight(n, ue8m0) not in weights)
    if stray_scales:
        raise CheckpointError(f"{checkpoint_dir}: scale tensor(s) of no expected weight: {_summarise(stray_scales)}")
    if missing:
        raise CheckpointError(f"{checkpoint_dir}: missing tensor(s) {_summarise(missing)}")
    if unexpected:
        raise CheckpointError(f"{checkpoint_dir}: unexpected tensor(s) {_summarise(unexpected)}")
    expected = _expected_shapes(args, sources)
    headers = {path: _header(path) for path in sorted(set(files.values()))}
    fp4_names = set()
    for name, shape in expected.items():
        dtype, stored_shape, _ = headers[files[name]][name]
        if dtype == "I8" and packs_fp4 and family.stored.fp4_quantised.match(name):  # FP4 values, two a byte
            dtype, stored_shape = "F4", [*stored_shape[:-1], 2 * stored_shape[-1]]
        if dtype == "F4":
            fp4_names.add(name)
        if name.endswith(family.stored.index_tensors):
            if dtype not in INDEX_DTYPES:
                raise CheckpointError(f"{files[name].name}: tensor {name} has dtype {SAFETENSORS_DTYPES[dtype]}; "
                                      "supported: int64, int32")
        elif dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{files[name].name}: tensor {name} has dtype {SAFETENSORS_DTYPES[dtype]}; supported: "
                                  f"{SUPPORTED_WEIGHTS}")
        if tuple(stored_shape) != shape:
            raise CheckpointError(f"{files[name].name}: tensor {name} has shape {stored_shape}, expected {list(shape)} "
                                  "from config.json")
        _check_scale(name, shape, dtype, files, headers, block, family, ue8m0)
    fp4_bytes = {name: (files[name], *headers[files[name]][name][2]) for name in sorted(fp4_names)}
    checked = CheckedCheckpoint(args, family, files, block, expected, sources, fp4_bytes, ue8m0)
    _check_index_tables(checked)
    return checked


def _ue8m0_names(files: dict[str, Path]) -> bool:
    """Whether the checkpoint names its scales `X.scale` (DeepSeek-V4-Flash's FP8 as released), not
    `X.weight_scale_inv`: a `.scale` tensor beside its `.weight`."""
    return any(n.endswith(UE8M0_SUFFIX) and scaled_weight(n, True) in files for n in files)


def _check_scale(name: str, shape: tuple[int, ...], dtype: str, files: dict[str, Path], headers: dict,
                 block: tuple[int, int] | None, family: Family, ue8m0: bool) -> None:
    """An FP8 (FP4) weight's scale is present and tiles it; a weight of another dtype has none."""
    scale = scale_name(name, ue8m0)
    if dtype not in QUANTIZED:
        if scale in files:
            raise CheckpointError(f"{files[scale].name}: {scale} scales {name}, which is stored as "
                                  f"{SAFETENSORS_DTYPES[dtype]}, not float8_e4m3fn or float4_e2m1")
        return
    kind = QUANTIZED[dtype]
    if scale not in files or (block is None and dtype != "F4"):
        raise CheckpointError(f"{files[name].name}: tensor {name} is {kind} but {scale} is missing")
    if dtype == "F4" and headers[files[scale]][scale][0] != "F8_E8M0":
        raise CheckpointError(f"{files[scale].name}: {scale} scales the FP4 tensor {name} as "
                              f"{SAFETENSORS_DTYPES[headers[files[scale]][scale][0]]}; FP4 scales are float8_e8m0fnu")
    if len(shape) != 2 or (dtype == "F4" and shape[1] % 2):
        even = " (FP4: of an even column count)" if dtype == "F4" else ""
        raise CheckpointError(f"{files[name].name}: tensor {name} is {kind} of shape {list(shape)}; block "
                              f"scales quantise matrices only{even}")
    per_row = (fp4.BLOCK if dtype == "F4" else
               (1, block[1]) if name.endswith(family.stored.row_sharded_tables) else block)  # a table's rows scale alone
    stored = headers[files[scale]][scale][1]
    wanted = list(scale_grid(shape, per_row))
    if list(stored) != wanted:
        raise CheckpointError(f"{files[scale].name}: {scale}: scales {list(stored)} do not tile a weight of "
                              f"{list(shape)} in {list(per_row)} blocks; expected {wanted}")


def _check_index_tables(checked: CheckedCheckpoint) -> None:
    """Index tables (V4's `tid2eid`: token -> routed experts) name experts 0..E-1 only: any other
    id would read past the experts; and a token's experts are distinct, as a router's top-k are:
    the static grouped GEMM sizes its blocks for K distinct experts a token (`local_rows_bound`),
    and a repeat would overflow them (the only tensor values checked before loading)."""
    experts = checked.args.n_routed_experts
    for name in (n for n in checked.expected if n.endswith(checked.family.stored.index_tensors)):
        with safe_open(checked.files[name], "pt") as f:
            table = f.get_tensor(name)
        bad = table[(table < 0) | (table >= experts)]
        if bad.numel():
            raise CheckpointError(f"{checked.files[name].name}: tensor {name} names expert {int(bad[0])}; expected "
                                  f"routed experts 0..{experts - 1} (n_routed_experts {experts})")
        ordered = table.sort(dim=-1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1).nonzero()
        if repeated.numel():
            token = int(repeated[0])
            raise CheckpointError(f"{checked.files[name].name}: tensor {name} gives token {token} the experts "
                                  f"{table[token].tolist()}, one of them twice; a token's experts must be distinct")


def _header(path: Path) -> dict[str, tuple[str, list[int], tuple[int, int]]]:
    """A safetensors file's tensors (dtype, shape, byte range in the file), each byte range checked
    against the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if length is None or length > size - 8:
            raise CheckpointError(f"{path}: truncated or not a safetensors file (its header does not fit the file)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    data_bytes = size - 8 - length
    tensors = {}
    for name, meta in header.items() if isinstance(header, dict) else [("", None)]:
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
            nbytes = (-(-math.prod(shape) // 2) if dtype == "F4" else
                      math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize)
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if end - begin != nbytes or not 0 <= begin <= end <= data_bytes:
            raise CheckpointError(f"{path}: tensor {name} claims bytes {begin}..{end} of {data_bytes} "
                                  f"({list(shape)} {dtype} is {nbytes} bytes): the file is truncated or corrupt")
        tensors[name] = (dtype, shape, (8 + length + begin, 8 + length + end))
    return tensors


def fp8_tensors(checkpoint_dir: str | Path) -> list[str]:
    """Names of the tensors the checkpoint stores as float8_e4m3fn (reads the headers only)."""
    files = _tensor_files(Path(checkpoint_dir))
    found = []
    for path in sorted(set(files.values())):
        with safe_open(path, "pt") as f:
            found += [n for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3"]
    return sorted(found)


def default_sparse_probabilities(dtype: torch.dtype) -> str:
    """The kernel's bf16-rounded P for a bf16 model; fp32 P (the reference's) otherwise."""
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _fp8_block(checkpoint_dir: Path, config: dict, files: dict[str, Path], ue8m0: bool) -> tuple[int, int] | None:
    """The FP8 scale block shape from config.json, if the checkpoint holds scales."""
    if not any(scaled_weight(n, ue8m0) is not None for n in files):
        return None
    quantization = config.get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    if quantization.get("quant_method") != "fp8" or not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{checkpoint_dir}/config.json: the checkpoint holds FP8 scales "
            f"({UE8M0_SUFFIX if ue8m0 else SCALE_SUFFIX}) but "
            f"quantization_config is {quantization or 'missing'}; expected quant_method 'fp8' and weight_block_size "
            "[rows, cols]")
    return block[0], block[1]


def _read_tensor(handles: dict, checked: CheckedCheckpoint, name: str, shape: tuple[int, ...],
                 rows: slice = slice(None), shard: tuple[int, TensorShard] | None = None) -> Tensor:
    """A stored tensor (its `rows` only: a sharded Engram table; or a tensor-parallel rank's slice
    of split dim `shard[0]`), FP8 dequantised with its scales (the whole scale blocks the slice
    lies in, then the slice of those); FP4 dequantised whole, then sliced."""
    files, fp8_block, family = checked.files, checked.fp8_block, checked.family
    path, scale = files[name], scale_name(name, checked.ue8m0)
    if name in checked.fp4_bytes:
        whole = fp4.dequantize(_fp4_pairs(checked, name), _fp4_scale(handles, checked, name))
        return whole[rows] if shard is None else whole[shard[1].index(shard[0], shape[shard[0]])]
    stored = handles[path].get_slice(name)
    if tuple(stored.get_shape()) != shape:
        raise CheckpointError(
            f"{path.name}: tensor {name} has shape {list(stored.get_shape())}, expected {list(shape)} from config.json"
        )
    fp8 = stored.get_dtype() == "F8_E4M3"
    if shard is not None:
        dim, tp_shard = shard
        if not fp8:
            return stored[tp_shard.index(dim, shape[dim])]
        covering = tp_shard.covering_blocks(dim, shape[dim], fp8_block[dim])
        rows_or_columns = tuple(slice(s.start * fp8_block[d], s.stop * fp8_block[d]) if d == dim else s
                                for d, s in enumerate(covering))
        whole = dequantize(stored[rows_or_columns], handles[files[scale]].get_slice(scale)[covering], fp8_block)
        return whole[tp_shard.within_blocks(dim, shape[dim], fp8_block[dim])]
    tensor = stored[rows]
    if fp8:  # its scale is there and tiles it (`check_checkpoint`)
        block = (1, fp8_block[1]) if name.endswith(family.stored.row_sharded_tables) else fp8_block  # a table's rows scale alone
        return dequantize(tensor, handles[files[scale]].get_slice(scale)[rows], block)
    if tensor.dtype not in SUPPORTED_DTYPES and not name.endswith(family.stored.index_tensors):
        raise CheckpointError(f"{path.name}: tensor {name} has dtype {tensor.dtype}; supported: {SUPPORTED_WEIGHTS}")
    return tensor


def _check_device(model: nn.Module, device: torch.device) -> None:
    wrong = [
        f"{name} on {t.device}"
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != device.type
    ]
    if wrong:
        raise CheckpointError(f"parameters not on {device} after loading: {_summarise(wrong)}")
