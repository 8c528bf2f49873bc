"""Start a benchmark's ranks: `world` spawned processes that join a gloo group on a free port."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, *args) -> list:
    """worker(rank, world, port, results, *args) on every rank, which stores its result in
    results[rank]; returns them in rank order."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(world, free_port(), results, *args), nprocs=world, start_method="spawn")
        return [results[rank] for rank in range(world)]
