"""`graphc` command line: parse, validate, echo what was resolved, call the typed API.

Bad input (`GraphcError`) prints one line `error: ...` and exits with status 2, as click's own
usage errors do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

# Before torch loads (c10 reads it once): c10d's C++ logs (a lost peer's socket errors, store
# retries, with C++ stack traces) would bury the one line graphc prints for each failure. Set
# TORCH_CPP_LOG_LEVEL=INFO to see them.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import click  # noqa: E402

from graphc.backends import BACKENDS, backend  # noqa: E402
from graphc.errors import GraphcError, Interrupted
from graphc.models.moe_forms import MOE_LOWERING_CHOICES
from graphc.sampling import MAX_TOP_LOGPROBS, SEED_MAX
from graphc.server.limits import (BODY_BASE_BYTES, BODY_BYTES_PER_TOKEN, BODY_SECONDS, MAX_CHOICES, MAX_N,
                                  PREFIX_CACHE_ISOLATION, TEMPLATE_SECONDS, RequestLimits)

EXIT_BAD_INPUT = 2


class _Group(click.Group):
    """Turns `GraphcError` from any command into a one-line message and exit status 2, and an
    interrupt (Ctrl-C, SIGTERM) into one line and 128 + the signal's number (130, 143)."""

    def invoke(self, ctx: click.Context):
        signal.signal(signal.SIGTERM, _raise_interrupted)
        try:
            return super().invoke(ctx)
        except GraphcError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            click.echo("error: interrupted (SIGINT); every rank was stopped", err=True)
            ctx.exit(128 + signal.SIGINT)
        except Interrupted as e:
            click.echo(f"error: stopped by {signal.Signals(e.signum).name}; every rank was stopped", err=True)
            ctx.exit(128 + e.signum)


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@click.group(cls=_Group)
@click.version_option(package_name="graphc")
def cli() -> None:
    """Compile Mixture-of-Experts LLMs ahead of time for static-shape accelerators, and serve them."""


@cli.group()
def checkpoint() -> None:
    """Make and inspect HF-layout checkpoints."""


@checkpoint.command("make-tiny")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", default=None, help="Architecture preset (default: lora-groups); `graphc checkpoint presets` lists "
              "them. `trained`: a tiny DeepSeek-V3 trained on text, with its MTP layer (not random).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights (not for --preset trained).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--fp8-block", type=click.IntRange(min=1), default=None,
              help="Store the projection weights as FP8 with NxN scale blocks (DeepSeek's release format uses 128).")
@click.option("--index-topk", type=click.IntRange(min=1), default=None,
              help="DeepSeek-V3.2 presets: keys each query attends to (below the context: sparse attention).")
def make_tiny(out: Path, preset: str | None, seed: int, force: bool, fp8_block: int | None,
              index_topk: int | None) -> None:
    """Write a tiny checkpoint of any family (config.json + model.safetensors) to OUT: random
    weights, or the trained one."""
    from graphc.weights.tiny import DEFAULT_PRESET, TRAINED_PRESET, make_tiny_checkpoint

    preset = preset or DEFAULT_PRESET
    if preset == TRAINED_PRESET and seed:
        raise click.BadParameter("the trained preset's weights are trained, not drawn from a seed", param_hint="--seed")
    path = make_tiny_checkpoint(out, preset=preset, seed=seed, force=force, fp8_block=fp8_block,
                                index_topk=index_topk)
    fp8 = f", FP8 in {fp8_block}x{fp8_block} blocks" if fp8_block else ""
    sparse = f", index_topk {index_topk}" if index_topk else ""
    weights = "trained weights" if preset == TRAINED_PRESET else f"seed {seed}"
    click.echo(f"wrote tiny checkpoint (preset {preset}, {weights}{fp8}{sparse}) to {path}")


@checkpoint.command("presets")
def presets() -> None:
    """List the tiny-checkpoint presets: each family's first one whole, the others as their
    difference from it."""
    from graphc.weights.tiny import PRESETS, TRAINED_CHECKPOINT, TRAINED_PRESET, preset_difference

    for name in PRESETS:
        family, config = preset_difference(name)
        click.echo(f"{name} ({family}): {json.dumps(config)}")
    config = json.loads((TRAINED_CHECKPOINT / "config.json").read_text())
    click.echo(f"{TRAINED_PRESET} (DeepSeek-V3, trained on text with its MTP layer): {json.dumps(config)}")


@cli.command()
@click.argument("config_path", metavar="MODEL_YAML", type=click.Path(path_type=Path))
def validate(config_path: Path) -> None:
    """Check MODEL_YAML against the schema and its checkpoint, and print the resolved config."""
    from graphc.config import load_config

    from graphc.weights.checkpoint import check_checkpoint

    config = load_config(config_path)
    checked = check_checkpoint(config.model.checkpoint)
    click.echo(_describe_config(config))
    click.echo(f"checkpoint {len(checked.expected)} tensors in {len(set(checked.files.values()))} file(s): names, "
               "dtypes, shapes and byte ranges checked")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integers (e.g. '1,2,3')") from None
    if not ids:
        raise click.BadParameter("a prompt needs at least one token id")
    return ids


@cli.command()
@click.argument("config_path", metavar="MODEL_YAML", type=click.Path(path_type=Path))
@click.option("--prompt-ids", "prompt_ids", multiple=True, required=True,
              help="Comma-separated token ids of one prompt; repeat for several prompts.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens to generate per prompt (default: runtime.max_new_tokens).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt.")
