"""Speculative decoding with the MTP layer: acceptance and decode speed with k = 1, 2, 3 drafts and
without, and what a speculative step costs against a plain one, with a roofline.

    .venv/bin/python bench/bench_speculative.py [--ks 0,1,2,3] [--repeats 3]   # the trained tiny model
    .venv/bin/python bench/bench_speculative.py --cost-model [--ks 0,1,2,3]        # the 140 M ladder model

Acceptance and speed (`graphc checkpoint make-tiny --preset trained`, inductor, fp32): eight
48-byte prompts cut from the standard library files the model was not trained on, 64 new tokens
greedy, at batch 1 and 8. Decode tok/s = batch x (new - 1) / (time of a generation of `new`
tokens - time of a 1-token one), so prefill and start-up cancel (as `bench_scale.py`). Acceptance
per draft position j: drafts accepted over drafts verified at that position.

Cost model (`bench_scale.py`'s 140 M model, random weights, inductor, batch 1): each decode graph
timed alone (`Engine.run_bucket` on one row at position 64, best of `--repeats` x 20 calls): the
plain [1, 1] step, the plain [1, 2] step (the main model over 2 tokens: k = 1's verify alone; a
prompt-as-decode graph), and the speculative [1, 1 + k] step (verify, verdict, the
MTP layer over 1 + k positions and k - 1 positions ahead). Draft cost = speculative - verify.
Roofline: the bytes each step must read (`bench_scale.step_bytes`: the weights but the routed
experts, the experts its tokens route to, the KV; the speculative step also the MTP layer and the
head once more) over the bandwidth measured here. The projection for the released DeepSeek-V3:
expected tokens per step 1 + a_1 + a_1 a_2 + ... over the step's cost, with the cost ratio from
the bytes model at V3's shape (batch 1: 8 of 256 experts a token) and the acceptance DeepSeek
reports for one MTP token (85-90 %, V3 report section 5.4.3) and the one measured here.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import yaml

import timing
from timing import best_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
NEW, PROMPT_BYTES, PROMPTS = 64, 48, 8
CONTEXT, BLOCK_SIZE, NUM_BLOCKS = 256, 16, 160


def held_out_prompts() -> list[list[int]]:
    """Eight 48-byte prompts from the files `scripts/train_tiny.py` holds out, each at a line start."""
    from train_tiny import corpus

    text = corpus()[1]
    starts, offset = [], 0
    while len(starts) < PROMPTS:
        offset = text.index(b"\n", offset + len(text) // (PROMPTS + 1)) + 1
        starts.append(offset)
    return [list(text[s: s + PROMPT_BYTES]) for s in starts]


def compile_artifacts(checkpoint: Path, out: Path, k: int, buckets: dict) -> Path:
    from graphc.compiler.pipeline import CompileOptions, compile
    from graphc.config import load_config

    model = {"checkpoint": str(checkpoint), "dtype": "float32"}
    if k:
        model["speculative"] = {"method": "mtp", "tokens": k}
    config = {"model": model, "buckets": {**buckets, "context_limit": CONTEXT},
              "kv_cache": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS},
              "runtime": {"max_num_prefilling_tokens": 64}, "backend": "inductor"}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    compile(load_config(path), out, CompileOptions(show_progress=False, force=True))
    return out


def generate(engine, prompts: list[list[int]], new: int):
    from graphc.runtime import Request

    session = engine.session()
    for prompt in prompts:
        session.scheduler.submit(Request(prompt, new, stop_at_eos=False))
    steps = 0
    while not session.idle:
        session.step()
        steps += 1
    return session.scheduler, steps


def worker_speed(artifacts: str, repeats: int) -> dict:
    """Decode tok/s and acceptance at batch 1 and 8 (one process per artifacts: a quiet heap)."""
    from graphc.runtime import Engine

    engine, prompts, out = Engine(artifacts), held_out_prompts(), {}
    generate(engine, prompts[:1], 2)  # warm-up: first calls load kernels
    for batch in (1, 8):
        chosen = prompts[:batch]
        full = best_of(repeats, lambda: generate(engine, chosen, NEW), warmup=1)
        first = best_of(repeats, lambda: generate(engine, chosen, 1), warmup=1)
        scheduler, steps = generate(engine, chosen, NEW)
        drafts = scheduler.drafts
        out[f"b{batch}"] = {"tok_s": batch * (NEW - 1) / (full - first), "steps": steps,
                            "acceptance": [a / p if p else 0.0 for a, p in zip(drafts.accepted, drafts.proposed)],
                            "tokens": [scheduler.results[i].output_ids for i in range(batch)]}
    return out


def worker_step_times(artifacts: str, repeats: int) -> dict:
    """Milliseconds of each decode graph (batch 1), alone, on one row at position 64."""
    from graphc.runtime import Engine
    from graphc.runtime.paged import SequenceBlocks, step_metadata
    from graphc.sampling import sampler_inputs

    engine = Engine(artifacts)
    sequence = SequenceBlocks(BLOCK_SIZE, list(range(8)))
    out = {}
    for graph in engine.manifest.ranks[0].graphs:
        bucket = graph.bucket
        if bucket.kind != "decode":
            continue
        tokens = [5 + i for i in range(bucket.width)]
        fields = step_metadata([(sequence, tokens, 64)], bucket.width, engine.manifest.kv_cache.blocks_per_row,
                               drafts=[bucket.width - 1])
        inputs = {**dict(zip(("input_ids", "positions", "block_table", "slot_mapping", "logits_index"), fields)),
                  **sampler_inputs([], [], 1)}
        with torch.no_grad():
            seconds = best_of(repeats, lambda: [engine.run_bucket(bucket, inputs) for _ in range(20)], warmup=1) / 20
        out[bucket.name] = seconds * 1e3
    return out


WORKERS = {"speed": worker_speed, "step_times": worker_step_times}


def run_worker(name: str, *args) -> dict:
    """Run WORKERS[name](*args) in a fresh process."""
    return timing.run_worker(__file__, name, *args)


def bench_trained(work: Path, ks: list[int], repeats: int) -> list[float]:
    """The trained tiny model: the table, and the first draft position's acceptance at batch 1."""
    from graphc.weights.tiny import TRAINED_PRESET, make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(work / "trained", TRAINED_PRESET, force=True)
    results = {}
    for k in ks:
        artifacts = compile_artifacts(checkpoint, work / f"trained-k{k}", k, {"prefill": [64], "decode": [1, 8]})
        results[k] = run_worker("speed", artifacts, repeats)
        gc.collect()
    print("\ntrained tiny DeepSeek-V3 (1.4 M parameters), inductor, fp32, greedy, 64 new tokens")
    print(f"{'k':>3} {'batch':>5} {'decode tok/s':>13} {'vs k=0':>7} {'steps':>6}  acceptance per draft position")
    for batch in (1, 8):
        for k in ks:
            r = results[k][f"b{batch}"]
            ratio = r["tok_s"] / results[ks[0]][f"b{batch}"]["tok_s"]
            same = "" if r["tokens"] == results[ks[0]][f"b{batch}"]["tokens"] else "  TOKENS DIFFER from k=0"
            print(f"{k:>3} {batch:>5} {r['tok_s']:>13.0f} {ratio:>6.2f}x {r['steps']:>6}  "
                  f"{' '.join(f'{a:.2f}' for a in r['acceptance'])}{same}")
    return results[max(ks)]["b1"]["acceptance"]


