"""`graphc serve --api-key`: every route but /health answers 401 unless the request carries
`Authorization: Bearer KEY` (what OpenAI's clients send their api_key as).

An ASGI middleware rather than a route dependency, so that it runs before anything else about the
request (its body is not read) and covers every path, unknown ones too. /health stays open: it is
what a load balancer or an orchestrator probes, and it tells nothing about the model.
"""

from __future__ import annotations

import hmac

from graphc.server.schemas import error_response

OPEN_PATHS = frozenset({"/health"})


class ApiKeyRequired:
    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = _bearer_token(scope["headers"])
        # compare_digest takes as long whatever the first difference: a timing never tells a
        # client how much of a guess was right.
        if given is not None and hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        message = ("this server needs an API key: send it as Authorization: Bearer KEY" if given is None else
                   "the API key given is not this server's")
        response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None where there is none."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None