def generate(config_path: Path, prompt_ids: tuple[str, ...], max_new_tokens: int | None, as_json: bool) -> None:
    """Generate with graphc's eager reference model on the paged cache (no compilation)."""
    import torch

    from graphc.config import load_config
    from graphc.tools.generate import PagedKV, generate as run_generate
    from graphc.sampling import Sampling
    from graphc.weights.checkpoint import load_model
    from graphc.request import vocabulary_error

    config = load_config(config_path)
    prompts = [_parse_ids(p) for p in prompt_ids]
    limit = max_new_tokens or config.runtime.max_new_tokens
    for i, prompt in enumerate(prompts):
        if len(prompt) + limit > config.buckets.context_limit:
            raise GraphcError(
                f"prompt {i}: {len(prompt)} tokens + {limit} new tokens exceed buckets.context_limit "
                f"({config.buckets.context_limit})"
            )
    vocab = config.model_args.vocab_size
    for i, prompt in enumerate(prompts):
        outside = vocabulary_error(prompt, vocab)
        if outside:
            raise GraphcError(f"prompt {i}: {outside}")
    model = load_model(config.model.checkpoint, dtype=getattr(torch, config.model.dtype),
                       sparse_probabilities=config.model.sparse_probabilities)
    click.echo(_describe_config(config), err=True)  # echoed once everything is known to be valid
    s = config.runtime.sampling
    outputs = run_generate(
        model, prompts, limit,
        kv=PagedKV(config.kv_cache.block_size, config.kv_cache.num_blocks),
        prefill_chunk=max(config.buckets.prefill),
        sampling=Sampling(s.temperature, s.top_k, s.top_p, s.seed),
    )
    for prompt, tokens in zip(prompts, outputs):
        if as_json:
            click.echo(json.dumps({"prompt_ids": prompt, "output_ids": tokens}))
        else:
            click.echo(" ".join(map(str, tokens)))


@cli.command("compile")
@click.argument("config_path", metavar="MODEL_YAML", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="Artifacts directory to write.")
@click.option("--backend", type=click.Choice(list(BACKENDS)), default=None,
              help="Overrides model.yaml's backend.")
@click.option("--disable-pass", "disabled", multiple=True, help="Skip a pass by name (debugging); repeatable.")
@click.option("--dump-graphs", type=click.Path(path_type=Path), default=None,
              help="Write each graph before and after every pass into this directory.")
@click.option("--verify-passes", is_flag=True, help="Run the graph verifier between passes.")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Parallel compile processes.")
@click.option("--force", is_flag=True, help="Replace the output directory if it holds graphc artifacts (only then).")
@click.option("--sign-key", type=click.Path(path_type=Path), default=None,
              help="Ed25519 private key (PEM, from `graphc keygen`): sign the artifacts.")
@click.option("--moe-lowering", type=click.Choice(MOE_LOWERING_CHOICES), default=None,
              help="Overrides model.yaml's model.moe_lowering (how exchanged MoE tokens travel).")
@click.option("--shapes-only", is_flag=True,
              help="Abstract weights (no weight bytes read): every program, no weights; what a checkpoint of config.json "
                   "alone compiles to anyway. The artifacts cannot be served.")
def compile_command(config_path, out, backend, disabled, dump_graphs, verify_passes, jobs, force, sign_key,
                    moe_lowering, shapes_only) -> None:
    """Capture, rewrite and compile MODEL_YAML's model: one program per bucket, which every rank runs."""
    from graphc.config import load_config
    from graphc.compiler.pipeline import CompileOptions, compile

    config = load_config(config_path)
    if moe_lowering:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, moe_lowering=moe_lowering))
    options = CompileOptions(backend=backend, disabled_passes=frozenset(disabled), dump_graphs=dump_graphs,
                             verify_passes=verify_passes, force=force, sign_key=sign_key, shapes_only=shapes_only,
                             **({"workers": jobs} if jobs else {}))
    manifest = compile(config, out, options, on_checked=lambda: click.echo(_describe_config(config, backend), err=True))
    for note in manifest.extra.get("notes", []):
        click.echo(f"note: {note}", err=True)
    graphs = {g.file for r in manifest.ranks for g in r.graphs}
    click.echo(f"wrote {out}: {sum(len(r.graphs) for r in manifest.ranks)} graphs over {len(manifest.ranks)} "
               f"rank(s), {len(graphs)} distinct, backend {manifest.backend}" + (", signed" if sign_key else "")
               + (", shapes only (no weights: not servable)" if manifest.shapes_only else ""))


@cli.command("neuron-finish")
@click.argument("artifacts", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Artifacts directory to write (the input is never modified).")
@click.option("--target", type=click.Choice(["trn1", "trn2", "trn3"]), default="trn2", show_default=True,
              help="neuronx-cc --target: the Neuron generation.")
@click.option("--lnc", type=click.Choice(["1", "2"]), default=None,
              help="neuronx-cc --lnc: physical NeuronCores a logical one (a rank); trn2 / trn3 only [2 there]. "
                   "The runtime's NEURON_LOGICAL_NC_CONFIG must equal it.")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="neuronx-cc runs at once [one a CPU, as many as the available memory holds at 32 GiB each].")
@click.option("--force", is_flag=True, help="Replace the output directory if it holds graphc artifacts (only then).")
@click.option("--sign-key", type=click.Path(path_type=Path), default=None, help="Sign the finished artifacts.")
@click.option("--trusted-key", type=click.Path(path_type=Path), default=None,
              help="Refuse input artifacts this Ed25519 public key did not sign.")
