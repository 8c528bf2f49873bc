"""`graphc plan --device`: what one rank holds and reads on a Trainium device, before any capture.

Arithmetic on the config, config.json and the family's module built on the meta device (shapes,
no data), so it runs on a config.json alone (a released model's). Per rank:

- `weights_bytes`, by dtype: the rank's share of every tensor its graphs take (the routed experts
  of its EP shard, a row-sharded table's rows), each in the dtype the artifacts store it
  (`models/abstract.stored_tensors`: FP8 plus fp32 block scales where `model.weights` is
  as-stored and the release quantises the tensor). Tests hold it to loaded shards tensor by tensor.
- `kv_bytes`: the configured pool (`kv_cache.num_blocks`), and `kv_tokens_fit`: the tokens of KV
  the memory left after weights and activations holds (per rank; a replica holds cp times as many,
  its sequences' blocks being spread over its cp ranks; its tp ranks hold the same blocks, MLA's
  latent being every head's).
- `activation_bytes`: the largest bucket's peak. Given the artifacts compiled from the config
  (`graphc plan --artifacts`, neuron), the largest temporaries of XLA's buffer assignment of a
  program (`backends/xla/memory.py`: every value between its inputs and outputs, the gathered keys
  and dequantised weights included; bf16 programs overstated by XLA:CPU's fp32 copies of the
  operands of its dots). Before any lowering an estimate, which is low: its tokens through the
  widest projection and the routed experts' rows, four hidden vectors a token, attention's fp32
  scores over the block table's slots, and the fp32 logits (a tiny V3: 0.40 MB estimated, 3.43 MB
  assigned).
- per decode bucket, on the busiest rank: `step_bytes` read from HBM (every weight but the routed
  experts, the embedding and the row-sharded tables (V4.1's Engram: a few rows a token, not
  counted), one embedding row a token, the routed experts the step's routes reach
  under uniform routing and in the worst case, every cached value of each row's context at the
  context limit: an upper bound for sparse attention) and the roofline `step_ms` / tok/s at the
  device's bandwidth; its collective bytes beside it (over links, not HBM: not in the roofline).
  With speculative decoding (k drafts, `models/speculation.py`) a decode step is the [B, 1 + k]
  verify bucket: the main layers over B (1 + k) tokens, then the MTP layer (its weights and the
  LM head read again each time) over the same tokens and k - 1 times over B; it yields from B
  tokens (no draft accepted) to B (1 + k) (every one): `tokens_per_second` and
  `tokens_per_second_accepted`. The MTP layer's later passes re-read its own KV: one layer's of
  the cache, not counted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from graphc.artifacts.manifest import Manifest
from graphc.backends import backend
from graphc.buckets.selection import Bucket, chunk_lengths, max_prefill_chunk, smallest_fitting
from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.weights import fp4
from graphc.weights.abstract import StoredTensor, released_fp8_block
from graphc.models.layers import STACKED_EXPERT
from graphc.models.registry import family_of
from graphc.models.step_model import ModelArgs
from graphc.perf.device import DeviceModel, Sourced, load_device, shipped
from graphc.perf.step_time import StepTime, step_time
from graphc.perf.work import EMBEDDING, HEAD, config_work, draft_tensor_names, rank_tensors
from graphc.step import blocks_per_row, kv_pool_shape
from graphc.tools.plan import draft_passes, format_bytes as size, step_collectives

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One rank of a Trainium instance: the unit graphc shards over."""

    name: str
    memory_bytes: int
    bandwidth: float
    """HBM bytes/s."""
    describes: str
    """The chip and instance behind the numbers (the device file cites its pages)."""
    model: DeviceModel | None = None
    """The device's file, for the step model (None: a custom device of memory and bandwidth alone)."""


def _from_model(model: DeviceModel) -> Device:
    return Device(model.name, int(model.memory.value), model.hbm.value, model.describes, model)


DEVICES = {name: _from_model(load_device(name)) for name in shipped()}
"""Per rank, before the runtime's own reservation (not modelled): the files graphc ships (`perf/devices`)."""


