"""A request body as the server reads it: bounded in size (HTTP 413, answered before a body over
the limit is read whole) and in the time its client takes to send it (HTTP 408), then parsed as JSON into its schema. Every way a body can be malformed
(not UTF-8, not JSON, nested past what the parser takes, a lone surrogate, a field of the wrong
type) is a `BadRequest`, never FastAPI's {"detail": ...} or a 500."""

from __future__ import annotations

import json
import re
import sys
from email.message import Message

import anyio
from fastapi import Request
from pydantic import BaseModel, ValidationError

from graphc.errors import GraphcError
from graphc.server.translate import BadRequest

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""Where a lone surrogate can come from once the body decoded as UTF-8: a JSON escape of one."""


class BodyTooLarge(GraphcError):
    """A request body over the server's bound (HTTP 413)."""


class BodyTooSlow(GraphcError):
    """A request body not sent whole within the server's time (HTTP 408)."""


async def read_body(http: Request, limit: int, seconds: float) -> bytes:
    """The request's body, or BodyTooLarge as soon as it is known to be over `limit` bytes: from
    its Content-Length before a byte of it is read, else once the bytes read pass the limit; or
    BodyTooSlow if the whole of it has not arrived `seconds` after the headers."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body is {int(declared)} bytes; this server takes at most {limit} "
                           "(--max-body-bytes)")
    chunks, size = [], 0
    with anyio.move_on_after(seconds) as deadline:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"the request body is over {limit} bytes, the most this server takes "
                                   "(--max-body-bytes)")
            chunks.append(chunk)
    if deadline.cancelled_caught:
        raise BodyTooSlow(f"the request body was not sent within {seconds:g} s ({size} bytes arrived; "
                          "--body-timeout)")
    return b"".join(chunks)


def parse_body(raw: bytes, content_type: str | None, schema: type[BaseModel], context_limit: int) -> BaseModel:
    """`raw` as a `schema` (whose validators may refuse what cannot fit `context_limit` tokens),
    or BadRequest saying what is wrong with it (and naming the field where one is to blame)."""
    if content_type and not _is_json(content_type):
        raise BadRequest(f"the request body must be JSON (Content-Type: application/json), not {content_type}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise BadRequest("the request body nests arrays or objects too deeply to be a request") from None
    except ValueError:  # an integer of more digits than Python converts
        raise BadRequest(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} digits") \
            from None
    if _SURROGATE_ESCAPE.search(text):  # a scan at C speed spares the walk over most bodies
        _refuse_lone_surrogates(value)
    try:
        return schema.model_validate(value, context={"context_limit": context_limit})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise BadRequest(f"{where + ': ' if where else ''}{first['msg']}", param=where or None) from None


def _is_json(content_type: str) -> bool:
    """application/json or application/*+json, as FastAPI takes them."""
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _refuse_lone_surrogates(value) -> None:
    """BadRequest naming the first string (or object key) of `value` that holds a lone surrogate:
    no tokenizer encodes one, and no error message that quotes one can be sent as UTF-8.
    Iterative: the parser's nesting depth is near the recursion limit."""
    stack = [((), value, "")]
    while stack:
        path, item, what = stack.pop()
        if isinstance(item, dict):
            # Keys last, so popped first: a bad key is named by its object's path, not by itself.
            stack += [((*path, key), v, "") for key, v in item.items()] + [(path, key, "a key is ") for key in item]
        elif isinstance(item, list):
            stack += [((*path, index), v, "") for index, v in enumerate(item)]
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                where = ".".join(map(str, path))
                raise BadRequest(f"{where or 'the request body'}: {what}not valid Unicode: a lone surrogate "
                                 f"{item[e.start]!r} at character {e.start}", param=where or None) from None
