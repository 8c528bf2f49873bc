"""Throughput and time-to-first-token of `graphc run`, as ratios against references in the same run.

    .venv/bin/python bench/bench_serve.py [--preset lora-groups] [--repeats 3]

Same tiny checkpoint everywhere. Decode tokens/s = (tokens of a 65-token generation minus those
of a 1-token one) / (time difference), so prefill and start-up cancel out; prefill tokens/s =
prompt tokens / time of a 1-token generation. Each figure is the best of `--repeats` runs.
References: transformers' `generate` (eager HF), and graphc's own eager model on the paged cache.
Time-to-first-token compares a fresh process serving from artifacts against a fresh process that
compiles the same model with `torch.compile` at start-up (whole-process wall time, imports
included, each with an empty inductor cache, as on a newly started host).
Absolute times are printed only for context: machines are noisy, ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from graphc.compiler.pipeline import CompileOptions, compile
from graphc.config import load_config
from graphc.weights.checkpoint import load_model
from graphc.weights.tiny import make_tiny_checkpoint
from graphc.runtime import Engine, Request
from graphc.tools.generate import PagedKV, generate
from timing import best_of

PROMPT, LONG_PROMPT, NEW = 16, 128, 65


def prompts(batch, length):
    return [[(5 * i + 11 * b) % 250 + 3 for i in range(length)] for b in range(batch)]


def measure(run, batch, repeats):
    """(decode tokens/s, prefill tokens/s) for run(prompts, new_tokens)."""
    short = prompts(batch, PROMPT)
    run(short, 2)  # warm-up: first calls load kernels
    full = best_of(repeats, lambda: run(short, NEW))
    first = best_of(repeats, lambda: run(short, 1))
    long = prompts(batch, LONG_PROMPT)
    prefill = best_of(repeats, lambda: run(long, 1))
    return batch * (NEW - 1) / (full - first), batch * LONG_PROMPT / prefill


def hf_runner(checkpoint):
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)

    def run(batch_prompts, new):
        with torch.no_grad():
            model.generate(torch.tensor(batch_prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False)

    return run


def eager_runner(checkpoint):
    model = load_model(checkpoint)
    return lambda batch_prompts, new: generate(model, batch_prompts, new, kv=PagedKV(16, 160), stop_at_eos=False)


def engine_runner(artifacts):
    engine = Engine(artifacts)
    return lambda batch_prompts, new: engine.generate([Request(p, new, stop_at_eos=False) for p in batch_prompts])


TTFT_ARTIFACTS = """
import sys
from graphc.runtime import Engine, Request
Engine(sys.argv[1]).generate([Request(list(range(3, 19)), 1)])
"""

TTFT_TORCH_COMPILE = """
import sys, torch
from graphc.weights.checkpoint import load_model
from graphc.tools.generate import generate
model = load_model(sys.argv[1])
model.forward = torch.compile(model.forward, dynamic=False)
generate(model, [list(range(3, 19))], 1)
"""


def ttft(script, arg):
    """Wall time of a whole fresh process, interpreter start and imports included, with an empty
    inductor cache (a server starting on a new host has none)."""
    with tempfile.TemporaryDirectory() as cold_cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cold_cache}
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", script, str(arg)], capture_output=True, check=True, env=env)
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="lora-groups")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="graphc-bench-"))
    checkpoint = make_tiny_checkpoint(work / "ckpt", args.preset)
    artifacts = {}
    for backend in ("export", "inductor"):
        config = {"model": {"checkpoint": str(checkpoint)},
                  "buckets": {"prefill": [LONG_PROMPT], "decode": [1, 8], "context_limit": 256},
                  "kv_cache": {"block_size": 16, "num_blocks": 160},
                  "runtime": {"max_num_prefilling_tokens": LONG_PROMPT}, "backend": backend}
        (work / f"{backend}.yaml").write_text(yaml.safe_dump(config))
        artifacts[backend] = work / f"art-{backend}"
        compile(load_config(work / f"{backend}.yaml"), artifacts[backend], CompileOptions(show_progress=False))

    runners = {"transformers": hf_runner(checkpoint), "graphc eager": eager_runner(checkpoint),
               **{f"graphc {b}": engine_runner(a) for b, a in artifacts.items()}}
    print(f"preset {args.preset}, torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeats}")
    for batch in (1, 8):
        results = {name: measure(run, batch, args.repeats) for name, run in runners.items()}
        hf_decode, hf_prefill = results["transformers"]
        eager_decode, eager_prefill = results["graphc eager"]
        print(f"\nbatch {batch}:")
        print(f"  {'':16s} {'decode tok/s':>13s} {'vs HF':>7s} {'vs eager':>9s} {'prefill tok/s':>14s} {'vs HF':>7s}")
        for name, (decode, prefill) in results.items():
            print(f"  {name:16s} {decode:13.0f} {decode / hf_decode:6.2f}x {decode / eager_decode:8.2f}x "
                  f"{prefill:14.0f} {prefill / hf_prefill:6.2f}x")

    from_artifacts = min(ttft(TTFT_ARTIFACTS, artifacts["inductor"]) for _ in range(args.repeats))
    compiled_at_start = ttft(TTFT_TORCH_COMPILE, checkpoint)
    print(f"\ntime to first token, fresh process: from inductor artifacts {from_artifacts:.2f} s, "
          f"torch.compile at start-up {compiled_at_start:.2f} s: {compiled_at_start / from_artifacts:.1f}x faster "
          "from artifacts")


if __name__ == "__main__":
    main()