def neuron_finish(artifacts, out, target, lnc, jobs, force, sign_key, trusted_key) -> None:
    """On a Neuron host: compile every program of neuron ARTIFACTS to a NEFF with neuronx-cc."""
    from graphc.backends.neuron_archive import check_flags, default_lnc
    from graphc.tools.neuron_finish import finish

    lnc = None if lnc is None else int(lnc)
    check_flags(target, lnc)  # before anything is read: a bad pair is a usage error
    count = finish(artifacts, out, target, lnc, force, sign_key, trusted_key, jobs)
    lnc = default_lnc(target) if lnc is None else lnc
    click.echo(f"wrote {out}: {count} NEFF(s) for --target {target}" + (f" --lnc {lnc}" if lnc else "")
               + (", signed" if sign_key else ""))


@cli.command()
@click.argument("private_key", type=click.Path(path_type=Path))
def keygen(private_key: Path) -> None:
    """Write a new Ed25519 key pair: PRIVATE_KEY (for `compile --sign-key`, mode 0600) and
    PRIVATE_KEY.pub (for `run --trusted-key` on the serving hosts)."""
    from graphc.artifacts.signing import generate_key

    public = generate_key(private_key)
    click.echo(f"wrote private key {private_key} and public key {public}")


def _host_options(command):
    """torchrun's multi-node options, for a job whose ranks span hosts (one command per host)."""
    options = [
        click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Hosts the job's ranks span; run the same command on each, with its own --node-rank."),
        click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
                     help="This host's number; host 0 runs the leader (rank 0) and the rendezvous store."),
        click.option("--master-addr", default=None, help="Host 0's address, reachable from every host [127.0.0.1]."),
        click.option("--master-port", type=click.IntRange(1, 65535), default=None,
                     help="The rendezvous store's port on host 0 [29500]."),
        click.option("--rdzv-endpoint", default=None, help="HOST:PORT: --master-addr and --master-port in one."),
        click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
                     help="Ranks on each host (default: the artifacts' ranks / --nnodes)."),
        click.option("--join-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
                     help="Seconds the hosts wait for each other to join before naming the missing ones."),
        click.option("--job-secret-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
                     help="File holding the job's secret, the same on every host (or set GRAPHC_JOB_SECRET): "
                          "needed with --nnodes > 1; it authenticates the hosts' rendezvous."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _hosts(nnodes, node_rank, master_addr, master_port, rdzv_endpoint, nproc_per_node, join_timeout, job_secret_file):
    from graphc.runtime.hosts import HostOptions

    return HostOptions.from_cli(nnodes, node_rank, master_addr, master_port, rdzv_endpoint, nproc_per_node,
                                join_timeout, job_secret_file)


@cli.command()
@click.argument("artifacts", type=click.Path(path_type=Path))
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Comma-separated token ids; repeatable.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (needs the checkpoint's tokenizer.json); repeatable.")
@click.option("--prompts-file", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="JSONL: one object per line with 'prompt' or 'prompt_ids' and optional sampling overrides.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Default: the manifest's, clipped to the room the context leaves.")
@click.option("--temperature", type=float, default=None, help="0 is greedy (default: the manifest's).")
@click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens; 0 keeps all.")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling mass, in (0, 1].")
@click.option("--seed", type=int, default=None, help="Sampling seed, 0..2**32-1.")
@click.option("--ignore-eos", is_flag=True, help="Generate through EOS tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt.")
@click.option("--logprobs", type=click.IntRange(0, MAX_TOP_LOGPROBS), default=None,
              help="With --json: each generated token's log-probability and its position's N most likely tokens'.")
@click.option("--prompt-logprobs", type=click.IntRange(0, MAX_TOP_LOGPROBS), default=None,
              help="With --json: each prompt token's log-probability (the first's is null) and its position's N most "
                   "likely tokens' (artifacts compiled with runtime.prompt_logprobs).")
@click.option("--trusted-key", type=click.Path(path_type=Path), default=None,
              help="Ed25519 public key (PEM): refuse artifacts it did not sign, before loading anything.")
@click.option("--verbose", is_flag=True, help="Several ranks: also show the launcher's own log lines.")
@_host_options
def run(artifacts, prompt_ids, prompts, prompts_file, max_new_tokens, temperature, top_k, top_p, seed,
        ignore_eos, as_json, logprobs, prompt_logprobs, trusted_key, verbose, **host_options) -> None:
    """Generate from precompiled ARTIFACTS (no compilation at serve time); artifacts compiled for
    several ranks run as one process per rank (torchrun's agent), the leader printing. A job
    that spans hosts runs this command on each host (--nnodes, --node-rank, ...); host 0 takes the
    prompts and prints, the others need none."""
    from graphc.artifacts.directory import read_manifest
    from graphc.request import Asked, first_sampling_error, read_prompts_file, run_request
    from graphc.runtime.launch import serve
    from graphc.runtime.scheduler import Result

    overrides = {k: v for k, v in {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}.items()
                 if v is not None}
    bad = first_sampling_error(overrides)  # before any file is read
    if bad:
        raise GraphcError(f"--{bad[0].replace('_', '-')} {bad[1]}")
    for flag, value in {"--logprobs": logprobs, "--prompt-logprobs": prompt_logprobs}.items():
        if value is not None and not as_json:
            raise click.UsageError(f"{flag} prints with --json only: give --json too")
    hosts = _hosts(**host_options)
    manifest = read_manifest(artifacts, trusted_key)
    if prompt_logprobs is not None and not manifest.buckets.prompt_logprobs:
        raise GraphcError(f"--prompt-logprobs: {artifacts} has no score programs; compile it with "
                          "runtime.prompt_logprobs: true in model.yaml")
    world = manifest.topology.world
    tokenizer = None
    if manifest.tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(artifacts / manifest.tokenizer))
    asked = [Asked(p, f"prompt {i}") for i, p in enumerate([*map(_parse_ids, prompt_ids), *prompts])]
    asked += read_prompts_file(prompts_file) if prompts_file is not None else []
    if not asked and hosts.node_rank == 0:  # the other hosts of a job take no prompts: the leader serves
        raise click.UsageError("give at least one prompt: --prompt-ids, --prompt or --prompts-file")
    resolved = [run_request(a, manifest, tokenizer, max_new_tokens, overrides, not ignore_eos) for a in asked]
    resolved = [(dataclasses.replace(request, logprobs=logprobs, prompt_logprobs=prompt_logprobs), error)
                for request, error in resolved]
    servable = [request for request, error in resolved if error is None]
    on = f", host {hosts.node_rank} of {hosts.nnodes}" if hosts.nnodes > 1 else ""
    click.echo(f"loading {artifacts}: {world} rank(s){on}, backend {manifest.backend}", err=True)
    # Over several hosts every host starts its ranks, even with nothing to serve: the others wait for it.
    launch = servable or hosts.nnodes > 1
    outcomes = serve(artifacts, [servable], manifest, trusted_key, verbose, hosts=hosts) if launch else [None]
    if outcomes is None:  # another host's part of the job: the leader's host prints
        return
    [outcome] = outcomes
    served = iter(outcome.results if outcome else [])
    results = [Result(request, [], "error", error) if error else _named(next(served), where.where)
               for (request, error), where in zip(resolved, asked)]
    failed = 0
    for result in results:
        failed += result.error is not None
        text = tokenizer.decode(result.output_ids) if tokenizer and result.error is None else None
        if as_json:
            record = {"prompt_ids": result.request.prompt, "output_ids": result.output_ids,
                      "finish_reason": result.finish_reason, **_latencies(result)}
            record.update({"text": text} if text is not None else {})
            record.update({"logprobs": list(map(_logprob_record, result.logprobs))} if result.logprobs else {})
            record.update({"prompt_logprobs": [_logprob_record(entry) if entry else None
                                               for entry in result.prompt_logprobs]} if result.prompt_logprobs else {})
            record.update({"error": result.error} if result.error else {})
            click.echo(json.dumps(record))
        elif result.error:
            click.echo(f"error: {result.error}", err=True)
        else:
            click.echo(" ".join(map(str, result.output_ids)) + (f"\t{text!r}" if text is not None else ""))
    if outcome and any(outcome.drafts.proposed):
        rates = ", ".join(f"{a}/{p} at {j}" for j, (a, p) in enumerate(zip(outcome.drafts.accepted,
                                                                           outcome.drafts.proposed), start=1))
        click.echo(f"speculative decoding: drafts accepted {rates} (draft position)", err=True)
    if failed:
        raise click.exceptions.Exit(EXIT_BAD_INPUT)


