"""Cold compile time against the world size: the cost of world-independent graphs.

    .venv/bin/python bench/bench_compile_world.py [--backends export,inductor] [--config examples/tiny.yaml]

Compiles the config at (cp, ep) = (1, 1) and (4, 4) with each backend, each as a fresh `graphc
compile` process with an empty graphc cache and an empty inductor cache (a cold compile, as on a
new build host), and prints the wall time of each, the ratio of the 4x4 compile to the 1x1 one
and the distinct graph files written. Before world-independent graphs a 4x4 compile built every
rank's programs (4x the graphs); now a bucket has one program on export and inductor (two on
neuron: the leader's, the followers'), so what grows with the world is the weight shards.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

TOPOLOGIES = ((1, 1), (4, 4))


def cold_compile(config: dict, backend: str, folder: Path) -> tuple[float, int]:
    """(seconds, distinct graph files) of one cold `graphc compile` of `config`."""
    (folder / "model.yaml").write_text(yaml.safe_dump(config))
    environment = {**os.environ, "GRAPHC_CACHE_DIR": str(folder / "cache"),
                   "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache")}
    started = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "graphc"), "compile", str(folder / "model.yaml"), "-o",
                    str(folder / "artifacts"), "--backend", backend], env=environment, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    return seconds, len(list((folder / "artifacts" / "graphs").iterdir()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="export,inductor")
    parser.add_argument("--config", type=Path, default=Path("examples/tiny.yaml"))
    options = parser.parse_args()
    base = yaml.safe_load(options.config.read_text())
    base["model"]["checkpoint"] = str((options.config.parent / base["model"]["checkpoint"]).resolve())
    print(f"{options.config}: buckets {base['buckets']}")
    print(f"{'backend':10s} {'cp x ep':8s} {'cold compile':>13s} {'graph files':>12s} {'vs 1x1':>7s}")
    for backend in options.backends.split(","):
        times = {}
        for cp, ep in TOPOLOGIES:
            config = {**base, "topology": {"cp": cp, "ep": ep}}
            with tempfile.TemporaryDirectory(prefix="bench-compile-") as scratch:
                times[cp, ep], files = cold_compile(config, backend, Path(scratch))
            print(f"{backend:10s} {f'{cp}x{ep}':8s} {times[cp, ep]:12.1f}s {files:12d} "
                  f"{times[cp, ep] / times[TOPOLOGIES[0]]:6.2f}x")


if __name__ == "__main__":
    main()
