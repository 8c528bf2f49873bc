"""An OpenAI request body as the engine's request: its prompt's token ids (text encoded, bounded
by its length in characters first) and its parameters, checked by `graphc.request`'s rules
(the same as `graphc run`'s) plus OpenAI's refusal of a `max_tokens` the context cannot hold.
Every refusal is a `BadRequest` naming the field."""

from __future__ import annotations

import dataclasses
import json
import math
import secrets

from graphc.artifacts.manifest import Manifest
from graphc.errors import GraphcError
from graphc.request import default_max_new_tokens, engine_request, first_sampling_error, vocabulary_error
from graphc.runtime.penalties import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS_TOKENS, PENALTY_RANGE, Penalties
from graphc.runtime.scheduler import Request as GenerationRequest
from graphc.sampling import SAMPLING_RULES, SEED_MAX


class BadRequest(GraphcError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ModelNotFound(BadRequest):
    """A model this server does not serve: 404, as OpenAI answers."""


def check_model(name: str, model_name: str) -> None:
    if name != model_name:
        raise ModelNotFound(f"model {name!r} does not exist; this server serves {model_name!r}", param="model",
                            code="model_not_found")


def prompt_ids(prompt: str | list[int], tokenizer, char_limit: int | None, context_limit: int) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if tokenizer is None:
        raise BadRequest("a text prompt needs a tokenizer and these artifacts have none; send token ids",
                         param="prompt")
    return encode(prompt, tokenizer, char_limit, context_limit, "prompt", add_special_tokens=True)


def encode(text: str, tokenizer, char_limit: int | None, context_limit: int, param: str,
           add_special_tokens: bool) -> list[int]:
    """`text`'s token ids, or BadRequest when its length alone shows they cannot fit the context
    (see `prompt_char_limit`): a 50 MB prompt is refused without being tokenised."""
    if char_limit is not None and len(text) > char_limit:
        raise BadRequest(prompt_too_long(len(text), char_limit, context_limit), param=param)
    # encode_batch releases the GIL while it works (encode does not): the event loop runs meanwhile.
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def prompt_too_long(chars: int, char_limit: int, context_limit: int) -> str:
    return (f"this model's maximum context length is {context_limit} tokens; a prompt of {chars} characters cannot "
            f"fit it (no {context_limit - 1} tokens of this tokenizer hold more than {char_limit})")


def prompt_char_limit(tokenizer, context_limit: int) -> int | None:
    """The most characters a prompt that leaves room under `context_limit` can have, or None where
    this tokenizer gives no such bound.

    Each token stands for at most as many characters as its longest vocabulary entry (byte-level
    entries spell their bytes; added tokens match their content), so context_limit - 1 tokens hold
    at most that many times as many. That holds only if nothing drops characters before the
    model sees them: a BPE model that does not fuse unknown characters into one token, and
    normalizers and pre-tokenizers from the kinds below, which keep every character.
    """
    spec = json.loads(tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or (model.get("fuse_unk") and model.get("unk_token")):
        return None
    if not (_keeps_characters(spec.get("normalizer"), _KEEPING_NORMALIZERS)
            and _keeps_characters(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS)):
        return None
    longest = max(len(entry) for entry in tokenizer.get_vocab(with_added_tokens=True))
    return (context_limit - 1) * longest


_KEEPING_NORMALIZERS = {"Prepend", "Lowercase"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
"""Kinds that never drop a character (Split and Punctuation unless their behavior is "Removed");
NFC and its kin are left out: composing characters shortens a text."""


def _keeps_characters(step: dict | None, kinds: set[str]) -> bool:
    if step is None:
        return True
    if step["type"] == "Sequence":
        parts = step.get("normalizers", step.get("pretokenizers", []))
        return all(_keeps_characters(part, kinds) for part in parts)
    return step["type"] in kinds and step.get("behavior") != "Removed"


def generation_request(body, prompt: list[int], manifest: Manifest, default_seed: int | None = None,
                       cache_salt: str | None = None, choice: int = 0) -> GenerationRequest:
    """The engine's request for `body` (a completion or a chat), or BadRequest naming the field.
    A body without `seed` gets `default_seed` (the server's `--seed`), or fresh noise where none is
    set, as OpenAI and vLLM draw: identical unseeded requests then sample differently. Choice j
    of a prompt (`n`) samples with the seed plus j, as vLLM seeds its n sequences.
    `cache_salt`: the salt its prefix-cache blocks are keyed under (`graphc.server.isolation`)."""
    outside = vocabulary_error(prompt, manifest.model.vocab_size)
    if outside:
        raise BadRequest(outside, param="prompt")
    given = {name: getattr(body, name) for name in SAMPLING_RULES if getattr(body, name) is not None}
    bad = first_sampling_error(given)
    if bad:
        raise BadRequest(f"{bad[0]}: {bad[1]}", param=bad[0])
    given.setdefault("seed", secrets.randbelow(SEED_MAX + 1) if default_seed is None else default_seed)
    given["seed"] = (given["seed"] + choice) % (SEED_MAX + 1)
    prompt_logprobs = body.asked_prompt_logprobs()
    if prompt_logprobs is not None and not manifest.buckets.prompt_logprobs:
        raise BadRequest("echo: the prompt's logprobs need artifacts compiled with runtime.prompt_logprobs: true; these "
                         "were compiled without (echo without logprobs needs nothing)", param="echo")
    max_tokens = _max_tokens(body, len(prompt), manifest, scores=prompt_logprobs is not None)
    if body.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})", param="min_tokens")
    penalties = _penalties(body, manifest.model.vocab_size)
    return dataclasses.replace(engine_request(manifest, prompt, max_tokens, given, stop_at_eos=not body.ignore_eos,
                                              min_new_tokens=body.min_tokens, cache_salt=cache_salt),
                               logprobs=body.asked_logprobs(), prompt_logprobs=prompt_logprobs,
                               penalties=penalties if penalties.active else None)


def _penalties(body, vocab_size: int) -> Penalties:
    """The body's penalties and logit bias, or BadRequest naming the field out of its range."""
    low, high = PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise BadRequest(f"{name}: {value!r} must be a number in [{low:g}, {high:g}]", param=name)
    repetition = body.repetition_penalty
    if repetition is not None and not (math.isfinite(repetition) and repetition > 0):
        raise BadRequest(f"repetition_penalty: {repetition!r} must be a number > 0 (1 is off)",
                         param="repetition_penalty")
    return Penalties(body.presence_penalty or 0.0, body.frequency_penalty or 0.0,
                     1.0 if repetition is None else repetition, _logit_bias(body.logit_bias or {}, vocab_size))


def _logit_bias(given: dict[str, float], vocab_size: int) -> dict[int, float]:
    if len(given) > MAX_LOGIT_BIAS_TOKENS:
        raise BadRequest(f"logit_bias: {len(given)} tokens are more than the {MAX_LOGIT_BIAS_TOKENS} a request may bias",
                         param="logit_bias")
    low, high = LOGIT_BIAS_RANGE
    bias = {}
    for key, value in given.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise BadRequest(f"logit_bias: key {key!r} is not a token id of the vocabulary 0..{vocab_size - 1}",
                             param="logit_bias")
        if not (math.isfinite(value) and low <= value <= high):
            raise BadRequest(f"logit_bias: the bias of token {key} is {value!r}; it must be in [{low:g}, {high:g}]",
                             param="logit_bias")
        bias[int(key)] = float(value)
    return bias


def _max_tokens(body, prompt_tokens: int, manifest: Manifest, scores: bool) -> int:
    """`body.max_tokens` if the context holds it, else BadRequest; absent, `graphc.request`'s default.
    A request that `scores` its prompt may ask for none."""
    if body.max_tokens is None:
        return default_max_new_tokens(manifest, prompt_tokens)
    limit = manifest.buckets.context_limit
    if body.max_tokens < (0 if scores else 1):
        raise BadRequest(f"max_tokens: {body.max_tokens} must be at least 1 (0 only with echo and logprobs, to score "
                         "a prompt)", param="max_tokens")
    if prompt_tokens + body.max_tokens > limit:
        raise BadRequest(f"this model's maximum context length is {limit} tokens; the request asks for "
                         f"{prompt_tokens + body.max_tokens} ({prompt_tokens} in the prompt, {body.max_tokens} for the "
                         "completion)", param="max_tokens")
    return body.max_tokens