def _latencies(result) -> dict:
    """A result's TTFT (from the start of serving) and time per output token, in ms, where measured."""
    tpot = result.time_per_output_token
    return {**({"ttft_ms": result.first_token_seconds * 1e3} if result.first_token_seconds is not None else {}),
            **({"tpot_ms": tpot * 1e3} if tpot is not None else {})}


def _logprob_record(entry) -> dict:
    """A token's `runtime.logprobs.TokenLogprobs` as `graphc run --json` prints it."""
    return {"logprob": entry.logprob, "top": [{"id": token, "logprob": logprob} for token, logprob in entry.top]}


def _named(result, where: str):
    """A served request's result, its error (the scheduler's refusal) naming the prompt or line."""
    return dataclasses.replace(result, error=f"{where}: {result.error}") if result.error else result


@cli.command()
@click.argument("artifacts", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option("--model-name", default=None, help="The model id clients name (default: the artifacts directory's name).")
@click.option("--max-waiting", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests that may wait for admission; past it, HTTP 429 with Retry-After.")
@click.option("--grace-period", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds SIGTERM gives in-flight requests before ending them with an error.")
@click.option("--trusted-key", type=click.Path(path_type=Path), default=None,
              help="Ed25519 public key (PEM): refuse artifacts it did not sign, before loading anything.")
@click.option("--api-key", envvar="GRAPHC_API_KEY", default=None,
              help="Every route but /health needs Authorization: Bearer KEY, 401 otherwise "
                   "(prefer GRAPHC_API_KEY: a command line is visible to every user of the host).")
@click.option("--api-keys-file", type=click.Path(path_type=Path), default=None,
              help="More API keys, one a line; each key is a tenant (see --prefix-cache-isolation).")
@click.option("--prefix-cache-isolation", type=click.Choice(PREFIX_CACHE_ISOLATION), default="shared",
              show_default=True,
              help="Who shares cached prompt blocks: every request (a request's cache_salt keeps its own apart), "
                   "each API key alone (api-key), or only requests with the same cache_salt, which every request "
                   "must then give (salt).")
@click.option("--hide-cached-tokens", is_flag=True,
              help="Leave usage.prompt_tokens_details.cached_tokens out of responses.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=None,
              help=f"The largest request body; past it, HTTP 413 before the body is read. Default: "
                   f"{BODY_BYTES_PER_TOKEN} bytes per token of the context limit, plus {BODY_BASE_BYTES >> 10} KiB.")
@click.option("--template-timeout", type=click.FloatRange(min=0, min_open=True), default=TEMPLATE_SECONDS,
              show_default=True, help="Seconds a chat template may take to render a request; past it, HTTP 400. "
                                        "A chat that waits this long for a free template worker: HTTP 429.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=BODY_SECONDS, show_default=True,
              help="Seconds a client has to send a request's body once its headers are in; past it, HTTP 408.")
@click.option("--max-n", type=click.IntRange(1, MAX_CHOICES), default=MAX_N, show_default=True,
              help="The most choices (n) a request may ask of one prompt; past it, HTTP 400.")
@click.option("--seed", type=click.IntRange(0, SEED_MAX), default=None,
              help="The sampling seed of a request that gives none (reproducible sampling); default: fresh noise "
                   "per request, as OpenAI's API draws.")
@_host_options
def serve(artifacts, host, port, model_name, max_waiting, grace_period, trusted_key, api_key, api_keys_file,
          prefix_cache_isolation, hide_cached_tokens, max_body_bytes, template_timeout, body_timeout, max_n, seed,
          **host_options) -> None:
    """Serve ARTIFACTS over HTTP with OpenAI's API: /v1/completions (streaming too), /v1/models,
    /health, /metrics (Prometheus). Requests are batched continuously as they arrive. A job that
    spans hosts runs this command on each host (--nnodes, --node-rank, ...); host 0 serves HTTP."""
    from graphc.server.auth import server_keys
    from graphc.server.isolation import CacheIsolation
    from graphc.server.launch import serve_http

    serve_http(artifacts, host, port, max_waiting, grace_period, model_name, trusted_key,
               RequestLimits(max_body_bytes, template_timeout, body_timeout, max_n),
               server_keys(api_key, api_keys_file),
               _hosts(**host_options), seed, CacheIsolation(prefix_cache_isolation, hide_cached_tokens))


@cli.command()
@click.argument("artifacts", type=click.Path(path_type=Path))
@click.option("--lint", is_flag=True, help="Also check the programs' structure (neuron: the HLO lint); exit 1 on a problem.")
@click.option("--memory", is_flag=True,
              help="Also each program's parameter, result and temporary bytes in its compiler's buffer assignment "
                   "(neuron: XLA's, compiling the CPU variants: seconds to minutes a program).")
def inspect(artifacts: Path, lint: bool, memory: bool) -> None:
    """Show ARTIFACTS' buckets, graphs, sizes and op counts (verifies hashes first)."""
    from graphc.artifacts.directory import read_manifest
    m = read_manifest(artifacts)
    programs = backend(m.backend).memory(artifacts, m) if memory else {}
    click.echo(f"graphc {m.graphc_version}, torch {m.torch_version}, backend {m.backend}, "
               f"format {m.format_version}")
    sparse = f", sparse attention P {m.model.sparse_probabilities}" if m.model.sparse_probabilities else ""
    click.echo(f"model {m.model_fingerprint[:16]} ({m.model.architecture}, {m.model.dtype}{sparse}); "
               f"topology {dataclasses.asdict(m.topology)}")
    click.echo(f"buckets {dataclasses.asdict(m.buckets)}; kv_cache {dataclasses.asdict(m.kv_cache)}")
    for note in m.extra.get("notes", []):
        click.echo(f"note: {note}")
    for rank in m.ranks:
        size = (artifacts / rank.weights).stat().st_size
        click.echo(f"rank {rank.rank}: weights {rank.weights} ({size / 1e6:.2f} MB), "
                   f"{'samples' if rank.samples else 'no sampler'}")
        for g in rank.graphs:
            label = g.bucket.name
            counts = m.extra.get("op_counts", {}).get(label, {})  # every rank runs the bucket's one program
            graphc_ops = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()) if op.startswith("graphc::"))
            click.echo(f"  {label:12s} {g.file} ({(artifacts / g.file).stat().st_size / 1e6:.2f} MB; "
                       f"MoE {g.moe_form}, exchange {g.moe_exchange}; {sum(counts.values())} ops; {graphc_ops})")
    if memory:
        for graph in m.ranks[0].graphs:
            p = programs[graph.file]
            click.echo(f"memory: {graph.bucket.name:12s} parameters {p.parameters / 1e6:.2f} MB, results "
                       f"{p.results / 1e6:.2f} MB ({p.aliased / 1e6:.2f} MB of them in a parameter's buffer), "
                       f"temporaries {p.temporaries / 1e6:.2f} MB (XLA:CPU's buffer assignment)")
    if lint:
        from graphc.tools.lint import lint_artifacts

        problems = lint_artifacts(artifacts, m)
        for problem in problems:
            click.echo(f"lint: {problem}", err=True)
        click.echo(f"lint: {len({g.file for r in m.ranks for g in r.graphs})} program(s), "
                   f"{len(problems) or 'no'} problem(s)")
        if problems:
            raise SystemExit(1)


@cli.command()
@click.argument("model_yaml", type=click.Path(path_type=Path))
@click.option("--workload", type=click.Path(path_type=Path),
              help="Prompt lengths (one per line, or `length count`); default: buckets.auto.workload.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path),
              help="Write a PNG of the lengths, buckets and waste (with --workload) and of a rank's memory (with --device).")
@click.option("--device", "device_name", type=str, default=None,
              help="Per rank on this device (trn1, trn2, trn2-lnc1, trn3): weights, KV, activations, fits, decode "
                   "roofline, and each bucket's step time by the step model.")
@click.option("--device-file", type=click.Path(path_type=Path), default=None,
              help="A device file of your own (the shipped ones' form: every value with its provenance and source).")
@click.option("--device-memory", type=float, default=None, help="A rank's memory in GiB (a custom device, or overriding --device's).")
@click.option("--device-bandwidth", type=float, default=None,
              help="A rank's HBM bandwidth in GB/s (a custom device, or overriding --device's).")
@click.option("--artifacts", type=click.Path(path_type=Path), default=None,
              help="This config's compiled artifacts (neuron): activations from their programs' buffer assignment, "
                   "not the estimate (with --device; seconds to minutes a program).")
@click.option("--json", "as_json", is_flag=True, help="Print the device plan as JSON on stdout (with --device).")
@click.option("--search", "search_layouts", is_flag=True,
              help="Price every layout on whole instances of the device (with --device or --device-file): the Pareto "
                   "front of tok/s an instance against tok/s a user, and the layout the objective picks.")
@click.option("--objective", type=click.Choice(["latency", "throughput"]), default=None,
              help="--search: the lowest TPOT (the default), or the most tok/s an instance within the limits.")
@click.option("--tpot-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--search: TPOT at most this.")
@click.option("--ttft-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--search: TTFT (a prompt of half the context) at most this.")
@click.option("--context", type=click.IntRange(min=1), default=None,
              help="--search: tokens a sequence holds (default: buckets.context_limit).")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="--search: the largest decode batch a replica runs (powers of two up to it; default 64).")
