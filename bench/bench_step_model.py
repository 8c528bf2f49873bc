"""The step model on this host: its constants from `graphc calibrate` alone, its fixed cost a layer
fitted on half the configurations, its predictions tested on the other half against `graphc profile`.

    .venv/bin/python bench/bench_step_model.py [--sizes tiny,140m] [--dtypes float32,bfloat16] [--repeats 10]

Configurations: the `bench_scale.py` ladder's sizes x dtypes, each compiled for one rank on the
export backend with a prefill chunk of 64 and decode batches of 1 and 8 at context 512. The fit
half alternates along the ladder (tiny fp32, 140m bf16, ...), the test half is the rest; then one
change: the test half's first configuration with its context doubled, measured
against predicted. Prints each program's measured and predicted ms with the error, and the test
half's median and largest |error|. Measure on a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from pathlib import Path

import yaml

from bench_scale import SIZES
from graphc.compiler.pipeline import CompileOptions, compile
from graphc.config import load_config
from graphc.perf.calibrate import host_device, write_device
from graphc.perf.device import load_device
from graphc.perf.profile import Profiled, fit_layer_fixed, profile, refitted
from graphc.weights.tiny import preset_config, write_random_checkpoint

BUCKETS = {"prefill": [64], "decode": [1, 8], "prompt_as_decode": 0}


def configuration(work: Path, size: str, dtype: str, context: int = 512) -> tuple[Path, Path]:
    """(model.yaml, artifacts) of a one-rank export compile of `size` in `dtype`."""
    checkpoint = work / f"checkpoint-{size}"
    if not (checkpoint / "config.json").is_file():
        write_random_checkpoint(checkpoint, {**preset_config("lora-groups"), **SIZES[size]}, seed=0)
    name = f"{size}-{dtype}-{context}"
    path = work / f"{name}.yaml"
    blocks = context // 16 * 9 + 1  # eight rows at the context, and one more
    path.write_text(yaml.safe_dump({"model": {"checkpoint": str(checkpoint), "dtype": dtype},
                                    "buckets": {**BUCKETS, "context_limit": context},
                                    "kv_cache": {"block_size": 16, "num_blocks": blocks}, "backend": "export"}))
    compile(load_config(path), work / name, CompileOptions(show_progress=False))
    return path, work / name


def show(label: str, rows: list[tuple[str, Profiled]]) -> None:
    print(label)
    print(f"  {'configuration':22s} {'bucket':10s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>7s}")
    for name, p in rows:
        print(f"  {name:22s} {p.bucket:10s} {p.measured_ms:12.2f} {p.predicted_ms:13.2f} {p.error:+7.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,140m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="graphc-step-model-") as folder:
        work = Path(folder)
        device_file = work / "host.yaml"
        write_device(host_device(), device_file)
        device = load_device(path=device_file)
        rates = f"fp32 {device.flops['float32'].value / 1e9:.1f} / bf16 {device.flops['bfloat16'].value / 1e9:.1f}"
        print(f"host: {device.hbm.value / 1e9:.1f} GB/s, {rates} GFLOP/s, all-reduce "
              f"{device.links['chip'].latency.value * 1e6:.0f} us (graphc calibrate)")
        runs = [(f"{size} {dtype}", configuration(work, size, dtype))
                for size in options.sizes.split(",") for dtype in options.dtypes.split(",")]
        measured = {name: profile(load_config(path), artifacts, device, options.repeats)
                    for name, (path, artifacts) in runs}
        # Alternate along the ladder so that each half holds every size and dtype once where it can.
        names = [n for n, _ in runs]
        fit_names = [n for i, n in enumerate(names) if (i + i // len(options.dtypes.split(","))) % 2 == 0]
        test_names = [n for n in names if n not in fit_names]
        fixed = fit_layer_fixed([p for n in fit_names for p in measured[n]], device)
        print(f"layer_fixed_us fitted on {', '.join(fit_names)}: {fixed * 1e6:.1f}")
        fitted = dataclasses.replace(device, layer_fixed=dataclasses.replace(device.layer_fixed, value=fixed))

        def again(p: Profiled) -> Profiled:
            [predicted] = refitted([p], fitted)
            return predicted

        show("fit half (the fit's residuals):", [(n, again(p)) for n in fit_names for p in measured[n]])
        tested = [(n, again(p)) for n in test_names for p in measured[n]]
        show("test half (predictions):", tested)
        errors = [abs(p.error) for _, p in tested]
        print(f"test half: median |error| {statistics.median(errors):.0%}, largest {max(errors):.0%} "
              f"over {len(errors)} programs")
        size, dtype = test_names[0].split()
        path, artifacts = configuration(work, size, dtype, context=1024)
        doubled = {p.bucket: again(p) for p in profile(load_config(path), artifacts, device, options.repeats)}
        print(f"context doubled ({test_names[0]}, 512 -> 1024): measured change against predicted change")
        for p in measured[test_names[0]]:
            base, after = again(p), doubled[p.bucket]
            print(f"  {p.bucket:10s} measured {after.measured_ms / base.measured_ms:5.2f}x, predicted "
                  f"{after.predicted_ms / base.predicted_ms:5.2f}x")


if __name__ == "__main__":
    main()
