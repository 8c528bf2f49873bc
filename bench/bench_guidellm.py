"""GuideLLM's report beside graphc's own client on the same traffic, and beside the programs' own
step times: what the GuideLLM test (tests/server/test_clients.py) runs, measured.

    .venv/bin/python bench/bench_guidellm.py [--requests 12]

The trained tiny checkpoint is compiled as the test serves it (export backend, prefill [8, 32],
decode [1, 4], prompt-as-decode 4, MTP drafts k = 2) and served by one `graphc serve`. The same
traffic, 32-token prompts and 16 generated tokens each (EOS ignored), runs twice a profile:

- GuideLLM 0.8.1's `guidellm run` (synthetic text of the checkpoint's tokenizer), synchronous and
  at a constant 4 requests a second: its median time to first token and inter-token latency from
  its JSON report (its output tokens a second is a rate over the run's time, not a request's,
  so it is left out);
- `bench_serve_online.one_request`, graphc's bench client (streamed completions of random token
  ids), with the same arrivals: the same medians, measured alike (inter-token latency over a
  request's tokens after its first, as GuideLLM defines it).

Then the ratio of the two, and `graphc profile`'s measured program times of the decode and prefill
buckets beside the step model's prediction with this host's `graphc calibrate` constants (what a
token costs inside the program, without HTTP or the scheduler). Absolute times are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import yaml

from bench_serve_online import Server, one_request

ROOT = Path(__file__).resolve().parent.parent
GRAPHC = str(Path(sys.executable).parent / "graphc")
CHECKPOINT = ROOT / "src/graphc/weights/trained"
PROMPT_TOKENS, OUTPUT_TOKENS, RATE = 32, 16, 4.0
CONFIG = {"model": {"checkpoint": str(CHECKPOINT), "dtype": "float32", "speculative": {"method": "mtp", "tokens": 2}},
          "buckets": {"prefill": [8, 32], "decode": [1, 4], "prompt_as_decode": 4, "context_limit": 128},
          "kv_cache": {"block_size": 8, "num_blocks": 64},
          "runtime": {"max_num_prefilling_tokens": 32, "max_new_tokens": 16}, "backend": "export"}


def compiled(work: Path) -> tuple[Path, Path]:
    model = work / "model.yaml"
    model.write_text(yaml.safe_dump(CONFIG))
    artifacts = work / "artifacts"
    subprocess.run([GRAPHC, "compile", str(model), "-o", str(artifacts), "--force"], check=True,
                   stderr=subprocess.DEVNULL)
    return model, artifacts


def guidellm(url: str, profile: str, requests: int, work: Path) -> dict[str, float]:
    """GuideLLM's medians (ms) for `profile`."""
    report = work / f"guidellm-{profile.replace(',', '-').replace('=', '')}.json"
    subprocess.run([str(Path(sys.executable).parent / "guidellm"), "run", "--backend", f"kind=openai_http,target={url}",
                    "--profile", profile, "--data",
                    f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                    "--constraint", f"kind=max_requests,count={requests}",
                    "--tokenizer", f"kind=hf_auto,model={CHECKPOINT}", "--output", f"kind=json,path={report}",
                    "--disable-console"], check=True, capture_output=True)
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    return {"ttft": metrics["time_to_first_token_ms"]["successful"]["median"],
            "itl": metrics["inter_token_latency_ms"]["successful"]["median"]}


async def own_client(url: str, rate: float | None, requests: int) -> dict[str, float]:
    """The bench client's medians for the same traffic: one request at a time (`rate` None) or
    arrivals every 1 / rate seconds."""
    prompts = [[(7 * i + 13 * r) % 240 + 5 for i in range(PROMPT_TOKENS)] for r in range(requests)]
    async with httpx2.AsyncClient(limits=httpx2.Limits(max_connections=None)) as client:
        if rate is None:
            results = [await one_request(client, url, p, OUTPUT_TOKENS, time.monotonic()) for p in prompts]
        else:
            start = time.monotonic() + 0.2
            results = await asyncio.gather(*(one_request(client, url, p, OUTPUT_TOKENS, start + r / rate)
                                             for r, p in enumerate(prompts)))
    done = [r for r in results if not r["failed"]]
    assert len(done) == requests and all(len(r["times"]) == OUTPUT_TOKENS for r in done), "a request failed"
    itl = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in done]
    return {"ttft": statistics.median(1e3 * (r["times"][0] - r["sent"]) for r in done),
            "itl": 1e3 * statistics.median(itl)}


def profiled(model: Path, artifacts: Path, work: Path) -> dict:
    """`graphc profile --json` of the artifacts with this host's calibrated device file."""
    device = work / "host.yaml"
    subprocess.run([GRAPHC, "calibrate", "--output", str(device)], check=True, capture_output=True)
    done = subprocess.run([GRAPHC, "profile", str(model), str(artifacts), "--device-file", str(device), "--json"],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-guidellm")
    options = parser.parse_args()
    options.work.mkdir(parents=True, exist_ok=True)
    model, artifacts = compiled(options.work)
    server = Server(artifacts)
    try:
        rows = []
        for name, profile, rate in (("synchronous", "kind=synchronous", None),
                                    (f"constant {RATE:g}/s", f"kind=constant,rate={RATE:g}", RATE)):
            theirs = guidellm(server.url, profile, options.requests, options.work)
            ours = asyncio.run(own_client(server.url, rate, options.requests))
            rows.append((name, theirs, ours))
    finally:
        server.stop()
    print(f"{options.requests} requests a profile, {PROMPT_TOKENS} prompt and {OUTPUT_TOKENS} output tokens each, "
          "medians (graphc serve of the trained tiny checkpoint, export, MTP k = 2)")
    print(f"{'profile':16s} {'metric':10s} {'GuideLLM':>10s} {'bench client':>13s} {'ratio':>7s}")
    for name, theirs, ours in rows:
        for metric in ("ttft", "itl"):
            print(f"{name:16s} {metric + ' ms':10s} {theirs[metric]:10.1f} {ours[metric]:13.1f} "
                  f"{theirs[metric] / ours[metric]:7.2f}")
    print("the programs alone (graphc profile: measured ms, the step model's prediction with this host's constants):")
    for entry in profiled(model, artifacts, options.work):
        print(f"  {entry['bucket']:12s} {entry['measured_ms']:8.2f} {entry['predicted_ms']:8.2f}")


if __name__ == "__main__":
    main()
