"""`graphc profile`: each bucket's compiled program timed on this host beside the step model's
prediction for it, and (`--fit`) the device file's fixed cost a layer fitted on those timings.

One rank's programs (a one-rank compile), each called as the runtime calls it: full rows of
random prompt tokens at the middle of the context, their blocks reserved in a pool of the
compiled size, greedy sampling. A program's time is the median of `repeats` calls after two
warm-ups (the step model prices a typical step; the best would flatter the host).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.perf.device import DeviceModel
from graphc.perf.step_time import StepWork, step_time
from graphc.perf.work import config_work
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata

SAMPLING = {"temperature": (torch.float32, 0.0), "top_k": (torch.int64, 0), "top_p": (torch.float32, 1.0),
            "seed": (torch.int64, 0)}
"""Greedy sampling, each row."""


@dataclass(frozen=True)
class Profiled:
    bucket: str
    measured_ms: float
    predicted_ms: float
    layers: int
    unfixed_ms: float
    """The device time the step model predicts but its fixed cost a layer: max(memory, flops) +
    collectives (what `fit_layer_fixed` solves against)."""

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1

    def to_json(self) -> dict:
        return {"bucket": self.bucket, "measured_ms": self.measured_ms, "predicted_ms": self.predicted_ms,
                "error": self.error}


def _inputs(runner, manifest, num_blocks: int, vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    bucket, block = runner.bucket, manifest.kv_cache.block_size
    known = {"input_ids", "positions", "block_table", "slot_mapping", "logits_index", "kv_pool", "coordinates",
             *SAMPLING}
    if set(runner.shapes) - known:
        raise GraphcError(f"graphc profile: {bucket.name} takes {sorted(set(runner.shapes) - known)}, which it does "
                          "not build (a speculative program)")
    rows, width = runner.shapes["input_ids"]
    start = max(0, manifest.buckets.context_limit // 2 - width)
    allocator, run = BlockAllocator(num_blocks), []
    for _ in range(rows):
        blocks = SequenceBlocks(block)
        blocks.reserve(start + width, allocator)
        run.append((blocks, torch.randint(2, vocab, (width,), generator=generator).tolist(), start))
    metadata = dict(zip(("input_ids", "positions", "block_table", "slot_mapping", "logits_index"),
                        step_metadata(run, width, runner.shapes["block_table"][1])))
    inputs = {name: metadata[name].to(runner.dtypes[name]) for name in metadata}
    inputs["kv_pool"] = torch.zeros(runner.shapes["kv_pool"], dtype=runner.dtypes["kv_pool"])
    inputs["coordinates"] = torch.tensor([0, 0, 1], dtype=runner.dtypes["coordinates"])
    for name, (dtype, value) in SAMPLING.items():
        inputs[name] = torch.full(runner.shapes[name], value, dtype=runner.dtypes[name])
    return inputs


def profile(config: GraphcConfig, artifacts: Path, device: DeviceModel, repeats: int = 10) -> list[Profiled]:
    """Each bucket of a one-rank compile of `config`, measured and predicted.

    Raises:
        GraphcError: the artifacts are not this config's compile, or not a one-rank one.
    """
    from graphc.runtime.loader import load_rank
    from graphc.tools.device_plan import check_compiled_from

    try:
        manifest = check_compiled_from(config, artifacts)
    except GraphcError as e:
        raise GraphcError(f"graphc profile: artifacts {e}") from None
    if manifest.topology.world != 1:
        raise GraphcError(f"graphc profile: {artifacts} is compiled for {manifest.topology.world} ranks; it times a "
                          "one-rank compile's programs")
    loaded = load_rank(artifacts, 0, manifest)
    works: dict[str, StepWork] = {w.bucket: w for w in config_work(config, device)}
    generator = torch.Generator().manual_seed(0)
    out = []
    for bucket, runner in loaded.runners.items():
        inputs = _inputs(runner, manifest, loaded.num_blocks, manifest.model.vocab_size, generator)
        times = []
        with torch.no_grad():
            for i in range(repeats + 2):
                began = time.perf_counter()
                runner(loaded.weights, inputs)
                if i >= 2:
                    times.append(time.perf_counter() - began)
        work = works[bucket.name]
        predicted = step_time(work, device)
        out.append(Profiled(bucket.name, statistics.median(times) * 1e3, predicted.step * 1e3, work.layers,
                            (max(predicted.memory, predicted.flops) + predicted.collectives) * 1e3))
    return out


def fit_layer_fixed(profiled: list[Profiled], device: DeviceModel) -> float:
    """Seconds a layer that best (least squares) closes the measured steps over `profiled`, the
    device's straggler share and host time as the step model applies them (`step_time`)."""
    share, host_ms = device.straggler_share.value, device.host_step.value * 1e3
    residuals = [((p.measured_ms - host_ms) * (1 - share) - p.unfixed_ms, p.layers) for p in profiled]
    return max(sum(layers * r for r, layers in residuals) / sum(layers**2 for _, layers in residuals), 1e-3) * 1e-3


def refitted(profiled: list[Profiled], device: DeviceModel) -> list[Profiled]:
    """`profiled` predicted again with `device`'s fixed cost a layer (a fitted one)."""
    share, host_ms, fixed_ms = device.straggler_share.value, device.host_step.value * 1e3, device.layer_fixed.value * 1e3
    return [Profiled(p.bucket, p.measured_ms, (p.unfixed_ms + p.layers * fixed_ms) / (1 - share) + host_ms, p.layers,
                     p.unfixed_ms) for p in profiled]
