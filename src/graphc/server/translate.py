"""An OpenAI request body as the engine's request: its prompt's token ids (text encoded, a chat
rendered with the checkpoint's template) and its parameters, checked by `graphc.request`'s rules
(the same as `graphc run`'s) plus OpenAI's refusal of a `max_tokens` the context cannot hold.
Every refusal is a `BadRequest` naming the field."""

from __future__ import annotations

import functools

from jinja2 import TemplateError

from graphc.artifacts.manifest import ChatTemplate, Manifest
from graphc.errors import GraphcError
from graphc.request import default_max_new_tokens, engine_request, first_sampling_error, vocabulary_error
from graphc.runtime.scheduler import Request as GenerationRequest
from graphc.sampling import SAMPLING_RULES


class BadRequest(GraphcError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@functools.cache
def _compiled_template(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    # As transformers builds it: trimmed blocks, {% break %} / {% continue %}, raise_exception.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)


def render_chat(template: ChatTemplate, messages: list[dict]) -> str:
    """The prompt text of `messages`, as transformers' `apply_chat_template` renders it: the
    template runs in Jinja's immutable sandbox (it came with the artifacts: input, not code)."""
    try:
        return _compiled_template(template.template).render(
            messages=messages, add_generation_prompt=True, bos_token=template.bos_token, eos_token=template.eos_token)
    except TemplateError as e:
        raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from None


def check_model(name: str, model_name: str) -> None:
    if name != model_name:
        raise BadRequest(f"model {name!r} does not exist; this server serves {model_name!r}", param="model",
                         code="model_not_found")


def prompt_ids(prompt: str | list[int], tokenizer) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if tokenizer is None:
        raise BadRequest("a text prompt needs a tokenizer and these artifacts have none; send token ids",
                         param="prompt")
    return tokenizer.encode(prompt).ids


def generation_request(body, prompt: list[int], manifest: Manifest) -> GenerationRequest:
    """The engine's request for `body` (a completion or a chat), or BadRequest naming the field."""
    outside = vocabulary_error(prompt, manifest.model.vocab_size)
    if outside:
        raise BadRequest(outside, param="prompt")
    given = {name: getattr(body, name) for name in SAMPLING_RULES if getattr(body, name) is not None}
    bad = first_sampling_error(given)
    if bad:
        raise BadRequest(f"{bad[0]}: {bad[1]}", param=bad[0])
    max_tokens = _max_tokens(body, len(prompt), manifest)
    if body.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})", param="min_tokens")
    return engine_request(manifest, prompt, max_tokens, given, stop_at_eos=not body.ignore_eos,
                          min_new_tokens=body.min_tokens)


def _max_tokens(body, prompt_tokens: int, manifest: Manifest) -> int:
    """`body.max_tokens` if the context holds it, else BadRequest; absent, `graphc.request`'s default."""
    if body.max_tokens is None:
        return default_max_new_tokens(manifest, prompt_tokens)
    limit = manifest.buckets.context_limit
    if body.max_tokens < 1:
        raise BadRequest(f"max_tokens: {body.max_tokens} must be at least 1", param="max_tokens")
    if prompt_tokens + body.max_tokens > limit:
        raise BadRequest(f"this model's maximum context length is {limit} tokens; the request asks for "
                         f"{prompt_tokens + body.max_tokens} ({prompt_tokens} in the prompt, {body.max_tokens} for the "
                         "completion)", param="max_tokens")
    return body.max_tokens
