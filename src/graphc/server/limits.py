"""What one request may take of `graphc serve`: the bounds and their defaults. Light (no
FastAPI): the command line reads the defaults."""

from __future__ import annotations

from dataclasses import dataclass

BODY_BYTES_PER_TOKEN = 64
BODY_BASE_BYTES = 64 << 10
"""The default bound on a request body: this many bytes per token of the context, plus the base
(80 KiB for 256 tokens, 8 MiB and 64 KiB for 128 k). Parsing a body holds the GIL (and so the
event loop) for one C call, so a body is bounded by what the context can hold: a token is a few
bytes of JSON as text (about a dozen as escaped CJK) or as an id, a message at least one token
and some 30 bytes."""
BODY_SECONDS = 30.0
"""The default time a client has to send a request's body: a client that trickles it (a few bytes
a second, as a slowloris attack does) holds a connection no longer than this."""
TEMPLATE_SECONDS = 2.0
"""The default time a chat template may take to render a request: real ones take milliseconds."""
MAX_PROMPTS = 64
"""A completion request's batch of prompts: at most this many (each is a request of its own in the
admission queue; lm-evaluation-harness sends a few to a few dozen)."""
MAX_CHOICES = 64
"""A request's choices, prompts times `n`: at most this many."""
MAX_N = 8
"""The default bound on `n` (`graphc serve --max-n`)."""
PREFIX_CACHE_ISOLATION = ("shared", "api-key", "salt")
"""Who shares the prefix cache (`graphc.server.isolation`)."""
MAX_CACHE_SALT_CHARS = 1024
"""A request's cache_salt: at most this many characters (a 256-bit secret is 43 in base64)."""
MAX_STOP_STRINGS = 32
MAX_STOP_BYTES = 4096
"""A request's stop strings: at most this many, of at most this many UTF-8 bytes together
(each generated token is looked for in every one of them)."""


@dataclass(frozen=True)
class RequestLimits:
    """The bounds `graphc serve`'s options set."""

    max_body_bytes: int | None = None
    """None: derived from the context limit (`body_bytes`)."""
    template_seconds: float = TEMPLATE_SECONDS
    body_seconds: float = BODY_SECONDS
    max_n: int = MAX_N
    """The most choices a request may ask of one prompt (`n`)."""

    def body_bytes(self, context_limit: int) -> int:
        """The bound on a request body for a context of `context_limit` tokens."""
        return self.max_body_bytes or BODY_BYTES_PER_TOKEN * context_limit + BODY_BASE_BYTES