@click.option("--instances", type=click.IntRange(min=1), default=None, help="--search: instances (default 1).")
@click.option("--write-yaml", type=click.Path(path_type=Path), default=None,
              help="--search: write model.yaml with the chosen layout here (it compiles as written).")
def plan(model_yaml, workload, plot_path, device_name, device_file, device_memory, device_bandwidth, artifacts,
         as_json, search_layouts, objective, tpot_ms, ttft_ms, context, batch, instances, write_yaml) -> None:
    """Dry run before any capture: the bucket table, expected padding, graphs per rank and in
    all, the collectives each rank issues per step; with --device, what a rank holds and reads,
    and each bucket's step time; with --search, the layouts worth compiling."""
    import json

    from graphc.tools import device_plan
    from graphc.tools import plan as planning
    from graphc.buckets.planner import read_workload
    from graphc.config import load_config

    on_device = any(v is not None for v in (device_name, device_file, device_memory, device_bandwidth))
    target = device_plan.device(device_name, device_memory, device_bandwidth, device_file) if on_device else None
    searched = {"--objective": objective, "--tpot-ms": tpot_ms, "--ttft-ms": ttft_ms, "--context": context,
                "--batch": batch, "--instances": instances, "--write-yaml": write_yaml}
    if search_layouts:
        planned = {"--workload": workload, "--plot": plot_path, "--artifacts": artifacts}
        given = [flag for flag, value in planned.items() if value is not None]
        if given:
            raise GraphcError(f"{given[0]} plans the config's own layout; --search prices every layout without it")
        return _plan_search(model_yaml, target, objective or "latency", tpot_ms, ttft_ms, context, batch or 64,
                            instances or 1, write_yaml, as_json)
    given = [flag for flag, value in searched.items() if value is not None]
    if given:
        raise GraphcError(f"{given[0]} goes with --search")
    for flag, given in (("--json prints", as_json), ("--artifacts measures", artifacts is not None)):
        if given and target is None:
            raise GraphcError(f"{flag} the device plan: pass --device (or --device-memory and --device-bandwidth)")
    config = load_config(model_yaml)
    source = workload or (config.buckets.auto.workload if config.buckets.auto else None)
    if plot_path is not None and source is None and target is None:
        raise GraphcError("--plot needs a workload or a device: pass --workload (or set buckets.auto.workload) "
                          "or --device")
    lengths = None
    if source is not None:
        try:
            lengths = read_workload(source)
        except OSError as e:
            raise GraphcError(f"--workload: cannot read {str(source)!r}: {e.strerror}") from None
        except ValueError as e:
            raise GraphcError(f"--workload: {e}") from None
    measured = device_plan.measured_activations(config, artifacts) if artifacts is not None else None
    memory = device_plan.plan_device(config, target, measured) if target is not None else None
    if as_json:
        click.echo(json.dumps(memory.to_json(), indent=2))
    else:
        click.echo(_describe_config(config))
        for line in planning.describe(config, lengths) + (device_plan.describe(memory) if memory else []):
            click.echo(line)
        if plot_path is not None:
            planning.plot(plot_path, config, lengths,
                          (lambda axis: device_plan.plot(axis, memory)) if memory is not None else None)
            click.echo(f"wrote {plot_path}")
    if memory is not None and not memory.fits:  # the report stands; the status says it cannot be served
        raise GraphcError(f"a rank does not fit the {memory.device} device ({planning.format_bytes(memory.device_bytes)}): "
                          f"{memory.reason}")


