"""DeepSeek's tool-call formats: how each family's model writes function calls, read back as
OpenAI `tool_calls`, and the grammar that makes its output calls when a request requires them.

| format | written by | a call |
|---|---|---|
| `deepseek_v3` | V3, V3-0324, R1 | `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + "\\n```json\\n" + ARGS + "\\n```" + `<｜tool▁call▁end｜>` |
| `deepseek_v31` | V3.1, V3.1-Terminus, V3.2-Exp | `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` |
| `deepseek_v32`, `deepseek_v4`, `deepseek_v41` | V3.2, V4, V4.1 (DSML) | `<｜DSML｜invoke name="NAME">` + one `parameter` element an argument |

The first two wrap their calls in `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`; DSML in a
`function_calls` (V3.2), `tool_calls` (V4) or ` calls` (V4.1, whose tag names begin with a space)
element. These are the markup of the released chat templates and encoders (deepseek-ai's
tokenizer_config.json chat templates and encoding_dsv32.py / encoding_dsv4.py). In the V3 and
V4 tokenizers they are ordinary added tokens ("special": false), so decoded text keeps them.

A checkpoint's format is read from its chat template (`tool_format_of`): the markup it renders
past calls in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from graphc.runtime.constraints import grammar_of, json_value

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DSML = "｜DSML｜"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """JSON text, as OpenAI's `function.arguments` carries it."""


