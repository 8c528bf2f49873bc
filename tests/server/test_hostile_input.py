"""`graphc serve` against hostile clients: every bad request a 4xx with OpenAI's error body, an
API key, bodies, prompts and chats bounded before they cost anything, chat templates that raise,
recurse, blow up or never end (and chats queued behind them), and streams cut when the grace
period ends.

One server process serves every case: an API key, a 1 MB body bound, a 2 s body time limit, a
1 s template limit, a
template that misbehaves on cue (the last message names how), a pool that holds one long request
at a time, and a grace period of 1 s, which the last test ends. A few tests drive the app in
the tests' process instead, where the threads its work runs on can be seen.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx2
import openai
import pytest
import yaml

from graphc.artifacts.directory import read_manifest
from graphc.artifacts.manifest import MANIFEST
from graphc.server import templates
from graphc.server.body import parse_body
from graphc.server.isolation import CacheIsolation
from graphc.server.limits import RequestLimits
from graphc.server.routes import create_app
from graphc.server.schemas import ChatCompletionRequest, ChatMessage
from graphc.server.translate import BadRequest
from servers import Server

pytestmark = pytest.mark.compiles

PRESET, BUCKETS = "lora-groups", "prompt_as_decode"  # the artifacts test_openai_server serves
KEY = "test-key-0123"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BODY_BYTES = 1_000_000
BODY_SECONDS = 2

CHAT_TEMPLATE = """{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] or '' }}
{%- for call in message['tool_calls'] or [] %}[{{ call['function']['name'] }}({{ call['function']['arguments'] }})]
{%- endfor %}
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""
"""What the template renders unless cued. Only this part is compiled in the tests' process:
Jinja folds constants as it compiles, and would build `'x' * 4000000000` here."""
TEMPLATE = """{% set cue = messages[-1]['content'] %}
{%- if cue == 'divide' %}{{ 1 / 0 }}
{%- elif cue == 'raise' %}{{ raise_exception('no such role') }}
{%- elif cue == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}
{%- elif cue == 'recurse' %}{% macro down(n) %}{{ down(n + 1) }}{% endmacro %}{{ down(0) }}
{%- elif cue == 'memory' %}{{ 'x' * 4000000000 }}
{%- elif cue == 'long' %}{{ 'y' * 100000 }}
{%- elif cue == 'surrogate' %}{{ '\\ud800' }}
{%- else %}""" + CHAT_TEMPLATE + "{% endif %}"


