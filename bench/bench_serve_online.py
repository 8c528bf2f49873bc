"""`graphc serve` under arriving traffic: Poisson arrivals against a running server.

    .venv/bin/python bench/bench_serve_online.py [--rates 2,8,32] [--requests 60] [--backend inductor]

A tiny checkpoint (the lora-groups preset) is compiled twice, with prompt-as-decode graphs
(P = 4) and without (P = 0), the same buckets otherwise; each is served by a `graphc serve`
process and driven over HTTP with OpenAI's streaming completions, every request in its own task
started at its Poisson arrival time (prompt and output lengths lognormal, seeded: the same
traffic for both servers).

1. Load: for each arrival rate, throughput (generated tokens / wall time from the first arrival to
   the last token), requests completed and failed, time to first token and inter-token latency
   (p50 / p99), for both servers.
2. Short prompts under decode load: 8 long generations keep the decode batch busy while prompts
   of at most P tokens arrive (Poisson); their time to first token with and without
   prompt-as-decode graphs, and the ratio. Without them, each short prompt takes a prefill step
   of its own between the running decodes' steps; with them, it joins the decode step.
3. Prefix caching: 32 requests sharing a 192-token prefix, each with its own 16-token suffix,
   arriving over time (Poisson, 4/s), served by the P = 4 artifacts with GRAPHC_PREFIX_CACHING=1
   and =0: mean time to first token of each and the ratio, whether the greedy tokens are equal,
   and the hit rate (`graphc_prefix_cache_hits` / `_queries` from /metrics).
Absolute times are this machine's; the ratios within one run are the result.

    .venv/bin/python bench/bench_serve_online.py --sections prefix   # the prefix-caching figure alone
    .venv/bin/python bench/bench_serve_online.py --sections prefix --size 140m   # on bench_scale's 140M model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import yaml

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = {"prefill": [16, 64], "decode": [1, 4, 8], "context_limit": 256}
PROMPT_AS_DECODE = 4
PREFIX_REQUESTS, PREFIX_TOKENS, SUFFIX_TOKENS = 32, 192, 16


def compile_artifacts(work: Path, backend: str, size: str) -> dict[str, Path]:
    graphc = str(Path(sys.executable).parent / "graphc")
    checkpoint = work / "checkpoint"
    if size != "tiny":  # a rung of bench_scale.py's ladder, random weights
        from bench_scale import SIZES
        from graphc.weights.tiny import preset_config, write_random_checkpoint

        config = {**preset_config("lora-groups"), **SIZES[size]}
        if not (checkpoint / "config.json").is_file() or json.loads((checkpoint / "config.json").read_text()) != config:
            write_random_checkpoint(checkpoint, config, seed=0)
    elif not checkpoint.exists():
        subprocess.run([graphc, "checkpoint", "make-tiny", str(checkpoint)], check=True)
    out = {}
    for name, p in (("P=4", PROMPT_AS_DECODE), ("P=0", 0)):
        config = {"model": {"checkpoint": str(checkpoint), "dtype": "float32"}, "backend": backend,
                  "buckets": {**BUCKETS, "prompt_as_decode": p}, "kv_cache": {"block_size": 16, "num_blocks": 256},
                  "runtime": {"max_num_prefilling_tokens": 64, "max_new_tokens": 64}}
        path = work / f"model-p{p}.yaml"
        path.write_text(yaml.safe_dump(config))
        out[name] = work / f"artifacts-p{p}"
        subprocess.run([graphc, "compile", str(path), "-o", str(out[name]), "--force"], check=True,
                       stderr=subprocess.DEVNULL)
    return out


class Server:
    def __init__(self, artifacts: Path, env: dict[str, str] | None = None):
        self.process = subprocess.Popen([str(Path(sys.executable).parent / "graphc"), "serve", str(artifacts),
                                         "--port", "0", "--model-name", "tiny", "--max-waiting", "1024"],
                                        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        for line in self.process.stderr:
            if match := re.search(r"on (http://\S+)", line):
                self.url = match.group(1)
                return
        raise RuntimeError("graphc serve did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(120)


async def one_request(client, url: str, prompt: list[int], max_tokens: int, start: float, ignore_eos=True) -> dict:
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    sent, times, ids_seen = time.monotonic(), [], []
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": ignore_eos,
            "temperature": 0}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                return {"failed": True}
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    ids = json.loads(line[6:])["choices"][0].get("token_ids", [])
                    times += [time.monotonic()] * len(ids)
                    ids_seen += ids
    except httpx2.HTTPError:
        return {"failed": True}
    return {"failed": not times, "sent": sent, "times": times, "ids": ids_seen}


def traffic(rate: float, count: int, seed: int) -> list[tuple[float, list[int], int]]:
    """(arrival offset, prompt, max_tokens): Poisson arrivals, lognormal lengths."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        length = min(120, max(1, round(rng.lognormvariate(3.0, 0.8))))  # median 20 tokens
        new = min(64, max(1, round(rng.lognormvariate(3.0, 0.6))))
        out.append((at, [rng.randrange(3, 250) for _ in range(length)], new))
    return out


