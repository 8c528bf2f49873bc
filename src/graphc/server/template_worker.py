"""A chat-template worker process (`python -m graphc.server.template_worker`): renders messages
with the template it was given, one request at a time, over its stdin and stdout.

Protocol, one JSON object a line: the server sends the setup ({"template", "bos_token",
"eos_token", "seconds", "max_chars", "memory_bytes"}), the worker answers "ready"; then for each
chat ({"messages": [...], "tools": [...] or null, "kwargs": {...}}) it answers {"text": ...},
{"chars": N} (a render longer than max_chars) or {"error": ...}. It exits when its stdin closes.
Imports stay light (jinja2 only): a worker starts while the server runs.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

MAX_ERROR_CHARS = 1000
"""An error's message is cut here: it is quoted in a 400, and its reply must fit the server's pipe."""


def _environment():
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # As transformers builds it: trimmed blocks, {% break %} / {% continue %}, raise_exception, and
    # a `tojson` that writes JSON as json.dumps does (Jinja's own escapes "<" and "'" for HTML).
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = tojson
    return environment


def _render(setup: dict, chat: dict, compiled: list) -> dict:
    """One reply: the text, its length past max_chars, or why the template failed."""
    from jinja2 import TemplateError

    try:
        if not compiled:  # compiled at the first render, so a syntax error is that request's 400
            compiled.append(_environment().from_string(setup["template"]))
        text = compiled[0].render(**chat["kwargs"], messages=chat["messages"], tools=chat["tools"],
                                  add_generation_prompt=True, bos_token=setup["bos_token"],
                                  eos_token=setup["eos_token"])
        text.encode("utf-8")  # a lone surrogate from a string literal: no tokenizer takes it
    except TemplateError as e:
        return {"error": str(e)[:MAX_ERROR_CHARS]}
    except Exception as e:  # the template's own failure (ZeroDivisionError, RecursionError, MemoryError, ...)
        return {"error": (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:MAX_ERROR_CHARS]}
    return {"chars": len(text)} if len(text) > setup["max_chars"] else {"text": text}


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    # A template can build a string as large as memory: bound this process, not the server.
    resource.setrlimit(resource.RLIMIT_AS, (setup["memory_bytes"], resource.getrlimit(resource.RLIMIT_AS)[1]))
    os.nice(10)  # a render is one request's work; the server's steps are everyone's: they go first
    compiled: list = []
    print("ready", flush=True)
    for line in sys.stdin:
        # The server kills a render that overruns; SIGALRM (whose default action ends the process)
        # ends one a second later anyway, should the server be gone.
        signal.setitimer(signal.ITIMER_REAL, setup["seconds"] + 1)
        reply = _render(setup, json.loads(line), compiled)
        signal.setitimer(signal.ITIMER_REAL, 0)
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
