"""The OpenAI-compatible routes over an `OnlineEngine`, and `serve_http`, which runs them.

Every bad request gets HTTP 400 with OpenAI's error body and changes nothing; past the admission
queue's bound, 429 with Retry-After. A client that disconnects cancels its request, whose KV
blocks return to the pool before the next step. SIGTERM (or Ctrl-C) stops accepting connections,
lets in-flight requests finish within the grace period, cancels the rest, and exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from graphc.artifacts.manifest import ChatTemplate, Manifest
from graphc.errors import GraphcError
from graphc.runtime.engine import Engine
from graphc.runtime.online import OnlineEngine, QueueFull, Ticket
from graphc.runtime.scheduler import Request as GenerationRequest
from graphc.sampling import SAMPLING_RULES, Sampling, sampling_error
from graphc.server.metrics import ServerMetrics
from graphc.server.schemas import ChatCompletionRequest, CompletionRequest, error_body

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context_limit": "length"}
"""graphc's finish reasons as OpenAI's."""
RETRY_AFTER_SECONDS = 1


class BadRequest(GraphcError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class Generation:
    """One request's tokens as they arrive, as text deltas cut at stop strings.

    Text is decoded from every token so far (a tokenizer may merge bytes across tokens); a tail
    that is an incomplete UTF-8 character, or that could still become a stop string, is held
    back until the next token or the end.
    """

    def __init__(self, online: OnlineEngine, metrics: ServerMetrics, request: GenerationRequest, tokenizer,
                 stop: list[str]):
        self.online, self.metrics, self.request = online, metrics, request
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.text, self.sent = "", 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrived = self.last_token = time.monotonic()
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        def deliver(token, result):  # on the engine thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(self.events.put_nowait, (token, result))

        self.ticket: Ticket = online.submit(request, deliver)

    def cancel(self) -> None:
        """End the request early (a stop string, or its client left); its blocks are freed."""
        self.online.cancel(self.ticket)
        if self.finish_reason is None:
            self._end("cancelled")

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.requests.labels(reason).inc()

    async def deltas(self):
        """Yield (text delta, token ids) until the request ends; then `finish_reason` is set."""
        while self.finish_reason is None:
            token, result = await self.events.get()
            new_ids = []
            if token is not None:
                self._record_token()
                self.ids.append(token)
                new_ids.append(token)
                self._decode()
            if self._stopped():
                self._end("stop")
                if result is None:
                    self.online.cancel(self.ticket)  # its blocks go back now; later tokens would be cut anyway
            elif result is not None:
                if result.finish_reason == "error":
                    self.error = result.error
                self._end(FINISH_REASONS.get(result.finish_reason, result.finish_reason))
            end = len(self.text) if self.finish_reason else self._safe_end()
            delta, self.sent = self.text[self.sent:end], max(self.sent, end)
            if delta or new_ids or self.finish_reason:
                yield delta, new_ids

    def _record_token(self) -> None:
        now = time.monotonic()
        (self.metrics.first_token if not self.ids else self.metrics.inter_token).observe(
            now - (self.arrived if not self.ids else self.last_token))
        self.last_token = now
        self.metrics.token()

    def _decode(self) -> None:
        if self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.ids)

    def _stopped(self) -> bool:
        if not self.stop or len(self.ids) < self.request.min_new_tokens:
            return False
        found = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
        return bool(found)

    def _safe_end(self) -> int:
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1  # an incomplete UTF-8 character: its bytes are still arriving
        if self.stop:  # the last len(stop) - 1 characters could still begin a stop string
            end = max(self.sent, end - max(len(s) for s in self.stop) + 1)
        return end


def create_app(online: OnlineEngine, manifest: Manifest, tokenizer, model_name: str) -> FastAPI:
    """The app: its routes and error handlers are closures over the engine and the manifest, so
    they read as one listing (hence one function of about 60 lines)."""
    app = FastAPI(title="graphc", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(online)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return _error(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}", param=where or None)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return _error(400, str(error), param=error.param, code=error.code)

    @app.exception_handler(GraphcError)
    async def unavailable(request: Request, error: GraphcError):  # the engine failed or is stopping
        return _error(503, str(error), kind="server_error")

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, error: QueueFull):
        return _error(429, f"the server is at capacity: {error}; retry later", kind="rate_limit_error",
                      headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.get("/health")
    async def health():
        if online.state.failure:
            return _error(503, f"the engine failed: {online.state.failure}", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "graphc",
                                            "max_model_len": manifest.buckets.context_limit}]}

    async def respond(body, prompt: list[int], shape: Shape, http: Request):
        request = _generation_request(body, prompt, manifest)
        refusal = online.refusal(request)
        if refusal:
            raise BadRequest(refusal, param="prompt")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        generation = Generation(online, metrics, request, tokenizer, stop)
        head = {"id": f"{shape.prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return GenerationStream(generation, _stream(generation, head, shape, include_usage))
        return await _complete(generation, head, shape, http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(body.model, model_name)
        return await respond(body, _prompt_ids(body.prompt, tokenizer), TEXT, http)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        _check_model(body.model, model_name)
        template = manifest.model.chat_template
        if template is None or tokenizer is None:
            raise BadRequest(f"model {model_name!r} has no chat template (its checkpoint's tokenizer_config.json "
                             "has none); use /v1/completions", param="messages", code="no_chat_template")
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        text = _render_chat(template, [m.model_dump() for m in body.messages])
        return await respond(body, tokenizer.encode(text, add_special_tokens=False).ids, CHAT, http)

    return app


@dataclass(frozen=True)
class Shape:
    """How a response is laid out: a completion's choices carry `text`, a chat's a `message`
    (streamed as `delta`s, the first naming the role)."""

    prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, ids: list[int], finish_reason: str | None, first: bool = False,
               whole: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "token_ids": ids}
        content = {"role": "assistant", "content": text} if whole or first else ({"content": text} if text else {})
        return {"index": 0, "message" if whole else "delta": content, "logprobs": None,
                "finish_reason": finish_reason, "token_ids": ids}


TEXT = Shape("cmpl", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


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


def _render_chat(template: ChatTemplate, messages: list[dict]) -> str:
    """The prompt text of `messages`, as transformers' `apply_chat_template` renders it: the
    template runs in Jinja's immutable sandbox (it came with the artifacts: input, not code)."""
    try:
        return _compiled_template(template.template).render(
            messages=messages, add_generation_prompt=True, bos_token=template.bos_token, eos_token=template.eos_token)
    except TemplateError as e:
        raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from None


