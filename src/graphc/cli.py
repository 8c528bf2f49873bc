"""`graphc` command line: parse, validate, echo what was resolved, call the typed API.

Bad input (`GraphcError`) prints one line `error: ...` and exits with status 2, as click's own
usage errors do.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from graphc.errors import GraphcError

EXIT_BAD_INPUT = 2


class _Group(click.Group):
    """Turns `GraphcError` from any command into a one-line message and exit status 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except GraphcError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(EXIT_BAD_INPUT)


@click.group(cls=_Group)
@click.version_option(package_name="graphc")
def cli() -> None:
    """Compile Mixture-of-Experts LLMs ahead of time for static-shape accelerators, and serve them."""


@cli.group()
def checkpoint() -> None:
    """Make and inspect HF-layout checkpoints."""


@checkpoint.command("make-tiny")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", default=None, help="Architecture preset (default: lora-groups); see --list-presets.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def make_tiny(out: Path, preset: str | None, seed: int, force: bool) -> None:
    """Write a tiny random DeepSeek-V3 checkpoint (config.json + model.safetensors) to OUT."""
    from graphc.models.tiny import DEFAULT_PRESET, make_tiny_checkpoint

    preset = preset or DEFAULT_PRESET
    path = make_tiny_checkpoint(out, preset=preset, seed=seed, force=force)
    click.echo(f"wrote tiny checkpoint (preset {preset}, seed {seed}) to {path}")


@checkpoint.command("presets")
def presets() -> None:
    """List the tiny-checkpoint presets and how they differ from the base config."""
    from graphc.models.tiny import PRESETS

    for name, overrides in PRESETS.items():
        click.echo(f"{name}: {json.dumps(overrides) if overrides else '(base config)'}")


@cli.command()
@click.argument("config_path", metavar="MODEL_YAML", type=click.Path(path_type=Path))
def validate(config_path: Path) -> None:
    """Check MODEL_YAML against the schema and its checkpoint, and print the resolved config."""
    from graphc.config import load_config

    config = load_config(config_path)
    click.echo(_describe_config(config))


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
    from graphc.generate import PagedKV, Sampling, generate as run_generate
    from graphc.models.checkpoint import load_model, load_model_args

    config = load_config(config_path)
    prompts = [_parse_ids(p) for p in prompt_ids]
    limit = max_new_tokens or config.runtime.max_new_tokens
    for i, prompt in enumerate(prompts):
        if len(prompt) + limit > config.buckets.context_limit:
            raise GraphcError(
                f"prompt {i}: {len(prompt)} tokens + {limit} new tokens exceed buckets.context_limit "
                f"({config.buckets.context_limit})"
            )
    vocab = load_model_args(config.model.checkpoint).vocab_size
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise GraphcError(f"prompt {i}: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    model = load_model(config.model.checkpoint, dtype=getattr(torch, config.model.dtype))
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


def _describe_config(config) -> str:
    b, t, kv = config.buckets, config.topology, config.kv_cache
    return "\n".join([
        f"model      {config.model.checkpoint} ({config.model.dtype})",
        f"topology   cp={t.cp} ep={t.ep}",
        f"buckets    prefill={b.prefill} decode={b.decode} prompt_as_decode={b.prompt_as_decode} "
        f"context_limit={b.context_limit}",
        f"kv_cache   {kv.num_blocks} blocks x {kv.block_size} tokens",
        f"backend    {config.backend}",
    ])


def main() -> None:
    cli()