@cli.command()
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="The device file to write (give it to graphc plan --device-file and graphc profile).")
@click.option("--ranks", type=click.IntRange(min=2), default=2, show_default=True,
              help="Processes the collective timings run over.")
def calibrate(out: Path, ranks: int) -> None:
    """Measure this host as a device: a rank's memory bandwidth and GEMM rates, gloo's collectives'
    latency and bandwidth; its fixed cost a layer is left to graphc profile --fit."""
    from graphc.perf.calibrate import host_device, write_device

    data = host_device(ranks)
    write_device(data, out)
    link = data["links"]["chip"]
    click.echo(f"wrote {out}: {data['hbm_gbs']['value']:.1f} GB/s, fp32 {data['tflops']['float32']['value']:.3f} / "
               f"bf16 {data['tflops']['bfloat16']['value']:.3f} TFLOPS, all-reduce "
               f"{link['latency_us']['value']:.0f} us + bytes / {link['gbs']['value']:.2f} GB/s")


@cli.command()
@click.argument("model_yaml", type=click.Path(path_type=Path))
@click.argument("artifacts", type=click.Path(path_type=Path))
@click.option("--device-file", type=click.Path(path_type=Path), required=True,
              help="This host's device file (graphc calibrate).")
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True, help="Timed calls a program.")
@click.option("--fit", is_flag=True,
              help="Fit the device file's layer_fixed_us on these programs' times and write it back (calibrated).")
