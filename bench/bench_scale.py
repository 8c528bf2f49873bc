"""A ladder of model sizes: graphc's decode and prefill speed against transformers, with a roofline.

    .venv/bin/python bench/bench_scale.py [--sizes tiny,140m,1b] [--repeats 3] [--with-dense] [--dtype bfloat16]
    .venv/bin/python bench/bench_scale.py --weights [--sizes 140m]   # fp32 / bf16 / FP8-as-stored decode
    .venv/bin/python bench/bench_scale.py --tensor-parallel [--sizes 140m]   # decode at tp = 1 and tp = 2

Sizes (random DeepSeek-V3 checkpoints in the HF layout, written here):
  tiny  the `lora-groups` preset: hidden 64, 8 experts, top-2
  140m  vocab 4096, hidden 512, 6 layers (first dense), 8 heads, q LoRA 256, kv LoRA 128, rope 32 /
        nope 64 / v 64, 64 routed experts top-6 in 8 groups (top-4), expert width 256, 1 shared
  1b    vocab 8192, hidden 1024, 10 layers (first dense), 16 heads, q LoRA 512, kv LoRA 256,
        128 routed experts top-8 in 8 groups (top-4), expert width 256, 1 shared

Every measurement runs in a fresh process of its own, one after another (a quiet machine, one
model in memory, peak RSS per process): graphc compile (inductor) and graphc serving the
artifacts (`Engine`), graphc's eager model, transformers eager and transformers with its forward
under `torch.compile` and a static cache. `--with-dense` also serves artifacts compiled with
`moe_form: dense` (every expert on every token: the formulation graphc had before).

Decode tok/s = batch x (new tokens - 1) / (time of a generation of `new` tokens - time of a
1-token one), so prefill and start-up cancel; prompts of 12 tokens, 32 new tokens. Prefill
tok/s: one 512-token prompt (batch 1), and eight 64-token prompts (batch 8), each timed as a
1-token generation.

The bytes model of a decode step (what it must read, in the model dtype): every weight of the attention, the
dense MLP, the shared experts, the routers, the norms and the LM head; one embedding row per
token; per MoE layer the routed experts the step's tokens chose (counted distinct, from the
routing of the eager run of the same prompts); and the KV cache read by attention. The roofline
is those bytes over the bandwidth measured here (a 2-thread sum over 256 MiB). The prefill
roofline is the step's multiply-adds (its tokens through every projection and K routed experts,
the LM head for the last token, attention's QK and PV over the causal context) at the GEMM rate
measured here in the model dtype. Absolute numbers are this machine's; ratios within one run are the result.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

import timing
from timing import best_of

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": {"max_position_embeddings": 2048},  # room for the 512-token prefill
    "140m": {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
             "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 256,
             "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
             "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 8, "topk_group": 4,
             "max_position_embeddings": 2048},
    "1b": {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256,
           "num_hidden_layers": 10, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 512,
           "kv_lora_rank": 256, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
           "n_routed_experts": 128, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
           "max_position_embeddings": 2048},
}
PROMPT, NEW, PREFILL, PREFILL_BATCH, PREFILL_BATCH_LENGTH = 12, 32, 512, 8, 64
BLOCK_SIZE, NUM_BLOCKS = 16, 384


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * b) % (vocab - 3) + 2 for i in range(length)] for b in range(batch)]


def measure_bandwidth() -> float:
    """Bytes/s of a 2-thread sum over 256 MiB (fp32): what a memory-bound step can stream."""
    x = torch.ones(64 << 20)
    return x.numel() * 4 / best_of(5, x.sum, warmup=2)


def measure_gemm(dim: int, dtype: torch.dtype) -> float:
    """Multiply-add rate (flop/s) of a [512, D] x [D, 4D] GEMM, a prefill's shape."""
    a, b = torch.randn(PREFILL, dim, dtype=dtype), torch.randn(dim, 4 * dim, dtype=dtype)
    return 2 * PREFILL * dim * 4 * dim / best_of(5, lambda: a @ b, warmup=2)


# --- workers: each runs in its own process and prints one JSON line ---------------------------------