@pytest.fixture(scope="module")
def hostile(compiled, tmp_path_factory):
    artifacts = shutil.copytree(compiled(PRESET, "export", BUCKETS), tmp_path_factory.mktemp("hostile") / "artifacts")
    manifest = yaml.safe_load((artifacts / MANIFEST).read_text())
    manifest["model"]["chat_template"]["template"] = TEMPLATE
    (artifacts / MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    # 17 blocks of 8 tokens: one request of 127 tokens at a time (the grace-period test's queue).
    server = Server(artifacts, "--max-body-bytes", str(MAX_BODY_BYTES), "--template-timeout", "1",
                    "--body-timeout", str(BODY_SECONDS), "--grace-period", "1", env={"GRAPHC_API_KEY": KEY, "GRAPHC_NUM_KV_BLOCKS": "17"}, api_key=KEY)
    yield server
    assert server.stop() == 0, "".join(server.lines)


def post(server: Server, path: str, body, headers: dict | None = None) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(f"{server.url}{path}", content=content, timeout=60,
                       headers={"content-type": "application/json", **AUTH, **(headers or {})})


def openai_error(response: httpx2.Response, status: int) -> dict:
    """The response's OpenAI error object, asserting its status and shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def chat(cue: str, **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": cue}], "max_tokens": 2, **fields}


def test_every_route_but_health_needs_the_api_key(hostile):
    assert httpx2.get(f"{hostile.url}/health").json() == {"status": "ok"}
    for path in ("/v1/models", "/metrics", "/v1/nothing"):
        missing = openai_error(httpx2.get(f"{hostile.url}{path}"), 401)
        assert missing["message"] == "this server needs an API key: send it as Authorization: Bearer KEY"
        assert missing["code"] == "invalid_api_key"
    wrong = httpx2.post(f"{hostile.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6]},
                        headers={"authorization": f"Bearer {KEY}x"})
    assert openai_error(wrong, 401)["message"] == "the API key given is not this server's"
    assert wrong.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{hostile.url}/v1", api_key="guess", max_retries=0).models.list()
    assert [m.id for m in hostile.client.models.list().data] == ["tiny"]
    assert "graphc_requests_waiting" in httpx2.get(f"{hostile.url}/metrics", headers=AUTH).text


BAD_BODIES = [
    # (path, body, content type, message, param)
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', None,
     "prompt: not valid Unicode: a lone surrogate '\\ud800' at character 1", "prompt"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', None,
     "messages.0.content: not valid Unicode: a lone surrogate '\\udfff' at character 0", "messages.0.content"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [5], "\\ud800": 1}', None,
     "the request body: a key is not valid Unicode: a lone surrogate '\\ud800' at character 0", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "caf\xe9"}', None,
     "the request body is not UTF-8 text (invalid continuation byte at byte 32)", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": [5, 6', None,
     "the request body is not valid JSON: Expecting ',' delimiter (line 1, column 34)", None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None,
     "the request body nests arrays or objects too deeply to be a request", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": [5], "seed": ' + b"9" * 5000 + b"}", None,
     "the request body holds an integer of more than 4300 digits", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": [5]}', "text/plain",
     "the request body must be JSON (Content-Type: application/json), not text/plain", None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, None,
     "messages.0.content: part 1 has type 'image_url'; graphc serves text models and takes only parts of type "
     "'text'", "messages.0.content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": ["hi"]}]}, None,
     "messages.0.content: part 0 is not an object; graphc serves text models and takes only parts of type 'text'",
     "messages.0.content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": None}]}, None,
     "messages.0: content is null or missing; only an assistant message with tool_calls may have none", "messages.0"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "stop": ["s"] * 33}, None,
     "stop: 33 stop strings are more than the 32 a request may give", "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "stop": ["é" * 2049]}, None,
     "stop: the stop strings are 4098 bytes (UTF-8) together, more than the 4096 a request may give", "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "logprobs": 21}, None,
     "logprobs: Input should be less than or equal to 20", "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     None, "top_logprobs: it needs logprobs: true", "top_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "echo": True, "logprobs": 1}, None,
     "echo: the prompt's logprobs need artifacts compiled with runtime.prompt_logprobs: true; these were compiled "
     "without (echo without logprobs needs nothing)", "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "echo": True, "max_tokens": 0}, None,
     "max_tokens: 0 must be at least 1 (0 only with echo and logprobs, to score a prompt)", "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "presence_penalty": 2.5}, None,
     "presence_penalty: 2.5 must be a number in [-2, 2]", "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "repetition_penalty": 0}, None,
     "repetition_penalty: 0.0 must be a number > 0 (1 is off)", "repetition_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "logit_bias": {"5": 101}}, None,
     "logit_bias: the bias of token 5 is 101.0; it must be in [-100, 100]", "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "logit_bias": {"256": 1}}, None,
     "logit_bias: key '256' is not a token id of the vocabulary 0..255", "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "logit_bias": {str(i): 1 for i in range(301)}}, None,
     "logit_bias: 301 tokens are more than the 300 a request may bias", "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "n": 9}, None,
     "n: 9 is more than the 8 choices of a prompt this server gives (graphc serve --max-n)", "n"),
    ("/v1/completions", {"model": "tiny", "prompt": [[5]] * 9, "n": 8}, None,
     "n: 9 prompts of 8 choices each are more than the 64 choices a request may ask", "n"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "n": 0}, None,
     "n: Input should be greater than or equal to 1", "n"),
    ("/v1/chat/completions", {**chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}, None,
     "tools: the chat template of model 'tiny' writes no tool calls graphc reads (DeepSeek-V3, V3.1, V3.2 or V4 "
     "markup); send the request without tools", "tools"),
    ("/v1/chat/completions", {**chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, None,
     "tools: two tools are named 'f'; a call names one function", "tools"),
    ("/v1/chat/completions", {**chat("hi"), "tools": [{"type": "function", "function": {"name": "a b"}}]}, None,
     "tools.0.function.name: String should match pattern '^[A-Za-z0-9_-]{1,64}$'", "tools.0.function.name"),
    ("/v1/chat/completions", {**chat("hi"), "tool_choice": "required"}, None,
     "tool_choice: is only allowed when tools are given", "tool_choice"),
    ("/v1/chat/completions", {**chat("hi"), "chat_template_kwargs": {"messages": [], "tools": []}}, None,
     "chat_template_kwargs: messages, tools: set by the server, not by a request", "chat_template_kwargs"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "cache_salt": ""}, None,
     "cache_salt: String should have at least 1 character", "cache_salt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "cache_salt": "s" * 1025}, None,
     "cache_salt: String should have at most 1024 characters", "cache_salt"),
]


@pytest.mark.parametrize("path, body, content_type, message, param", BAD_BODIES)
def test_a_bad_body_gets_400_with_an_openai_error(hostile, path, body, content_type, message, param):
    error = openai_error(post(hostile, path, body, {"content-type": content_type} if content_type else {}), 400)
    assert (error["message"], error["param"], error["type"]) == (message, param, "invalid_request_error")


def test_unknown_routes_and_methods_get_openai_errors(hostile):
    assert openai_error(httpx2.get(f"{hostile.url}/v1/nothing", headers=AUTH), 404)["message"] == "Not Found"
    assert openai_error(httpx2.get(f"{hostile.url}/v1/completions", headers=AUTH), 405)["message"] == \
        "Method Not Allowed"


def test_a_body_trickled_past_the_time_limit_gets_408_and_the_connection_closes(hostile):
    host, port = hostile.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {KEY}\r\n"
                           "content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"".encode())
        started = time.monotonic()
        response = http.client.HTTPResponse(connection)
        response.begin()  # the rest of the body never comes
        waited = time.monotonic() - started
        assert response.status == 408 and response.getheader("connection") == "close"
        body = response.read()
        assert connection.recv(1) == b""  # closed by the server
    assert waited >= BODY_SECONDS - 0.5
    assert json.loads(body)["error"]["message"] == (f"the request body was not sent within {BODY_SECONDS} s "
                                                    "(8 bytes arrived; --body-timeout)")
    assert httpx2.get(f"{hostile.url}/health").status_code == 200


def test_a_body_over_the_bound_gets_413_before_it_is_read(hostile):
    host, port = hostile.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:  # headers only: no body follows
        connection.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {KEY}\r\n"
                           "content-type: application/json\r\ncontent-length: 50000000\r\n\r\n".encode())
        response = http.client.HTTPResponse(connection)
        response.begin()
        assert response.status == 413
        body = response.read()
    assert json.loads(body)["error"]["message"] == ("the request body is 50000000 bytes; this server takes at most "
                                                    f"{MAX_BODY_BYTES} (--max-body-bytes)")
    chunked = httpx2.post(f"{hostile.url}/v1/completions", content=iter([b" " * 65536] * 20), headers=AUTH)  # chunked
    assert openai_error(chunked, 413)["message"] == (f"the request body is over {MAX_BODY_BYTES} bytes, the most "
                                                     "this server takes (--max-body-bytes)")
    with pytest.raises(openai.APIStatusError) as refused:
        hostile.client.completions.create(model="tiny", prompt="x" * (2 * MAX_BODY_BYTES))
    assert refused.value.status_code == 413


def test_a_prompt_longer_than_any_that_fits_is_refused_by_its_length(hostile):
    # The tokenizer is byte-level: no 127 tokens hold more than 127 characters.
    error = openai_error(post(hostile, "/v1/completions", {"model": "tiny", "prompt": "a" * 900_000}), 400)
    assert error["message"] == ("this model's maximum context length is 128 tokens; a prompt of 900000 characters "
                                "cannot fit it (no 127 tokens of this tokenizer hold more than 127)")
    assert hostile.client.completions.create(model="tiny", prompt="a" * 100, max_tokens=2).usage.prompt_tokens == 100


@pytest.mark.parametrize("cue, message", [
    ("divide", "the chat template cannot render these messages: ZeroDivisionError: division by zero"),
    ("raise", "the chat template cannot render these messages: no such role"),
    ("recurse", "the chat template cannot render these messages: RecursionError: maximum recursion depth exceeded"),
    ("memory", "the chat template cannot render these messages: MemoryError"),
    ("surrogate", "the chat template cannot render these messages: UnicodeEncodeError: 'utf-8' codec can't encode "
                  "character '\\ud800' in position 0: surrogates not allowed"),
    ("loop", "the chat template did not finish rendering these messages within 1 s (--template-timeout)"),
    ("long", "this model's maximum context length is 128 tokens; a prompt of 100000 characters cannot fit it (no 127 "
             "tokens of this tokenizer hold more than 127)"),
])
def test_a_template_that_fails_or_never_ends_gets_400_and_the_next_chat_is_served(hostile, cue, message):
    error = openai_error(post(hostile, "/v1/chat/completions", chat(cue)), 400)
    assert (error["message"], error["param"]) == (message, "messages")
    served = hostile.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
    assert served.usage.completion_tokens == 2


def rendered_tokens(messages: list[dict]) -> int:
    """The prompt tokens of `messages` under the template (byte-level: one token a byte)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    return len(template.render(messages=messages, add_generation_prompt=True).encode())


def test_text_parts_and_an_assistant_turn_of_tool_calls_are_taken_as_openai_defines_them(hostile):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = hostile.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                                      max_tokens=4, temperature=0)
    as_text = hostile.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello\nthere"}], max_tokens=4, temperature=0)
    assert as_parts.choices[0].model_extra["token_ids"] == as_text.choices[0].model_extra["token_ids"]
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]
    done = hostile.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert done.usage.prompt_tokens == rendered_tokens([*messages[:2], {**messages[2], "content": "sunny"}])


