"""A chat reply's text, as it streams, split into OpenAI's message fields: `reasoning_content`
(a thinking section's text), `content`, and `tool_calls` parsed from the family's markup
(`graphc.server.tool_formats`).

Reasoning: where the prompt leaves the model inside a thinking section (its template's
generation prompt ends with `<think>`: DeepSeek-V3.1's `thinking` switch on, R1, V3.2 and V4 in
thinking mode), the text up to `</think>` is reasoning (a `<think>` the reply repeats at its
start is dropped); a reply that never closes it is all reasoning, as vLLM reads DeepSeek's.

Streaming holds back only what could still be the start of a marker (and, before calls, the
whitespace the markup starts with); each call goes out whole, in one delta, once its markup is
complete. Text after the calls is dropped, as the reference parsers drop it; calls whose markup
never completes are given back as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import uuid

from graphc.server.tool_formats import ParsedCall, ToolFormat

THINK, THINK_END = "<think>", "</think>"


def opens_thinking(prompt: str) -> bool:
    """Whether `prompt` leaves the model in a thinking section: its generation prompt ends with
    `<think>` (a `<think>` a message holds is the message's text, not the template's switch)."""
    return prompt.rstrip().endswith(THINK)


class ChatReply:
    """`feed` a reply's text deltas, then `finish`: each returns the message fields the text
    adds. `tools`: the format to read calls in, None where calls are not parsed."""

    def __init__(self, tools: ToolFormat | None = None, reasoning: bool = False):
        self.tools, self.reasoning = tools, reasoning
        self.state = "reasoning" if reasoning else "content"
        self.pending = ""
        self.started = False
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> dict:
        self.pending += text
        return self._advance(final=False)

    def finish(self) -> dict:
        return self._advance(final=True)

    def message(self, text: str) -> dict:
        """The whole reply's fields (a non-streamed response's message)."""
        fields = merged(self.feed(text), self.finish())
        message = {"role": "assistant", "content": fields.get("content") or (None if self.calls or self.reasoning
                                                                               else "")}
        if self.reasoning:
            message["reasoning_content"] = fields.get("reasoning_content")
        if self.calls:  # a message's calls carry no stream index
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in fields["tool_calls"]]
        return message

    def _advance(self, final: bool) -> dict:
        fields: dict = {}
        while True:
            step = getattr(self, f"_{self.state}")(final)
            if step is None:
                return fields
            fields = merged(fields, step)

    def _reasoning(self, final: bool) -> dict | None:
        if not self.started:  # a reply may open its own thinking section
            if len(self.pending) < len(THINK) and THINK.startswith(self.pending) and not final:
                return None
            self.started = True
            self.pending = self.pending.removeprefix(THINK)
        return self._until(THINK_END, "reasoning_content", "content", final)

    def _content(self, final: bool) -> dict | None:
        if self.tools is None:
            text, self.pending = self.pending, ""
            return {"content": text} if text else None
        return self._until(self.tools.begin, "content", "calls", final, trim=True)

    def _calls(self, final: bool) -> dict | None:
        calls, at = self.tools.calls(self.pending)
        self.pending = self.pending[at:]
        if self.pending.lstrip().startswith(self.tools.end):
            self.state, self.pending = "done", ""
        elif final and (self.pending.strip() or not self.calls and not calls):
            # Markup that never completed: the model's text, given back as content.
            left, self.state, self.pending = self.pending, "done", ""
            lost = {"content": ("" if self.calls or calls else self.tools.begin) + left}
            return merged(self._numbered(calls), lost) if calls else lost
        return self._numbered(calls) if calls else None

    def _done(self, final: bool) -> None:
        self.pending = ""

    def _until(self, marker: str, field: str, then: str, final: bool, trim: bool = False) -> dict | None:
        """The pending text before `marker` as `field`, then state `then`; without the marker,
        all but what could begin it (and with `trim`, the whitespace before that)."""
        at = self.pending.find(marker)
        if at >= 0:
            text = self.pending[:at].rstrip() if trim else self.pending[:at]
            self.pending, self.state = self.pending[at + len(marker):], then
            return {field: text} if text else {}
        held = 0 if final else _held(self.pending, marker, trim)
        text, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        return {field: text} if text else None

    def _numbered(self, calls: list[ParsedCall]) -> dict:
        first = len(self.calls)
        self.calls += calls
        return {"tool_calls": [{"index": first + i, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]}


def _held(text: str, marker: str, trim: bool) -> int:
    """How many characters at the end of `text` could begin `marker` (with `trim`, and the
    whitespace before them)."""
    held = next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)
    if trim:
        held += len(text[:len(text) - held]) - len(text[:len(text) - held].rstrip())
    return held


def merged(a: dict, b: dict) -> dict:
    """Fields of two steps as one delta: texts joined, calls listed in order."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out