def _decode_timings(run, vocab: int, repeats: int) -> dict:
    """Decode tok/s at batch 1 and 8."""
    out = {}
    run(prompts(1, PROMPT, vocab), 2)  # warm-up: first calls load kernels
    for batch in (1, 8):
        short = prompts(batch, PROMPT, vocab)
        run(short, 2)
        full = best_of(repeats, lambda: run(short, NEW))
        first = best_of(repeats, lambda: run(short, 1))
        out[f"decode_b{batch}"] = batch * (NEW - 1) / (full - first)
    return out


def _timings(run, vocab: int, repeats: int) -> dict:
    """Decode tok/s at batch 1 and 8, prefill tok/s of one 512-token and eight 64-token prompts."""
    out = _decode_timings(run, vocab, repeats)
    long = prompts(1, PREFILL, vocab)
    run(long, 1)
    out["prefill_b1"] = PREFILL / best_of(repeats, lambda: run(long, 1))
    batched = prompts(PREFILL_BATCH, PREFILL_BATCH_LENGTH, vocab)
    run(batched, 1)
    out["prefill_b8"] = PREFILL_BATCH * PREFILL_BATCH_LENGTH / best_of(repeats, lambda: run(batched, 1))
    return out


def worker_parallel_compile(checkpoint: Path, work: Path, dtype: str) -> dict:
    """Compile at cp = ep = 4 (export backend: the memory question is the compiler's, not the
    backend's); the largest rank's weights file, to hold the compile's peak RSS against."""
    from graphc.config import load_config
    from graphc.compiler.pipeline import CompileOptions, compile

    config = {"model": {"checkpoint": str(checkpoint), "dtype": dtype}, "topology": {"cp": 4, "ep": 4},
              "buckets": {"prefill": [PREFILL_BATCH_LENGTH], "decode": [1], "context_limit": PREFILL + 64},
              "kv_cache": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS}, "backend": "export"}
    path = work / "model-cp4-ep4.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / "artifacts-cp4-ep4"
    start = time.perf_counter()
    manifest = compile(load_config(path), out, CompileOptions(show_progress=False, force=True))
    rank_weights = max((out / r.weights).stat().st_size for r in manifest.ranks)
    return {"seconds": time.perf_counter() - start, "rank_weights": rank_weights}


def worker_compile(checkpoint: Path, work: Path, moe_form: str, dtype: str) -> dict:
    from graphc.buckets.selection import Bucket
    from graphc.config import load_config
    from graphc.compiler.pipeline import CompileOptions, compile

    config = {"model": {"checkpoint": str(checkpoint), "moe_form": moe_form, "dtype": dtype},
              # Prompts of <= 64 tokens run as [B, 64] steps: the eight 64-token prompts prefill in
              # one [8, 64] step (graphc's batched prefill), the 12-token ones in [1, 64] / [8, 64].
              "buckets": {"prefill": [PREFILL], "decode": [1, PREFILL_BATCH], "prompt_as_decode": PREFILL_BATCH_LENGTH,
                          "context_limit": PREFILL + 64},
              "kv_cache": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS},
              "runtime": {"max_num_prefilling_tokens": PREFILL}, "backend": "inductor"}
    path = work / f"model-{moe_form}.yaml"
    path.write_text(yaml.safe_dump(config))
    start = time.perf_counter()
    manifest = compile(load_config(path), work / f"artifacts-{moe_form}", CompileOptions(show_progress=False, force=True))
    forms = {Bucket(g.kind, g.size, g.tokens_per_row).name: g.moe_form for g in manifest.ranks[0].graphs}
    return {"seconds": time.perf_counter() - start, "forms": forms}


