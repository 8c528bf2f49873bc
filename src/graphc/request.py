"""A generation request as `graphc run` (its options and --prompts-file lines) and `graphc serve`
take it: the checks they share, the defaults they fill in, and the engine's `Request` it becomes.

The rules, the same at every entry point:
- token ids lie in the vocabulary, 0..vocab_size - 1 (`vocabulary_error`);
- sampling parameters are the manifest's runtime.sampling, each overridden by what the request
  gives, later overrides winning (`merged_sampling`): a prompts-file line over `run`'s options;
- max_new_tokens, when the request gives none, is runtime.max_new_tokens clipped to the room the
  context leaves: min(runtime.max_new_tokens, context_limit - prompt tokens), at least 1
  (`default_max_new_tokens`; a prompt with no room left is then refused by the scheduler). One
  that is given is kept: `run` stops it at the context limit (finish reason "context_limit"),
  `serve` refuses one that does not fit, as OpenAI's API does.

A prompts file is JSONL, one request a line (`JSONL_FIELDS`); a bad line becomes a request with
an error of its own, named by its file:line, so the other lines are still served.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from graphc.artifacts.manifest import Manifest
from graphc.errors import GraphcError
from graphc.runtime.scheduler import Request
from graphc.sampling import SAMPLING_RULES, Sampling, sampling_error

JSONL_FIELDS = {
    "prompt": (str,), "prompt_ids": (list,), "max_new_tokens": (int,), "temperature": (int, float),
    "top_k": (int,), "top_p": (int, float), "seed": (int,),
}
"""A prompts-file line's keys and the JSON types each accepts: 'prompt' (text) or 'prompt_ids',
the rest optional per-request overrides."""


@dataclass(frozen=True)
class Asked:
    """One request as given, before the defaults fill in what it leaves out."""

    prompt: list[int] | str
    """Token ids, or text for the artifacts' tokenizer."""
    where: str
    """How messages name it: "prompt 3" (the command line) or "prompts.jsonl:7"."""
    max_new_tokens: int | None = None
    sampling: dict = field(default_factory=dict)
    """The sampling parameters it gives (a subset of `SAMPLING_RULES`)."""
    error: str | None = None
    """Why it cannot be served (a bad prompts-file line); its prompt is then empty."""


def vocabulary_error(prompt: list[int], vocab_size: int) -> str | None:
    """Why `prompt` is not a list of token ids of a `vocab_size`-token vocabulary, or None."""
    outside = [t for t in prompt if not 0 <= t < vocab_size]
    return f"token id {outside[0]} is outside the vocabulary 0..{vocab_size - 1}" if outside else None


def first_sampling_error(given: dict) -> tuple[str, str] | None:
    """(name, why) for the first of the `given` sampling parameters that its rule refuses, or None."""
    for name in SAMPLING_RULES:  # in the rules' order, so the same line always names the same one
        problem = sampling_error(name, given[name]) if name in given else None
        if problem:
            return name, problem
    return None


def merged_sampling(manifest: Manifest, *overrides: dict) -> Sampling:
    """The manifest's runtime.sampling with each of `overrides` applied in turn (the last wins)."""
    merged = dataclasses.asdict(manifest.runtime.sampling)
    for given in overrides:
        merged.update(given)
    return Sampling(**merged)


def default_max_new_tokens(manifest: Manifest, prompt_tokens: int) -> int:
    """runtime.max_new_tokens clipped to what context_limit leaves after the prompt, at least 1."""
    return max(1, min(manifest.runtime.max_new_tokens, manifest.buckets.context_limit - prompt_tokens))


def engine_request(manifest: Manifest, prompt: list[int], max_new_tokens: int | None, *sampling: dict,
                   stop_at_eos: bool = True, min_new_tokens: int = 0, cache_salt: str | None = None) -> Request:
    """The engine's request, with the manifest's defaults where `max_new_tokens` is None and for
    the sampling parameters no override gives."""
    limit = default_max_new_tokens(manifest, len(prompt)) if max_new_tokens is None else max_new_tokens
    return Request(prompt, limit, merged_sampling(manifest, *sampling), stop_at_eos=stop_at_eos,
                   min_new_tokens=min_new_tokens, cache_salt=cache_salt)


def run_request(asked: Asked, manifest: Manifest, tokenizer, max_new_tokens: int | None, sampling: dict,
                stop_at_eos: bool) -> tuple[Request, str | None]:
    """`graphc run`'s request for `asked`, and why it cannot be served (or None): what `asked`
    leaves out comes from the command line's `max_new_tokens` and `sampling`, then the manifest."""
    if isinstance(asked.prompt, str) and tokenizer is None:
        raise GraphcError("text prompts need a tokenizer.json in the checkpoint directory; use --prompt-ids")
    ids = tokenizer.encode(asked.prompt).ids if isinstance(asked.prompt, str) else asked.prompt
    outside = vocabulary_error(ids, manifest.model.vocab_size)
    error = asked.error or (f"{asked.where}: {outside}" if outside else None)
    request = engine_request(manifest, ids, asked.max_new_tokens or max_new_tokens, sampling, asked.sampling,
                             stop_at_eos=stop_at_eos)
    return request, error


def read_prompts_file(path: Path) -> list[Asked]:
    """The requests of a prompts file, one a non-blank line; a bad line is a request with an error.

    Raises:
        GraphcError: the file is not UTF-8 text.
    """
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise GraphcError(f"--prompts-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return [_line_request(line, f"{path}:{number}") for number, line in enumerate(lines, start=1) if line.strip()]


def _line_request(line: str, where: str) -> Asked:
    try:
        item = _checked_item(json.loads(line), where)
    except json.JSONDecodeError as e:
        return Asked([], where, error=f"{where}: not valid JSON ({e})")
    except GraphcError as e:
        return Asked([], where, error=str(e))
    prompt = item.pop("prompt") if "prompt" in item else item.pop("prompt_ids")
    return Asked(prompt, where, item.pop("max_new_tokens", None), sampling=item)


def _checked_item(item, where: str) -> dict:
    """One prompts-file line's object: 'prompt' or 'prompt_ids', optional overrides, each typed."""
    optional = ", ".join(k for k in JSONL_FIELDS if k not in ("prompt", "prompt_ids"))
    if not isinstance(item, dict) or not ({"prompt", "prompt_ids"} & set(item)) or set(item) - set(JSONL_FIELDS):
        raise GraphcError(f"{where}: expected an object with 'prompt' or 'prompt_ids' and optionally {optional}")
    if {"prompt", "prompt_ids"} <= set(item):
        raise GraphcError(f"{where}: give 'prompt' or 'prompt_ids', not both")
    for key, value in item.items():
        # bool is an int in Python; JSON true must not pass as a count.
        if isinstance(value, bool) or not isinstance(value, JSONL_FIELDS[key]):
            raise GraphcError(f"{where}: {key} is {value!r}; expected {JSONL_FIELDS[key][0].__name__}")
    ids = item.get("prompt_ids", [])
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise GraphcError(f"{where}: prompt_ids must be a list of integers, got {ids!r}")
    if item.get("max_new_tokens", 1) < 1:
        raise GraphcError(f"{where}: max_new_tokens is {item['max_new_tokens']!r}; it must be >= 1")
    bad = first_sampling_error(item)
    if bad:
        raise GraphcError(f"{where}: {bad[0]} {bad[1]}")
    return item
