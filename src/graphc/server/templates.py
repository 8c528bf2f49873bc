"""A chat as its prompt text, rendered with the checkpoint's template as transformers'
`apply_chat_template` renders it, in worker processes, each render bounded in time and memory.

Why processes: a template came with the artifacts (input, not code) and runs in Jinja's immutable
sandbox, which keeps it from Python's objects but not from looping. Two nested loops over
`range(100000)` never end, and in the server's process nothing could end them: Python cannot
stop a thread, and an instruction budget (a tracing hook, or loop counters compiled into the
template) slows every render and still cannot interrupt one C call (a huge string join or
repetition). A process can be killed whatever it is doing. So each render runs in one of a few
long-lived workers (`template_worker`); one that has not answered within the time limit is
killed, the request answered 400, and a new worker started when one is next needed. A worker
also bounds its own memory, and ends itself a second past the limit should the server be gone.
A request waits for a free worker no longer than a render may take (`TemplatesBusy`, HTTP 429).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Callable

from pydantic import BaseModel

from graphc.artifacts.manifest import ChatTemplate
from graphc.errors import GraphcError
from graphc.server.translate import BadRequest

WORKERS = 2
"""Renders at a time; a request waits for a free worker, as long as one render may take."""
WORKER_MEMORY_BYTES = 1 << 30
"""A worker's address space (RLIMIT_AS): a render past it fails with MemoryError, a 400."""
START_SECONDS = 60.0
"""How long a worker may take to start (the interpreter and jinja2), which no render waits on."""


class TemplatesBusy(GraphcError):
    """Every worker stayed busy for as long as a render may take (HTTP 429: retry later)."""


def chat_line(messages: list[BaseModel], tools: list[BaseModel] | None = None, kwargs: dict | None = None) -> bytes:
    """What a worker is sent to render `messages` with `tools` (OpenAI's tool objects, as
    transformers passes them) and the template's own `kwargs`: work for a thread, not the event
    loop (dumping and encoding a chat takes a while for one of many messages)."""
    chat = {"messages": [m.model_dump(exclude_unset=True) for m in messages],
            "tools": [t.model_dump(exclude_unset=True) for t in tools] if tools else None, "kwargs": kwargs or {}}
    return (json.dumps(chat) + "\n").encode()


class TemplateRenderer:
    """Renders chats with `template` in up to `workers` worker processes, each render within
    `seconds`; a rendered prompt of more than `max_chars` characters is refused by its length
    alone (`too_long` says why), so no such text crosses a pipe."""

    def __init__(self, template: ChatTemplate, seconds: float, max_chars: int, too_long: Callable[[int], str],
                 workers: int = WORKERS):
        self.seconds, self.max_chars, self.too_long = seconds, max_chars, too_long
        self.template = template.template
        self._setup = json.dumps({"template": template.template, "bos_token": template.bos_token,
                                  "eos_token": template.eos_token, "seconds": seconds, "max_chars": max_chars,
                                  "memory_bytes": WORKER_MEMORY_BYTES}) + "\n"
        self._workers = workers
        self._idle: list[asyncio.subprocess.Process] = []
        self._slots: asyncio.Semaphore | None = None  # made on the server's event loop, at the first render

    async def render(self, line: bytes) -> str:
        """The prompt text of the chat that `line` (`chat_line`) holds; TemplatesBusy where no
        worker was free within the time a render may take; or BadRequest: the template raised,
        overran its time or memory, or rendered more than `max_chars` characters."""
        self._slots = self._slots or asyncio.Semaphore(self._workers)
        await self._free_worker()
        try:
            worker = self._idle.pop() if self._idle else await self._start()
            reply = await self._exchange(worker, line)
            self._idle.append(worker)  # only a worker that answered goes back: its state is known
        finally:
            self._slots.release()
        if "chars" in reply:
            raise BadRequest(self.too_long(reply["chars"]), param="messages")
        if "error" in reply:
            raise BadRequest(f"the chat template cannot render these messages: {reply['error']}", param="messages")
        return reply["text"]

    async def _free_worker(self) -> None:
        # Unbounded, the wait behind renders that each take up to the time limit grows with the
        # queue (a template that loops makes every render take it): past one render's time, 429.
        try:
            async with asyncio.timeout(self.seconds):
                await self._slots.acquire()
        except TimeoutError:
            raise TemplatesBusy(f"every chat template worker stayed busy for {self.seconds:g} s "
                                "(--template-timeout)") from None

    async def _start(self) -> asyncio.subprocess.Process:
        # The reply holds at most max_chars characters, each at most 12 bytes as a JSON escape.
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "graphc.server.template_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=12 * self.max_chars + 4096)
        try:
            worker.stdin.write(self._setup.encode())
            await asyncio.wait_for(worker.stdout.readline(), START_SECONDS)
        except BaseException:
            await _end(worker)
            raise
        return worker

    async def _exchange(self, worker: asyncio.subprocess.Process, line: bytes) -> dict:
        """The worker's reply to `line`; a worker that overruns, dies or is abandoned (its request
        cancelled) is killed."""
        try:
            worker.stdin.write(line)
            line = await asyncio.wait_for(self._reply(worker), self.seconds)
        except TimeoutError:
            await _end(worker)
            raise BadRequest(f"the chat template did not finish rendering these messages within {self.seconds:g} s "
                             "(--template-timeout)", param="messages") from None
        except ConnectionError:  # it died (memory, a signal) before it read them
            line = b""
        except BaseException:
            await _end(worker)
            raise
        if not line:
            code = await worker.wait()
            raise BadRequest(f"the chat template cannot render these messages: its worker process ended (exit code "
                             f"{code}) while rendering them", param="messages")
        return json.loads(line)

    @staticmethod
    async def _reply(worker: asyncio.subprocess.Process) -> bytes:
        await worker.stdin.drain()
        return await worker.stdout.readline()


async def _end(worker: asyncio.subprocess.Process) -> None:
    if worker.returncode is None:
        worker.kill()
    await worker.wait()