@click.option("--json", "as_json", is_flag=True, help="Print each bucket's measured and predicted ms as JSON.")
def profile(model_yaml: Path, artifacts: Path, device_file: Path, repeats: int, fit: bool, as_json: bool) -> None:
    """Time each bucket's program of a one-rank compile of MODEL_YAML (ARTIFACTS) here, beside the
    step model's prediction with the device file's constants, and the error."""
    import yaml

    from graphc.config import load_config
    from graphc.perf import profile as profiling
    from graphc.perf.device import load_device

    config = load_config(model_yaml)
    device = load_device(path=device_file)
    profiled = profiling.profile(config, artifacts, device, repeats)
    if fit:
        fixed = profiling.fit_layer_fixed(profiled, device)
        data = yaml.safe_load(device_file.read_text())
        buckets = ", ".join(p.bucket for p in profiled)
        data["layer_fixed_us"] = {"value": fixed * 1e6, "provenance": "calibrated",
                                  "source": f"graphc profile --fit on {artifacts} ({buckets})"}
        device_file.write_text(yaml.safe_dump(data, sort_keys=False))
        device = load_device(path=device_file)
        profiled = profiling.refitted(profiled, device)
    if as_json:
        click.echo(json.dumps([p.to_json() for p in profiled], indent=2))
        return
    click.echo(f"{'bucket':14s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>7s}")
    for p in profiled:
        click.echo(f"{p.bucket:14s} {p.measured_ms:12.3f} {p.predicted_ms:13.3f} {p.error:+7.0%}")
    if fit:
        click.echo(f"layer_fixed_us = {device.layer_fixed.value * 1e6:.1f} (fitted), written to {device_file}")


@cli.command()
@click.argument("model_yaml", type=click.Path(path_type=Path))
@click.option("--layer", type=int, required=True, help="Decoder layer to probe (0-based).")
@click.option("--tokens", type=click.IntRange(min=1), default=None,
              help="Length of the probe prefill; default: the largest prefill bucket.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=None,
              help="Relative difference that counts (max |diff| / max |reference|); default by dtype.")
def probe(model_yaml, layer, tokens, tolerance) -> None:
    """Run one layer of the compiled graph and the float64 reference side by side, op by op, and
    name the first op whose output differs beyond the tolerance. Exits 1 if that op is not at a
    known rounding point (bf16 P, bf16 routed partials, a cast to a narrower float)."""
    from graphc.tools import probe as probing
    from graphc.config import load_config

    config = load_config(model_yaml)
    click.echo(_describe_config(config))
    report = probing.probe(config, layer, tokens, tolerance)
    for line in report.lines():
        click.echo(line)
    if report.first is not None and report.first.rounding_point is None:
        raise SystemExit(1)


@cli.command()
@click.argument("model_yaml", type=click.Path(path_type=Path))
@click.argument("artifacts", type=click.Path(path_type=Path))
@click.option("--prompt-ids", "prompt_ids", multiple=True,
              help="Comma-separated token ids; repeatable (default: three built-in prompts).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=27, show_default=True,
              help="Golden tokens per prompt.")
@click.option("--seeds", type=click.IntRange(min=1), default=8, show_default=True,
              help="Perturbed reference runs measuring its noise floor.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the report as JSON.")
def compare(model_yaml, artifacts, prompt_ids, new_tokens, seeds, json_path) -> None:
    """Golden greedy tokens from the model's reference (graphc's eager DeepSeek-V4.1, or
    transformers), the compiled ARTIFACTS teacher-forced on them, per prompt: tokens matched,
    logits cosine and relative error per step, the worst step, the reference's noise floor and
    how many golden tokens the perturbed reference itself keeps. Exits 1 when a mismatch lies outside the floor."""
    from graphc.config import load_config
    from graphc.request import vocabulary_error
    from graphc.tools import compare as comparing

    config = load_config(model_yaml)
    vocab = config.model_args.vocab_size
    prompts = [_parse_ids(text) for text in prompt_ids] or comparing.DEFAULT_PROMPTS
    for ids in prompts:
        if vocabulary_error(ids, vocab):
            raise GraphcError(f"--prompt-ids: token ids must be in 0..{vocab - 1}; got {ids}")
    reports = comparing.compare(config, artifacts, prompts, new_tokens, seeds)
    for line in comparing.summary_lines(reports):
        click.echo(line)
    if json_path is not None:
        json_path.write_text(json.dumps(comparing.as_json(reports), indent=2) + "\n")
        click.echo(f"wrote {json_path}")
    if any(not m.inside_floor for r in reports for m in r.mismatches):
        raise SystemExit(1)


@cli.command()
@click.argument("model_yaml", type=click.Path(path_type=Path))
@click.option("--topologies", default="1x1,2x2", show_default=True,
              help="CPxEP (or DPxCPxEP: data-parallel replicas; DPxCPxTPxEP: tensor parallelism) stages, "
                   "comma-separated; 1x1 always runs first (the reference).")
