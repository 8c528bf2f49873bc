"""DeepSeek's tool-call formats (`graphc.server.tool_formats`) and a reply's split into reasoning,
content and calls (`graphc.server.chat_reply`): each family's markup, as its released template
or encoder writes it, parses into OpenAI calls; each format's grammar accepts that markup and
refuses a call outside the tools; streamed in any cuts, a reply gives the fields it gives whole."""

from __future__ import annotations

import json
import random

import pytest
from llguidance import LLMatcher, LLTokenizer

from graphc.server.chat_reply import ChatReply, merged, opens_thinking
from graphc.server.schemas import ChatCompletionRequest
from graphc.server.tool_formats import FORMATS, ParsedCall, tool_format_of
from graphc.server.tools import ToolUse, tool_use
from graphc.server.translate import BadRequest
from graphc.weights.tiny import TINY_TOKENIZER_CONFIG, byte_level_tokenizer

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"], "additionalProperties": False}}
CALLS = [ParsedCall("get_weather", '{"city": "Paris", "days": 3}'), ParsedCall("get_weather", '{"city": "Nice"}')]

# Two calls as each family writes them (the V3 / V3.1 templates' and the V3.2 / V4 encoders' shapes).
MARKUP = {
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                   '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                   'get_weather\n```json\n{"city": "Nice"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Nice"}'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    **{name: (f'\n\n<｜DSML｜{block}>\n<｜DSML｜{invoke} name="get_weather">\n<｜DSML｜{parameter} name="city" '
              f'string="true">Paris</｜DSML｜{parameter}>\n<｜DSML｜{parameter} name="days" string="false">3'
              f'</｜DSML｜{parameter}>\n</｜DSML｜{invoke}>\n<｜DSML｜{invoke} name="get_weather">\n<｜DSML｜{parameter} '
              f'name="city" string="true">Nice</｜DSML｜{parameter}>\n</｜DSML｜{invoke}>\n</｜DSML｜{block}>')
       for name, (block, invoke, parameter) in {"deepseek_v32": ("function_calls", "invoke", "parameter"),
                                                "deepseek_v4": ("tool_calls", "invoke", "parameter"),
                                                "deepseek_v41": (" calls", " invoke", " parameter")}.items()},
}


@pytest.fixture(scope="module")
def tokenizer():
    return LLTokenizer(byte_level_tokenizer().to_str(), n_vocab=256, eos_token=[0])


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = LLMatcher(tokenizer, grammar)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


@pytest.mark.parametrize("name", MARKUP)
def test_each_familys_markup_parses_into_its_calls_after_the_content(name):
    reply = ChatReply(FORMATS[name]).message("Let me check." + MARKUP[name] + "<｜end▁of▁sentence｜>")
    assert reply["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply["tool_calls"]] == \
        [(c.name, json.loads(c.arguments)) for c in CALLS]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in reply["tool_calls"])
    assert len({c["id"] for c in reply["tool_calls"]}) == 2
    only_calls = ChatReply(FORMATS[name]).message(MARKUP[name])
    assert only_calls["content"] is None and len(only_calls["tool_calls"]) == 2


@pytest.mark.parametrize("name", MARKUP)
def test_each_formats_grammar_takes_its_markup_and_refuses_other_functions(tokenizer, name):
    form = FORMATS[name]
    grammar = form.grammar([WEATHER], parallel=True, thinking=False)
    assert LLMatcher.validate_grammar(grammar, tokenizer) == ""
    assert _accepts(tokenizer, grammar, MARKUP[name])
    assert not _accepts(tokenizer, grammar, MARKUP[name].replace("get_weather", "get_wether", 1))
    assert not _accepts(tokenizer, form.grammar([WEATHER], parallel=False, thinking=False), MARKUP[name])
    thinking = form.grammar([WEATHER], parallel=True, thinking=True)
    assert _accepts(tokenizer, thinking, "Paris, then Nice.</think>" + MARKUP[name])


def test_a_v31_call_whose_arguments_break_the_schema_is_refused(tokenizer):
    grammar = FORMATS["deepseek_v31"].grammar([WEATHER], parallel=True, thinking=False)
    call = MARKUP["deepseek_v31"]
    assert not _accepts(tokenizer, grammar, call.replace('"days": 3', '"days": 0'))
    assert not _accepts(tokenizer, grammar, call.replace('{"city": "Nice"}', '{"town": "Nice"}'))


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31", "deepseek_v4"])
def test_a_streamed_reply_gives_in_any_cuts_what_it_gives_whole(name):
    text = "The user asks.</think>Checking " + MARKUP[name] + " ignored"
    whole = ChatReply(FORMATS[name], reasoning=True).message(text)
    assert whole["reasoning_content"] == "The user asks." and whole["content"] == "Checking"
    for seed in range(100):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        reply, streamed = ChatReply(FORMATS[name], reasoning=True), {}
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            streamed = merged(streamed, reply.feed(text[start:end]))
        streamed = merged(streamed, reply.finish())
        assert streamed["reasoning_content"] == whole["reasoning_content"]
        assert streamed["content"] == whole["content"]
        assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]
        assert [c["index"] for c in streamed["tool_calls"]] == [0, 1]


def test_a_reply_holds_back_only_what_could_begin_a_marker():
    reply = ChatReply(FORMATS["deepseek_v31"], reasoning=True)
    assert reply.feed("thinking </th") == {"reasoning_content": "thinking "}
    assert reply.feed("ink>Answer <｜tool") == {"content": "Answer"}
    assert reply.feed("s are") == {"content": " <｜tools are"}
    assert reply.finish() == {}


def test_thinking_that_never_ends_is_all_reasoning_and_broken_markup_is_content():
    assert ChatReply(FORMATS["deepseek_v31"], reasoning=True).message("<think>still going") == \
        {"role": "assistant", "content": None, "reasoning_content": "still going"}
    cut = MARKUP["deepseek_v31"][:60]
    assert ChatReply(FORMATS["deepseek_v31"]).message("Sure." + cut) == {"role": "assistant", "content": "Sure." + cut}
    assert ChatReply(None).message("plain " + MARKUP["deepseek_v31"])["content"] == "plain " + MARKUP["deepseek_v31"]


def test_the_prompt_decides_whether_a_reply_starts_in_thinking():
    assert opens_thinking("<｜User｜>hi<｜Assistant｜><think>")
    assert not opens_thinking("<｜User｜>hi<｜Assistant｜></think>")
    assert not opens_thinking("<｜User｜>hi<｜Assistant｜>")
    assert opens_thinking("<｜User｜>hi<｜Assistant｜><think>\n")  # R1's generation prompt
    assert not opens_thinking("<｜User｜>what does <think> do?<｜Assistant｜>")  # a message's text


@pytest.mark.parametrize("template, name", [
    (TINY_TOKENIZER_CONFIG["chat_template"], "deepseek_v31"),
    ("{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n' + args}}", "deepseek_v3"),
    ('<｜DSML｜function_calls>', "deepseek_v32"), ("<｜DSML｜tool_calls>", "deepseek_v4"),
    ("<｜DSML｜ calls>", "deepseek_v41"),
])
def test_a_templates_markup_names_its_format(template, name):
    assert tool_format_of(template).name == name


def test_a_template_without_call_markup_has_no_format():
    assert tool_format_of("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}") is None


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": {"name": "noop"}}]


def test_tool_choice_decides_what_is_read_and_what_is_enforced():
    v31 = FORMATS["deepseek_v31"]
    assert tool_use(_request(tools=TOOLS, tool_choice="none"), v31, "m") == ToolUse()
    assert tool_use(_request(tools=TOOLS), v31, "m") == ToolUse(v31)
    required = tool_use(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), v31, "m")
    assert [f["name"] for f in required.required] == ["get_weather", "noop"] and not required.parallel
    named = tool_use(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "noop"}}), v31, "m")
    assert [f["name"] for f in named.required] == ["noop"]
    assert tool_use(_request(), None, "m") == ToolUse()


@pytest.mark.parametrize("fields, form, message", [
    ({"tool_choice": "required"}, "deepseek_v31", "tool_choice: is only allowed when tools are given"),
    ({"tools": TOOLS}, None, "tools: the chat template of model 'm' writes no tool calls graphc reads"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "deepseek_v31",
     "tool_choice: names function 'nope', which is not one of the tools (get_weather, noop)"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "deepseek_v31",
     "tool_choice: a reply that must call a tool cannot also follow guided_regex"),
])
def test_tool_use_that_cannot_be_served_is_refused_naming_the_field(fields, form, message):
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        tool_use(_request(**fields), FORMATS.get(form), "m")
    assert refused.value.param == message.split(":")[0]


def test_with_thinking_a_response_format_holds_from_the_end_of_the_reasoning(tokenizer):
    from graphc.runtime.constraints import Grammars
    from graphc.server.formats import requested_grammar

    grammars = Grammars(byte_level_tokenizer().to_str(), 256, [0])
    body = _request(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    after_reasoning = requested_grammar(body, grammars, thinking=True)
    assert _accepts(tokenizer, after_reasoning, 'Paris, so {"city"}</think>{"city":"Paris","days":2}')
    assert not _accepts(tokenizer, after_reasoning, '{"city":"Paris","days":2}')
    assert _accepts(tokenizer, requested_grammar(body, grammars), '{"city":"Paris","days":2}')
    slashed = requested_grammar(_request(guided_regex=r"a/b\/c[0-9]\n"), grammars, thinking=True)
    assert _accepts(tokenizer, slashed, "hm</think>a/b/c7\n")


def test_dsml_writes_a_string_enum_as_it_is_and_other_values_as_json(tokenizer):
    unit = {"name": "convert", "parameters": {"type": "object", "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]}, "scale": {"enum": [1, 10]}}, "required": ["unit", "scale"]}}
    grammar = FORMATS["deepseek_v4"].grammar([unit], parallel=False, thinking=False)
    call = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="convert">\n<｜DSML｜parameter name="unit" string="true">{}'
            '</｜DSML｜parameter>\n<｜DSML｜parameter name="scale" string="false">10</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    assert _accepts(tokenizer, grammar, call.format("celsius"))
    assert not _accepts(tokenizer, grammar, call.format("kelvin"))
    [parsed] = ChatReply(FORMATS["deepseek_v4"]).message(call.format("celsius"))["tool_calls"]
    assert json.loads(parsed["function"]["arguments"]) == {"unit": "celsius", "scale": 10}


def test_parameters_the_grammar_library_cannot_compile_are_refused_naming_tools():
    from graphc.runtime.constraints import Grammars

    grammars = Grammars(byte_level_tokenizer().to_str(), 256, [0])
    broken = {"name": "f", "parameters": {"type": "objectx"}}
    with pytest.raises(BadRequest, match="tools: a function's parameters cannot be compiled to a grammar") as refused:
        ToolUse(FORMATS["deepseek_v31"], (broken,)).grammar(grammars, thinking=False)
    assert refused.value.param == "tools"