def worker_weights_compile(checkpoint: Path, work: Path, dtype: str, weights: str) -> dict:
    """Decode-only artifacts (inductor) of an FP8 checkpoint in `dtype`, its weights `weights`
    (`model.weights`: as-stored or dequantized)."""
    from graphc.config import load_config
    from graphc.compiler.pipeline import CompileOptions, compile

    config = {"model": {"checkpoint": str(checkpoint), "dtype": dtype, "weights": weights},
              "buckets": {"prefill": [PROMPT], "decode": [1, PREFILL_BATCH], "context_limit": PROMPT + NEW + 16},
              "kv_cache": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS}, "backend": "inductor"}
    path = work / f"model-{dtype}-{weights}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / f"artifacts-{dtype}-{weights}"
    start = time.perf_counter()
    manifest = compile(load_config(path), out, CompileOptions(show_progress=False, force=True))
    return {"seconds": time.perf_counter() - start, "weights_file": str(out / manifest.ranks[0].weights)}


def worker_tp_compile(checkpoint: Path, work: Path, tp: int) -> dict:
    """Decode artifacts (inductor, fp32) at tp ranks; every rank's weights file."""
    from graphc.config import load_config
    from graphc.compiler.pipeline import CompileOptions, compile

    config = {"model": {"checkpoint": str(checkpoint), "dtype": "float32"}, "topology": {"tp": tp},
              "buckets": {"prefill": [PROMPT], "decode": [1], "prompt_as_decode": 0, "context_limit": PROMPT + NEW + 16},
              "kv_cache": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS}, "backend": "inductor"}
    path = work / f"model-tp{tp}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / f"artifacts-tp{tp}"
    start = time.perf_counter()
    manifest = compile(load_config(path), out, CompileOptions(show_progress=False, force=True))
    return {"seconds": time.perf_counter() - start, "weights_files": [str(out / r.weights) for r in manifest.ranks]}


def worker_tp_serve(artifacts: Path, vocab: int) -> dict:
    """One greedy generation at batch 1 over every rank of the artifacts; its tokens and the mean
    decode step."""
    from graphc.runtime import Request
    from graphc.runtime.launch import serve

    [outcome] = serve(artifacts, [[Request(p, NEW, stop_at_eos=False) for p in prompts(1, PROMPT, vocab)]])
    decode = outcome.stats["decode-1"]
    return {"tokens": outcome.results[0].output_ids, "decode_ms": decode.seconds / decode.steps * 1e3}


def worker_graphc(artifacts: Path, vocab: int, repeats: int, decode_only: bool = False) -> dict:
    from graphc.runtime import Engine, Request

    engine = Engine(artifacts)
    timings = _decode_timings if decode_only else _timings
    return timings(lambda ps, new: engine.generate([Request(p, new, stop_at_eos=False) for p in ps]), vocab, repeats)


def worker_eager(checkpoint: Path, vocab: int, repeats: int, dtype: str) -> dict:
    from graphc.tools.generate import PagedKV, generate
    from graphc.weights.checkpoint import load_model

    model = load_model(checkpoint, dtype=getattr(torch, dtype))
    kv = PagedKV(BLOCK_SIZE, NUM_BLOCKS)
    return _timings(lambda ps, new: generate(model, ps, new, kv=kv, stop_at_eos=False), vocab, repeats)


def worker_transformers(checkpoint: Path, vocab: int, repeats: int, dtype: str, compiled: bool) -> dict:
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    options = {"eos_token_id": None, "pad_token_id": 0}
    if compiled:
        options["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, dynamic=False)
    model.generation_config = GenerationConfig(**options)

    def run(ps, new):
        with torch.no_grad():
            model.generate(torch.tensor(ps), attention_mask=torch.ones(len(ps), len(ps[0]), dtype=torch.long),
                           max_new_tokens=new, min_new_tokens=new, do_sample=False)

    return _timings(run, vocab, repeats)


def worker_routing(checkpoint: Path, vocab: int) -> dict:
    """Distinct routed experts per MoE layer per decode step, at batch 1 and 8 (eager routing of
    the benchmark's prompts: the bytes the step must read depend on it)."""
    from graphc.tools.generate import PagedKV, generate
    from graphc.weights.checkpoint import load_model
    from graphc.models.deepseek_v3.model import Router

    model = load_model(checkpoint)
    seen: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(int(out[1].unique().numel())))
             for m in model.modules() if isinstance(m, Router)]
    out = {}
    for batch in (1, 8):
        seen.clear()
        generate(model, prompts(batch, PROMPT, vocab), NEW, kv=PagedKV(BLOCK_SIZE, NUM_BLOCKS), stop_at_eos=False)
        decode = seen[len(hooks):]  # the first call of each router is the prefill
        out[f"distinct_b{batch}"] = sum(decode) / (len(decode) / len(hooks))  # summed over layers, per step
    for h in hooks:
        h.remove()
    return out


