"""`graphc serve` under hostile clients: do a 50 MB prompt and a chat template that never ends
slow down everyone else?

    .venv/bin/python bench/bench_hostile.py [--streams 8] [--rounds 3] [--max-body-bytes N] [--attacks prompt,template]

A tiny checkpoint (the lora-groups preset) whose chat template loops for ever when the last
message is "spin" is compiled and served by one `graphc serve` process. Streaming completions
(each 100 tokens, all at once, `--rounds` times) run twice in this one run: unloaded, then while
another process sends 50 MB text prompts and "spin" chats back to back. Printed: the streams'
inter-token latency (p50, p99) in both runs and their ratio, and the worst `/health` latency
(polled every 50 ms throughout each run). The issue's targets: ITL within 2x of the unloaded
run, /health under 1 s.

With the server's default body bound (derived from the context limit: 80 KiB for this one's 256
tokens) each 50 MB prompt is refused at its Content-Length (413); with `--max-body-bytes 67108864`
it is read, parsed and refused by its length in characters (400): the costliest path such a
prompt can take. `--attacks` runs one attack alone.
Absolute times are this machine's; the ratios within one run are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx2
import yaml

ROOT = Path(__file__).resolve().parent.parent
GRAPHC = str(Path(sys.executable).parent / "graphc")
SPIN = "{% if messages[-1]['content'] == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}" \
       "{% endfor %}{% endfor %}{% endif %}"
ATTACKS = {"prompt": "50 MB prompt", "template": "spinning template"}
ATTACK_SECONDS = 600
"""However the run goes, the attacker stops after this long."""


def compile_artifacts(work: Path) -> Path:
    checkpoint, artifacts = work / "checkpoint", work / "artifacts"
    if not checkpoint.exists():
        subprocess.run([GRAPHC, "checkpoint", "make-tiny", str(checkpoint)], check=True)
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = SPIN + config["chat_template"].removeprefix(SPIN)
    config_path.write_text(json.dumps(config))
    model = {"model": {"checkpoint": str(checkpoint), "dtype": "float32"}, "backend": "export",
             "buckets": {"prefill": [16, 64], "decode": [1, 4, 8], "prompt_as_decode": 4, "context_limit": 256},
             "kv_cache": {"block_size": 16, "num_blocks": 256},
             "runtime": {"max_num_prefilling_tokens": 64, "max_new_tokens": 64}}
    (work / "model.yaml").write_text(yaml.safe_dump(model))
    subprocess.run([GRAPHC, "compile", str(work / "model.yaml"), "-o", str(artifacts), "--force"], check=True,
                   stderr=subprocess.DEVNULL)
    return artifacts


def start_server(artifacts: Path, max_body_bytes: int | None) -> tuple[subprocess.Popen, str]:
    bound = ["--max-body-bytes", str(max_body_bytes)] if max_body_bytes else []
    process = subprocess.Popen([GRAPHC, "serve", str(artifacts), "--port", "0", "--model-name", "tiny", *bound],
                               stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if match := re.search(r"on (http://\S+)", line):
            return process, match.group(1)
    raise RuntimeError("graphc serve did not start")


def attack(url: str, kinds: list[str], stop, outcomes) -> None:
    """In a process of its own (its 50 MB JSON must not hold this one's GIL): a 50 MB prompt and a
    spinning chat (or those of `kinds`), each sent again as soon as it is answered, until `stop`
    (or ATTACK_SECONDS)."""
    big = json.dumps({"model": "tiny", "prompt": "x" * 50_000_000}).encode()
    spin = {"model": "tiny", "messages": [{"role": "user", "content": "spin"}]}

    async def again(send, name: str) -> None:
        deadline = time.monotonic() + ATTACK_SECONDS
        while not stop.is_set() and time.monotonic() < deadline:
            started = time.monotonic()
            status = (await send()).status_code
            outcomes.append((name, status, time.monotonic() - started))

    async def both() -> None:
        async with httpx2.AsyncClient(timeout=120) as client:
            senders = {"prompt": lambda: client.post(f"{url}/v1/completions", content=big,
                                                     headers={"content-type": "application/json"}),
                       "template": lambda: client.post(f"{url}/v1/chat/completions", json=spin)}
            await asyncio.gather(*(again(senders[kind], ATTACKS[kind]) for kind in kinds))

    asyncio.run(both())


async def one_stream(client, url: str, n: int) -> list[float]:
    """Arrival times of a 100-token stream's tokens."""
    body = {"model": "tiny", "prompt": [(7 * n + i) % 250 + 3 for i in range(8)], "max_tokens": 100, "stream": True,
            "ignore_eos": True, "temperature": 0}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times += [time.monotonic()] * len(json.loads(line[6:])["choices"][0].get("token_ids", []))
    assert len(times) == 100, f"a stream ended after {len(times)} tokens"
    return times


async def measure(url: str, streams: int, rounds: int) -> tuple[list[float], float]:
    """Inter-token latencies of `rounds` x `streams` concurrent streams, and the worst /health
    latency while they ran."""
    async with httpx2.AsyncClient(limits=httpx2.Limits(max_connections=None)) as client:
        done, worst = asyncio.Event(), [0.0]

        async def poll_health() -> None:
            while not done.is_set():
                started = time.monotonic()
                assert (await client.get(f"{url}/health", timeout=120)).status_code == 200
                worst[0] = max(worst[0], time.monotonic() - started)
                await asyncio.sleep(0.05)

        poller = asyncio.ensure_future(poll_health())
        gaps = []
        for _ in range(rounds):
            for times in await asyncio.gather(*(one_stream(client, url, n) for n in range(streams))):
                gaps += [b - a for a, b in zip(times, times[1:]) if b > a]  # one event can carry several
        done.set()
        await poller
    return gaps, worst[0]


def percentiles(values: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[98]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-body-bytes", type=int, help="The server's body bound (default: the server's).")
    parser.add_argument("--attacks", default="prompt,template", help="Which of prompt, template attack.")
    parser.add_argument("--work", type=lambda p: Path(p).resolve(), default=ROOT / "build" / "bench-hostile")
    options = parser.parse_args()
    options.work.mkdir(parents=True, exist_ok=True)
    process, url = start_server(compile_artifacts(options.work), options.max_body_bytes)
    try:
        asyncio.run(measure(url, options.streams, 1))  # warm-up
        quiet_gaps, quiet_health = asyncio.run(measure(url, options.streams, options.rounds))
        with multiprocessing.Manager() as manager:
            stop, outcomes = manager.Event(), manager.list()
            attacker = multiprocessing.Process(target=attack, args=(url, options.attacks.split(","), stop, outcomes))
            attacker.start()
            time.sleep(1.0)  # the first 50 MB body is on its way, the first spin rendering
            loud_gaps, loud_health = asyncio.run(measure(url, options.streams, options.rounds))
            stop.set()
            attacker.join(ATTACK_SECONDS)
            outcomes = list(outcomes)
    finally:
        process.terminate()
        process.wait(120)
    report(options, (quiet_gaps, quiet_health), (loud_gaps, loud_health), outcomes)


def report(options, quiet, loud, outcomes) -> None:
    print(f"tiny lora-groups preset, export, {options.streams} streams x {options.rounds} rounds of 100 tokens, "
          f"server --max-body-bytes {options.max_body_bytes or 'default'}\n")
    print(f"{'run':9s} {'ITL p50':>9s} {'p99':>9s} {'/health worst':>14s}")
    for name, (gaps, health) in (("unloaded", quiet), ("attacked", loud)):
        p50, p99 = percentiles(gaps)
        print(f"{name:9s} {p50 * 1e3:7.2f}ms {p99 * 1e3:7.2f}ms {health * 1e3:12.1f}ms")
    (q50, q99), (l50, l99) = percentiles(quiet[0]), percentiles(loud[0])
    print(f"\nITL attacked / unloaded: p50 {l50 / q50:.2f}x, p99 {l99 / q99:.2f}x (target: within 2x); "
          f"worst /health under attack {loud[1] * 1e3:.0f} ms (target: < 1000 ms)")
    for name in (ATTACKS[kind] for kind in options.attacks.split(",")):
        mine = [(status, seconds) for kind, status, seconds in outcomes if kind == name]
        statuses = ", ".join(f"{count} x {status}" for status, count in sorted(Counter(s for s, _ in mine).items()))
        mean = statistics.mean(s for _, s in mine) if mine else 0.0
        print(f"{name}: {statuses or 'none answered'}, {mean:.2f} s each on average")


if __name__ == "__main__":
    main()
