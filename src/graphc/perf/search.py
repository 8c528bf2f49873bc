"""`graphc plan --search`: every layout of a model on whole instances of a device, priced by the
step model, and the Pareto front of tok/s an instance against tok/s a user.

The layouts: dp x cp x tp over the instances' ranks (the device file's ranks a chip x chips an
instance), ep dividing the world and the routed experts, the MoE lowering where tokens travel
(`MOE_LOWERINGS`), and decode batches of powers of two up to `--batch`. A layout is feasible when
graphc compiles it (the topology's rules, the family's: `Family.check_compile`) and a rank holds
its weights, the KV of its replica's `batch` sequences at `context` tokens (its cp share) and the
activations' estimate (`device_plan.activation_bytes`) in the device's memory. Each feasible
(layout, batch) is priced as graphc would compile it (`work.config_work`): TPOT is a decode
step of `batch` rows at the context, TTFT a prompt of half the context through the largest
prefill chunk. Speculative decoding is not searched (a config's own k is planned by `graphc plan`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from graphc.backends import backend
from graphc.buckets.selection import chunk_lengths, max_prefill_chunk
from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.models.layers import STACKED_EXPERT
from graphc.models.moe_forms import MOE_LOWERINGS
from graphc.models.registry import family_of
from graphc.perf.device import DeviceModel
from graphc.perf.step_time import step_time
from graphc.perf.work import config_work
from graphc.step import blocks_per_row
from graphc.topology import Topology
from graphc.weights.abstract import StoredTensor, stored_tensors

OBJECTIVES = ("latency", "throughput")


@dataclass(frozen=True)
class Limits:
    context: int
    """Tokens a sequence holds (KV read every step, held in the pool)."""
    batch: int
    """The largest decode batch a replica runs."""
    tpot_ms: float | None = None
    ttft_ms: float | None = None


@dataclass(frozen=True)
class Candidate:
    """One layout at one decode batch, priced."""

    topology: Topology
    moe_lowering: str
    """model.moe_lowering as written (`auto` where tokens need not travel)."""
    exchange: str
    """What the programs exchange (`MOE_EXCHANGES`)."""
    batch: int
    tpot_ms: float
    ttft_ms: float
    rank_bytes: int
    """Weights, KV pool and activations of a rank."""
    collective_calls: int

    @property
    def user_tokens_per_second(self) -> float:
        return 1e3 / self.tpot_ms

    def instance_tokens_per_second(self, instances: int) -> float:
        return self.topology.dp * self.batch * 1e3 / self.tpot_ms / instances

    def to_json(self, instances: int) -> dict:
        t = self.topology
        return {"dp": t.dp, "cp": t.cp, "tp": t.tp, "ep": t.ep, "moe_lowering": self.moe_lowering,
                "exchange": self.exchange,
                "batch": self.batch, "tpot_ms": self.tpot_ms, "ttft_ms": self.ttft_ms,
                "tokens_per_second_user": self.user_tokens_per_second,
                "tokens_per_second_instance": self.instance_tokens_per_second(instances),
                "rank_bytes": self.rank_bytes, "collective_calls": self.collective_calls}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(config: GraphcConfig, world: int) -> list[tuple[Topology, str, str]]:
    """Every (topology, MoE lowering, exchange) of `world` ranks graphc compiles for the config's model."""
    args, family = config.model_args, config.family
    out = []
    for dp in _divisors(world):
        for tp in _divisors(world // dp):
            cp = world // dp // tp
            for ep in _divisors(world):
                try:
                    topology = Topology(cp=cp, ep=ep, dp=dp, tp=tp)
                    topology.experts(0, args.n_routed_experts)
                except GraphcError:
                    continue
                lowerings = ("auto",) if topology.tokens_replicated or ep == 1 else MOE_LOWERINGS
                exchanges = {}  # a lowering the backend compiles as another (neuron's a2a_v) is that one
                for lowering in lowerings:
                    exchanges.setdefault(backend(config.backend).exchange(lowering, topology)[0], lowering)
                for exchange, lowering in exchanges.items():
                    try:
                        family.check_compile(args, topology, exchange, config.backend)
                    except GraphcError:
                        continue
                    out.append((topology, lowering, exchange))
    return out


def search(config: GraphcConfig, device: DeviceModel, limits: Limits, instances: int = 1) -> list[Candidate]:
    """Every feasible (layout, batch) of `config`'s model on `instances` instances of `device`.

    Raises:
        GraphcError: the limits leave no layout (naming the tightest).
    """
    world = int(device.ranks_per_chip.value * device.chips_per_node.value) * instances
    batches = [2**i for i in range(int(math.log2(limits.batch)) + 1)]
    chunk = max_prefill_chunk(config.buckets.prefill, config.runtime.max_num_prefilling_tokens)
    prompt_chunks = len(chunk_lengths(max(1, limits.context // 2), chunk))
    found, fit = [], 0
    for topology, lowering, exchange in layouts(config, world):
        tensors = _tensors(config, topology.ep, topology.tp)
        weights = sum(t.nbytes for t in tensors)
        for batch in batches:
            candidate = _with_layout(config, topology, lowering, batch, limits.context)
            rank_bytes = weights + _kv_bytes(candidate, batch) + _activations(candidate, tensors)
            if rank_bytes > device.memory.value:
                break  # a larger batch holds more
            fit += 1
            steps = {t.bucket: t for t in (step_time(w, device) for w in config_work(candidate, device, tensors))}
            decode, prefill = steps[f"decode-{batch}"], steps[f"prefill-{chunk}"]
            found.append(Candidate(topology, lowering, exchange, batch, decode.step * 1e3,
                                   prefill.step * 1e3 * prompt_chunks, rank_bytes, decode.collective_calls))
    if not fit:
        raise GraphcError(f"--search: no layout of {config.model_args.architecture} fits {instances} instance(s) of "
                          f"{device.name} ({world} ranks of {device.memory.value / 2**30:.1f} GiB) at --context "
                          f"{limits.context}")
    kept = [c for c in found if (limits.tpot_ms is None or c.tpot_ms <= limits.tpot_ms)
            and (limits.ttft_ms is None or c.ttft_ms <= limits.ttft_ms)]
    if not kept:
        fastest = min(found, key=lambda c: c.tpot_ms)
        quickest = min(found, key=lambda c: c.ttft_ms)
        given = " and ".join(f"--{name.replace('_', '-')} {value}" for name, value in
                             (("tpot_ms", limits.tpot_ms), ("ttft_ms", limits.ttft_ms)) if value is not None)
        raise GraphcError(f"--search: no feasible layout meets {given}; the fastest TPOT is {fastest.tpot_ms:.2f} ms, "
                          f"the fastest TTFT {quickest.ttft_ms:.1f} ms")
    return kept


def pareto(candidates: list[Candidate], instances: int = 1) -> list[Candidate]:
    """The candidates no other beats on both tok/s a user and tok/s an instance, by tok/s a user."""
    front = [c for c in candidates
             if not any(o.user_tokens_per_second >= c.user_tokens_per_second
                        and o.instance_tokens_per_second(instances) >= c.instance_tokens_per_second(instances)
                        and (o.user_tokens_per_second, o.instance_tokens_per_second(instances))
                        != (c.user_tokens_per_second, c.instance_tokens_per_second(instances))
                        for o in candidates)]
    return sorted(front, key=lambda c: -c.user_tokens_per_second)


def choose(candidates: list[Candidate], objective: str, instances: int = 1) -> Candidate:
    """The lowest TPOT (`latency`) or the most tok/s an instance (`throughput`), ties to fewer ranks a replica."""
    if objective == "latency":
        return min(candidates, key=lambda c: (c.tpot_ms, c.topology.replica, c.batch))
    return max(candidates, key=lambda c: (c.instance_tokens_per_second(instances), -c.tpot_ms))


def layout_yaml(data: dict, chosen: Candidate, context: int) -> dict:
    """The model.yaml `data` with the chosen layout: its topology, MoE lowering, decode batch, the
    context as the limit and a KV pool that holds the batch at it."""
    t = chosen.topology
    block = data.get("kv_cache", {}).get("block_size", 16)
    buckets = {k: v for k, v in data["buckets"].items() if k != "auto"}
    buckets.update(decode=[chosen.batch], context_limit=context)
    buckets.setdefault("prefill", [min(context, 256)])
    model = dict(data["model"])
    if chosen.moe_lowering != "auto":
        model["moe_lowering"] = chosen.moe_lowering
    return {**data, "model": model, "topology": {"dp": t.dp, "cp": t.cp, "tp": t.tp, "ep": t.ep}, "buckets": buckets,
            "kv_cache": {**data.get("kv_cache", {}), "block_size": block,
                         "num_blocks": pool_blocks(context, block, chosen.batch, t.cp)}}


def _with_layout(config: GraphcConfig, topology: Topology, lowering: str, batch: int, context: int) -> GraphcConfig:
    b = config.buckets
    chunk = max_prefill_chunk(b.prefill, config.runtime.max_num_prefilling_tokens)
    return dataclasses.replace(
        config, topology=topology, model=dataclasses.replace(config.model, moe_lowering=lowering, speculative=None),
        buckets=dataclasses.replace(b, prefill=[chunk], decode=[batch], prompt_as_decode=0, context_limit=context))


def pool_blocks(context: int, block: int, batch: int, cp: int) -> int:
    """A rank's KV pool for its replica's `batch` sequences at `context` tokens (its cp shard's
    blocks), at least one whole sequence (`kv_cache.num_blocks`' rule), and the spare block."""
    per_row = blocks_per_row(context, block)
    return max(per_row, batch * -(-per_row // cp)) + 1


def _kv_bytes(config: GraphcConfig, batch: int) -> int:
    """A rank's pool (`pool_blocks`) in bytes."""
    args, block = config.model_args, config.kv_cache.block_size
    blocks = pool_blocks(config.buckets.context_limit, block, batch, config.topology.cp)
    width = torch.empty(0, dtype=getattr(torch, config.model.dtype)).element_size()
    return blocks * block * args.cache_layers * args.kv_cache_dim * width


def _activations(config: GraphcConfig, tensors: list[StoredTensor]) -> int:
    from graphc.tools.device_plan import activation_bytes

    return activation_bytes(config, config.model_args, tensors)


def _tensors(config: GraphcConfig, ep: int, tp: int) -> list[StoredTensor]:
    """A rank's stored tensors at (ep, tp): those at (1, tp), the routed experts' stacks cut to
    1 / ep (every family's experts shard so); families with ep-sharded tables are built whole."""
    if family_of(config.model_args).stored.row_sharded_tables:
        return _stored(config, ep, tp)
    out = []
    for t in _stored(config, 1, tp):
        if STACKED_EXPERT.match(t.name):
            t = dataclasses.replace(t, shape=(t.shape[0] // ep, *t.shape[1:]),
                                    scale_shape=(t.scale_shape[0] // ep, *t.scale_shape[1:]) if t.scale_shape else None)
        out.append(t)
    return out


def _stored(config: GraphcConfig, ep: int, tp: int) -> list[StoredTensor]:
    return _stored_cached(config.model_args, config.model.checkpoint, config.model.dtype,
                          config.model.weights == "as-stored", ep, tp)


@lru_cache(maxsize=64)
def _stored_cached(args, checkpoint, dtype: str, as_stored: bool, ep: int, tp: int) -> list[StoredTensor]:
    return stored_tensors(args, checkpoint, getattr(torch, dtype), as_stored, ep, tp)
