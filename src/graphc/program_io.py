"""`torch.export.save` / `torch.export.load`, minus work torch 2.13 repeats or throws away.

Both ends cost seconds per program on two cores, and a compile saves every program once (and, for
the AOTInductor and Neuron backends, loads it again) while every rank loads every bucket's program
at start-up:

- load: the deserializer (`serialize._dict_to_dataclass`) resolves `typing.get_type_hints` of a
  schema dataclass again for every object it rebuilds, about 20,000 calls for a 1,100-node graph
  and three quarters of the load (pytorch/pytorch#196452). A dataclass's hints never change: here
  each class's are resolved once per process.
- save: the serializer deep-copies the serialized program and canonicalizes the copy only to
  check that a canonical form exists ("Test canonical form is well defined"), then drops it: half
  of the save of a V4 program. It is skipped; the archive written is byte for byte torch's.

Each swaps one attribute of `torch._export.serde.serialize` for the call alone, under a lock.
"""

from __future__ import annotations

import threading
import typing
from contextlib import contextmanager
from pathlib import Path

import torch
from torch._export.serde import serialize
from torch.export import ExportedProgram

_HINTS: dict[tuple, dict] = {}
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


def _discarded_canonical_form_check(program, constants=None):
    """Stands in for `serialize.canonicalize` where the serializer calls it only as a check."""


@contextmanager
def _swapped(name: str, value):
    with _SWAP:
        original = getattr(serialize, name)
        setattr(serialize, name, value)
        try:
            yield
        finally:
            setattr(serialize, name, original)


def load_exported_program(path: str | Path) -> ExportedProgram:
    """torch.export.load(path): the same program. The caller checks the archive first
    (`runtime.archive_check`): torch.export.load unpickles."""
    with _swapped("typing", _MemoizedTyping()):
        return torch.export.load(str(path))


def save_exported_program(program: ExportedProgram, path: str | Path) -> None:
    """torch.export.save(program, path): the same archive."""
    with _swapped("canonicalize", _discarded_canonical_form_check):
        torch.export.save(program, str(path))