WORKERS = {"compile": worker_compile, "parallel_compile": worker_parallel_compile, "graphc": worker_graphc, "eager": worker_eager,
           "transformers": worker_transformers, "routing": worker_routing, "weights_compile": worker_weights_compile,
           "tp_compile": worker_tp_compile, "tp_serve": worker_tp_serve}


def run_worker(name: str, *args) -> dict:
    """Run WORKERS[name](*args) in a fresh process; its result plus its peak RSS (bytes)."""
    return timing.run_worker(__file__, name, *args)


def _worker_main(spec: str) -> None:
    name, *args = json.loads(spec)
    flag = lambda s: s == "True"  # noqa: E731
    typed = {"compile": (Path, Path, str, str), "parallel_compile": (Path, Path, str), "graphc": (Path, int, int, flag),
             "eager": (Path, int, int, str), "transformers": (Path, int, int, str, flag), "routing": (Path, int),
             "weights_compile": (Path, Path, str, str), "tp_compile": (Path, Path, int), "tp_serve": (Path, int)}[name]
    result = WORKERS[name](*(cast(a) for cast, a in zip(typed, args)))
    result["peak_rss"] = peak_rss()
    print(json.dumps(result))


def peak_rss() -> int:
    """This process's peak resident set (VmHWM, bytes). Not ru_maxrss: Linux carries that over
    fork and exec, so a worker would report its parent's peak if larger. The compiler's own
    worker processes (inductor's code generation) are not counted: they hold one graph, never
    the weights."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# --- the bytes and flops models -----------------------------------------------------------------------


def step_bytes(args, batch: int, distinct_experts: float, context: int, dtype: str) -> float:
    """Bytes a decode step of `batch` rows must read (see the module docstring); the router
    stays fp32 in every dtype, a rounding error here."""
    from graphc.models.deepseek_v3.model import DeepseekV3

    d = args.hidden_size

    with torch.device("meta"):
        model = DeepseekV3(args)
    total = sum(t.numel() for n, t in model.state_dict().items() if "mlp.experts." not in n and "embed_tokens" not in n)
    expert = 3 * d * args.moe_intermediate_size
    kv = args.num_hidden_layers * batch * context * args.kv_cache_dim
    return torch.finfo(getattr(torch, dtype)).bits // 8 * (total + batch * d + distinct_experts * expert + kv)


def stored_step_bytes(weights_file: Path, args, batch: int, distinct_experts: float, context: int,
                      kv_dtype: str) -> dict[str, float]:
    """`step_bytes` from the bytes the artifacts store, by dtype: every tensor of the rank's
    weights file (scales included) read whole, except one embedding row per token and, of the
    stacked routed experts, the `distinct_experts` chosen (their share of every expert tensor);
    the KV cache in the model dtype."""
    by_dtype: dict[str, float] = {}
    for name, dtype, nbytes in tensor_step_bytes(weights_file, args, batch, distinct_experts):
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    kv = args.num_hidden_layers * batch * context * args.kv_cache_dim * torch.finfo(getattr(torch, kv_dtype)).bits // 8
    by_dtype["KV"] = kv
    return by_dtype


def tensor_step_bytes(weights_file: Path, args, batch: int, distinct_experts: float) -> list[tuple[str, str, float]]:
    """(name, safetensors dtype, bytes a decode step of `batch` rows reads of it) for every tensor
    of a rank's weights file (see `stored_step_bytes`)."""
    from safetensors import safe_open

    moe_layers = args.num_hidden_layers - args.first_k_dense_replace
    out = []
    with safe_open(weights_file, "pt") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            nbytes = math.prod(tensor.get_shape()) * SAFETENSORS_BYTES[tensor.get_dtype()]
            if "mlp.experts." in name:
                nbytes *= distinct_experts / (moe_layers * args.n_routed_experts)
            elif "embed_tokens" in name:
                nbytes *= batch / args.vocab_size
            out.append((name, tensor.get_dtype(), nbytes))
    return out