def device(name: str | None, memory_gib: float | None = None, bandwidth_gbs: float | None = None,
           device_file: Path | None = None) -> Device:
    """A shipped device, a device file, or a custom one (`--device-memory` GiB, `--device-bandwidth`
    GB/s, which also override a named device's or a file's figures: the step model then reads
    the overridden bandwidth)."""
    if name is not None and device_file is not None:
        raise GraphcError("--device and --device-file: pass one")
    if name is not None and name not in DEVICES:
        raise GraphcError(f"--device {name!r}: unknown device; devices: {', '.join(DEVICES)} (or --device-file F, "
                          "or --device-memory and --device-bandwidth for another)")
    for flag, value in (("--device-memory", memory_gib), ("--device-bandwidth", bandwidth_gbs)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise GraphcError(f"{flag} {value}: must be a positive number")
    if name is None and device_file is None:
        if memory_gib is None or bandwidth_gbs is None:
            raise GraphcError("a custom device needs both --device-memory (GiB) and --device-bandwidth (GB/s); "
                              f"or --device {' | '.join(DEVICES)}, or --device-file F")
        return Device("custom", int(memory_gib * GiB), bandwidth_gbs * 1e9, "custom")
    model = load_device(path=device_file) if device_file is not None else DEVICES[name].model
    if memory_gib is not None:
        model = dataclasses.replace(model, memory=Sourced(memory_gib * GiB, "assumed", "--device-memory"))
    if bandwidth_gbs is not None:
        model = dataclasses.replace(model, hbm=Sourced(bandwidth_gbs * 1e9, "assumed", "--device-bandwidth"))
    return _from_model(model)


def _dtype_name(dtype: torch.dtype) -> str:
    """The stored format's name (FP4 weights are held as bytes of two values: `fp4.PAIRS`)."""
    return "float4_e2m1" if dtype == fp4.PAIRS else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DecodeStep:
    bucket: str
    rows: int
    weights_read: int
    """Every weight but the routed experts and the embedding, plus one embedding row a token."""
    experts_expected: float
    """Routed experts' bytes the step's routes reach on the busiest rank, uniform routing."""
    experts_worst: float
    """The same when every route lands on a different local expert."""
    kv_read: int
    collective_bytes: int
    step_bytes: float
    """weights_read + experts_expected + kv_read."""
    step_ms: float
    tokens_per_second: float
    step_ms_worst: float
    tokens_per_second_accepted: float | None = None
    """Speculative decoding: tok/s when every draft is accepted (`tokens_per_second`: none)."""


@dataclass(frozen=True)
class DevicePlan:
    device: str
    device_bytes: int
    bandwidth: float
    weights_bytes: dict[str, int]
    """By dtype ("float8_e4m3fn" and "float4_e2m1" with their scales)."""
    kv_bytes: int
    kv_tokens_fit: int
    activation_bytes: int
    activation_source: str
    """"estimate", or where the figure was measured (the artifacts' buffer assignment)."""
    total_bytes: int
    fits: bool
    reason: str
    decode: list[DecodeStep]
    cp: int
    """The KV shards of a replica: it holds cp times a rank's `kv_tokens_fit` (its tp ranks share them)."""
    steps: list[StepTime]
    """Every bucket's predicted step on the busiest rank (`perf.step_time`); none for a custom device."""
    ttft_ms: dict[int, float]
    """Predicted time to first token by prompt length: its chunks' prefill steps (`ttft`)."""
    constants: dict[str, Sourced]
    """The step model's constants by the device file's keys, each with its provenance and source."""

    def to_json(self) -> dict:
        out = {**asdict(self), "weights_total_bytes": sum(self.weights_bytes.values())}
        out["steps"] = [s.to_json() for s in self.steps]
        return out


def _dtype_bytes(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def activation_bytes(config: GraphcConfig, args: ModelArgs, tensors: list[StoredTensor]) -> int:
    """The estimate of the module docstring for the largest bucket (`tensors`: the rank's)."""
    b = config.buckets
    slots = blocks_per_row(b.context_limit, config.kv_cache.block_size) * config.kv_cache.block_size
    width = _dtype_bytes(config.model.dtype)
    topology = config.topology
    widest = max((t.shape[-2] for t in tensors if len(t.shape) >= 2 and "embed" not in t.name and t.name != HEAD),
                 default=args.hidden_size)
    heads = getattr(args, "num_attention_heads", 1) // topology.tp
    peak = 0
    for bucket in config.compiled_buckets:
        tokens = bucket.rows * bucket.width
        routed = tokens * args.num_experts_per_tok * 2 * args.moe_intermediate_size
        per_step = (width * (tokens * (4 * args.hidden_size + widest) + routed) + 4 * tokens * heads * slots
                    + 8 * bucket.head_rows(config.draft_tokens) * args.vocab_size)
        peak = max(peak, per_step)
    return peak


@dataclass(frozen=True)
class MeasuredActivations:
    """The largest temporaries of the buffer assignments of a compile's programs."""

    bytes: int
    source: str


def check_compiled_from(config: GraphcConfig, artifacts: Path) -> Manifest:
    """The artifacts' manifest, once they are shown to be the config's compile: same architecture,
    dtype, topology, buckets and KV pool.

    Raises:
        GraphcError: they were compiled from another config (naming the first field that differs).
    """
    from graphc.artifacts.directory import read_manifest

    manifest = read_manifest(artifacts)
    b, kv, topology = config.buckets, config.kv_cache, config.topology
    expected = {
        "model.dtype": (manifest.model.dtype, config.model.dtype),
        "model.architecture": (manifest.model.architecture, config.model_args.architecture),
        "topology": ((manifest.topology.cp, manifest.topology.ep, manifest.topology.dp, manifest.topology.tp),
                     (topology.cp, topology.ep, topology.dp, topology.tp)),
        "buckets.prefill": (manifest.buckets.prefill, list(b.prefill)),
        "buckets.decode": (manifest.buckets.decode, list(b.decode)),
        "buckets.prompt_as_decode": (manifest.buckets.prompt_as_decode, b.prompt_as_decode),
        "buckets.context_limit": (manifest.buckets.context_limit, b.context_limit),
        "draft_tokens": (manifest.buckets.draft_tokens, config.draft_tokens),
        "kv_cache": ((manifest.kv_cache.block_size, manifest.kv_cache.num_blocks), (kv.block_size, kv.num_blocks)),
    }
    for field, (compiled, configured) in expected.items():
        if compiled != configured:
            raise GraphcError(f"{str(artifacts)!r}: compiled with {field} {compiled}, the config has "
                              f"{configured}; compile this config (graphc compile) first")
    return manifest


def measured_activations(config: GraphcConfig, artifacts: Path) -> MeasuredActivations:
    """The artifacts' largest program temporaries (`Backend.memory`), once they are shown to be
    the config's compile (`check_compiled_from`).

    Raises:
        GraphcError: they were compiled from another config, or their backend has no buffer
            assignment to read.
    """
    try:
        manifest = check_compiled_from(config, artifacts)
    except GraphcError as e:
        raise GraphcError(f"--artifacts {e}") from None
    programs = backend(manifest.backend).memory(artifacts, manifest)
    return MeasuredActivations(max(p.temporaries for p in programs.values()),
                               f"buffer assignment of {artifacts}'s largest program ({manifest.backend})")


def plan_device(config: GraphcConfig, target: Device, measured: MeasuredActivations | None = None) -> DevicePlan:
    args = config.model_args
    topology = config.topology
    kv = config.kv_cache
    tensors, draft = rank_tensors(config), draft_tensor_names(config)
    steps = [step_time(w, target.model) for w in config_work(config, target.model)] if target.model else []
    by_dtype: dict[str, int] = {}
    for t in tensors:
        by_dtype[_dtype_name(t.dtype)] = by_dtype.get(_dtype_name(t.dtype), 0) + t.nbytes
    weights = sum(by_dtype.values())
    width = _dtype_bytes(config.model.dtype)
    per_token = args.cache_layers * args.kv_cache_dim * width
    pool = math.prod(kv_pool_shape(args.cache_layers, kv.num_blocks, kv.block_size, args.kv_cache_dim)) * width
    activations = measured.bytes if measured else activation_bytes(config, args, tensors)
    left = target.memory_bytes - weights - activations
    total = weights + pool + activations
    if weights > target.memory_bytes:
        experts = sum(t.nbytes for t in tensors if STACKED_EXPERT.match(t.name))
        reason = (f"the rank's weights alone ({size(weights)}: {size(experts)} of its routed experts, "
                  f"{size(weights - experts)} that every rank holds whole) exceed the device's {size(target.memory_bytes)}")
        if config.model.weights == "dequantized" and released_fp8_block(config.model.checkpoint):
            reason += "; keep the FP8 weights as stored (model.weights: as-stored)"
    elif total > target.memory_bytes:
        reason = (f"weights {size(weights)} + KV pool {size(pool)} + activations {size(activations)} "
                  f"exceed the device's {size(target.memory_bytes)}; the pool fits "
                  f"{max(0, left) // per_token} tokens (kv_cache.num_blocks <= "
                  f"{max(0, left) // (per_token * kv.block_size)})")
    else:
        reason = f"{size(target.memory_bytes - total)} to spare"
    return DevicePlan(target.name, target.memory_bytes, target.bandwidth, by_dtype, pool, max(0, left) // per_token,
                      activations, measured.source if measured else "estimate", total,
                      total <= target.memory_bytes, reason,
                      [_decode_step(config, args, topology, tensors, target, size, per_token, draft)
                       for size in config.buckets.decode], topology.cp,
                      steps, {n: ttft(config, steps, n) * 1e3 for n in _ttft_prompts(config)} if steps else {},
                      target.model.sourced() if target.model else {})


def ttft(config: GraphcConfig, steps: list[StepTime], prompt: int) -> float:
    """Seconds to a `prompt`-token prompt's first token: the runtime's prefill chunks of it, each
    padded into the smallest prefill bucket that holds it (the first token is sampled at the last)."""
    b = config.buckets
    by_bucket = {t.bucket: t.step for t in steps}
    chunks = chunk_lengths(prompt, max_prefill_chunk(b.prefill, config.runtime.max_num_prefilling_tokens))
    return sum(by_bucket[Bucket("prefill", smallest_fitting(sorted(b.prefill), n)).name] for n in chunks)


def _ttft_prompts(config: GraphcConfig) -> list[int]:
    """A prompt of one full chunk, and one of half the context."""
    b = config.buckets
    return sorted({max_prefill_chunk(b.prefill, config.runtime.max_num_prefilling_tokens), b.context_limit // 2})


def _decode_step(config, args, topology, tensors, target: Device, rows: int, per_token: int,
                 draft: set[str]) -> DecodeStep:
    family, k = family_of(args), config.draft_tokens
    experts = [t for t in tensors if STACKED_EXPERT.match(t.name)]
    expert_bytes = sum(t.nbytes for t in experts if t.name not in draft)
    draft_experts = sum(t.nbytes for t in experts if t.name in draft)
    embedding = sum(t.nbytes for t in tensors if t.name == EMBEDDING)
    head = sum(t.nbytes for t in tensors if t.name == HEAD) or embedding  # tied: the embedding is the head
    tables = sum(t.nbytes for t in tensors if t.name.endswith(family.stored.row_sharded_tables))
    draft_others = sum(t.nbytes for t in tensors if t.name in draft) - draft_experts
    others = sum(t.nbytes for t in tensors) - expert_bytes - draft_experts - embedding - tables - draft_others
    replicas = 1 if topology.tokens_replicated else max(1, topology.ep // topology.replica)

    def routed(tokens: int, layers: ModelArgs, layer_bytes: float) -> tuple[float, float]:
        """(expected, worst) bytes of the local experts `tokens`' routes reach in the MoE layers
        of `layers` (the main model's, or its draft layers' as a model)."""
        moe_layers = layers.num_hidden_layers - layers.first_k_dense_replace
        local = layers.n_routed_experts // topology.ep
        per_expert = layer_bytes / (moe_layers * local) if moe_layers and local else 0
        routes = tokens * layers.num_experts_per_tok * replicas
        # Uniform routing: each local expert is missed by all `routes` with probability (1 - 1/E)^routes.
        return (local * (1 - (1 - 1 / layers.n_routed_experts) ** routes) * per_expert * moe_layers,
                min(local, routes) * per_expert * moe_layers)

    tokens = rows * (1 + k)
    read = others + embedding // args.vocab_size * tokens
    expected, worst = routed(tokens, args, expert_bytes)
    for passed, _ in draft_passes(args, tokens, rows, k) if k else []:  # the draft layers' passes, each with the head
        read += draft_others + head + embedding // args.vocab_size * passed
        expected, worst = (a + b for a, b in zip((expected, worst), routed(passed, family.drafter.layer(args),
                                                                           draft_experts)))
    context = blocks_per_row(config.buckets.context_limit, config.kv_cache.block_size) * config.kv_cache.block_size
    kv_read = rows * math.ceil(context / topology.cp) * per_token
    exchange, _ = backend(config.backend).exchange(config.model.moe_lowering, topology)
    bucket = Bucket("decode", rows, 1 + k) if k else Bucket("decode", rows)
    collectives = sum(c.count * c.bytes_in for c in step_collectives(args, topology, bucket, config.model.dtype,
                                                                      exchange, context, config.kv_cache.block_size,
                                                                      k))
    step = read + expected + kv_read
    seconds = step / target.bandwidth
    return DecodeStep(bucket.name, rows, read, expected, worst, kv_read, collectives, step, seconds * 1e3,
                      rows / seconds, (read + worst + kv_read) / target.bandwidth * 1e3,
                      tokens / seconds if k else None)


def describe(plan: DevicePlan) -> list[str]:
    speculative = any(d.tokens_per_second_accepted is not None for d in plan.decode)
    lines = [f"per rank on {plan.device} ({size(plan.device_bytes)}, {plan.bandwidth / 1e9:.0f} GB/s):",
             "  weights     " + ", ".join(f"{dtype} {size(n)}" for dtype, n in plan.weights_bytes.items())
             + f"  (total {size(sum(plan.weights_bytes.values()))})",
             f"  KV pool     {size(plan.kv_bytes)} (kv_cache.num_blocks); the memory left holds "
             f"{plan.kv_tokens_fit} tokens of KV ({plan.kv_tokens_fit * plan.cp} a replica over its cp ranks)",
             f"  activations {size(plan.activation_bytes)} (the largest bucket: {plan.activation_source})",
             f"  total       {size(plan.total_bytes)} of {size(plan.device_bytes)}: "
             + ("fits" if plan.fits else "does not fit") + f" ({plan.reason})",
             "decode steps on the busiest rank (HBM roofline; collectives over links, not included)"
             + (": verify steps of the drafts, tok/s with none accepted and with all" if speculative else ":"),
             f"  {'bucket':10s} {'weights':>10s} {'experts':>10s} {'(worst)':>10s} {'KV':>10s} {'step':>10s} "
             f"{'ms':>8s} {'tok/s':>9s}" + (f" {'(all)':>9s}" if speculative else "") + f" {'collectives':>11s}"]
    for d in plan.decode:
        cells = " ".join(f"{size(n):>10s}" for n in (d.weights_read, d.experts_expected, d.experts_worst, d.kv_read,
                                                      d.step_bytes))
        accepted = f" {d.tokens_per_second_accepted:9.1f}" if speculative else ""
        lines.append(f"  {d.bucket:10s} {cells} {d.step_ms:8.2f} {d.tokens_per_second:9.1f}{accepted} "
                     f"{size(d.collective_bytes):>11s}")
    return lines + _step_lines(plan)


def _step_lines(plan: DevicePlan) -> list[str]:
    """The step model's table (`perf.step_time`), and where its constants come from."""
    if not plan.steps:
        return ["step model: none for a custom device (pass --device or --device-file for its constants)"]
    lines = ["step model on the busiest rank (ms; max(memory, flops) + fixed + collectives, then straggler "
             "and host):",
             f"  {'bucket':14s} {'tok/s':>9s} {'step':>8s} {'memory':>8s} {'flops':>8s} {'fixed':>8s} {'collect.':>8s} "
             f"{'calls':>6s} {'straggl.':>8s} {'host':>6s}"]
    for t in plan.steps:
        lines.append(f"  {t.bucket:14s} {t.tokens_per_step / t.step:9.1f} "
                     f"{t.step * 1e3:8.2f} {t.memory * 1e3:8.2f} {t.flops * 1e3:8.2f} "
                     f"{t.fixed * 1e3:8.2f} {t.collectives * 1e3:8.2f} {t.collective_calls:6d} "
                     f"{t.straggler * 1e3:8.2f} {t.host * 1e3:6.2f}")
    lines.append("  TTFT " + ", ".join(f"{ms:.1f} ms for a {n}-token prompt" for n, ms in plan.ttft_ms.items()))
    lines.append(f"  constants ({plan.device}):")
    lines += [f"    {name:28s} {value.provenance:13s} {value.source}" for name, value in plan.constants.items()]
    return lines


def plot(axis, plan: DevicePlan) -> None:
    """Stacked bars of a rank's memory against the device, and the decode roofline per bucket."""
    bottom = 0.0
    parts = [*((f"weights {k}", v) for k, v in plan.weights_bytes.items()), ("KV pool", plan.kv_bytes),
             ("activations", plan.activation_bytes)]
    for label, value in parts:
        axis.bar(["rank memory"], [value / 2**30], bottom=[bottom], label=label)
        bottom += value / 2**30
    axis.axhline(plan.device_bytes / 2**30, color="tab:red", linestyle="--", label=f"{plan.device} memory")
    axis.set_ylabel("GiB")
    steps = ", ".join(f"{d.bucket}: {d.step_ms:.1f} ms" for d in plan.decode)
    axis.set_title(f"per rank on {plan.device} ({'fits' if plan.fits else 'does not fit'}); roofline {steps}",
                   fontsize=8)
    axis.legend(fontsize=7)
