"""Run a function on N real processes joined by a gloo process group (for multi-rank tests)."""

from __future__ import annotations

import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphc.distributed import register_groups
from graphc.topology import Topology


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
        dist.barrier()  # before teardown: see shared/PLATFORM.md on gloo aborts at exit
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