class ToolFormat:
    """One family's markup of a reply's calls: `begin` opens them, `end` closes them, `call`
    matches one whole call (its groups: the name and the arguments), and calls are `separator`
    apart. This class is V3.1's: the name, then the arguments' JSON."""

    def __init__(self, name: str, begin: str, end: str, call: re.Pattern, separator: str = ""):
        self.name, self.begin, self.end, self.call, self.separator = name, begin, end, call, separator

    def calls(self, text: str) -> tuple[list[ParsedCall], int]:
        """The whole calls at the start of `text` (the text after `begin`), and where they end."""
        calls, at = [], 0
        while match := self.call.match(text, at):
            calls.append(self.parsed(*match.groups()))
            at = match.end()
        return calls, at

    def parsed(self, name: str, arguments: str) -> ParsedCall:
        return ParsedCall(name.strip(), arguments.strip())

    def grammar(self, functions: list[dict], parallel: bool, thinking: bool) -> str:
        """The grammar (llguidance's Lark) of a reply that is calls of `functions` (OpenAI function
        objects), each call's arguments valid under its function's parameters; one call unless
        `parallel`. With `thinking`, a reasoning section that `</think>` ends comes first."""
        between = f"({_literal(self.separator)} call)*" if self.separator else "call*"
        rules = [f"calls: call {between}" if parallel else "calls: call",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        rules += [f"call_{i}: {self.call_grammar(function)}" for i, function in enumerate(functions)]
        start = grammar_of(f"{_literal(self.opening)} calls {_literal(self.end)}", thinking)
        return start + "\n".join(rules) + "\n"

    @property
    def opening(self) -> str:
        return self.begin

    def call_grammar(self, function: dict) -> str:
        return f"{_literal(CALL_BEGIN + function['name'] + CALL_SEP)} {_json(function)} {_literal(CALL_END)}"


class FencedFormat(ToolFormat):
    """DeepSeek-V3's: a type, the name, then the arguments in a ```json fence; calls a line apart."""

    def call_grammar(self, function: dict) -> str:
        head = CALL_BEGIN + "function" + CALL_SEP + function["name"] + "\n```json\n"
        return f"{_literal(head)} {_json(function)} {_literal(chr(10) + '```' + CALL_END)}"


class DsmlFormat(ToolFormat):
    """V3.2's and V4's: an `invoke` element a call, a `parameter` element an argument, its value
    as it is (`string="true"`) or as JSON (`string="false"`)."""

    def __init__(self, name: str, block: str, invoke: str, parameter: str):
        self.invoke, self.parameter = invoke, parameter
        super().__init__(name, f"<{DSML}{block}>", f"</{DSML}{block}>", re.compile(
            rf'\s*<{DSML}{re.escape(invoke)}\s+name="([^"]*)"\s*>(.*?)</{DSML}{re.escape(invoke)}>', re.DOTALL))
        self.argument = re.compile(rf'<{DSML}{re.escape(parameter)}\s+name="([^"]*)"\s+string="(true|false)"\s*>'
                                   rf'(.*?)</{DSML}{re.escape(parameter)}>', re.DOTALL)

    def parsed(self, name: str, body: str) -> ParsedCall:
        arguments = {key: value if is_string == "true" else _json_or_text(value)
                     for key, is_string, value in self.argument.findall(body)}
        return ParsedCall(name.strip(), json.dumps(arguments, ensure_ascii=False))

    @property
    def opening(self) -> str:  # the encoders write a blank line before the block, a line between its elements
        return "\n\n" + self.begin + "\n"

    def call_grammar(self, function: dict) -> str:
        """The call's element and the line after it (a line of its own: the closing tag's "\n<"
        must not be a separator's, which the lexer, matching the longest text, would take); its
        schema's properties in order, the required ones always; a string's value as it is (one of
        its enum, or any text without "<": its schema's other bounds are not enforced), any other
        value as JSON."""
        schema = function.get("parameters") or {"type": "object"}
        required = set(schema.get("required", []))
        parts = [_literal(f'<{DSML}{self.invoke} name="{function["name"]}">\n')]
        for key, value_schema in (schema.get("properties") or {}).items():
            is_string, value = _dsml_value(value_schema)
            opening = f'<{DSML}{self.parameter} name={json.dumps(key)} string="{str(is_string).lower()}">'
            element = f"{_literal(opening)} {value} {_literal(f'</{DSML}{self.parameter}>' + chr(10))}"
            parts.append(element if key in required else f"({element})?")
        parts.append(_literal(f"</{DSML}{self.invoke}>\n"))
        return " ".join(parts)


def _dsml_value(schema: dict) -> tuple[bool, str]:
    """Whether DSML writes a value of `schema` as it is (a string), and its grammar."""
    enum = schema.get("enum")
    if enum and all(isinstance(value, str) for value in enum):
        return True, "(" + " | ".join(map(_literal, enum)) + ")"
    if schema.get("type") == "string" and not enum:
        return True, "/[^<]*/"
    return False, _json_value(schema)


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json(function: dict) -> str:
    """The arguments' grammar: JSON valid under the function's parameters (any object without)."""
    return _json_value(function.get("parameters") or {"type": "object"})


def _json_value(schema: dict) -> str:
    """JSON spaced as json.dumps spaces it, as the families' encoders write arguments."""
    return json_value(schema, ", ", ": ")


_V31_CALL = re.compile(rf"\s*{CALL_BEGIN}(.*?){CALL_SEP}(.*?){CALL_END}", re.DOTALL)
_V3_CALL = re.compile(rf"\s*{CALL_BEGIN}(?:.*?){CALL_SEP}(.*?)\n```json\n(.*?)\n```{CALL_END}", re.DOTALL)

FORMATS = {
    "deepseek_v3": FencedFormat("deepseek_v3", CALLS_BEGIN, CALLS_END, _V3_CALL, "\n"),
    "deepseek_v31": ToolFormat("deepseek_v31", CALLS_BEGIN, CALLS_END, _V31_CALL),
    "deepseek_v32": DsmlFormat("deepseek_v32", "function_calls", "invoke", "parameter"),
    "deepseek_v4": DsmlFormat("deepseek_v4", "tool_calls", "invoke", "parameter"),
    "deepseek_v41": DsmlFormat("deepseek_v41", " calls", " invoke", " parameter"),
}


def tool_format_of(template: str) -> ToolFormat | None:
    """The format a chat template renders past calls in (the markup it writes), or None."""
    for name in ("deepseek_v41", "deepseek_v4", "deepseek_v32"):
        if FORMATS[name].begin in template:
            return FORMATS[name]
    if CALL_SEP in template:
        return FORMATS["deepseek_v3" if "```json" in template else "deepseek_v31"]
    return None
