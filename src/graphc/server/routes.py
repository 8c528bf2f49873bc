"""The OpenAI-compatible routes over an `OnlineEngine`.

Every bad request gets a 4xx with OpenAI's error body and changes nothing (400; 413 for a body
over the bound; 408 for one not sent in time; 401 without the API key, where one is set); past
the admission queue's bound, or a chat's wait for a template worker, 429 with Retry-After. A
client that disconnects cancels its request, whose KV blocks return to the pool before the next
step. The event loop only routes: a request's CPU work (parsing its body, dumping a chat for its
template, tokenising, checking its ids) runs in a few worker threads, a chat template in a worker
process (`templates`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from graphc.artifacts.manifest import Manifest
from graphc.errors import GraphcError
from graphc.runtime.online import OnlineEngine, QueueFull
from graphc.runtime.constraints import Grammars
from graphc.runtime.prefix_cache import prefix_caching_enabled
from graphc.server.auth import ApiKeyRequired, tenant
from graphc.server.body import BodyTooLarge, BodyTooSlow, parse_body, read_body
from graphc.server.chat_reply import ChatReply, opens_thinking
from graphc.server.formats import requested_grammar
from graphc.server.isolation import CacheIsolation
from graphc.server.limits import MAX_CHOICES, RequestLimits
from graphc.server.metrics import ServerMetrics
from graphc.server.schemas import ChatCompletionRequest, CompletionRequest, error_response
from graphc.server.streaming import CHAT, TEXT, Generation, GenerationStream, Shape, complete, stream
from graphc.server.templates import TemplateRenderer, TemplatesBusy, chat_line
from graphc.server.tool_formats import tool_format_of
from graphc.server.tools import tool_use
from graphc.server.translate import (BadRequest, ModelNotFound, check_model, encode, generation_request,
                                     prompt_char_limit, prompt_ids, prompt_too_long)

RETRY_AFTER_SECONDS = 1
WORK_THREADS = 4
"""Requests prepared at a time (their bodies parsed, prompts tokenised); the rest wait their turn."""


def create_app(online: OnlineEngine, manifest: Manifest, tokenizer, model_name: str,
               limits: RequestLimits = RequestLimits(), api_keys: tuple[str, ...] = (),
               default_seed: int | None = None, isolation: CacheIsolation = CacheIsolation()) -> FastAPI:
    """The app: its routes and error handlers are closures over the engine and the manifest, so
    they read as one listing (hence one function of about 100 lines)."""
    app = FastAPI(title="graphc", docs_url=None, redoc_url=None)
    if api_keys:
        app.add_middleware(ApiKeyRequired, keys=api_keys)
    metrics = ServerMetrics(online)
    context_limit = manifest.buckets.context_limit
    body_bytes = limits.body_bytes(context_limit)
    char_limit = prompt_char_limit(tokenizer, context_limit) if tokenizer is not None else None
    renderer = _renderer(manifest, limits.template_seconds, body_bytes, char_limit)
    threads = anyio.CapacityLimiter(WORK_THREADS)
    cached_tokens = not isolation.hide_cached_tokens
    shares_prefill, block_size = prefix_caching_enabled(manifest.runtime.prefix_caching), manifest.kv_cache.block_size
    grammars = (Grammars(tokenizer.to_str(), manifest.model.vocab_size, manifest.model.eos_token_id)
                if tokenizer is not None else None)
    tool_format = tool_format_of(renderer.template) if renderer is not None else None

    async def off_loop(function, *args):
        # Tokenising releases the GIL (encode_batch), so the loop and the engine thread run on;
        # JSON parsing and pydantic hold it for one C call each: the body's bound bounds those.
        return await anyio.to_thread.run_sync(functools.partial(function, *args), limiter=threads)

    async def parsed(http: Request, schema):
        raw = await read_body(http, body_bytes, limits.body_seconds)
        body = await off_loop(parse_body, raw, http.headers.get("content-type"), schema, context_limit)
        check_model(body.model, model_name)
        return body

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # an unknown route, a wrong method
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return error_response(404 if isinstance(error, ModelNotFound) else 400, str(error), param=error.param,
                              code=error.code)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, error: BodyTooLarge):
        return error_response(413, str(error))

    @app.exception_handler(BodyTooSlow)
    async def too_slow(request: Request, error: BodyTooSlow):
        return error_response(408, str(error), headers={"Connection": "close"})

    @app.exception_handler(GraphcError)
    async def unavailable(request: Request, error: GraphcError):  # the engine failed or is stopping
        return error_response(503, str(error), kind="server_error")

    @app.exception_handler(QueueFull)
    @app.exception_handler(TemplatesBusy)
    async def at_capacity(request: Request, error: QueueFull | TemplatesBusy):
        return error_response(429, f"the server is at capacity: {error}; retry later", kind="rate_limit_error",
                              headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.get("/health")
    async def health():
        if online.state.failure:
            return error_response(503, f"the engine failed: {online.state.failure}", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    served_model = {"id": model_name, "object": "model", "created": 0, "owned_by": "graphc",
                    "max_model_len": manifest.buckets.context_limit}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served_model]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name, model_name)
        return served_model

    async def respond(body, prompts: list[list[int]], shape: Shape, http: Request, grammar: str | None,
                      reply=ChatReply, echoes: list[str] | None = None):
        """`n` choices for each of `prompts` (choice j of prompt p at index p * n + j): every one
        checked before any is submitted; each following `grammar` (None: free text), a chat's
        read by its own `reply()`; a completion's text after its prompt's `echoes`, where it asks."""
        n = _choices(body.n, len(prompts), limits.max_n)
        requests, salt = [], isolation.salt(body.cache_salt, tenant(http.scope))
        for index, prompt in enumerate(prompts):
            try:
                for choice in range(n):
                    request = await off_loop(generation_request, body, prompt, manifest, default_seed, salt, choice)
                    if grammar is not None:  # each choice follows the grammar from its own start
                        request = dataclasses.replace(request, constraint=grammars.constraint(grammar))
                    refusal = online.refusal(request)
                    if refusal:
                        raise BadRequest(refusal, param="prompt")
                    requests.append(request)
            except BadRequest as refused:
                raise _of_prompt(refused, index, len(prompts)) from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        generations = await submitted(requests, n, stop, reply, [echoes[i // n] if echoes else None
                                                                 for i in range(len(requests))])
        head = {"id": f"{shape.prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if body.stream:
            options = body.stream_options
            usage = "every chunk" if options and options.include_usage and options.continuous_usage_stats else \
                "last chunk" if options and options.include_usage else None
            return GenerationStream(generations, stream(generations, head, shape, usage, cached_tokens))
        return await complete(generations, head, shape, http, cached_tokens)

    async def submitted(requests: list, n: int, stop: list[str], reply, echoes: list[str | None]) -> list[Generation]:
        """A generation for each request, none left running if another cannot be submitted (a full
        admission queue) or the handler is cancelled meanwhile. With n > 1, a prompt's first choice
        goes first and its others once it has its first token: its prompt's full blocks are then in
        the prefix cache, which they read instead of computing them again."""
        generations: list[Generation | None] = [None] * len(requests)
        try:
            for lead in range(0, len(requests), n):
                generations[lead] = Generation(online, metrics, requests[lead], tokenizer, stop, reply=reply(),
                                               echo=echoes[lead])
            if n > 1 and shares_prefill:
                await asyncio.gather(*(g.started.wait() for g in generations
                                       if g is not None and len(g.request.prompt) > block_size))
            for index, request in enumerate(requests):
                if generations[index] is None:
                    generations[index] = Generation(online, metrics, request, tokenizer, stop, lead=False,
                                                    reply=reply(), echo=echoes[index])
        except BaseException:  # QueueFull, or the handler cancelled while the first choices prefill
            for generation in generations:
                if generation is not None:
                    generation.cancel()
            raise
        return generations

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await parsed(http, CompletionRequest)
        batch = body.prompts()
        prompts = []
        for index, prompt in enumerate(batch):
            try:
                prompts.append(await off_loop(prompt_ids, prompt, tokenizer, char_limit, context_limit))
            except BadRequest as refused:
                raise _of_prompt(refused, index, len(batch)) from None
        echoes = await off_loop(_echoes, batch, prompts, tokenizer) if body.echo else None
        return await respond(body, prompts, TEXT, http, await off_loop(requested_grammar, body, grammars),
                             echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        body = await parsed(http, ChatCompletionRequest)
        if renderer is None or tokenizer is None:
            raise BadRequest(f"model {model_name!r} has no chat template (its checkpoint's tokenizer_config.json "
                             "has none); use /v1/completions", param="messages", code="no_chat_template")
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        tools = tool_use(body, tool_format, model_name)
        text = await renderer.render(await off_loop(chat_line, body.messages, body.tools, body.chat_template_kwargs))
        ids = await off_loop(encode, text, tokenizer, char_limit, context_limit, "messages", False)
        thinking = opens_thinking(text)
        grammar = (await off_loop(tools.grammar, grammars, thinking)
                   or await off_loop(requested_grammar, body, grammars, thinking))
        return await respond(body, [ids], CHAT, http, grammar, lambda: ChatReply(tools.format, thinking))

    return app


def _choices(n: int, prompts: int, max_n: int) -> int:
    """`n`, or BadRequest where it asks more choices than the server gives a prompt or a request."""
    if n > max_n:
        raise BadRequest(f"n: {n} is more than the {max_n} choices of a prompt this server gives (graphc serve "
                         "--max-n)", param="n")
    if prompts * n > MAX_CHOICES:
        raise BadRequest(f"n: {prompts} prompts of {n} choices each are more than the {MAX_CHOICES} choices a request "
                         "may ask", param="n")
    return n


def _echoes(batch: list[str | list[int]], prompts: list[list[int]], tokenizer) -> list[str]:
    """What `echo` puts first in each prompt's choices: its text as sent, or its ids decoded."""
    return [prompt if isinstance(prompt, str) else tokenizer.decode(ids) if tokenizer is not None else ""
            for prompt, ids in zip(batch, prompts)]


def _of_prompt(refused: BadRequest, index: int, count: int) -> BadRequest:
    """`refused`, naming which prompt of a batch it is about."""
    if count == 1:
        return refused
    return BadRequest(f"prompt {index}: {refused}", param=refused.param, code=refused.code)


def _renderer(manifest: Manifest, seconds: float, body_bytes: int, char_limit: int | None) -> TemplateRenderer | None:
    """The chat template's renderer, refusing a render longer than any prompt that fits (or,
    where the tokenizer gives no such bound, than the largest body)."""
    template, context_limit = manifest.model.chat_template, manifest.buckets.context_limit
    if template is None:
        return None
    if char_limit is None:
        return TemplateRenderer(template, seconds, body_bytes, lambda chars: (
            f"the chat template rendered {chars} characters, more than the {body_bytes} this server takes"))
    return TemplateRenderer(template, seconds, char_limit,
                            lambda chars: prompt_too_long(chars, char_limit, context_limit))
