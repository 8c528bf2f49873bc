"""Load HF-layout DeepSeek-V3 checkpoints (`config.json` + safetensors) into `DeepseekV3`,
DeepSeek-V4 ones (released or transformers layout, `v4_layout`) into `DeepseekV4`, and DeepSeek-V4.1
ones (released layout, `v41_layout`) into the paged `DeepseekV41` or, by the released names, its
eager reference `DeepseekV41Reference` (`load_reference`).

The on-disk names are the HF / DeepSeek ones. graphc's module uses the same names except the routed
experts, which it stacks in the layout the compiled graphs read: `model.layers.{i}.mlp.experts.{e}.
gate_proj.weight` and `up_proj.weight` for e in 0..E-1 become `model.layers.{i}.mlp.experts.gate_up_proj`
[E, 2I, D] (each expert's gate rows, then its up rows), and `down_proj.weight` becomes `down_proj`
[E, D, I]. FP8 block-quantised weights (DeepSeek's
release format: a float8_e4m3fn `X.weight` with its `X.weight_scale_inv`) are dequantised exactly
on load (models/fp8.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from graphc.errors import CheckpointError
from graphc.models.args import ModelArgs, model_args_from_hf_config, read_hf_config
from graphc.models import deepseek_v4, v41_layout, v4_layout
from graphc.models.deepseek_v3 import FP32_SUFFIXES, DeepseekV3, RotaryEmbedding
from graphc.models.deepseek_v41 import DeepseekV41
from graphc.models.deepseek_v41_reference import DeepseekV41Reference
from graphc.models.deepseek_v4 import DeepseekV4
from graphc.models.engram import NgramHash
from graphc.models.fp8 import FP8, SCALE_SUFFIX, UE8M0_SUFFIX, dequantize, scale_name, scaled_weight
from graphc.models.v41_args import V41Args
from graphc.models.v4_args import V4Args
from graphc.topology import Topology

STACKED_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
EXPERT_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Each stacked expert parameter's checkpoint projections, concatenated along rows in this order."""
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Args = ModelArgs | V4Args | V41Args
Model = DeepseekV3 | DeepseekV4 | DeepseekV41
V41_FP32 = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|attn_sink|norm\.weight|gate\.bias|^head\.weight|"
                      r"compressor\.wgate\.weight)$")
"""DeepSeek-V4.1 parameters held in fp32 whatever the model dtype, as its inference code holds them
(and the compressor projections of layers pooling 2 or more tokens: `keeps_fp32`)."""
ENGRAM_TABLE = "engram.embed.weight"
OUTSIDE_TEXT_MODEL = re.compile(r"^(vision|aligner)\.|^image_(start|end|newline)$|\.ffn\.gate\.bias_vl$")
"""DeepSeek-V4.1's vision path (its tower, image markers, the routers' image-token biases): a
text-only loader skips them."""
Sources = dict[str, list[list[str]]]
"""Per graphc parameter, the stored tensors that make it: one list per routed expert (its
projections, concatenated along rows) for a stacked parameter stored per expert, else one list of
one tensor (for a stacked parameter stored stacked, as transformers' V4 layout may: this rank's
experts are rows of it)."""


def load_model_args(checkpoint_dir: Path) -> Args:
    return model_args_from_hf_config(read_hf_config(checkpoint_dir))


def build_model(args: Args, local_experts: int | None = None, sparse_probabilities: str = "fp32") -> Model:
    """The module of `args`'s architecture (weights uninitialised; build it under a meta device)."""
    if isinstance(args, V41Args):
        return DeepseekV41(args, local_experts)
    if isinstance(args, V4Args):
        return DeepseekV4(args, local_experts)
    return DeepseekV3(args, local_experts, sparse_probabilities)


def _parameter_shapes(args: Args) -> dict[str, tuple[int, ...]]:
    """Every graphc parameter (and persistent buffer) of the whole model, with its shape."""
    with torch.device("meta"):
        model = build_model(args)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (name == "lm_head.weight" and args.tie_word_embeddings)}


