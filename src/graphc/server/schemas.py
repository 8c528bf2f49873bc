"""Request bodies of the OpenAI API subset graphc serves, and its error body and response.

Unknown fields and values of the wrong JSON type are refused (HTTP 400) rather than ignored: a
client that sends a parameter graphc does not implement learns so at once. Strict types: `5` is
not `"5"`, `true` is not `1`.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from graphc.sampling import MAX_TOP_LOGPROBS
from graphc.server.limits import MAX_CACHE_SALT_CHARS, MAX_PROMPTS, MAX_STOP_BYTES, MAX_STOP_STRINGS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension (GuideLLM sends it): usage in every chunk, not only in a last one."""


class JsonSchemaFormat(_Strict):
    name: str
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None
    """graphc always enforces the schema (by its grammar), strict or not."""


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "json_schema goes with type 'json_schema', and only with it")
        return self


class _Generation(_Strict):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None = None
    """Default: the manifest's runtime.max_new_tokens, within the context limit."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """An extension (as vLLM's): keep the k most likely tokens; 0, or vLLM's -1, keeps all."""

    @field_validator("top_k")
    @classmethod
    def _vllm_disabled(cls, top_k: int | None):
        return 0 if top_k == -1 else top_k
    seed: int | None = None
    """Absent: the server's `--seed`, or fresh noise per request where it has none."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    """Choices of each prompt, each sampled with its own seed (`graphc serve --max-n` bounds it)."""
    ignore_eos: bool = False
    """vLLM's extension: generate through EOS tokens."""
    min_tokens: int = Field(0, ge=0)
    """vLLM's extension: EOS and stop strings do not end the request before this many tokens."""
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    """vLLM's extension: above 1 discourages tokens the prompt or the output holds."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a JSON key) -> a bias added to its logit, in [-100, 100]; at most 300."""
    response_format: ResponseFormat | None = None
    guided_regex: str | None = None
    """vLLM's extension: the output matches this regular expression."""
    guided_choice: list[str] | None = Field(None, min_length=1)
    """vLLM's extension: the output is one of these strings."""
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """vLLM's extension: the request shares prefix-cache blocks only with requests of the same
    salt (`graphc.server.isolation`)."""

    @field_validator("stop")
    @classmethod
    def _bounded(cls, stop: str | list[str] | None):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise PydanticCustomError("stop_count", f"{len(strings)} stop strings are more than the {MAX_STOP_STRINGS} "
                                                    "a request may give")
        size = sum(len(s.encode("utf-8")) for s in strings)
        if size > MAX_STOP_BYTES:
            raise PydanticCustomError("stop_bytes", f"the stop strings are {size} bytes (UTF-8) together, more than the "
                                                    f"{MAX_STOP_BYTES} a request may give")
        return stop


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    """Text (encoded with the artifacts' tokenizer) or token ids; or a batch of either, one choice
    each (`index` in order), as OpenAI's API defines it and lm-evaluation-harness sends it."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each token's log-probability and its position's N most likely tokens'."""
    echo: bool = False
    """The prompt's text before the completion's; with `logprobs`, the prompt tokens' logprobs
    before the completion's (the first null), which needs artifacts compiled with
    `runtime.prompt_logprobs`. With both, `max_tokens` may be 0: the prompt is scored, nothing
    generated (lm-evaluation-harness's loglikelihood)."""

    def asked_logprobs(self) -> int | None:
        """The most likely tokens a position reports (None: no logprobs)."""
        return self.logprobs

    def asked_prompt_logprobs(self) -> int | None:
        """The most likely tokens a prompt position reports (None: no prompt logprobs)."""
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _batch_bounded(cls, prompt):
        if _is_batch(prompt) and len(prompt) > MAX_PROMPTS:
            raise PydanticCustomError("prompt_count", f"a batch of {len(prompt)} prompts is more than the {MAX_PROMPTS} "
                                                      "a request may give; send the rest in other requests")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of its batch."""
        return list(self.prompt) if _is_batch(self.prompt) else [self.prompt]


def _is_batch(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


class ToolCallFunction(_Strict):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Strict):
    """A message as OpenAI's API defines it, for a model that reads text: its content a string or
    a list of text parts, null only on an assistant turn that made tool calls."""

    role: str
    content: str | None = None
    """Text parts are joined with newlines, as vLLM does for templates that take a string."""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    """On a tool message: the call it answers."""
    reasoning_content: str | None = None
    """On an assistant message: its reasoning, as a reply gave it (templates that keep it read it)."""

    @field_validator("content", mode="before")
    @classmethod
    def _text_of_parts(cls, content):
        if not isinstance(content, list):
            return content
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                what = f"has type {kind!r}" if isinstance(part, dict) else "is not an object"
                raise PydanticCustomError("content_part", f"part {index} {what}; graphc serves text models and takes "
                                                          "only parts of type 'text'")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise PydanticCustomError("content_part", f"part {index}: a text part has exactly a type and a string "
                                                          "text")
        return "\n".join(part["text"] for part in content)

    @model_validator(mode="after")
    def _content_or_tool_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content_null", "content is null or missing; only an assistant message with "
                                                      "tool_calls may have none")
        return self


TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
"""OpenAI's rule for a function's name."""
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
"""What the server passes a chat template itself: `chat_template_kwargs` may not set these."""


class FunctionDefinition(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    """A JSON schema of the call's arguments (an object); absent: any object."""
    strict: bool | None = None
    """graphc enforces the schema whenever a call is required (`tool_choice`), strict or not."""


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    """Functions the model may call, rendered into the prompt by the checkpoint's chat template;
    its calls come back as `tool_calls` (`graphc.server.tool_formats`)."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Absent: "auto" with tools, "none" without. "required" and a named function are enforced by
    a grammar: the reply is calls (of that function)."""
    parallel_tool_calls: bool = True
    """False: at most one call a reply."""
    chat_template_kwargs: dict | None = None
    """More variables for the chat template, as vLLM takes them: `{"thinking": true}` switches
    DeepSeek-V3.1's reasoning on."""
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens in chat (used when max_tokens is absent)."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """With `logprobs`: the N most likely tokens of each position too."""

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo):
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs", "it needs logprobs: true")
        return top_logprobs

    def asked_logprobs(self) -> int | None:
        """The most likely tokens a position reports (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def asked_prompt_logprobs(self) -> None:
        """A chat's prompt is the template's, never echoed."""
        return None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None):
        names = [tool.function.name for tool in tools or []]
        repeated = next((name for name in names if names.count(name) > 1), None)
        if repeated is not None:
            raise PydanticCustomError("tool_name", f"two tools are named {repeated!r}; a call names one function")
        return tools

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_servers(cls, kwargs: dict | None):
        taken = sorted(RESERVED_TEMPLATE_VARIABLES & set(kwargs or {}))
        if taken:
            raise PydanticCustomError("template_variable", f"{', '.join(taken)}: set by the server, not by a request")
        return kwargs

    @field_validator("messages", mode="before")
    @classmethod
    def _fit_the_context(cls, messages, info: ValidationInfo):
        # Counted before a message is validated: a body of many small messages costs its
        # validation, dumping and rendering per message, and each message renders to at least one
        # token of the prompt, which leaves room for one generated token.
        limit = (info.context or {}).get("context_limit")
        if limit is not None and isinstance(messages, list) and len(messages) > limit - 1:
            raise PydanticCustomError("messages_count", f"{len(messages)} messages cannot fit this model's context of "
                                                        f"{limit} tokens: each takes at least one token of a prompt "
                                                        f"of at most {limit - 1}")
        return messages


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: what its clients parse into exceptions."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """`error_body` as a response with HTTP `status`."""
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)
