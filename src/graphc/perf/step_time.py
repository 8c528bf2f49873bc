"""The step model: a step's time on one rank of a device from the work its program does there.

    device = max(memory, flops) + layers * layer_fixed + collectives
    step   = device / (1 - straggler_share) + host_step

- memory: the bytes the busiest rank's program reads from HBM (`StepWork`: weights, the routed
  experts as the lowering reads them, the KV the block table spans) at the device's bandwidth.
- flops: each matmul at the dtype's dense rate times a utilisation that falls for a dimension
  below the matrix engine's width (a 32-wide matrix keeps a quarter of a 128-wide array busy).
  Memory and FLOPs overlap (the engines run beside the DMA queues), so the step pays the larger.
- a fixed cost per decoder layer: per-op issue, synchronisation, sub-tile shapes; at batch 1 most
  of a step (NxD Inference's DeepSeek-V3 profile: ~63 % "compute" where the FLOPs are microseconds).
- collectives: each runtime collective the program holds at `latency + traffic / bandwidth` of the
  span its group lies in (one chip, one instance, several), traffic per the algorithm's bytes a rank
  sends (ring all-reduce 2 (g - 1) / g of the payload, all-gather (g - 1) times its input, ...).
- a straggler share of the device time, and the host's dispatch of the step.

Every constant comes from the device file with its provenance (`perf.device`).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphc.perf.device import DeviceModel


@dataclass(frozen=True)
class Matmul:
    """`count` products of [rows, inner] by a weight [inner, outer] (one rank's slice)."""

    rows: float
    inner: int
    outer: int
    count: int = 1
    routed: bool = False
    """A routed expert's matrix (the MoE lowering's FLOPs)."""


@dataclass(frozen=True)
class RuntimeCollective:
    """`count` runtime collectives of one kind over a group of `group` ranks lying in `span`."""

    kind: str
    """all_reduce, all_gather, reduce_scatter or all_to_all."""
    group: int
    span: str
    bytes_in: float
    """What each rank contributes to one call."""
    count: int


TRAFFIC = {
    "all_reduce": lambda g: 2 * (g - 1) / g,
    "all_gather": lambda g: g - 1,
    "reduce_scatter": lambda g: (g - 1) / g,
    "all_to_all": lambda g: (g - 1) / g,
}
"""Bytes a rank sends per byte it contributes, by kind, for a group of g (ring / pairwise forms)."""


@dataclass(frozen=True)
class StepWork:
    """What one step of a bucket does on the busiest rank."""

    bucket: str
    tokens_per_step: int
    """What a step serves: a decode step's rows (a token sampled each), a prefill step's prompt tokens."""
    layers: int
    """Decoder layers the step runs (a speculative step's draft passes included)."""
    dtype: str
    """The compute dtype."""
    weights_bytes: float
    """Weights read other than the routed experts (one embedding row a token)."""
    expert_bytes: float
    """Routed experts' weights as the lowering reads them on the busiest rank."""
    kv_bytes: float
    matmuls: tuple[Matmul, ...]
    collectives: tuple[RuntimeCollective, ...]

    @property
    def bytes_read(self) -> float:
        return self.weights_bytes + self.expert_bytes + self.kv_bytes

    @property
    def collective_calls(self) -> int:
        return sum(c.count for c in self.collectives)

    @property
    def flops(self) -> float:
        return sum(2 * m.rows * m.inner * m.outer * m.count for m in self.matmuls)

    @property
    def routed_flops(self) -> float:
        return sum(2 * m.rows * m.inner * m.outer * m.count for m in self.matmuls if m.routed)


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time and its parts, in seconds."""

    bucket: str
    tokens_per_step: int
    memory: float
    flops: float
    fixed: float
    collectives: float
    straggler: float
    host: float
    collective_calls: int

    @property
    def device(self) -> float:
        return max(self.memory, self.flops) + self.fixed + self.collectives

    @property
    def step(self) -> float:
        return self.device + self.straggler + self.host

    def shares(self) -> dict[str, float]:
        """Of the step, as a device profile splits it: compute (FLOPs and fixed cost), memory
        (the bytes' time the FLOPs do not hide), collectives, straggler, host."""
        parts = {"compute": self.flops + self.fixed, "memory": max(0.0, self.memory - self.flops),
                 "collectives": self.collectives, "straggler": self.straggler, "host": self.host}
        return {name: value / self.step for name, value in parts.items()}

    def to_json(self) -> dict:
        return {"bucket": self.bucket, "tokens_per_second": self.tokens_per_step / self.step,
                "step_ms": self.step * 1e3, "memory_ms": self.memory * 1e3,
                "flops_ms": self.flops * 1e3, "fixed_ms": self.fixed * 1e3,
                "collectives_ms": self.collectives * 1e3, "straggler_ms": self.straggler * 1e3,
                "host_ms": self.host * 1e3, "collective_calls": self.collective_calls, "shares": self.shares()}


def matmul_seconds(m: Matmul, device: DeviceModel, dtype: str) -> float:
    """One matmul's engine time: its FLOPs at the dtype's rate, scaled by the share of the PE
    array its weight's dimensions fill."""
    width = device.pe_width.value
    utilisation = min(1.0, m.inner / width) * min(1.0, m.outer / width)
    return 2 * m.rows * m.inner * m.outer * m.count / (device.flops[dtype].value * utilisation)


def collective_seconds(c: RuntimeCollective, device: DeviceModel) -> float:
    link = device.links[c.span]
    return c.count * (link.latency.value + TRAFFIC[c.kind](c.group) * c.bytes_in / link.bandwidth.value)


def step_time(work: StepWork, device: DeviceModel) -> StepTime:
    memory = work.bytes_read / device.hbm.value
    flops = sum(matmul_seconds(m, device, work.dtype) for m in work.matmuls)
    fixed = work.layers * device.layer_fixed.value
    collectives = sum(collective_seconds(c, device) for c in work.collectives)
    device_time = max(memory, flops) + fixed + collectives
    share = device.straggler_share.value
    return StepTime(work.bucket, work.tokens_per_step, memory, flops, fixed, collectives,
                    device_time * share / (1 - share), device.host_step.value, work.collective_calls)


def fit_layer_fixed(work: StepWork, device: DeviceModel, measured_step: float) -> float:
    """The fixed cost per layer that makes `work`'s predicted step equal `measured_step` seconds,
    every other constant from `device`: the one calibration of the step model."""
    share = device.straggler_share.value
    zero = step_time(work, device)
    device_time = (measured_step - device.host_step.value) * (1 - share)
    return (device_time - max(zero.memory, zero.flops) - zero.collectives) / work.layers
