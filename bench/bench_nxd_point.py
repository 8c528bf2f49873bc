"""The step model against the one measured DeepSeek-V3 on Trainium, and graphc's layouts beside it.

    .venv/bin/python bench/bench_nxd_point.py [--device trn2]

NxD Inference's DeepSeek-V3 (its contrib README; `graphc.perf.reference`): TP 64 at LNC 2, BF16,
batch 1, sequence 512, TPOT p50 20.5 ms, TTFT 1,667 ms for 256 input tokens, a profile of ~63 %
compute, ~16 % collectives, ~16 % memory, ~5 % stragglers. The trn2 file's fixed cost per layer is
fitted on that TPOT alone (printed here as the fit, which must equal the file's value); TTFT and the
profile's shares are predictions from the same constants. Then the released DeepSeek-V3's layouts
in `examples/released/` as graphc compiles them, by the same model and constants: their decode
TPOT and TTFT, and the ratio against NxD Inference's measured TPOT.

No hardware is timed here: every number is the model's, beside the published measurement.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from graphc.buckets.selection import Bucket
from graphc.config import load_config
from graphc.perf.device import load_device
from graphc.perf.reference import NXD_V3, nxd_v3_work
from graphc.perf.step_time import fit_layer_fixed, step_time
from graphc.tools.device_plan import device, plan_device

RELEASED = Path(__file__).resolve().parents[1] / "examples" / "released"
LAYOUTS = ("v3-trn2-tp16.yaml", "v3-trn2.yaml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="trn2")
    options = parser.parse_args()
    target = load_device(options.device)
    config = load_config(RELEASED / "v3-trn2.yaml")
    args, checkpoint = config.model_args, config.model.checkpoint
    decode = nxd_v3_work(args, checkpoint, Bucket("decode", 1))
    prefill = nxd_v3_work(args, checkpoint, Bucket("prefill", NXD_V3["prompt"]))
    fit = fit_layer_fixed(decode, target, NXD_V3["tpot_ms"] * 1e-3) * 1e6
    print(f"device {target.name}; layer_fixed_us in the file {target.layer_fixed.value * 1e6:.1f} "
          f"({target.layer_fixed.provenance}), the fit on NxD Inference's TPOT {fit:.1f}")
    tpot, ttft = step_time(decode, target), step_time(prefill, target)
    print("NxD Inference's DeepSeek-V3 (TP 64, expert TP 64, BF16), predicted vs measured:")
    print(f"  {'':22s} {'predicted':>10s} {'measured':>10s} {'error':>8s}")
    for label, predicted, measured in (("TPOT ms (batch 1)", tpot.step * 1e3, NXD_V3["tpot_ms"]),
                                       (f"TTFT ms ({NXD_V3['prompt']} tokens)", ttft.step * 1e3, NXD_V3["ttft_ms"])):
        print(f"  {label:22s} {predicted:10.1f} {measured:10.1f} {predicted / measured - 1:+8.0%}")
    shares = tpot.shares()
    for part, measured in NXD_V3["shares"].items():
        points = (shares[part] - measured) * 100
        print(f"  {part + ' share':22s} {shares[part]:10.0%} {measured:10.0%} {points:+7.0f}pt")
    print(f"  {'(host share)':22s} {shares['host']:10.0%} {'-':>10s}")
    print(f"  decode work: {decode.bytes_read / 1e9:.2f} GB read ({decode.expert_bytes / 1e9:.2f} GB of experts), "
          f"{decode.flops / 1e9:.1f} GFLOP, {decode.collective_calls} collectives; context encoding "
          f"{prefill.flops / 1e12:.1f} TFLOP, {prefill.expert_bytes / 1e9:.1f} GB of experts")
    print(f"graphc's released DeepSeek-V3 layouts on {target.name}, by the same model:")
    print(f"  {'layout':22s} {'bucket':12s} {'TPOT ms':>8s} {'tok/s':>8s} {'calls':>6s} {'vs NxD':>7s} {'fits':>5s}")
    for name in LAYOUTS:
        layout = load_config(RELEASED / name)
        plan = plan_device(layout, device(options.device))
        for t in plan.steps:
            if t.bucket.startswith("decode") and "x" not in t.bucket:
                ratio, fits = NXD_V3["tpot_ms"] / (t.step * 1e3), "yes" if plan.fits else "no"
                print(f"  {name:22s} {t.bucket:12s} {t.step * 1e3:8.2f} {t.tokens_per_step / t.step:8.1f} "
                      f"{t.collective_calls:6d} {ratio:6.2f}x {fits:>5s}")
        print(f"  {name:22s} TTFT " + ", ".join(f"{ms:.0f} ms ({n} tokens)" for n, ms in plan.ttft_ms.items()))


if __name__ == "__main__":
    main()