def hf_tensor_names(graphc_name: str, experts: int | range) -> list[str]:
    """The HF-layout DeepSeek-V3 tensor(s) that make up one graphc parameter, in stacking order
    (`experts`: how many routed experts, or which ones)."""
    stacked = STACKED_EXPERT.match(graphc_name)
    if stacked:
        prefix, fused = stacked.groups()
        return [f"{prefix}.{e}.{proj}.weight" for e in (range(experts) if isinstance(experts, int) else experts)
                for proj in EXPERT_PROJECTIONS[fused]]
    return [graphc_name]


def _v3_sources(args: ModelArgs) -> Sources:
    sources = {}
    for name in _parameter_shapes(args):
        if STACKED_EXPERT.match(name):
            parts = len(EXPERT_PROJECTIONS[STACKED_EXPERT.match(name).group(2)])
            names = hf_tensor_names(name, args.n_routed_experts)
            sources[name] = [names[i:i + parts] for i in range(0, len(names), parts)]
        else:
            sources[name] = [[name]]
    return sources


def _stored_per_expert(name: str, groups: list[list[str]]) -> bool:
    """Whether parameter `name` is a stacked expert parameter stored one tensor (or more) per expert."""
    return bool(STACKED_EXPERT.match(name)) and not STACKED_EXPERT.match(v4_layout.graphc_name(groups[0][0]))