def test_a_50mb_prompt_and_a_template_that_never_ends_leave_streams_and_health_served(hostile):
    """Both refused while four streams run and /health is polled: everything completes (the
    latencies are bench/bench_hostile.py's to measure, not a test's)."""
    done = threading.Event()

    def health() -> list[int]:
        statuses = []
        while not done.is_set() or not statuses:
            statuses.append(httpx2.get(f"{hostile.url}/health", timeout=60).status_code)
            time.sleep(0.05)
        return statuses

    def stream(n: int) -> int:
        chunks = hostile.client.completions.create(model="tiny", prompt=[5 + n, 6, 7], max_tokens=20, stream=True,
                                                   extra_body={"ignore_eos": True})
        return sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks)

    with ThreadPoolExecutor(7) as pool:
        polls = pool.submit(health)
        big = pool.submit(post, hostile, "/v1/completions", json.dumps({"model": "tiny", "prompt": "x" * 50_000_000}).encode())
        loop = pool.submit(post, hostile, "/v1/chat/completions", chat("loop"))
        streams = [pool.submit(stream, n) for n in range(4)]
        assert [s.result() for s in streams] == [20] * 4
        assert big.result().status_code == 413 and loop.result().status_code == 400
        done.set()
        assert set(polls.result()) == {200}