def bench_cost(work: Path, ks: list[int], repeats: int, measured: list[float]) -> None:
    from bench_scale import SIZES, measure_bandwidth
    from graphc.models.deepseek_v3.presets import BASE_CONFIG
    from graphc.models.registry import model_args_from_hf_config
    from graphc.weights.tiny import write_random_checkpoint

    config = {**BASE_CONFIG, **SIZES["140m"]}
    checkpoint = write_random_checkpoint(work / "140m", config, seed=0)
    args = model_args_from_hf_config(config)
    times = {}
    for k in ks:
        if k == 0:  # plain steps of 1 and 2 tokens (a prompt-as-decode graph): k = 1's verify alone
            out = compile_artifacts(checkpoint, work / "140m-plain", 0,
                                    {"prefill": [64], "decode": [1], "prompt_as_decode": 2})
            times.update({f"plain {name}": ms for name, ms in run_worker("step_times", out, repeats).items()})
        else:
            out = compile_artifacts(checkpoint, work / f"140m-k{k}", k, {"prefill": [64], "decode": [1]})
            times[f"speculative k={k}"] = run_worker("step_times", out, repeats)[f"decode-1x{1 + k}"]
    bandwidth = measure_bandwidth()
    plain = times["plain decode-1"]
    base_bytes = verify_bytes(args, 1, 64, "float32")
    print(f"\n140 M ladder model (random weights), inductor, fp32, batch 1; bandwidth here {bandwidth / 1e9:.1f} GB/s")
    print(f"{'step':>22} {'ms':>7} {'vs [1,1]':>9} {'bytes MB':>9} {'roofline ms':>12}")
    print(f"{'plain [1, 1]':>22} {plain:>7.2f} {1:>8.2f}x {base_bytes / 1e6:>9.1f} {base_bytes / bandwidth * 1e3:>12.2f}")
    for k in (j for j in ks if j):
        tokens = 1 + k
        verify, plain_bytes = times.get(f"plain decode-1x{tokens}"), verify_bytes(args, tokens, 64, "float32")
        if verify is not None:
            print(f"{f'plain [1, {tokens}]':>22} {verify:>7.2f} {verify / plain:>8.2f}x {plain_bytes / 1e6:>9.1f} "
                  f"{plain_bytes / bandwidth * 1e3:>12.2f}")
        spec, spec_bytes = times[f"speculative k={k}"], plain_bytes + mtp_layer_bytes(args, tokens, "float32")
        draft = f"  draft {spec - verify:.2f} ms" if verify is not None else ""
        print(f"{f'speculative [1, {tokens}]':>22} {spec:>7.2f} {spec / plain:>8.2f}x {spec_bytes / 1e6:>9.1f} "
              f"{spec_bytes / bandwidth * 1e3:>12.2f}{draft}")
    released_projection(measured)