def _check_model(name: str, model_name: str) -> None:
    if name != model_name:
        raise BadRequest(f"model {name!r} does not exist; this server serves {model_name!r}", param="model",
                         code="model_not_found")


def _prompt_ids(prompt: str | list[int], tokenizer) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if tokenizer is None:
        raise BadRequest("a text prompt needs a tokenizer and these artifacts have none; send token ids",
                         param="prompt")
    return tokenizer.encode(prompt).ids


def _generation_request(body, prompt: list[int], manifest: Manifest) -> GenerationRequest:
    """The engine's request for `body` (a completion or a chat), or BadRequest naming the field."""
    vocab = manifest.model.vocab_size
    outside = [t for t in prompt if not 0 <= t < vocab]
    if outside:
        raise BadRequest(f"token id {outside[0]} is outside the vocabulary 0..{vocab - 1}", param="prompt")
    defaults = dataclasses.asdict(manifest.runtime.sampling)
    given = {name: getattr(body, name) for name in SAMPLING_RULES if getattr(body, name) is not None}
    for name, value in given.items():
        problem = sampling_error(name, value)
        if problem:
            raise BadRequest(f"{name}: {problem}", param=name)
    limit = manifest.buckets.context_limit
    if body.max_tokens is not None and body.max_tokens < 1:
        raise BadRequest(f"max_tokens: {body.max_tokens} must be at least 1", param="max_tokens")
    if body.max_tokens is not None and len(prompt) + body.max_tokens > limit:
        raise BadRequest(f"this model's maximum context length is {limit} tokens; the request asks for "
                         f"{len(prompt) + body.max_tokens} ({len(prompt)} in the prompt, {body.max_tokens} for the "
                         "completion)", param="max_tokens")
    max_tokens = body.max_tokens or max(1, min(manifest.runtime.max_new_tokens, limit - len(prompt)))
    if body.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})", param="min_tokens")
    return GenerationRequest(prompt, max_tokens, Sampling(**{**defaults, **given}), stop_at_eos=not body.ignore_eos,
                             min_new_tokens=body.min_tokens)


