"""Tool calls and reasoning over `graphc serve` with the official `openai` client, on the trained
tiny checkpoint, whose chat template is DeepSeek-V3.1's in kind: `tool_choice` "required" and a
named function always give calls that validate against the tools' schemas, streamed or not; the
whole flow (a call, the tool's result fed back, an answer) renders as transformers renders the
template; the `thinking` switch gives the reply as `reasoning_content`."""

from __future__ import annotations

import json

import httpx2
import jsonschema
import openai
import pytest
import yaml

from graphc.artifacts.manifest import MANIFEST
from graphc.runtime import Engine, Request
from servers import Server

pytestmark = pytest.mark.compiles

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def artifacts(compiled):
    return compiled("trained", "export", "chat")


@pytest.fixture(scope="module")
def server(artifacts):
    running = Server(artifacts)
    yield running
    assert running.stop() == 0, "".join(running.lines)


def _valid(calls) -> list[tuple[str, dict]]:
    """Each call's name and arguments, asserting they are a tool's and validate against its schema."""
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _streamed_calls(server: Server, **options) -> tuple[list[tuple[str, dict]], str]:
    calls, finish = {}, None
    for chunk in server.client.chat.completions.create(model="tiny", stream=True, **options):
        delta = chunk.choices[0].delta
        assert delta.content in (None, "")
        for call in delta.tool_calls or []:
            calls[call.index] = call
        finish = chunk.choices[0].finish_reason or finish
    return _valid(calls[i] for i in sorted(calls)), finish


# One seed with one call and one with parallel calls per commit; two more seeds in the slow tier.
@pytest.mark.parametrize("seed", [0, 1, *(pytest.param(seed, marks=pytest.mark.slow) for seed in (2, 3))])
def test_required_always_gives_calls_that_validate_streamed_or_not(server, seed):
    options = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=1.0, seed=seed,
                   parallel_tool_calls=seed % 2 == 1)
    done = server.client.chat.completions.create(model="tiny", **options).choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content is None
    calls = _valid(done.message.tool_calls)
    assert len(calls) == 1 if seed % 2 == 0 else len(calls) >= 1
    assert all(call.id.startswith("call_") and call.type == "function" for call in done.message.tool_calls)
    assert _streamed_calls(server, **options) == (calls, "tool_calls")


def test_a_named_function_is_the_one_called(server):
    named = {"type": "function", "function": {"name": "get_time"}}
    for temperature in (0.0, 1.0):
        done = server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                                     max_tokens=400, temperature=temperature, seed=5).choices[0]
        [(name, _)] = _valid(done.message.tool_calls)
        assert name == "get_time" and done.finish_reason == "tool_calls"


def test_a_call_its_result_and_an_answer_render_as_transformers_renders_the_template(server, artifacts):
    from transformers import PreTrainedTokenizerFast

    first = server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                  max_tokens=400, temperature=0, parallel_tool_calls=False)
    message = first.choices[0].message
    [call] = message.tool_calls
    messages = [*ASK, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})}]
    answer = server.client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8,
                                                   temperature=0)

    reference = PreTrainedTokenizerFast(tokenizer_file=str(artifacts / "tokenizer.json"),
                                        chat_template=_template(artifacts))
    text = reference.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.endswith(f'<｜tool▁output▁begin｜>{{"sky": "clear"}}<｜tool▁output▁end｜>')
    prompt = reference(text, add_special_tokens=False)["input_ids"]
    [want] = Engine(artifacts).generate([Request(prompt, 8)])
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.choices[0].model_extra["token_ids"] == want.output_ids
    assert answer.choices[0].message.content == reference.decode(want.output_ids)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"


def test_the_thinking_switch_gives_the_reply_as_reasoning_content(server, artifacts):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(artifacts / "tokenizer.json"),
                                        chat_template=_template(artifacts))
    text = reference.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, thinking=True)
    assert text.endswith("<think>")
    [want] = Engine(artifacts).generate([Request(reference(text, add_special_tokens=False)["input_ids"], 8)])
    thinking = {"chat_template_kwargs": {"thinking": True}}
    done = server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0,
                                                 extra_body=thinking).choices[0]
    assert done.model_extra["token_ids"] == want.output_ids
    assert done.message.model_extra["reasoning_content"] == reference.decode(want.output_ids)
    assert done.message.content is None
    streamed = server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0,
                                                     stream=True, extra_body=thinking)
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in streamed) == \
        done.message.model_extra["reasoning_content"]
    plain = server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0).choices[0]
    assert "reasoning_content" not in plain.message.model_extra and plain.message.content


def test_a_tool_choice_naming_no_tool_is_refused_naming_the_field(server):
    response = httpx2.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "tool_choice: names function 'x', which is not one of the tools (get_weather, get_time)",
        "type": "invalid_request_error", "param": "tool_choice", "code": None}
    with pytest.raises(openai.BadRequestError, match="tool_choice: is only allowed when tools are given"):
        server.client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")


def _template(artifacts) -> str:
    """The chat template the artifacts serve (their manifest's copy of the checkpoint's)."""
    return yaml.safe_load((artifacts / MANIFEST).read_text())["model"]["chat_template"]["template"]