async def run_traffic(url: str, requests: list[tuple[float, list[int], int]]) -> list[dict]:
    async with httpx2.AsyncClient(limits=httpx2.Limits(max_connections=None)) as client:
        start = time.monotonic() + 0.2
        return await asyncio.gather(*(one_request(client, url, p, n, start + at) for at, p, n in requests))


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarise(results: list[dict]) -> dict:
    done = [r for r in results if not r["failed"]]
    ttft = [r["times"][0] - r["sent"] for r in done]
    itl = [b - a for r in done for a, b in zip(r["times"], r["times"][1:]) if b > a]
    first, last = min(r["sent"] for r in done), max(r["times"][-1] for r in done)
    return {"completed": len(done), "failed": len(results) - len(done),
            "throughput": sum(len(r["times"]) for r in done) / (last - first),
            "ttft": (percentile(ttft, 50), percentile(ttft, 99)),
            "itl": (percentile(itl, 50), percentile(itl, 99)) if itl else (0.0, 0.0)}


async def short_prompts_under_load(url: str, count: int, seed: int) -> list[float]:
    """TTFT of short prompts arriving while 8 long generations decode."""
    rng = random.Random(seed)
    async with httpx2.AsyncClient(limits=httpx2.Limits(max_connections=None)) as client:
        now = time.monotonic()
        load = [asyncio.ensure_future(one_request(client, url, [rng.randrange(3, 250) for _ in range(8)], 200, now))
                for _ in range(8)]
        await asyncio.sleep(1.0)  # the long ones are decoding
        at, shorts = time.monotonic(), []
        for _ in range(count):
            at += rng.expovariate(4.0)
            prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, PROMPT_AS_DECODE))]
            shorts.append(asyncio.ensure_future(one_request(client, url, prompt, 4, at)))
        results = await asyncio.gather(*shorts)
        for task in load:
            task.cancel()
    return [r["times"][0] - r["sent"] for r in results if not r["failed"]]


def shared_prefix_traffic(seed: int) -> list[tuple[float, list[int], int]]:
    """Section 3's requests: a 192-token prefix, a 16-token suffix each, Poisson arrivals at 4/s."""
    rng, at = random.Random(seed), 0.0
    prefix, out = [rng.randrange(3, 250) for _ in range(PREFIX_TOKENS)], []
    for _ in range(PREFIX_REQUESTS):
        at += rng.expovariate(4.0)
        out.append((at, prefix + [rng.randrange(3, 250) for _ in range(SUFFIX_TOKENS)], 8))
    return out


def prefix_cache_counts(url: str) -> tuple[float, float]:
    text = httpx2.get(f"{url}/metrics").text
    return tuple(float(re.search(rf"^graphc_prefix_cache_{name}_total (\S+)$", text, re.M).group(1))
                 for name in ("queries", "hits"))