def _usage(generation: Generation) -> dict:
    prompt, completion = len(generation.request.prompt), len(generation.ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class GenerationStream(StreamingResponse):
    """The events of one generation, which is cancelled however the response ends early: a
    client that disconnects, even before the first event, or a server past its grace period."""

    def __init__(self, generation: Generation, events):
        super().__init__(events, media_type="text/event-stream")
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.generation.finish_reason is None:
                self.generation.cancel()


async def _complete(generation: Generation, head: dict, shape: Shape, http: Request) -> JSONResponse:
    """The whole completion; cancelled if the client goes away first (or the handler is)."""
    collect = asyncio.ensure_future(_collect(generation))
    try:
        while not collect.done():
            await asyncio.wait([collect], timeout=0.25)
            if not collect.done() and await http.is_disconnected():
                return JSONResponse({}, status_code=499)
    finally:
        if not collect.done():
            generation.cancel()
            collect.cancel()
    if generation.error:
        return _error(500, f"the request failed: {generation.error}", kind="server_error")
    choice = shape.choice(generation.text, generation.ids, generation.finish_reason, whole=True)
    return JSONResponse({**head, "object": shape.object, "choices": [choice], "usage": _usage(generation)})


async def _collect(generation: Generation) -> None:
    async for _ in generation.deltas():
        pass


async def _stream(generation: Generation, head: dict, shape: Shape, include_usage: bool):
    """Server-sent events in OpenAI's format."""
    first = True
    async for delta, ids in generation.deltas():
        if generation.error:
            yield _event(error_body(f"the request failed: {generation.error}", kind="server_error"))
            break
        choice = shape.choice(delta, ids, generation.finish_reason, first=first)
        first = False
        yield _event({**head, "object": shape.chunk_object, "choices": [choice]})
    if include_usage:
        yield _event({**head, "object": shape.chunk_object, "choices": [], "usage": _usage(generation)})
    yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


@dataclass(frozen=True)
class HttpJob:
    """What the leader rank of `graphc serve` does: serve HTTP until SIGTERM / SIGINT (picklable:
    with several ranks it travels to the leader's process)."""

    artifacts: str
    host: str
    port: int
    max_waiting: int
    grace_seconds: float
    model_name: str
    follower_timeout: float | None = None  # followers idle between requests as long as the server does
    ends_on_signal: bool = True

    @property
    def shutdown_seconds(self) -> int:
        """The agent waits the grace period (and the ranks' teardown) before killing them."""
        return int(self.grace_seconds) + 15

    def lead(self, engine: Engine) -> None:
        from tokenizers import Tokenizer

        manifest = engine.manifest
        tokenizer = Tokenizer.from_file(str(Path(self.artifacts) / manifest.tokenizer)) if manifest.tokenizer else None
        online = OnlineEngine(engine, self.max_waiting)
        listener = socket.create_server((self.host, self.port))
        config = uvicorn.Config(create_app(online, manifest, tokenizer, self.model_name), log_level="warning",
                                timeout_graceful_shutdown=self.grace_seconds, lifespan="off")
        # uvicorn handles SIGTERM / SIGINT while it serves, then re-raises them: to a handler that
        # does nothing, so a graceful stop ends here (before this point they stop the command).
        previous = {signum: signal.signal(signum, lambda *_: None) for signum in (signal.SIGTERM, signal.SIGINT)}
        print(f"serving {self.artifacts} on http://{self.host}:{listener.getsockname()[1]}", file=sys.stderr,
              flush=True)
        try:
            _DrainingServer(config).run(sockets=[listener])
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            online.stop()
            listener.close()


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM / SIGINT and not cut short by a second:
    with several ranks the leader gets a Ctrl-C twice (from the terminal, then from the agent)."""

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            super().handle_exit(sig, frame)


def serve_http(artifacts: Path, host: str, port: int, max_waiting: int, grace_seconds: float,
               model_name: str | None = None, trusted_key: Path | None = None) -> None:
    """Serve `artifacts` on (host, port) (0: any free port) until SIGTERM or Ctrl-C: in this
    process on one rank; with several, this process is torchrun's agent, the server runs in the
    leader rank's process and the followers run its steps."""
    from graphc.artifacts.directory import read_manifest
    from graphc.runtime.launch import launch_ranks
    from graphc.runtime.loader import kv_pool_blocks

    manifest = read_manifest(artifacts, trusted_key)
    job = HttpJob(str(artifacts), host, port, max_waiting, grace_seconds, model_name or Path(artifacts).resolve().name)
    if manifest.topology.world == 1:
        job.lead(Engine(artifacts, manifest=manifest))
        return
    kv_pool_blocks(manifest)  # GRAPHC_NUM_KV_BLOCKS checked here, not once per rank after start-up
    launch_ranks(Path(artifacts), job, manifest.topology.world, trusted_key=trusted_key)
