"""`graphc serve --api-key` / `--api-keys-file`: every route but /health answers 401 unless the
request carries `Authorization: Bearer KEY` (what OpenAI's clients send their api_key as) with one
of the server's keys. Each key is a tenant: the route reads which (`tenant`) to keep tenants'
prefix caches apart (`graphc.server.isolation`).

An ASGI middleware rather than a route dependency, so that it runs before anything else about the
request (its body is not read) and covers every path, unknown ones too. /health stays open: it is
what a load balancer or an orchestrator probes, and it tells nothing about the model.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

from graphc.errors import GraphcError
from graphc.server.schemas import error_response

OPEN_PATHS = frozenset({"/health"})
BEARER_TOKEN = re.compile(r"[!-~]+")
"""What a key may be: printable ASCII without spaces, so a Bearer header can carry it."""


def tenant_of(key: str) -> str:
    """A key's tenant as the server names it: a digest, so the key itself is kept nowhere else."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant(scope) -> str | None:
    """The tenant of an authenticated request (None where the server takes no key)."""
    return scope.get("state", {}).get("tenant")


def server_keys(api_key: str | None, keys_file: Path | None) -> tuple[str, ...]:
    """The keys of `graphc serve`'s --api-key (or GRAPHC_API_KEY) and --api-keys-file together.

    Raises:
        GraphcError: a key a Bearer token cannot carry, or a bad keys file (`read_api_keys`).
    """
    if api_key is not None and not BEARER_TOKEN.fullmatch(api_key):
        raise GraphcError("--api-key / GRAPHC_API_KEY must be printable ASCII without spaces (a Bearer token)")
    from_file = read_api_keys(keys_file) if keys_file is not None else ()
    return tuple(dict.fromkeys(((api_key,) if api_key is not None else ()) + from_file))


def read_api_keys(path: Path) -> tuple[str, ...]:
    """The keys of an --api-keys-file: one a non-blank line.

    Raises:
        GraphcError: the file cannot be read, holds no key, a key a Bearer token cannot carry, or
            a key twice (naming the line).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise GraphcError(f"--api-keys-file {path}: cannot read it ({e})") from None
    keys: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        key = line.strip()
        if not key:
            continue
        if not BEARER_TOKEN.fullmatch(key):
            raise GraphcError(f"--api-keys-file {path}:{number}: a key must be printable ASCII without spaces "
                              "(a Bearer token)")
        if key in keys:
            raise GraphcError(f"--api-keys-file {path}:{number}: the key of line {keys[key]} again")
        keys[key] = number
    if not keys:
        raise GraphcError(f"--api-keys-file {path}: no key in it (one a line)")
    return tuple(keys)


class ApiKeyRequired:
    def __init__(self, app, keys: tuple[str, ...]):
        self.app, self.keys = app, [(key.encode(), tenant_of(key)) for key in keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = _bearer_token(scope["headers"])
        # compare_digest takes as long whatever the first difference, and every key is compared:
        # a timing tells a client neither how much of a guess was right nor which key it was near.
        matched = [name for key, name in self.keys if given is not None and hmac.compare_digest(given, key)]
        if matched:
            scope.setdefault("state", {})["tenant"] = matched[0]
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
