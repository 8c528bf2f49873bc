"""Shared by the benchmarks: the best wall time of repeated runs (noise only ever adds time)."""

from __future__ import annotations

import time


def best_of(repeats: int, fn, warmup: int = 0) -> float:
    """The fastest of `repeats` calls of `fn`, in seconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