def verify_bytes(args, tokens: int, context: int, dtype: str) -> float:
    """`bench_scale.step_bytes` of one row of `tokens` tokens: every weight but the routed experts,
    and the experts its tokens route to, counted as if no two tokens shared one (an upper bound)."""
    from bench_scale import step_bytes

    moe_layers = args.num_hidden_layers - args.first_k_dense_replace
    experts = moe_layers * min(tokens * args.num_experts_per_tok, args.n_routed_experts)
    return step_bytes(args, 1, experts, context, dtype)


def mtp_layer_bytes(args, tokens: int, dtype: str) -> float:
    """What the MTP layer reads beside the main model in a speculative step: its own tensors but
    the routed experts, the experts of `tokens` tokens, and the head once more."""
    import dataclasses

    from graphc.models.deepseek_v3.model import DeepseekV3

    with torch.device("meta"):
        model = DeepseekV3(dataclasses.replace(args, draft_layers=1))
    prefix = f"model.layers.{args.num_hidden_layers}."
    own = sum(t.numel() for n, t in model.state_dict().items() if n.startswith(prefix) and ".mlp.experts." not in n)
    experts = min(tokens * args.num_experts_per_tok, args.n_routed_experts) * 3 * args.hidden_size * args.moe_intermediate_size
    return torch.finfo(getattr(torch, dtype)).bits // 8 * (own + experts + args.vocab_size * args.hidden_size)


def released_projection(measured: list[float]) -> None:
    """DeepSeek-V3 at batch 1, bf16: the bytes of a step with one MTP draft against a plain one's."""
    from graphc.models.registry import model_args_from_hf_config

    config = json.loads((ROOT / "examples" / "released" / "deepseek-v3" / "config.json").read_text())
    args = model_args_from_hf_config({k: v for k, v in config.items() if k != "quantization_config"})
    plain = verify_bytes(args, 1, 1024, "bfloat16")
    cost = (verify_bytes(args, 2, 1024, "bfloat16") + mtp_layer_bytes(args, 2, "bfloat16")) / plain
    print(f"\nreleased DeepSeek-V3 (61 layers + 1 MTP layer), one row at 1024 tokens of context, bytes model: a k = 1 "
          f"step reads {cost:.2f}x a plain step's bytes (the 2 tokens' 16 experts a layer, the MTP layer, the head again)")
    for a in sorted({0.85, 0.90, *(round(x, 2) for x in measured[:1])}):
        print(f"  acceptance {a:.2f}: {1 + a:.2f} tokens a step -> {(1 + a) / cost:.2f}x decode tok/s if bandwidth-bound")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="0,1,2,3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-model", action="store_true")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-speculative")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        name, *args = json.loads(options.worker)
        print(json.dumps(WORKERS[name](args[0], int(args[1]))))
        return
    ks = sorted({0, *map(int, options.ks.split(","))})
    options.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    measured = bench_trained(options.work, ks, options.repeats)
    if options.cost_model:
        bench_cost(options.work, ks, options.repeats, measured)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