def test_a_chat_of_more_messages_than_the_context_holds_is_refused_by_their_count(hostile):
    messages = [{"role": "user", "content": "a"}] * 128  # a prompt of at most 127 tokens
    error = openai_error(post(hostile, "/v1/chat/completions", {"model": "tiny", "messages": messages}), 400)
    assert (error["message"], error["param"]) == (
        "messages: 128 messages cannot fit this model's context of 128 tokens: each takes at least one token of a "
        "prompt of at most 127", "messages")


def test_messages_are_counted_before_any_of_them_is_validated():
    """Four messages that are not messages at all: refused by their count, so none was validated."""
    with pytest.raises(BadRequest) as refused:
        parse_body(json.dumps({"model": "tiny", "messages": [{}] * 4}).encode(), None, ChatCompletionRequest, 4)
    assert (str(refused.value), refused.value.param) == (
        "messages: 4 messages cannot fit this model's context of 4 tokens: each takes at least one token of a "
        "prompt of at most 3", "messages")


def in_process(compiled, limits: RequestLimits = RequestLimits(), **options):
    """The app over the module's artifacts in this process, its engine one that refuses every
    request (a chat is parsed, rendered and tokenised, then refused)."""
    from tokenizers import Tokenizer

    artifacts = compiled(PRESET, "export", BUCKETS)
    manifest = read_manifest(artifacts)
    refusing = SimpleNamespace(refusal=lambda request: "refused by the test", state=SimpleNamespace(failure=None))
    return create_app(refusing, manifest, Tokenizer.from_file(str(artifacts / manifest.tokenizer)), "tiny", limits,
                      **options)


def test_a_server_that_needs_a_cache_salt_refuses_a_request_without_one(compiled):
    app = in_process(compiled, isolation=CacheIsolation("salt"))
    _, missing = posted_in_process(app, "/v1/completions", json.dumps({"model": "tiny", "prompt": [5]}).encode())
    error = openai_error(missing, 400)
    assert error["param"] == "cache_salt" and error["message"].startswith("cache_salt: this server keeps")
    _, salted = posted_in_process(app, "/v1/completions", json.dumps({"model": "tiny", "prompt": [5],
                                                                      "cache_salt": "s"}).encode())
    assert openai_error(salted, 400)["message"] == "refused by the test"  # past the salt, to the engine


def posted_in_process(app, path: str, body: bytes) -> tuple[int, httpx2.Response]:
    """The event loop's thread and the app's response to `body`."""
    async def send():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://graphc") as client:
            response = await client.post(path, content=body, headers={"content-type": "application/json"})
            return threading.get_ident(), response

    return asyncio.run(send())


