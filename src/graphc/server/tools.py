"""A chat request's `tools` and `tool_choice`, checked against what the checkpoint's template can
do: which format its calls are read in, and the grammar that enforces `required` or a named
function (OpenAI's semantics: "none" never reads calls, "auto" reads what the model writes,
"required" makes the reply calls, a named function makes it one call of that function)."""

from __future__ import annotations

from dataclasses import dataclass

from graphc.errors import GraphcError
from graphc.runtime.constraints import Grammars
from graphc.server.tool_formats import ToolFormat
from graphc.server.translate import BadRequest


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools ask of its reply: `format` to read calls in (None: none are
    read), and the functions (OpenAI function objects) its reply must call (empty: any reply)."""

    format: ToolFormat | None = None
    required: tuple[dict, ...] = ()
    parallel: bool = True

    def grammar(self, grammars: Grammars, thinking: bool) -> str | None:
        """The checked grammar of the calls the reply must be (None where none are required)."""
        if not self.required:
            return None
        try:
            return grammars.checked(self.format.grammar(list(self.required), self.parallel, thinking))
        except (GraphcError, ValueError) as e:
            raise BadRequest(f"tools: a function's parameters cannot be compiled to a grammar: {e}",
                             param="tools") from None


def tool_use(body, tool_format: ToolFormat | None, model_name: str) -> ToolUse:
    """`body`'s tool use, or BadRequest naming the field."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice: is only allowed when tools are given", param="tool_choice")
        return ToolUse()
    if tool_format is None:
        raise BadRequest(f"tools: the chat template of model {model_name!r} writes no tool calls graphc reads "
                         "(DeepSeek-V3, V3.1, V3.2 or V4 markup); send the request without tools", param="tools")
    functions = {tool.function.name: tool.function.model_dump(exclude_none=True) for tool in body.tools}
    if choice == "none":
        return ToolUse()
    if choice in (None, "auto"):
        return ToolUse(tool_format)
    guided = [name for name in ("response_format", "guided_regex", "guided_choice") if getattr(body, name) is not None]
    if guided:
        raise BadRequest(f"tool_choice: a reply that must call a tool cannot also follow {guided[0]}",
                         param="tool_choice")
    if choice == "required":
        return ToolUse(tool_format, tuple(functions.values()), body.parallel_tool_calls)
    name = choice.function.name
    if name not in functions:
        raise BadRequest(f"tool_choice: names function {name!r}, which is not one of the tools "
                         f"({', '.join(functions)})", param="tool_choice")
    return ToolUse(tool_format, (functions[name],), parallel=False)
