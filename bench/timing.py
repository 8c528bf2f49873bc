"""Shared by the benchmarks: the best wall time of repeated runs (noise only ever adds time), and
a measurement in a fresh process of its own (a quiet heap, its own peak memory)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from graphc.perf.calibrate import best_of  # noqa: F401  (the benchmarks' `timing.best_of`)


def run_worker(script: str | Path, name: str, *args) -> dict:
    """Run `script --worker '[name, *args]'` in a fresh process: the JSON object of its last line."""
    done = subprocess.run([sys.executable, str(script), "--worker", json.dumps([name, *map(str, args)])],
                          capture_output=True, text=True, cwd=Path(script).parent)
    if done.returncode:
        raise SystemExit(f"worker {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