def _expected_shapes(args: Args, sources: Sources) -> dict[str, tuple[int, ...]]:
    """The shape each stored source of a parameter must have."""
    expected = {}
    for name, shape in _parameter_shapes(args).items():
        groups = sources.get(name, [])
        if groups and _stored_per_expert(name, groups):
            expected.update({n: (shape[1] // len(parts), shape[2]) for parts in groups for n in parts})
        else:
            expected.update({n: shape for parts in groups for n in parts})
    return expected


def expected_tensors(args: Args) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `args` holds for the main layers, with its shape: DeepSeek-V3's
    HF layout, DeepSeek-V4's and V4.1's released ones (what graphc's tiny checkpoints are written in)."""
    if isinstance(args, ModelArgs):
        return _expected_shapes(args, _v3_sources(args))
    if isinstance(args, V41Args):
        return _expected_shapes(args, v41_layout.sources(list(_parameter_shapes(args)), args.n_routed_experts))
    sources = {}
    for name in _parameter_shapes(args):
        stacked = STACKED_EXPERT.match(name)
        if stacked:
            sources[name] = v4_layout.released_expert_weights(*stacked.groups(), args.n_routed_experts)
        else:
            sources[name] = [[v4_layout.released_name(name)]]
    return _expected_shapes(args, sources)


def is_multi_token_prediction(name: str, args: Args) -> bool:
    """MTP modules are stored as layers num_hidden_layers .. num_hidden_layers + n - 1 (V3), or
    under `mtp.` (V4, V4.1)."""
    if isinstance(args, (V4Args, V41Args)):
        return bool(v4_layout.MULTI_TOKEN_PREDICTION.search(name))
    layer = LAYER_INDEX.match(name)
    return bool(layer) and args.num_hidden_layers <= int(layer.group(1)) < (
        args.num_hidden_layers + args.num_nextn_predict_layers
    )


def keeps_fp32(name: str, args: Args) -> bool:
    """Whether parameter `name` stays fp32 whatever the model dtype."""
    if isinstance(args, V41Args):  # by the released name: the reference's, or the paged model's mapped back
        name = v41_layout.released_name(name)
        layer = LAYER_INDEX.match("model." + name)
        pools = bool(layer) and args.compress_ratios[int(layer.group(1))] > 1
        return bool(V41_FP32.search(name)) or (pools and name.endswith("compressor.wkv.weight"))
    return name.endswith(deepseek_v4.FP32_SUFFIXES if isinstance(args, V4Args) else FP32_SUFFIXES)


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


def _summarise(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def load_expert_shard(checkpoint_dir: Path, topology: Topology, rank: int, dtype: torch.dtype,
                      sparse_probabilities: str | None = None) -> Model:
    """The model of `rank`'s expert-parallel shard: the module holding its routed experts (all of
    them when ep = 1); ranks with the same `topology.ep_rank` hold the same shard."""
    experts = topology.experts(topology.ep_rank(rank), load_model_args(checkpoint_dir).n_routed_experts)
    return load_model(checkpoint_dir, dtype=dtype, experts=experts, sparse_probabilities=sparse_probabilities)


def load_model(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               experts: range | None = None, sparse_probabilities: str | None = None) -> Model:
    """Build `DeepseekV3` (or `DeepseekV4`, or the paged `DeepseekV41`) from a checkpoint.

    Args:
        checkpoint_dir: directory with config.json and model.safetensors (or a sharded index).
        dtype: parameter dtype; the router stays fp32.
        device: where the parameters go; every tensor is checked to be there afterwards.
        experts: the routed experts to load (an expert-parallel rank's share); all by default.
        sparse_probabilities: P's precision in sparse attention (V3.2 only): "bf16" as FlashMLA's
            kernel, "fp32" as the reference; by default "bf16" for a bfloat16 model, else "fp32".

    Raises:
        CheckpointError: unsupported architecture, missing/unexpected tensor, wrong shape or dtype.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if torch.device(device).type == "meta":
        raise CheckpointError("device 'meta' holds no data; load onto a real device (e.g. 'cpu')")
    if dtype not in SUPPORTED_DTYPES:
        raise CheckpointError(f"dtype {dtype} is not supported; supported: float32, bfloat16, float16")
    checked = check_checkpoint(checkpoint_dir)
    args, files, block, expected, sources = (checked.args, checked.files, checked.fp8_block, checked.expected,
                                             checked.sources)

    experts = experts if experts is not None else range(args.n_routed_experts)
    if experts.start < 0 or experts.stop > args.n_routed_experts or not len(experts):
        raise CheckpointError(f"experts {experts} are not a share of the checkpoint's {args.n_routed_experts}")
    with torch.device("meta"):
        model = build_model(args, len(experts), sparse_probabilities or default_sparse_probabilities(dtype))
    state: dict[str, Tensor] = {}
    with contextlib.ExitStack() as stack:
        # pread, not a mapping: the tensors are copied anyway, and a mapped checkpoint's touched
        # pages would count in this process's resident memory on top of the copies (measured: a
        # cp=ep=4 compile of the 1 B model peaked at 2.27x a rank's weights with the mapping).
        handles = {path: stack.enter_context(safe_open(path, "pt", backend="pread"))
                   for path in sorted(set(files.values()))}
        for name in model.state_dict():
            if name == "lm_head.weight" and args.tie_word_embeddings:
                continue
            target = (torch.int64 if name.endswith(v4_layout.INDEX_TENSORS) else
                      torch.float32 if keeps_fp32(name, args) else dtype)

            def read(stored: str, dtype: torch.dtype = target) -> Tensor:
                return _read_tensor(handles, files, stored, expected[stored], block, checked.ue8m0).to(device=device,
                                                                                                      dtype=dtype)

            groups = sources[name]
            if name.endswith(ENGRAM_TABLE) and len(experts) < args.n_routed_experts:
                state[name] = _table_rows(handles, checked, groups[0][0], experts).to(device=device, dtype=target)
            elif _stored_per_expert(name, groups):
                state[name] = torch.stack([torch.cat([read(n) for n in groups[e]]) for e in experts])
            elif STACKED_EXPERT.match(name):  # stored stacked: this rank's rows
                state[name] = read(groups[0][0])[experts.start:experts.stop]
            else:
                state[name] = read(groups[0][0])
    if args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    for module in model.modules():  # buffers built from the config on the CPU, not in the state dict
        if isinstance(module, (RotaryEmbedding, NgramHash)):
            module.to(device)
    _check_device(model, torch.device(device))
    return model.requires_grad_(False).eval()  # inference only: no autograd bookkeeping


def _table_rows(handles: dict, checked: "CheckedCheckpoint", name: str, experts: range) -> Tensor:
    """An Engram table's rows that this expert shard holds (read alone: tables are the largest
    tensors of V4.1): shard s of ep holds rows [s R, (s + 1) R), R = ceil(rows / ep), zero past
    the table's end (`engram`)."""
    shards = checked.args.n_routed_experts // len(experts)  # experts are a contiguous, even share
    shard = experts.start // len(experts)
    shape = checked.expected[name]
    held = -(-shape[0] // shards)
    part = _read_tensor(handles, checked.files, name, shape, checked.fp8_block, checked.ue8m0,
                        slice(shard * held, min((shard + 1) * held, shape[0])))
    return torch.nn.functional.pad(part, (0, 0, 0, held - part.shape[0]))


def load_reference(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32) -> DeepseekV41Reference:
    """DeepSeek-V4.1's eager reference (`deepseek_v41_reference`) from a checkpoint, on the CPU,
    checked as `load_model` checks it."""
    checked = check_checkpoint(Path(checkpoint_dir))
    if not isinstance(checked.args, V41Args):
        raise CheckpointError(f"{checkpoint_dir}: {checked.args.architecture} has no graphc reference model; "
                              "transformers implements it")
    with torch.device("meta"):
        model = DeepseekV41Reference(checked.args)
    state = {}
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, "pt", backend="pread"))
                   for path in sorted(set(checked.files.values()))}
        for name, parameter in model.state_dict().items():
            tensor = _read_tensor(handles, checked.files, name, tuple(parameter.shape), checked.fp8_block,
                                  checked.ue8m0)
            state[name] = tensor.to(torch.float32 if keeps_fp32(name, checked.args) else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


@dataclass(frozen=True)
class CheckedCheckpoint:
    args: Args
    files: dict[str, Path]
    """Each stored tensor's safetensors file."""
    fp8_block: tuple[int, int] | None
    expected: dict[str, tuple[int, ...]]
    """Each tensor of the main layers with its shape."""
    sources: Sources
    """The stored tensors of each graphc parameter."""
    ue8m0: bool = False
    """FP8 scales named and stored as DeepSeek-V4.1's (`fp8.UE8M0_SUFFIX`)."""


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                      "F8_E8M0": torch.float8_e8m0fnu}
"""safetensors' dtype names."""
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F8_E4M3")
"""What a weight may be stored as (FP8 with its block scales)."""
INDEX_DTYPES = ("I64", "I32")
"""What an index table (V4's `tid2eid`) may be stored as."""


def check_checkpoint(checkpoint_dir: Path) -> CheckedCheckpoint:
    """Everything the files' headers tell, without reading tensor data: config.json; the tensor
    names (missing, unexpected, scales of no weight); every tensor's dtype and shape; every byte
    range against its file's length (a truncated or corrupt file). `graphc validate` runs it;
    `load_model` starts with it.

    Raises:
        CheckpointError: naming the file, the tensor and what is wrong.
    """
    args = load_model_args(checkpoint_dir)
    files = _tensor_files(checkpoint_dir)
    ue8m0 = isinstance(args, V41Args)  # V4.1's scale names
    block = _fp8_block(checkpoint_dir, files, ue8m0)
    stored = {n for n in files if not is_multi_token_prediction(n, args)}
    scales = {n for n in stored if scaled_weight(n, ue8m0) is not None}
    stored -= scales
    if args.tie_word_embeddings:  # a tied head may be stored too; the embedding is what counts
        stored -= {"lm_head.weight", "head.weight"}
    if isinstance(args, V41Args):
        stored = {n for n in stored if not OUTSIDE_TEXT_MODEL.search(n)}
        sources = v41_layout.sources(list(_parameter_shapes(args)), args.n_routed_experts)
        named = {n for groups in sources.values() for parts in groups for n in parts}
        missing, unexpected = sorted(named - stored), sorted(stored - named)
    elif isinstance(args, V4Args):
        sources, missing = v4_layout.parameter_sources(stored, args.n_routed_experts)
        params = _parameter_shapes(args)
        missing += [v4_layout.released_name(n) for n in params if n not in sources]
        unexpected = sorted(n for target, groups in sources.items() if target not in params for parts in groups
                            for n in parts)
        sources = {name: groups for name, groups in sources.items() if name in params}
    else:
        sources = _v3_sources(args)
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
    for name, shape in expected.items():
        dtype, stored_shape = headers[files[name]][name]
        if name.endswith(v4_layout.INDEX_TENSORS):
            if dtype not in INDEX_DTYPES:
                raise CheckpointError(f"{files[name].name}: tensor {name} has dtype {SAFETENSORS_DTYPES[dtype]}; "
                                      "supported: int64, int32")
        elif dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{files[name].name}: tensor {name} has dtype {SAFETENSORS_DTYPES[dtype]}; supported: "
                                  "float32, bfloat16, float16, and float8_e4m3fn with block scales")
        if tuple(stored_shape) != shape:
            raise CheckpointError(f"{files[name].name}: tensor {name} has shape {stored_shape}, expected {list(shape)} "
                                  "from config.json")
    return CheckedCheckpoint(args, files, block, expected, sources, ue8m0)


def _header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """A safetensors file's tensors (dtype, shape), each byte range checked against the file."""
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
            nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if end - begin != nbytes or not 0 <= begin <= end <= data_bytes:
            raise CheckpointError(f"{path}: tensor {name} claims bytes {begin}..{end} of {data_bytes} "
                                  f"({list(shape)} {dtype} is {nbytes} bytes): the file is truncated or corrupt")
        tensors[name] = (dtype, shape)
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


def _fp8_block(checkpoint_dir: Path, files: dict[str, Path], ue8m0: bool) -> tuple[int, int] | None:
    """The FP8 scale block shape from config.json, if the checkpoint holds scales."""
    if not any(scaled_weight(n, ue8m0) is not None for n in files):
        return None
    quantization = read_hf_config(checkpoint_dir).get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    if quantization.get("quant_method") != "fp8" or not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{checkpoint_dir}/config.json: the checkpoint holds FP8 scales "
            f"({UE8M0_SUFFIX if ue8m0 else SCALE_SUFFIX}) but "
            f"quantization_config is {quantization or 'missing'}; expected quant_method 'fp8' and weight_block_size "
            "[rows, cols]")
    return block[0], block[1]


