"""Strict conversion of YAML data into dataclasses: the one loader of `model.yaml` (config.py) and
of artifact manifests (artifacts/schema.py). Torch-free."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

from graphc.errors import GraphcError


def describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {describe(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", Path: "a path"}.get(tp, str(tp))


def build(tp: Any, value: Any, error: type[Exception], base_dir: Path | None = None, path: str = "") -> Any:
    """Convert YAML data to `tp` (a dataclass, or the types its fields use), strictly: an unknown
    key, a missing required one or a value of the wrong type raises `error` naming the key path
    (`buckets.prefill[2]`), the value and what is allowed. Paths resolve against `base_dir`."""
    where = path or "<top level>"
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise error(f"{where}: expected a mapping, got {value!r}")
        hints = typing.get_type_hints(tp)
        # A field marked from_data=False is set by the code, never read from the data.
        fields = {f.name: f for f in dataclasses.fields(tp) if f.metadata.get("from_data", True)}
        unknown = sorted(set(value) - set(fields), key=str)
        if unknown:
            key = f"{path}.{unknown[0]}" if path else str(unknown[0])
            raise error(f"{key}: unknown key; allowed here: {', '.join(fields)}")
        kwargs = {}
        for name, f in fields.items():
            key = f"{path}.{name}" if path else name
            if name in value:
                kwargs[name] = build(hints[name], value[name], error, base_dir, key)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise error(f"{key}: required key is missing ({describe(hints[name])})")
        try:
            return tp(**kwargs)
        except GraphcError as e:  # the dataclass's own rules (`Topology`'s): their message names the key
            raise error(str(e)) from None
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise error(f"{where}: {value!r} is not allowed; expected {describe(tp)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{where}: expected a mapping, got {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {build(key_type, k, error, base_dir, f"{path}.{k}"): build(value_type, v, error, base_dir, f"{path}.{k}")
                for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise error(f"{where}: expected {describe(tp)}, got {value!r}")
        return [build(typing.get_args(tp)[0], v, error, base_dir, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else build(inner[0], value, error, base_dir, path)
    # bool is an int in Python; YAML `true` must not pass as a size.
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise error(f"{where}: expected an integer, got {value!r}")
    if tp is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise error(f"{where}: expected a number, got {value!r}")
    if tp is bool and not isinstance(value, bool):
        raise error(f"{where}: expected true or false, got {value!r}")
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise error(f"{where}: expected a path string, got {value!r}")
        return (base_dir / value).resolve()
    if tp is str and not isinstance(value, str):
        raise error(f"{where}: expected a string, got {value!r}")
    if tp is float:
        return float(value)
    return value
