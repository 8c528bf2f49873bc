"""A device as data: one rank's memory, bandwidths, compute rates, links and fixed costs, each
value with where it comes from.

graphc ships a file per device (`devices/*.yaml`); `graphc plan --device-file F` reads a user's
own in the same form (for instance with link latencies from nccom-test runs of the job's replica
groups). Every value is `{value, provenance, source}`: provenance is one of `PROVENANCES`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from graphc.errors import GraphcError
from graphc.models.moe_forms import grouped_block

PROVENANCES = ("specification", "published", "derived", "assumed", "calibrated", "measured")
"""specification: a vendor's data sheet; published: someone's measurement, cited; derived:
arithmetic on those; assumed: a stated guess; calibrated: fitted on a cited measurement (one
fit, never refitted per layout); measured: `graphc calibrate` on this host."""

SPANS = ("chip", "node", "network")
"""Where a collective group's ranks lie: one chip, one instance's chips, several instances."""

DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
"""The compute dtypes a device file gives a rate for (FP4 weights compute in bf16)."""

SHIPPED = Path(__file__).parent / "devices"

PROGRAM_TARGET = "trn2"
"""The device whose costs shape a neuron program where a lowering chooses by cost (the grouped
GEMM's form): graphc's default neuronx-cc target (`neuron_archive.NEURON_TARGET`), as a program is
lowered before any target is named."""


@dataclass(frozen=True)
class Sourced:
    """One number of a device file and where it comes from."""

    value: float
    provenance: str
    source: str


@dataclass(frozen=True)
class Link:
    """A collective's cost over one span: `latency` seconds a call plus bytes / `bandwidth`."""

    latency: Sourced
    """Seconds a call, whatever its size (the value is given in microseconds in the file)."""
    bandwidth: Sourced
    """Bytes/s a rank sends (GB/s in the file)."""


@dataclass(frozen=True)
class DeviceModel:
    """One rank of a device (the unit graphc shards over), with what a step costs on it."""

    name: str
    describes: str
    ranks_per_chip: Sourced
    chips_per_node: Sourced
    memory: Sourced
    """Bytes (GiB in the file)."""
    hbm: Sourced
    """Bytes/s (GB/s in the file)."""
    flops: dict[str, Sourced]
    """Dense FLOP/s by compute dtype (TFLOPS in the file)."""
    pe_width: Sourced
    """The matrix engine's side: a matmul dimension below it leaves part of the engine idle."""
    links: dict[str, Link]
    """By span (`SPANS`)."""
    layer_fixed: Sourced
    """Seconds a decoder layer costs whatever its work: per-op issue, synchronisation, sub-tile
    shapes (microseconds in the file)."""
    host_step: Sourced
    """Seconds of host time a step: the synchronous dispatch of its program (microseconds)."""
    straggler_share: Sourced
    """The share of a step's device time the ranks spend waiting for the slowest one."""

    def span(self, ranks: list[int]) -> str:
        """Where `ranks` lie: one chip, one instance, or several."""
        per_chip = int(self.ranks_per_chip.value)
        per_node = per_chip * int(self.chips_per_node.value)
        if len({r // per_chip for r in ranks}) == 1:
            return "chip"
        return "node" if len({r // per_node for r in ranks}) == 1 else "network"

    def sourced(self) -> dict[str, Sourced]:
        """Every value by its dotted name, as the file spells it."""
        out = {"ranks_per_chip": self.ranks_per_chip, "chips_per_node": self.chips_per_node,
               "memory_gib": self.memory, "hbm_gbs": self.hbm, "pe_width": self.pe_width,
               "layer_fixed_us": self.layer_fixed, "host_step_us": self.host_step,
               "straggler_share": self.straggler_share}
        out.update({f"tflops.{dtype}": value for dtype, value in self.flops.items()})
        for span, link in self.links.items():
            out[f"links.{span}.latency_us"], out[f"links.{span}.gbs"] = link.latency, link.bandwidth
        return out


@functools.cache
def program_target() -> "DeviceModel":
    return load_device(PROGRAM_TARGET)


def neuron_grouped_block(local_rows: int, rows: int, experts: int, dim: int, width: int, itemsize: int) -> int:
    """The grouped GEMM's form in a neuron program (`moe_forms.grouped_block` on `PROGRAM_TARGET`'s
    costs) for rows [rows, dim] through E' = `experts` matrices [dim, width] of `itemsize` bytes."""
    device = program_target()
    rate = device.flops["float32" if itemsize == 4 else "bfloat16"].value
    return grouped_block(local_rows, rows, experts, dim * width * itemsize, 2 * dim * width, device.hbm.value, rate)


def shipped() -> list[str]:
    """The devices graphc ships a file for."""
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def load_device(name: str | None = None, path: Path | None = None) -> DeviceModel:
    """A shipped device by `name`, or the device file at `path`.

    Raises:
        GraphcError: an unknown device, an unreadable file, or a value missing, not a positive
            finite number (a share: in [0, 1)), or of an unknown provenance; the error names it.
    """
    if path is None:
        if name not in shipped():
            raise GraphcError(f"--device {name!r}: unknown device; devices: {', '.join(shipped())} "
                              "(or --device-file F for another)")
        path = SHIPPED / f"{name}.yaml"
    where = f"--device-file {str(path)!r}"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise GraphcError(f"{where}: cannot read it: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise GraphcError(f"{where}: not YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise GraphcError(f"{where}: expected a mapping of the device's values")
    reader = _Reader(data, where)
    scale = {"memory_gib": 2**30, "hbm_gbs": 1e9, "layer_fixed_us": 1e-6, "host_step_us": 1e-6}
    values = {key: reader.value(key, factor) for key, factor in scale.items()}
    return DeviceModel(
        name=reader.text("name"), describes=reader.text("describes"),
        ranks_per_chip=reader.value("ranks_per_chip"), chips_per_node=reader.value("chips_per_node"),
        memory=values["memory_gib"], hbm=values["hbm_gbs"],
        flops={dtype: reader.value(f"tflops.{dtype}", 1e12) for dtype in DTYPES},
        pe_width=reader.value("pe_width"),
        links={span: Link(reader.value(f"links.{span}.latency_us", 1e-6), reader.value(f"links.{span}.gbs", 1e9))
               for span in SPANS},
        layer_fixed=values["layer_fixed_us"], host_step=values["host_step_us"],
        straggler_share=reader.value("straggler_share", share=True))


class _Reader:
    """Reads dotted keys of a device file, naming the file and key in every error."""

    def __init__(self, data: dict, where: str):
        self.data, self.where = data, where

    def _get(self, key: str):
        node = self.data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise GraphcError(f"{self.where}: {key} is missing")
            node = node[part]
        return node

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not value:
            raise GraphcError(f"{self.where}: {key} must be a non-empty string")
        return value

    def value(self, key: str, factor: float = 1.0, share: bool = False) -> Sourced:
        node = self._get(key)
        if not isinstance(node, dict) or set(node) != {"value", "provenance", "source"}:
            raise GraphcError(f"{self.where}: {key} must be {{value, provenance, source}}")
        value = node["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise GraphcError(f"{self.where}: {key}.value {value!r} must be a number")
        if share and not 0 <= value < 1:
            raise GraphcError(f"{self.where}: {key}.value {value} must be in [0, 1)")
        if not share and value <= 0:
            raise GraphcError(f"{self.where}: {key}.value {value} must be positive")
        if node["provenance"] not in PROVENANCES:
            raise GraphcError(f"{self.where}: {key}.provenance {node['provenance']!r} must be one of "
                              f"{', '.join(PROVENANCES)}")
        if not isinstance(node["source"], str) or not node["source"]:
            raise GraphcError(f"{self.where}: {key}.source must say where the value comes from")
        return Sourced(value * factor, node["provenance"], node["source"])
