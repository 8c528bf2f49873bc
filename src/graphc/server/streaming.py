"""A request's tokens as text deltas cut at stop strings, sent as server-sent events or as one
JSON body; either way the generation is cancelled when the response ends early."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from graphc.runtime.logprobs import TokenLogprobs
from graphc.runtime.online import OnlineEngine, Ticket
from graphc.runtime.scheduler import Request as GenerationRequest
from graphc.server.chat_reply import ChatReply, merged
from graphc.server.detokenize import IncrementalText
from graphc.server.logprob_format import logprobs_body, text_length
from graphc.server.metrics import ServerMetrics
from graphc.server.schemas import error_body, error_response

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context_limit": "length"}
"""graphc's finish reasons as OpenAI's."""


class Generation:
    """One request's tokens as they arrive, as text deltas cut at stop strings.

    Text is decoded incrementally (`detokenize.IncrementalText`: a tail that is an incomplete
    UTF-8 character waits for the bytes that complete it); a tail that could still become a stop
    string is held back until the next token or the end.
    """

    def __init__(self, online: OnlineEngine, metrics: ServerMetrics, request: GenerationRequest, tokenizer,
                 stop: list[str], lead: bool = True, reply: ChatReply | None = None, echo: str | None = None):
        self.online, self.metrics, self.request = online, metrics, request
        self.lead = lead
        """The first choice of its prompt: usage counts the prompt's tokens once, on it."""
        self.echo = echo
        """A completion's prompt text, to come before its own (`echo`) in its first chunk, or None."""
        self.reply = reply or ChatReply()
        """A chat's text as message fields: reasoning, content, tool calls."""
        self.decoded = IncrementalText(tokenizer)
        self.eos: list[int] = []
        """The EOS token that ended it, if one did: counted and reported, but its text is left out
        (as vLLM does: a tokenizer whose EOS is an ordinary token would otherwise show it)."""
        self.logprobs: list[TokenLogprobs] = []
        """Of each token so far, where the request asks for them."""
        self.logprob_chars = 0
        """Where the next token's text starts in a completion's logprobs (`text_offset`)."""
        self.stop = [s for s in stop if s]
        self.text, self.sent = "", 0
        self.searched = 0
        """Text before this was searched for stop strings, or was exempt from them (`min_tokens`)."""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.unavailable = False
        """The error is the server's going away (its grace period over), not the request's."""
        self.arrived = self.last_token = time.monotonic()
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.started = asyncio.Event()
        """Set at its first event: its first token (its prompt prefilled) or its end."""

        def deliver(token, result, logprobs=None):  # on the engine thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._arrived, (token, result, logprobs))

        self.ticket: Ticket = online.submit(request, deliver)

    def _arrived(self, event) -> None:
        self.events.put_nowait(event)
        self.started.set()

    def cancel(self) -> None:
        """End the request early (a stop string, or its client left); its blocks are freed."""
        self.online.cancel(self.ticket)
        if self.finish_reason is None:
            self._end("cancelled")

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.requests.labels(reason).inc()

    async def deltas(self):
        """Yield (text delta, token ids, their logprobs) until the request ends; then
        `finish_reason` is set."""
        while self.finish_reason is None:
            token, result, logprobs = await self.events.get()
            new_ids, new_logprobs = [], []
            if token is not None:
                self._record_token()
                if result is not None and result.finish_reason == "eos":
                    self.eos.append(token)
                else:
                    self.decoded.add(token)
                new_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs)
                new_logprobs.append(logprobs)
            if result is not None:
                self.decoded.finish()
            self.text = self.decoded.text
            if self._stopped():
                self._end("stop")
                if result is None:
                    self.online.cancel(self.ticket)  # its blocks go back now; later tokens would be cut anyway
            elif result is not None:
                if result.finish_reason in ("error", "aborted"):
                    self.error, self.unavailable = result.error, result.finish_reason == "aborted"
                self._end(FINISH_REASONS.get(result.finish_reason, result.finish_reason))
            end = len(self.text) if self.finish_reason else self._safe_end()
            delta, self.sent = self.text[self.sent:end], max(self.sent, end)
            if delta or new_ids or self.finish_reason:
                yield delta, new_ids, new_logprobs

    @property
    def ids(self) -> list[int]:
        return self.decoded.ids + self.eos

    def _record_token(self) -> None:
        now = time.monotonic()
        (self.metrics.first_token if not self.ids else self.metrics.inter_token).observe(
            now - (self.arrived if not self.ids else self.last_token))
        self.last_token = now
        self.metrics.token()

    def _stopped(self) -> bool:
        """Whether a stop string ends in the new text, cutting `text` before it. Text of the first
        min_tokens - 1 tokens is exempt for good: a stop string that ends in it never cuts (its
        start may have been streamed already); one that starts in it and ends later does."""
        searched, self.searched = self.searched, len(self.text)
        if not self.stop or len(self.ids) < self.request.min_new_tokens:
            return False
        cut = find_stop(self.text, self.stop, searched)
        if cut is not None:
            self.text = self.text[:cut]
        return cut is not None

    def _safe_end(self) -> int:
        end = len(self.text)
        if self.stop:  # the last len(stop) - 1 characters could still begin a stop string
            end = max(self.sent, end - max(len(s) for s in self.stop) + 1)
        return end


def find_stop(text: str, stops: list[str], searched: int) -> int | None:
    """The start of the earliest stop string in `text` that ends past `searched`, or None. Text
    up to `searched` was searched before, or is exempt: an occurrence that ends there never counts."""
    found = [i for i in (text.find(s, max(0, searched - len(s) + 1)) for s in stops) if i >= 0]
    return min(found, default=None)


