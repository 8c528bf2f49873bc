"""`graphc calibrate`: this host as a device file (`perf.device`), every value measured here.

A rank of this host is one process of `graphc run`: the ranks share its memory and cores, so a
rank's bandwidth and GEMM rate are measured with the threads a rank runs (torch's default, which
`graphc run` keeps at one rank and divides among several). Collectives are gloo's over loopback
between `ranks` processes. What a step costs beyond bytes, FLOPs and collectives (a layer's ops
dispatched one by one from Python or C++) is `layer_fixed_us`: `graphc profile --fit` fits it on
compiled artifacts, and until then the file says it is unmeasured (zero is not allowed, so it holds
an assumed 1 us).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

SMALL, LARGE = 4, 8 << 20
"""Payloads of the collective timings: latency from the smallest, bandwidth from the difference."""


def best_of(repeats: int, fn, warmup: int = 0) -> float:
    """The fastest of `repeats` calls of `fn`, in seconds, after `warmup` untimed calls (noise only
    ever adds time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth() -> float:
    """Bytes/s a rank streams: a sum over 256 MiB of fp32."""
    x = torch.ones(64 << 20)
    return x.numel() * 4 / best_of(5, x.sum, warmup=2)


GEMM = (128, 1024, 1024)
"""[M, K] x [K, N]: a small prefill chunk through a projection."""


def gemm_rate(dtype: torch.dtype) -> float:
    """FLOP/s of a `GEMM`-shaped projection as the models run them (`F.linear` of an [N, K] weight:
    on this host's CPU, bf16 through it runs 20x faster than a bf16 `a @ b`)."""
    m, k, n = GEMM
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    return 2 * m * k * n / best_of(3, lambda: torch.nn.functional.linear(a, w), warmup=1)


def _collective_worker(rank: int, world: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        timings = {}
        for size in (SMALL, LARGE):
            tensor = torch.ones(size // 4)
            dist.barrier()
            timings[size] = best_of(20, lambda: dist.all_reduce(tensor), warmup=3)
        if rank == 0:
            results.update(timings)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def collectives(world: int) -> dict[int, float]:
    """Seconds of gloo's all-reduce of `SMALL` and `LARGE` bytes over `world` ranks (one link model
    for every kind: the device file has one a span)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_collective_worker, args=(world, port, results), nprocs=world, start_method="spawn")
        return dict(results)


def host_device(world: int = 2) -> dict:
    """The device file of this host (`perf.device`'s form), measured now."""
    measured = lambda value, source: {"value": float(value), "provenance": "measured", "source": source}  # noqa: E731
    threads = torch.get_num_threads()
    timed = collectives(world)
    reduce_small, reduce_large = timed[SMALL], timed[LARGE]
    # A ring all-reduce sends 2 (g - 1) / g of its payload a rank (`step_time.TRAFFIC`).
    link_bandwidth = 2 * (world - 1) / world * (LARGE - SMALL) / max(reduce_large - reduce_small, 1e-9)
    gemm = {dtype: gemm_rate(getattr(torch, dtype)) for dtype in ("float32", "bfloat16")}
    cores = os.cpu_count() or 1
    link = {"latency_us": measured(reduce_small * 1e6, f"graphc calibrate: gloo all-reduce of {SMALL} B over {world} "
                                                        "processes on loopback, best of 20"),
            "gbs": measured(link_bandwidth / 1e9, f"graphc calibrate: gloo all-reduce of {LARGE >> 20} MiB less "
                                                  f"{SMALL} B over {world} processes, ring traffic")}
    return {
        "name": "host",
        "describes": f"one graphc rank of this host ({cores} cores, {threads} torch threads a rank), measured by "
                     "graphc calibrate",
        "ranks_per_chip": measured(cores, "os.cpu_count(): ranks on this host share its memory"),
        "chips_per_node": measured(1, "one host"),
        "memory_gib": measured(psutil.virtual_memory().total / cores / 2**30,
                               "psutil: a rank's share of this host's memory (total / cores)"),
        "hbm_gbs": measured(bandwidth() / 1e9, f"graphc calibrate: a {threads}-thread sum over 256 MiB of fp32, "
                                               "best of 5 (one rank alone, as graphc profile times it; ranks "
                                               "running together share it)"),
        "tflops": {
            "float32": measured(gemm["float32"] / 1e12, f"graphc calibrate: F.linear {_gemm_text()} fp32, best of 3"),
            "bfloat16": measured(gemm["bfloat16"] / 1e12, f"graphc calibrate: F.linear {_gemm_text()} bf16, best of 3"),
            "float8_e4m3fn": measured(gemm["bfloat16"] / 1e12, "graphc calibrate: the bf16 rate (FP8 weights compute "
                                                               "after dequantisation on a CPU)"),
        },
        "pe_width": {"value": 1, "provenance": "assumed", "source": "a CPU's vector units: no wide matrix array "
                                                                    "left idle by a narrow matrix"},
        "links": {span: link for span in ("chip", "node", "network")},
        "layer_fixed_us": {"value": 1.0, "provenance": "assumed",
                           "source": "unmeasured: graphc profile --fit fits it on compiled artifacts"},
        "host_step_us": {"value": 1.0, "provenance": "assumed",
                         "source": "a step's dispatch runs in the measured step on a CPU host"},
        "straggler_share": {"value": 0.0, "provenance": "assumed",
                            "source": "the ranks of one host: no straggler beyond the measured step"},
    }


def _gemm_text() -> str:
    m, k, n = GEMM
    return f"[{m}, {k}] x [{k}, {n}]"


def write_device(data: dict, path: Path) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
