"""Requests that arrive at any time: one thread runs the leader's steps while callers on other
threads (an HTTP server's event loop) submit, receive tokens as they are produced, and cancel.

The engine thread owns the scheduler. Callers never touch it: they enqueue commands, which the
thread applies between steps (so a submit never waits for a step to finish), and get each
request's events through the listener they submitted it with, called on the engine thread.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from graphc.errors import GraphcError
from graphc.runtime.engine import Engine
from graphc.runtime.logprobs import TokenLogprobs
from graphc.runtime.scheduler import DraftStats, Request, Result

logger = logging.getLogger(__name__)

ENGINE_FAILED = "a rank of the job failed or was lost; the server's log says which"
"""What clients are told when a step fails: the failure itself (gloo's peer addresses, build
paths) goes to the server's log only."""

Listener = Callable[[int | None, Result | None, TokenLogprobs | None], None]
"""Called on the engine thread with each generated token (result None) and, where the request
asks for them, its logprobs; then once with the request's result (token None, or the last token
when that token ended it)."""


class QueueFull(GraphcError):
    """More requests wait for admission than the engine was told to hold."""


@dataclass
class Ticket:
    """A submitted request, for cancelling it."""

    request: Request
    listener: Listener
    index: int | None = None
    """The scheduler's index, once the engine thread has taken the request."""
    cancelled: bool = False
    cached_tokens: int = 0
    """Prompt tokens its sequence read from the prefix cache (set before its first token is delivered)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Its prompt's logprobs where it asked for them (`Request.prompt_logprobs`), set before its
    first event is delivered."""


@dataclass
class EngineState:
    """What the engine thread last saw (for metrics and admission control)."""

    waiting: int = 0
    running: int = 0
    blocks_in_use: int = 0
    cached_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_tokens: tuple[int, int] = (0, 0)
    """Prompt tokens looked up in the prefix cache and found there, since the start."""
    steps: dict[str, int] = field(default_factory=dict)
    drafts: DraftStats = field(default_factory=lambda: DraftStats([], []))
    """Speculative decoding's drafts verified and accepted, per draft position, since the start."""
    failure: str | None = None