@dataclass(frozen=True)
class Shape:
    """How a response is laid out: a completion's choices carry `text`, a chat's a `message`
    (streamed as `delta`s, the first naming the role)."""

    prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, index: int, generation: Generation, text: str, ids: list[int], first: bool = False,
               whole: bool = False, logprobs: dict | None = None) -> dict:
        """Choice `index` of `generation`: its whole text, or (a chunk's) the `text` it adds; a
        completion's first chunk (or whole text) after its echoed prompt."""
        finish_reason = generation.finish_reason
        if not self.chat:
            echo = generation.echo if (first or whole) and generation.echo is not None else ""
            return {"index": index, "text": echo + text, "logprobs": logprobs, "finish_reason": finish_reason,
                    "token_ids": ids}
        reply = generation.reply
        if whole:
            message = reply.message(text)
        else:
            message = merged(reply.feed(text), reply.finish()) if finish_reason else reply.feed(text)
            message = {"role": "assistant", "content": "", **message} if first else message
        if reply.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return {"index": index, "message" if whole else "delta": message, "logprobs": logprobs,
                "finish_reason": finish_reason, "token_ids": ids}


TEXT = Shape("cmpl", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


def _usage(generations: list[Generation], cached_tokens: bool) -> dict:
    """OpenAI's usage of a request's choices together, each prompt counted once (on its first
    choice) however many choices it has; with `cached_tokens`, the prompt tokens the prefix cache
    held for them."""
    leads = [g for g in generations if g.lead]
    prompt = sum(len(g.request.prompt) for g in leads)
    completion = sum(len(g.ids) for g in generations)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": sum(g.ticket.cached_tokens for g in leads)}
    return usage


class GenerationStream(StreamingResponse):
    """The events of a request's generations, each cancelled however the response ends early: a
    client that disconnects, even before the first event, or a server past its grace period."""

    def __init__(self, generations: list[Generation], events):
        super().__init__(events, media_type="text/event-stream")
        self.generations = generations

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self.generations:
                if generation.finish_reason is None:
                    generation.cancel()


async def complete(generations: list[Generation], head: dict, shape: Shape, http: Request,
                   cached_tokens: bool = True) -> JSONResponse:
    """The whole completion, a choice a generation; cancelled if the client goes away first (or
    the handler is)."""
    collect = asyncio.ensure_future(asyncio.gather(*(_collect(g) for g in generations)))
    try:
        while not collect.done():
            await asyncio.wait([collect], timeout=0.25)
            if not collect.done() and await http.is_disconnected():
                return JSONResponse({}, status_code=499)
    finally:
        if not collect.done():
            for generation in generations:
                generation.cancel()
            collect.cancel()
    failed = next((g for g in generations if g.error), None)
    if failed:  # 503: the server is going away, which a client may retry elsewhere
        return error_response(503 if failed.unavailable else 500, f"the request failed: {failed.error}",
                              kind="server_error")
    choices = [shape.choice(i, g, g.text, g.ids, whole=True, logprobs=_logprobs(g, g.ids, g.logprobs, shape, True))
               for i, g in enumerate(generations)]
    usage = _usage(generations, cached_tokens)
    return JSONResponse({**head, "object": shape.object, "choices": choices, "usage": usage})


async def _collect(generation: Generation) -> None:
    async for _ in generation.deltas():
        pass


async def stream(generations: list[Generation], head: dict, shape: Shape, usage: str | None,
                 cached_tokens: bool = True):
    """Server-sent events in OpenAI's format, each generation's chunks under its choice's index as
    they come; `usage`: None, in a "last chunk" of its own (OpenAI's `include_usage`), or also in
    "every chunk" (vLLM's `continuous_usage_stats`), with the cached tokens if `cached_tokens`."""
    deltas: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        async for delta, ids, logprobs in generation.deltas():
            await deltas.put((index, delta, ids, logprobs))
        await deltas.put((index, None, None, None))

    pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    first, running = set(range(len(generations))), len(generations)
    try:
        while running:
            index, delta, ids, logprobs = await deltas.get()
            generation = generations[index]
            if delta is None:
                running -= 1
                continue
            if generation.error:
                yield _event(error_body(f"the request failed: {generation.error}", kind="server_error"))
                break
            choice = shape.choice(index, generation, delta, ids, first=index in first,
                                  logprobs=_logprobs(generation, ids, logprobs, shape, index in first))
            first.discard(index)
            counts = {"usage": _usage(generations, cached_tokens)} if usage == "every chunk" else {}
            yield _event({**head, "object": shape.chunk_object, "choices": [choice], **counts})
    finally:
        for task in pumps:
            task.cancel()
    if usage is not None:
        last = _usage(generations, cached_tokens)
        yield _event({**head, "object": shape.chunk_object, "choices": [], "usage": last})
    yield "data: [DONE]\n\n"


def _logprobs(generation: Generation, ids: list[int], entries: list[TokenLogprobs], shape: Shape,
              first: bool) -> dict | None:
    """A choice's (or a chunk's) logprobs of `ids`, None where its request asks for none; the
    `first` chunk's (or the whole choice's) after its prompt's, where it asks for those (`echo`)."""
    if generation.request.logprobs is None:
        return None
    if first and generation.request.prompt_logprobs is not None:
        ids, entries = generation.request.prompt + ids, generation.ticket.prompt_logprobs + entries
    tokenizer = generation.decoded.tokenizer
    body = logprobs_body(tokenizer, ids, entries, shape.chat, generation.logprob_chars)
    generation.logprob_chars += text_length(tokenizer, ids)
    return body


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
