"""Run a function on N real processes joined by a gloo process group (for multi-rank tests)."""

from __future__ import annotations

import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphc.weights.checkpoint import load_model
from graphc.models.step_model import Parallelism
from graphc.weights.tensor_shard import TensorShard
from graphc.ops.distributed import register_groups
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata
from graphc.topology import Topology


def channel_segments() -> set[str]:
    """The step channels' shared-memory segments on this host now: a test compares the set after
    its job with the set before (a job killed outside the test, e.g. an interrupted run, may have
    left one of its own)."""
    return {p.name for p in Path("/dev/shm").glob("graphc-*")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, topology, port, fn, args, results):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=topology.world)
        register_groups(topology, rank)
        results[rank] = fn(rank, topology, *args)
        dist.barrier()  # before teardown: see docs/platform.md on gloo aborts at exit
    except BaseException:
        results[rank] = RuntimeError(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(topology: Topology, fn, *args) -> list:
    """fn(rank, topology, *args) on every rank; returns the results in rank order."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(topology, _free_port(), fn, args, results), nprocs=topology.world,
                           start_method="spawn")
        out = [results[rank] for rank in range(topology.world)]
    for result in out:
        if isinstance(result, BaseException):
            raise result
    return out


def greedy_on_rank(rank: int, topology: Topology, checkpoint: str, moe_exchange: str, prompts: list[list[int]],
                   chunk: int, decode_steps: int, block_size: int, blocks_per_shard: int, blocks_per_row: int):
    """The eager model on `rank`: chunked prefill of its replica's prompt (`prompts[dp rank]`, all
    of one length, so every rank runs the same steps), then greedy decode, with the rank's share of
    the cache, the experts and the tensor-parallel weights; every rank runs the same host logic (as the leader would).
    Returns (the logits of every decode step [decode_steps, V], the tokens)."""
    prompt = prompts[topology.dp_rank(rank)]
    n_experts = load_model(checkpoint).args.n_routed_experts if topology.ep > 1 else None
    model = load_model(checkpoint, experts=topology.experts(rank, n_experts) if n_experts else None,
                       tp_shard=TensorShard(topology.tp_rank(rank), topology.tp))
    parallel = Parallelism(cp_rank=topology.cp_rank(rank), cp=topology.cp, ep_rank=topology.ep_rank(rank),
                           ep=topology.ep, moe_exchange=moe_exchange)
    pool = model.new_kv_pool(blocks_per_shard, block_size)
    seq = SequenceBlocks(block_size, num_shards=topology.cp)
    seq.reserve(len(prompt) + decode_steps, [BlockAllocator(blocks_per_shard) for _ in range(topology.cp)])
    logits, tokens = [], []

    def step(run, start):
        ids, positions, table, slots, last = step_metadata(
            [(seq, run, start)], len(run), blocks_per_row, shard=topology.cp_rank(rank))
        with torch.no_grad():
            return model(ids, positions, table, slots, pool, last, parallel=parallel)[0]

    for start in range(0, len(prompt), chunk):
        out = step(prompt[start : start + chunk], start)
    for i in range(decode_steps):
        logits.append(out)
        tokens.append(int(out.argmax()))
        out = step([tokens[-1]], len(prompt) + i)
    return torch.stack(logits), tokens