SAFETENSORS_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4}


def bench_weights(size: str, work: Path, repeats: int) -> None:
    """Decode with the weights of one FP8 checkpoint (128 x 128 blocks) stored fp32, bf16, and FP8
    as stored (bf16 compute): tok/s, the bytes a step reads by dtype, the roofline and the
    fraction of it reached, each measured in this run."""
    from graphc.models.registry import model_args_from_hf_config
    from graphc.weights.tiny import preset_config, write_random_checkpoint

    config = {**preset_config("lora-groups"), **SIZES[size],
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}
    args = model_args_from_hf_config(config)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint-fp8"
    if not (checkpoint / "config.json").is_file() or json.loads((checkpoint / "config.json").read_text()) != config:
        write_random_checkpoint(checkpoint, config, seed=0)
    bandwidth = measure_bandwidth()
    print(f"\n== {size}, weights of an FP8 checkpoint three ways; bandwidth {bandwidth / 1e9:.1f} GB/s (measured now)")
    routing = run_worker("routing", checkpoint, args.vocab_size)
    ways = {"fp32": ("float32", "dequantized"), "bf16": ("bfloat16", "dequantized"), "fp8 as stored": ("bfloat16", "as-stored")}
    rows = {}
    for label, (dtype, weights) in ways.items():
        compiled = run_worker("weights_compile", checkpoint, work, dtype, weights)
        timed = run_worker("graphc", work / f"artifacts-{dtype}-{weights}", args.vocab_size, repeats, True)
        rows[label] = (dtype, compiled, timed)
        print(f"compile ({label}): {compiled['seconds']:.0f} s; weights file "
              f"{_gb(Path(compiled['weights_file']).stat().st_size)}")
    bf16 = rows["bf16"][2]
    print(f"{'':16s} {'batch':>5s} {'tok/s':>8s} {'vs bf16':>8s} {'MB/step':>8s} {'by dtype (MB)':40s} {'roofline':>9s} {'reached':>8s}")
    for label, (dtype, compiled, timed) in rows.items():
        for batch in (1, 8):
            context = PROMPT + NEW // 2
            parts = stored_step_bytes(Path(compiled["weights_file"]), args, batch, routing[f"distinct_b{batch}"],
                                      context, dtype)
            needed = sum(parts.values())
            roofline = bandwidth / needed * batch
            speed = timed[f"decode_b{batch}"]
            split = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in parts.items())
            print(f"{label:16s} {batch:5d} {speed:8.1f} {speed / bf16[f'decode_b{batch}']:7.2f}x {needed / 1e6:8.1f} "
                  f"{split:40s} {roofline:9.0f} {speed / roofline:8.0%}")


