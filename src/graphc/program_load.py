"""`torch.export.load` without its repeated type-hint resolution.

torch 2.13's deserializer (`torch._export.serde.serialize._dict_to_dataclass`) resolves
`typing.get_type_hints` of a schema dataclass again for every object it rebuilds: about 20,000
calls for a 1,100-node graph, three quarters of the whole load (pytorch/pytorch#196452). A
dataclass's hints never change, so here each class's are resolved once per process. Every rank
loads every bucket's program at start-up, and compiling for the AOTInductor and Neuron backends
loads each program again, so this is most of a multi-rank export job's start.
"""

from __future__ import annotations

import threading
import typing
from contextlib import contextmanager
from pathlib import Path

import torch
from torch._export.serde import serialize
from torch.export import ExportedProgram

_HINTS: dict[tuple[type, int], dict] = {}
_SWAP = threading.Lock()


class _MemoizedTyping:
    """The `typing` module as the deserializer sees it, with get_type_hints memoized per class
    and namespace (the deserializer passes one namespace: the schema module's globals)."""

    def __getattr__(self, name: str):
        return getattr(typing, name)

    @staticmethod
    def get_type_hints(cls, globalns=None, localns=None, include_extras=False):
        key = (cls, id(globalns), id(localns), include_extras)
        if key not in _HINTS:
            _HINTS[key] = typing.get_type_hints(cls, globalns, localns, include_extras)
        return _HINTS[key]


@contextmanager
def _memoized_schema_hints():
    with _SWAP:  # one load at a time swaps the module's `typing`, and puts it back
        serialize.typing = _MemoizedTyping()
        try:
            yield
        finally:
            serialize.typing = typing


def load_exported_program(path: str | Path) -> ExportedProgram:
    """torch.export.load(path), minus the repeated hint resolution (same program, same graph).
    The caller checks the archive first (`runtime.archive_check`): torch.export.load unpickles."""
    with _memoized_schema_hints():
        return torch.export.load(str(path))