def prefix_caching(artifacts: Path) -> None:
    print(f"\nprefix caching: {PREFIX_REQUESTS} requests, a {PREFIX_TOKENS}-token shared prefix + "
          f"{SUFFIX_TOKENS}-token suffixes, Poisson 4/s, 8 new tokens each")
    outcome = {}
    for caching in ("1", "0"):
        server = Server(artifacts, {"GRAPHC_PREFIX_CACHING": caching})
        try:
            asyncio.run(run_traffic(server.url, traffic(4, 8, seed=1)))  # warm-up: unrelated prompts
            before = prefix_cache_counts(server.url)
            results = asyncio.run(run_traffic(server.url, shared_prefix_traffic(seed=11)))
            queries, hits = (b - a for a, b in zip(before, prefix_cache_counts(server.url)))
            floor = asyncio.run(run_traffic(server.url, [(0.1 * i, [5 + i], 1) for i in range(16)]))
        finally:
            server.stop()
        done = [r for r in results if not r["failed"]]
        ttft = statistics.mean(r["times"][0] - r["sent"] for r in done)
        outcome[caching] = ttft, [r["ids"] for r in done], len(results) - len(done)
        floor_ms = statistics.mean(r["times"][0] - r["sent"] for r in floor) * 1e3
        print(f"  GRAPHC_PREFIX_CACHING={caching}: mean TTFT {ttft * 1e3:7.1f} ms (a 1-token prompt's: "
              f"{floor_ms:.1f} ms), {len(done)} done, "
              f"{len(results) - len(done)} failed, hit rate {hits / queries if queries else 0:.1%} "
              f"({hits:.0f} of {queries:.0f} prompt tokens)")
    (on, on_ids, _), (off, off_ids, _) = outcome["1"], outcome["0"]
    print(f"  mean TTFT {off / on:.2f}x lower with caching; tokens equal: {on_ids == off_ids}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="2,8,32")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--backend", default="inductor", choices=["export", "inductor"])
    parser.add_argument("--size", default="tiny", help="tiny (the lora-groups preset) or a size of bench_scale.py "
                        "(140m, 1b): the fixed cost of HTTP and a step weighs less against a larger model's prefill")
    parser.add_argument("--work", type=lambda p: Path(p).resolve(), default=None,
                        help="default: build/bench-serve-online (tiny) or build/bench-serve-online-SIZE")
    parser.add_argument("--sections", default="load,prefix", help="load (sections 1 and 2), prefix (section 3)")
    options = parser.parse_args()
    options.work = options.work or ROOT / "build" / ("bench-serve-online" + ("" if options.size == "tiny" else
                                                                             f"-{options.size}"))
    options.work.mkdir(parents=True, exist_ok=True)
    artifacts = compile_artifacts(options.work, options.backend, options.size)
    sections = set(options.sections.split(","))
    if "load" in sections:
        load_and_short_prompts(artifacts, options)
    if "prefix" in sections:
        prefix_caching(artifacts["P=4"])


def load_and_short_prompts(artifacts: dict[str, Path], options) -> None:
    rates = [float(r) for r in options.rates.split(",")]
    model = "tiny lora-groups preset" if options.size == "tiny" else f"{options.size} model of bench_scale.py"
    print(f"{model}, {options.backend}, {options.requests} requests per rate, streaming, greedy\n")
    print(f"{'server':6s} {'rate/s':>7s} {'done':>5s} {'failed':>6s} {'tok/s':>8s} {'TTFT p50':>9s} {'p99':>8s} "
          f"{'ITL p50':>8s} {'p99':>8s}")
    shorts = {}
    for name, path in artifacts.items():
        server = Server(path)
        try:
            asyncio.run(run_traffic(server.url, traffic(4, 8, seed=1)))  # warm-up
            for rate in rates:
                s = summarise(asyncio.run(run_traffic(server.url, traffic(rate, options.requests, seed=7))))
                print(f"{name:6s} {rate:7.1f} {s['completed']:5d} {s['failed']:6d} {s['throughput']:8.1f} "
                      f"{s['ttft'][0] * 1e3:7.1f}ms {s['ttft'][1] * 1e3:6.1f}ms {s['itl'][0] * 1e3:6.2f}ms "
                      f"{s['itl'][1] * 1e3:6.2f}ms")
            shorts[name] = asyncio.run(short_prompts_under_load(server.url, 40, seed=3))
        finally:
            server.stop()
    on, off = (statistics.median(shorts[k]) for k in ("P=4", "P=0"))
    print(f"\nshort prompts (<= {PROMPT_AS_DECODE} tokens) arriving under 8 decoding requests: median TTFT "
          f"{on * 1e3:.1f} ms with prompt-as-decode graphs, {off * 1e3:.1f} ms without: {off / on:.2f}x")


if __name__ == "__main__":
    main()