@click.option("--backends", default="export", show_default=True, help="Comma-separated backends that serve on this host: export, inductor, neuron (on XLA:CPU).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("sweep-report"), show_default=True,
              help="Directory for sweep.xml (JUnit), sweep.md, sweep.json and the stages' artifacts.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=8, show_default=True, help="Tokens generated per prompt.")
@_host_options
def sweep(model_yaml, topologies, backends, out, new_tokens, **host_options) -> None:
    """Compile MODEL_YAML at every topology and backend, run prompts that hit every bucket, and
    check the tokens against one rank and transformers. Exit status 1 on any mismatch. Over
    several hosts (--nnodes, --node-rank, ...) every host runs this command: a stage whose ranks
    divide among the hosts spans them (its rendezvous on --master-port + the stage's number), the
    others run on host 0, which checks and reports."""
    from graphc.tools import sweep as sweeping
    from graphc.config import load_config

    config = load_config(model_yaml)
    stages_wanted = sweeping.parse_topologies(topologies)
    backend_list = [b.strip() for b in backends.split(",") if b.strip()]
    here = [name for name, b in BACKENDS.items() if b.serves_here]
    unknown = [b for b in backend_list if b not in here]
    if unknown or not backend_list:
        raise GraphcError(f"--backends: {unknown[0] if unknown else backends!r} is not a backend that serves on this "
                          f"host; use {', '.join(here)}")
    hosts = _hosts(**host_options)
    stages = sweeping.sweep(config, out / "artifacts", stages_wanted, backend_list, new_tokens,
                            log=lambda line: click.echo(line, err=True), hosts=hosts)
    if hosts.node_rank > 0:
        click.echo(f"host {hosts.node_rank}: its part of every stage served; host 0 checks and reports", err=True)
        return
    paths = sweeping.write_reports(stages, out)
    click.echo(sweeping.markdown(stages))
    click.echo(f"reports: {', '.join(str(p) for p in paths.values())}", err=True)
    if not sweeping.passed(stages):
        failed = sum(bool(r.failures) for s in stages for r in s.cases)
        click.echo(f"sweep failed: {failed} case(s) differ (see {paths['markdown']})", err=True)
        raise SystemExit(1)


def _plan_search(model_yaml: Path, target, objective: str, tpot_ms, ttft_ms, context, batch: int, instances: int,
                 write_yaml: Path | None, as_json: bool) -> None:
    """`graphc plan --search` (`perf.search`)."""
    import yaml

    from graphc.config import load_config
    from graphc.perf import search
    from graphc.tools.plan import format_bytes

    if target is None or target.model is None:
        raise GraphcError("--search prices layouts with a device's constants: pass --device or --device-file")
    config = load_config(model_yaml)
    limits = search.Limits(context or config.buckets.context_limit, batch, tpot_ms, ttft_ms)
    found = search.search(config, target.model, limits, instances)
    front, chosen = search.pareto(found, instances), search.choose(found, objective, instances)
    if write_yaml is not None:
        data = search.layout_yaml(yaml.safe_load(model_yaml.read_text()), chosen, limits.context)
        write_yaml.write_text(yaml.safe_dump(data, sort_keys=False))
    if as_json:
        click.echo(json.dumps({"chosen": chosen.to_json(instances), "pareto": [c.to_json(instances) for c in front],
                               "feasible": len(found)}, indent=2))
        return
    world = int(target.model.ranks_per_chip.value * target.model.chips_per_node.value) * instances
    click.echo(f"search: {len(found)} feasible layouts x batches of {config.model_args.architecture} on {instances} "
               f"{target.name} instance(s) ({world} ranks), context {limits.context}; the Pareto front:")
    click.echo(f"  {'dp':>3s} {'cp':>3s} {'tp':>3s} {'ep':>3s} {'moe':8s} {'batch':>5s} {'TPOT ms':>8s} "
               f"{'tok/s/user':>10s} {'tok/s/inst':>10s} {'TTFT ms':>9s} {'rank mem':>9s} {'calls':>5s}")
    for c in front:
        t = c.topology
        click.echo(f"  {t.dp:3d} {t.cp:3d} {t.tp:3d} {t.ep:3d} {c.exchange:8s} {c.batch:5d} {c.tpot_ms:8.2f} "
                   f"{c.user_tokens_per_second:10.1f} {c.instance_tokens_per_second(instances):10.1f} {c.ttft_ms:9.1f} "
                   f"{format_bytes(c.rank_bytes):>9s} {c.collective_calls:5d}" + ("  <- chosen" if c == chosen else ""))
    t = chosen.topology
    click.echo(f"chosen for {objective}: dp={t.dp} cp={t.cp} tp={t.tp} ep={t.ep} batch {chosen.batch}: TPOT "
               f"{chosen.tpot_ms:.2f} ms, {chosen.instance_tokens_per_second(instances):.0f} tok/s an instance, TTFT "
               f"{chosen.ttft_ms:.0f} ms" + (f"; wrote {write_yaml}" if write_yaml else ""))


def _describe_config(config, backend: str | None = None) -> str:
    b, t, kv = config.buckets, config.topology, config.kv_cache
    return "\n".join([
        f"model      {config.model.checkpoint} ({config.model.dtype})",
        f"topology   dp={t.dp} cp={t.cp} tp={t.tp} ep={t.ep}" + (f" (MoE exchange {config.model.moe_lowering})" if t.dp > 1 else ""),
        f"buckets    prefill={b.prefill} decode={b.decode} prompt_as_decode={b.prompt_as_decode} "
        f"context_limit={b.context_limit}" + (f" speculative={config.model.speculative.method} "
                                              f"k={config.draft_tokens}" if config.draft_tokens else ""),
        f"kv_cache   {kv.num_blocks} blocks x {kv.block_size} tokens",
        f"backend    {backend or config.backend}" + (" (from --backend)" if backend else ""),
    ])


def main() -> None:
    cli()
