"""Request bodies of the OpenAI API subset graphc serves, and its error body and response.

Unknown fields and values of the wrong JSON type are refused (HTTP 400) rather than ignored: a
client that sends a parameter graphc does not implement learns so at once. Strict types: `5` is
not `"5"`, `true` is not `1`.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None = None
    """Default: the manifest's runtime.max_new_tokens, within the context limit."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """An extension (as vLLM's): keep the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Absent: the manifest's default seed (sampling is then reproducible across calls)."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False
    """vLLM's extension: generate through EOS tokens."""
    min_tokens: int = Field(0, ge=0)
    """vLLM's extension: EOS and stop strings do not end the request before this many tokens."""
    user: str | None = None


class CompletionRequest(_Generation):
    prompt: str | list[int]
    """Text (encoded with the artifacts' tokenizer) or token ids."""


class ChatMessage(_Strict):
    role: str
    content: str


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens in chat (used when max_tokens is absent)."""


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: what its clients parse into exceptions."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """`error_body` as a response with HTTP `status`."""
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)