def bench_tensor_parallel(size: str, work: Path) -> None:
    """Decode at batch 1 (fp32, inductor) at tp = 1 and tp = 2: the tokens, and what a rank's
    step reads by kind of weight, from each rank's weights file (`stored_step_bytes` per tensor):
    the tensors tensor parallelism splits halve, the others (latent projections, norms, routers,
    routed experts: ep = 1 here) do not. Step times are printed for what they are: at tp = 2 the two
    ranks share this machine's cores with each other, so they are not a speed result."""
    from graphc.models.registry import family_of, model_args_from_hf_config
    from graphc.weights.tiny import preset_config, write_random_checkpoint

    config = {**preset_config("lora-groups"), **SIZES[size]}
    args = model_args_from_hf_config(config)
    split_dim = family_of(args).tensor_parallel_dim
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint"
    if not (checkpoint / "config.json").is_file() or json.loads((checkpoint / "config.json").read_text()) != config:
        write_random_checkpoint(checkpoint, config, seed=0)
    routing = run_worker("routing", checkpoint, args.vocab_size)
    context = PROMPT + NEW // 2
    print(f"\n== {size}, decode batch 1 at tp = 1 and tp = 2 (fp32, inductor)")
    print(f"{'':6s} {'rank':>4s} {'split MB':>9s} {'whole MB':>9s} {'experts MB':>10s} {'KV MB':>7s} {'step ms':>8s}  tokens")
    runs = {}
    for tp in (1, 2):
        compiled = run_worker("tp_compile", checkpoint, work, tp)
        served = run_worker("tp_serve", work / f"artifacts-tp{tp}", args.vocab_size)
        runs[tp] = served
        for rank, weights_file in enumerate(compiled["weights_files"]):
            kinds = {"split": 0.0, "whole": 0.0, "experts": 0.0}
            for name, _, nbytes in tensor_step_bytes(Path(weights_file), args, 1, routing["distinct_b1"]):
                kinds["experts" if "mlp.experts." in name else "split" if split_dim(name) is not None else "whole"] += nbytes
            kv = stored_step_bytes(Path(weights_file), args, 1, routing["distinct_b1"], context, "float32")["KV"]
            print(f"tp={tp:<3d} {rank:4d} {kinds['split'] / 1e6:9.2f} {kinds['whole'] / 1e6:9.2f} "
                  f"{kinds['experts'] / 1e6:10.2f} {kv / 1e6:7.2f} {served['decode_ms']:8.2f}  "
                  f"{served['tokens'][:6]}... (compile {compiled['seconds']:.0f} s)")
    print("tokens at tp = 2 " + ("equal" if runs[1]["tokens"] == runs[2]["tokens"] else "DIFFER from") + " tp = 1's")



def prefill_flops(args, tokens: int) -> float:
    """Multiply-adds x 2 of a prefill of `tokens` tokens (one row; logits for the last token)."""
    from graphc.models.deepseek_v3.model import DeepseekV3

    with torch.device("meta"):
        model = DeepseekV3(args)
    per_token = 0
    for name, t in model.state_dict().items():
        if t.dim() < 2 or "embed_tokens" in name or name == "lm_head.weight":
            continue
        if "mlp.experts." in name:
            per_token += t[0].numel() * args.num_experts_per_tok  # K of the stacked experts
        elif "kv_b_proj" in name:
            continue  # absorbed into attention below
        else:
            per_token += t.numel()
    heads, latent = args.num_attention_heads, args.kv_lora_rank
    absorb = heads * latent * (args.qk_nope_head_dim + args.v_head_dim)  # W_uk into q, W_uv out of the latent
    attention = heads * (2 * latent + args.qk_rope_head_dim) * (tokens + 1) / 2  # QK and PV over the causal half
    per_layer = args.num_hidden_layers * (absorb + attention)
    return 2 * (tokens * (per_token + per_layer) + args.vocab_size * args.hidden_size)


# --- the ladder ------------------------------------------------------------------------------------------


