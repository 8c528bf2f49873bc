"""The grammar a request's output must follow (`graphc.runtime.constraints`): OpenAI's
`response_format` (a JSON object, or JSON valid under a schema) or vLLM's `guided_regex` /
`guided_choice`; a grammar llguidance cannot compile is a BadRequest naming the field."""

from __future__ import annotations

from graphc.errors import GraphcError
from graphc.runtime.constraints import Grammars, choice_grammar, json_schema_grammar, regex_grammar
from graphc.server.translate import BadRequest


def requested_grammar(body, grammars: Grammars | None, thinking: bool = False) -> str | None:
    """The checked grammar `body` asks its output to follow, or None for free text; with
    `thinking`, after the reasoning the prompt opened."""
    asked = {name: grammar for name, grammar in _asked(body, thinking)}
    if not asked:
        return None
    if len(asked) > 1:
        raise BadRequest(f"{' and '.join(asked)}: give one of response_format, guided_regex and guided_choice",
                         param=next(iter(asked)))
    [(name, grammar)] = asked.items()
    if grammars is None:
        raise BadRequest(f"{name}: structured outputs need the artifacts' tokenizer, and these have none", param=name)
    try:
        return grammars.checked(grammar())
    except (GraphcError, ValueError) as e:
        where = "response_format.json_schema.schema" if name == "response_format" else name
        raise BadRequest(f"{where}: cannot be compiled to a grammar: {e}", param=name) from None


def _asked(body, thinking: bool):
    """(field, a function making its grammar) for each grammar field `body` gives."""
    formats = body.response_format
    if formats is not None and formats.type == "json_object":
        yield "response_format", lambda: json_schema_grammar({"type": "object"}, thinking)
    elif formats is not None and formats.type == "json_schema":
        yield "response_format", lambda: json_schema_grammar(formats.json_schema.schema_, thinking)
    if body.guided_regex is not None:
        yield "guided_regex", lambda: regex_grammar(body.guided_regex, thinking)
    if body.guided_choice is not None:
        yield "guided_choice", lambda: choice_grammar(body.guided_choice, thinking)