def _read_tensor(handles: dict, files: dict[str, Path], name: str, shape: tuple[int, ...],
                 fp8_block: tuple[int, int] | None, ue8m0: bool = False, rows: slice = slice(None)) -> Tensor:
    """A stored tensor (its `rows` only: a sharded Engram table), FP8 dequantised with its scales."""
    path, scale = files[name], scale_name(name, ue8m0)
    stored = handles[path].get_slice(name)
    if tuple(stored.get_shape()) != shape:
        raise CheckpointError(
            f"{path.name}: tensor {name} has shape {list(stored.get_shape())}, expected {list(shape)} from config.json"
        )
    tensor = stored[rows]
    if tensor.dtype == FP8:
        if scale not in files or fp8_block is None:
            raise CheckpointError(f"{path.name}: tensor {name} is float8_e4m3fn but {scale} is missing")
        block = (1, fp8_block[1]) if name.endswith(ENGRAM_TABLE) else fp8_block  # a table's rows scale alone
        try:
            return dequantize(tensor, handles[files[scale]].get_slice(scale)[rows], block)
        except ValueError as e:
            raise CheckpointError(f"{files[scale].name}: {scale}: {e}") from None
    if scale in files:
        raise CheckpointError(f"{path.name}: {scale} scales {name}, which is stored as {tensor.dtype}, "
                              "not float8_e4m3fn")
    if tensor.dtype not in SUPPORTED_DTYPES and not name.endswith(v4_layout.INDEX_TENSORS):
        raise CheckpointError(f"{path.name}: tensor {name} has dtype {tensor.dtype}; supported: float32, bfloat16, "
                              "float16, and float8_e4m3fn with block scales")
    return tensor


def _check_device(model: Model, device: torch.device) -> None:
    wrong = [
        f"{name} on {t.device}"
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != device.type
    ]
    if wrong:
        raise CheckpointError(f"parameters not on {device} after loading: {_summarise(wrong)}")
