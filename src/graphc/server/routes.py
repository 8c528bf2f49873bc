"""The OpenAI-compatible routes over an `OnlineEngine`.

Every bad request gets HTTP 400 with OpenAI's error body and changes nothing; past the admission
queue's bound, 429 with Retry-After. A client that disconnects cancels its request, whose KV
blocks return to the pool before the next step.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from graphc.artifacts.manifest import Manifest
from graphc.errors import GraphcError
from graphc.runtime.online import OnlineEngine, QueueFull
from graphc.server.metrics import ServerMetrics
from graphc.server.schemas import ChatCompletionRequest, CompletionRequest, error_response
from graphc.server.streaming import CHAT, TEXT, Generation, GenerationStream, Shape, complete, stream
from graphc.server.translate import BadRequest, check_model, generation_request, prompt_ids, render_chat

RETRY_AFTER_SECONDS = 1


def create_app(online: OnlineEngine, manifest: Manifest, tokenizer, model_name: str) -> FastAPI:
    """The app: its routes and error handlers are closures over the engine and the manifest, so
    they read as one listing (hence one function of about 60 lines)."""
    app = FastAPI(title="graphc", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(online)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
        return error_response(400, message, param=where or None)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return error_response(400, str(error), param=error.param, code=error.code)

    @app.exception_handler(GraphcError)
    async def unavailable(request: Request, error: GraphcError):  # the engine failed or is stopping
        return error_response(503, str(error), kind="server_error")

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, error: QueueFull):
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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "graphc",
                                            "max_model_len": manifest.buckets.context_limit}]}

    async def respond(body, prompt: list[int], shape: Shape, http: Request):
        request = generation_request(body, prompt, manifest)
        refusal = online.refusal(request)
        if refusal:
            raise BadRequest(refusal, param="prompt")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        generation = Generation(online, metrics, request, tokenizer, stop)
        head = {"id": f"{shape.prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return GenerationStream(generation, stream(generation, head, shape, include_usage))
        return await complete(generation, head, shape, http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model, model_name)
        return await respond(body, prompt_ids(body.prompt, tokenizer), TEXT, http)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        check_model(body.model, model_name)
        template = manifest.model.chat_template
        if template is None or tokenizer is None:
            raise BadRequest(f"model {model_name!r} has no chat template (its checkpoint's tokenizer_config.json "
                             "has none); use /v1/completions", param="messages", code="no_chat_template")
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        text = render_chat(template, [m.model_dump() for m in body.messages])
        return await respond(body, tokenizer.encode(text, add_special_tokens=False).ids, CHAT, http)

    return app