def test_a_chat_is_validated_dumped_and_encoded_off_the_event_loop(compiled, monkeypatch):
    """Each holds the GIL for a while on a chat of many messages: on a worker thread, the loop
    gets its turns between them; on the loop, nothing else is served meanwhile."""
    app = in_process(compiled)
    threads = {"validate": set(), "dump": set(), "encode": set()}

    def recorded(name: str, function):
        def run(*args, **kwargs):
            threads[name].add(threading.get_ident())
            return function(*args, **kwargs)
        return run

    validate, dump = ChatCompletionRequest.model_validate.__func__, ChatMessage.model_dump
    monkeypatch.setattr(ChatCompletionRequest, "model_validate", classmethod(recorded("validate", validate)))
    monkeypatch.setattr(ChatMessage, "model_dump", recorded("dump", dump))
    monkeypatch.setattr(templates, "json", SimpleNamespace(dumps=recorded("encode", json.dumps), loads=json.loads))
    loop, response = posted_in_process(app, "/v1/chat/completions", json.dumps(chat("hi")).encode())
    assert openai_error(response, 400)["message"] == "refused by the test"  # rendered and tokenised first
    assert all(threads.values()) and loop not in set().union(*threads.values()), (loop, threads)


def test_the_default_body_bound_is_what_the_context_can_hold(compiled):
    """64 bytes a token and 64 KiB: 72 KiB for the 128 tokens here, not a fixed 8 MiB."""
    body = json.dumps({"model": "tiny", "prompt": "x" * 80_000}).encode()
    _, response = posted_in_process(in_process(compiled), "/v1/completions", body)
    assert openai_error(response, 413)["message"] == (f"the request body is {len(body)} bytes; this server takes at "
                                                      "most 73728 (--max-body-bytes)")


def test_chats_waiting_for_a_template_worker_past_the_time_limit_get_429(hostile):
    """Two workers, each held 1 s by a template that never ends: of six such chats at once, the
    later ones wait past the 1 s limit for a worker and are told to retry."""
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: post(hostile, "/v1/chat/completions", chat("loop")), range(6)))
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {400, 429} and statuses[429] >= 2, statuses
    busy = [r for r in responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" for r in busy)
    assert openai_error(busy[0], 429) == {
        "message": "the server is at capacity: every chat template worker stayed busy for 1 s (--template-timeout); "
                   "retry later", "type": "rate_limit_error", "param": None, "code": None}
    served = hostile.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
    assert served.usage.completion_tokens == 2


def test_when_the_grace_period_ends_cut_streams_end_with_an_error_event_and_done(hostile):
    """Last: it stops the module's server. Sixteen streams that the pool serves one at a time
    (119 tokens each) outlast its 1 s grace period; each ends with its own last events, and a
    completion that is not streamed gets a 503."""
    first_token = threading.Event()

    def stream(n: int) -> list[str]:
        body = {"model": "tiny", "prompt": [5 + n, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 119, "stream": True,
                "ignore_eos": True}
        lines = []
        with httpx2.stream("POST", f"{hostile.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            for line in filter(None, response.iter_lines()):
                lines.append(line)
                first_token.set()
        return lines

    whole = {"model": "tiny", "prompt": [4, 6, 7, 8], "max_tokens": 119, "ignore_eos": True}
    with ThreadPoolExecutor(18) as pool:
        streams = [pool.submit(stream, n) for n in range(16)]
        assert first_token.wait(60)  # one of them is generating, the others wait for the pool
        completions = [pool.submit(post, hostile, "/v1/completions", whole) for _ in range(2)]  # not streamed
        time.sleep(0.2)  # queued behind the streams
        hostile.process.send_signal(signal.SIGTERM)
        ends = [s.result() for s in streams]
        unavailable = [openai_error(c.result(), 503) for c in completions]  # the server's going, not the request
    assert hostile.process.wait(60) == 0
    assert unavailable == [{"message": "the request failed: the server is shutting down and its grace period (1 s) "
                                       "has ended", "type": "server_error", "param": None, "code": None}] * 2
    cut = [lines for lines in ends if '"finish_reason": "length"' not in lines[-2]]
    assert cut and all(lines[-1] == "data: [DONE]" for lines in ends)
    for lines in cut:
        assert json.loads(lines[-2].removeprefix("data: "))["error"] == {
            "message": "the request failed: the server is shutting down and its grace period (1 s) has ended",
            "type": "server_error", "param": None, "code": None}
    log = "".join(hostile.lines)
    assert "Traceback" not in log and "CancelledError" not in log, log
