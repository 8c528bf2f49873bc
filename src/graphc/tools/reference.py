"""The documentation's two generated references, so neither can go stale: `model.yaml` from the
schema (the dataclasses of `graphc.config`: every key's path, type, default and docstring) and
the command line from the click commands of `graphc.cli` (every command's usage, help, arguments
and options).

This file is also the docs site's MkDocs hook (`hooks:` in mkdocs.yml): a page holding the line
`<!-- graphc-reference: config -->` or `<!-- graphc-reference: cli -->` gets that reference in its
place at build time. tests/test_docs.py checks both against the schema and the commands.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal

MARKER = re.compile(r"^<!-- graphc-reference: (\w+) -->$", flags=re.M)


# --- model.yaml ---------------------------------------------------------------------------------

def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string literal after each field), dedented."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0], len(inner) < len(typing.get_args(tp))
    return tp, False


def type_name(tp: Any) -> str:
    """A field's type as a model.yaml author writes its value."""
    tp, _ = _optional(tp)
    if typing.get_origin(tp) is Literal:
        return " | ".join(f"`{a}`" for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {int: "integer", float: "number", str: "string", bool: "`true` | `false`", Path: "path"}.get(tp, str(tp))


def _yaml_value(value: Any) -> str:
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def default_text(f: dataclasses.Field, tp: Any) -> str:
    if f.default is not dataclasses.MISSING:
        return _yaml_value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return "its keys' defaults" if dataclasses.is_dataclass(_optional(tp)[0]) else _yaml_value(f.default_factory())
    return "**required**"


def config_keys(cls: type | None = None, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field, str]]:
    """Every model.yaml key, depth first in declaration order: (path, type, field, docstring).
    Fields the loader sets itself (`from_data=False`) are not keys."""
    if cls is None:
        from graphc.config import GraphcConfig

        cls = GraphcConfig
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("from_data", True):
            continue
        path, tp = f"{prefix}{f.name}", hints[f.name]
        yield path, tp, f, docs.get(f.name, "")
        inner = _optional(tp)[0]
        if dataclasses.is_dataclass(inner):
            yield from config_keys(inner, f"{path}.")


def config_markdown() -> str:
    """The model.yaml reference: one heading per key path, its type, default and docstring."""
    out = []
    for path, tp, f, doc in config_keys():
        level = "##" if "." not in path else "###"
        out.append(f"{level} `{path}` {{#{path.replace('.', '-')}}}\n")
        inner, optional = _optional(tp)
        kind = type_name(tp) + (" (optional)" if optional else "")
        out.append(f"**Type:** {kind} · **Default:** {default_text(f, tp)}\n")
        if doc:
            out.append(doc + "\n")
        if dataclasses.is_dataclass(inner) and inner.__doc__ and not inner.__doc__.startswith(inner.__name__ + "("):
            out.append(inspect.cleandoc(inner.__doc__) + "\n")
    return "\n".join(out)


# --- the command line ---------------------------------------------------------------------------

def _escape(text: str) -> str:
    """Markdown-safe help text: `*` and `<` escaped outside code spans, click's `\\b` dropped."""
    parts = text.replace("\b\n", "").replace("\b", "").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("*", "\\*").replace("<", "&lt;")
    return "`".join(parts)


def commands(group=None, ctx=None) -> Iterator[tuple[Any, Any]]:
    """Every command under `graphc` (groups included), depth first: (command, its click context)."""
    import click

    if group is None:
        from graphc.cli import cli as group

        ctx = click.Context(group, info_name="graphc")
        yield group, ctx
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        sub = click.Context(command, info_name=name, parent=ctx)
        yield command, sub
        if isinstance(command, click.Group):
            yield from commands(command, sub)


def cli_markdown() -> str:
    """The command-line reference: per command its usage, help, arguments and options."""
    import click

    out = []
    for command, ctx in commands():
        path = ctx.command_path
        out.append(f"## `{path}` {{#{path.replace(' ', '-')}}}\n")
        if command.help:
            out.append(_escape(inspect.cleandoc(command.help)) + "\n")
        out.append(f"```text\n{command.get_usage(ctx)}\n```\n")
        params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
        arguments = [p for p in params if isinstance(p, click.Argument)]
        if arguments:
            out.append("**Arguments:** " + ", ".join(f"`{p.human_readable_name}`" for p in arguments) + "\n")
        options = [p for p in params if isinstance(p, click.Option)]
        if isinstance(command, click.Group):
            out.append("**Commands:** " + ", ".join(
                f"[`{name}`](#{path.replace(' ', '-')}-{name})" for name in command.list_commands(ctx)) + "\n")
        if options:
            out.append("**Options:**\n")
            for option in options:
                names, help_text = option.get_help_record(ctx)
                envvar = f" (environment: `{option.envvar}`)" if isinstance(option.envvar, str) else ""
                out.append(f"- `{names}`: {_escape(help_text)}{envvar}")
            out.append("")
    return "\n".join(out)


GENERATORS = {"config": config_markdown, "cli": cli_markdown}


def expand(markdown: str) -> str:
    """Each marker line replaced by its reference."""
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


def on_page_markdown(markdown: str, **kwargs) -> str:  # the MkDocs hook
    return expand(markdown)