def bench_size(size: str, work: Path, repeats: int, with_dense: bool, dtype: str) -> None:
    from graphc.models.registry import model_args_from_hf_config
    from graphc.weights.tiny import preset_config, write_random_checkpoint

    config = {**preset_config("lora-groups"), **SIZES[size]}
    args = model_args_from_hf_config(config)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint"
    if not (checkpoint / "config.json").is_file() or json.loads((checkpoint / "config.json").read_text()) != config:
        write_random_checkpoint(checkpoint, config, seed=0)
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        params = sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())
    vocab = args.vocab_size
    bandwidth, gemm = measure_bandwidth(), measure_gemm(args.hidden_size, getattr(torch, dtype))
    print(f"\n== {size}, {dtype}: {params / 1e6:.1f} M parameters stored (MTP layer included); bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, {dtype} GEMM {gemm / 1e9:.0f} GFLOP/s (measured now)")
    forms = ["auto", "dense"] if with_dense else ["auto"]
    compiled = {form: run_worker("compile", checkpoint, work, form, dtype) for form in forms}
    for form, c in compiled.items():
        print(f"compile ({form}): {c['seconds']:.0f} s, peak RSS {_gb(c['peak_rss'])}; forms {c['forms']}")
    sharded = run_worker("parallel_compile", checkpoint, work, dtype)
    print(f"compile at cp=ep=4 (export): {sharded['seconds']:.0f} s, peak RSS {_gb(sharded['peak_rss'])} = "
          f"{sharded['peak_rss'] / sharded['rank_weights']:.2f}x the largest rank's weights ({_gb(sharded['rank_weights'])})")
    results = {"graphc inductor": run_worker("graphc", work / "artifacts-auto", vocab, repeats)}
    if with_dense:
        results["graphc inductor, dense MoE"] = run_worker("graphc", work / "artifacts-dense", vocab, repeats)
    results["graphc eager"] = run_worker("eager", checkpoint, vocab, repeats, dtype)
    results["transformers eager"] = run_worker("transformers", checkpoint, vocab, repeats, dtype, False)
    results["transformers compile"] = run_worker("transformers", checkpoint, vocab, repeats, dtype, True)
    routing = run_worker("routing", checkpoint, vocab)

    hf_compiled = results["transformers compile"]
    print(f"{'':28s} {'decode b1':>10s} {'vs HFc':>7s} {'decode b8':>10s} {'vs HFc':>7s} "
          f"{'prefill b1':>11s} {'vs HFc':>7s} {'prefill b8':>11s} {'vs HFc':>7s} {'peak RSS':>9s}")
    for name, r in results.items():
        cells = [f"{r[key]:10.1f} {r[key] / hf_compiled[key]:6.2f}x" for key in ("decode_b1", "decode_b8")]
        cells += [f"{r[key]:11.0f} {r[key] / hf_compiled[key]:6.2f}x" for key in ("prefill_b1", "prefill_b8")]
        print(f"{name:28s} {' '.join(cells)} {_gb(r['peak_rss']):>9s}")
    ours = results["graphc inductor"]
    for batch in (1, 8):
        context = PROMPT + NEW // 2
        needed = step_bytes(args, batch, routing[f"distinct_b{batch}"], context, dtype)
        roofline = bandwidth / needed * batch
        print(f"decode b{batch}: {needed / 1e6:.1f} MB per step ({routing[f'distinct_b{batch}']:.1f} distinct routed "
              f"experts over the MoE layers); roofline {roofline:.0f} tok/s; graphc {ours[f'decode_b{batch}']:.1f} tok/s "
              f"= {ours[f'decode_b{batch}'] / roofline:.0%} of it; transformers compile "
              f"{hf_compiled[f'decode_b{batch}'] / roofline:.0%}")
    flops = prefill_flops(args, PREFILL)
    achieved = flops / (PREFILL / ours["prefill_b1"])
    print(f"prefill {PREFILL}: {flops / 1e9:.1f} GFLOP; graphc {achieved / 1e9:.0f} GFLOP/s = {achieved / gemm:.0%} of the "
          f"measured GEMM rate")
    batched = flops / PREFILL * ours["prefill_b8"]  # the 512-token prefill's flops per token: attention's a little high
    print(f"prefill {PREFILL_BATCH} x {PREFILL_BATCH_LENGTH} (one [8, 64] step): graphc about {batched / 1e9:.0f} GFLOP/s "
          f"= {batched / gemm:.0%} of the measured GEMM rate")


def _gb(n) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f} GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,140m,1b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--with-dense", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weights", action="store_true",
                        help="instead of the ladder: decode with one FP8 checkpoint's weights stored fp32, bf16 and "
                             "FP8 as stored, against each other and the roofline")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="instead of the ladder: decode at tp = 1 and tp = 2, the tokens and each rank's bytes")
    # Absolute: the workers run in bench/.
    parser.add_argument("--work", type=lambda p: Path(p).resolve(), default=ROOT / "build" / "bench-scale")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        return _worker_main(options.worker)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {options.repeats}")
    for size in options.sizes.split(","):
        if size not in SIZES:
            raise SystemExit(f"--sizes: {size!r} is unknown; sizes: {', '.join(SIZES)}")
        if options.tensor_parallel:
            bench_tensor_parallel(size, options.work / size / "tensor-parallel")
        elif options.weights:
            bench_weights(size, options.work / size, options.repeats)
        else:
            bench_size(size, options.work / size, options.repeats, options.with_dense, options.dtype)


if __name__ == "__main__":
    main()
