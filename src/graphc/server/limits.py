"""What one request may take of `graphc serve`: the bounds and their defaults. Light (no
FastAPI): the command line reads the defaults."""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 8 << 20
"""The default bound on a request body: far above what a context of 128 k tokens takes as text or
token ids, and a few tens of milliseconds of JSON parsing."""
BODY_SECONDS = 30.0
"""The default time a client has to send a request's body: a client that trickles it (a few bytes
a second, as a slowloris attack does) holds a connection no longer than this."""
TEMPLATE_SECONDS = 2.0
"""The default time a chat template may take to render a request: real ones take milliseconds."""
MAX_STOP_STRINGS = 32
MAX_STOP_BYTES = 4096
"""A request's stop strings: at most this many, of at most this many UTF-8 bytes together
(each generated token is looked for in every one of them)."""


@dataclass(frozen=True)
class RequestLimits:
    """The bounds `graphc serve`'s options set."""

    max_body_bytes: int = MAX_BODY_BYTES
    template_seconds: float = TEMPLATE_SECONDS
    body_seconds: float = BODY_SECONDS