class OnlineEngine:
    """Drives `engine` (the leader's, or the only rank's) from a thread of its own.

    Args:
        engine: the loaded engine.
        max_waiting: requests that may wait for admission (queued or waiting for KV blocks);
            `submit` raises QueueFull past it rather than holding unbounded memory.
    """

    def __init__(self, engine: Engine, max_waiting: int):
        self.engine, self.max_waiting = engine, max_waiting
        self.session = engine.session()
        self._commands: deque[tuple[str, Ticket]] = deque()
        self._tickets: dict[int, Ticket] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._aborted: str | None = None
        self.state = EngineState(num_blocks=sum(a.num_blocks for a in self.session.scheduler.allocators))
        self._thread = threading.Thread(target=self._loop, name="graphc-engine", daemon=True)
        self._thread.start()

    def refusal(self, request: Request) -> str | None:
        """Why `request` can never be served here (a bad request), or None. Reads only the
        scheduler's fixed limits: safe from any thread."""
        return self.session.scheduler.refusal(request)

    def submit(self, request: Request, listener: Listener) -> Ticket:
        """Queue `request`; its events go to `listener`.

        Raises:
            QueueFull: `max_waiting` requests already wait.
            GraphcError: the engine has stopped or failed.
        """
        with self._wake:
            if self._stopping or self.state.failure or self._aborted:
                raise GraphcError(self.state.failure or self._aborted or "the engine is stopping")
            if self.state.waiting + sum(kind == "submit" for kind, _ in self._commands) >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting")
            ticket = Ticket(request, listener)
            self._commands.append(("submit", ticket))
            self._wake.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """End `ticket`'s request (its KV blocks return to the pool before the next step)."""
        with self._wake:
            if not ticket.cancelled:
                ticket.cancelled = True
                self._commands.append(("cancel", ticket))
                self._wake.notify()

    def abort(self, message: str) -> None:
        """End every request in flight with `message` as its error (finish reason "aborted"), and
        refuse new ones as `submit` does once stopping: a server whose grace period is over."""
        with self._wake:
            self._aborted = message
            self._wake.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel whatever is in flight and end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        scheduler = self.session.scheduler
        try:
            while True:
                with self._wake:
                    while not self._commands and self.session.idle and not self._stopping:
                        self._wake.wait()
                    commands, self._commands = list(self._commands), deque()
                    stopping, aborted = self._stopping, self._aborted
                for kind, ticket in commands:
                    self._apply(kind, ticket)
                for ticket in list(self._tickets.values()) if aborted else []:
                    _notify(ticket, None, Result(ticket.request, self._end(ticket).output_ids, "aborted", aborted))
                self._publish_state(scheduler)  # admission control counts what was just queued
                if stopping:
                    for ticket in list(self._tickets.values()):
                        self._apply("cancel", ticket)
                    return
                if not self.session.idle:
                    for emitted in self.session.step():
                        ticket = self._tickets[emitted.index]
                        ticket.cached_tokens = emitted.cached_tokens
                        if emitted.prompt_logprobs is not None:
                            ticket.prompt_logprobs = emitted.prompt_logprobs
                        if emitted.result is not None:
                            del self._tickets[emitted.index]
                            del scheduler.results[emitted.index]  # delivered: a server keeps no history
                        _notify(ticket, emitted.token, emitted.result, emitted.logprobs)
                self._publish_state(scheduler)
        except Exception:  # a graph or a rank failed: every request in flight gets the error
            logger.exception("the engine stopped: a step failed")
            self._fail(ENGINE_FAILED)

    def _apply(self, kind: str, ticket: Ticket) -> None:
        scheduler = self.session.scheduler
        if kind == "submit":
            if ticket.cancelled:
                _notify(ticket, None, Result(ticket.request, [], "cancelled"))
                return
            ticket.index = scheduler.submit(ticket.request)
            if ticket.index in scheduler.results:  # refused at once
                _notify(ticket, None, scheduler.results.pop(ticket.index))
            else:
                self._tickets[ticket.index] = ticket
        elif ticket.index is not None and ticket.index in self._tickets:
            _notify(ticket, None, self._end(ticket))

    def _end(self, ticket: Ticket) -> Result:
        """Cancel `ticket`'s request in the scheduler; its result, which no one else will read."""
        del self._tickets[ticket.index]
        result = self.session.scheduler.cancel(ticket.index)
        del self.session.scheduler.results[ticket.index]
        return result

    def _publish_state(self, scheduler) -> None:
        with self._wake:
            self.state.waiting = len(scheduler.waiting)
            self.state.running = len(scheduler.running)
            self.state.blocks_in_use = scheduler.blocks_in_use
            self.state.cached_blocks = scheduler.cached_blocks
            self.state.prefix_cache_tokens = scheduler.prefix_cache_tokens
            self.state.drafts = copy.deepcopy(scheduler.drafts)
            self.state.steps = {name: stats.steps for name, stats in self.engine.stats.items()}

    def _fail(self, message: str) -> None:
        with self._wake:
            self.state.failure = message
            pending = [ticket for _, ticket in self._commands if not ticket.cancelled]
            self._commands.clear()
        for ticket in [*self._tickets.values(), *pending]:
            _notify(ticket, None, Result(ticket.request, [], "error", message))
        self._tickets.clear()


def _notify(ticket: Ticket, token: int | None, result: Result | None, logprobs: TokenLogprobs | None = None) -> None:
    """Call the ticket's listener; one whose caller has gone (a closed event loop at shutdown)
    must not stop the engine for every other request."""
    try:
        ticket.listener(token, result, logprobs)
    except Exception:
        logger.exception("a request's listener failed; the request was dropped")
