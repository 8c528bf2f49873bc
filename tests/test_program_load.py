"""`load_exported_program`: torch.export.load's program, with each schema class's type hints
resolved once (torch 2.13 resolves them again for every deserialised object)."""

from __future__ import annotations

import typing

import torch
from torch._export.serde import serialize

from graphc.program_load import load_exported_program


class _Small(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            x = torch.relu(x @ y) + x.sum(-1, keepdim=True)
        return x


def _saved(tmp_path):
    inputs = (torch.randn(4, 4), torch.randn(4, 4))
    path = tmp_path / "small.pt2"
    torch.export.save(torch.export.export(_Small(), inputs), str(path))
    return path, inputs


def _counting_hints(monkeypatch) -> list:
    calls = []
    resolve = typing.get_type_hints

    def counted(*args, **kwargs):
        calls.append(args[0])
        return resolve(*args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", counted)
    return calls


def test_the_same_program_as_torch_export_load(tmp_path):
    path, inputs = _saved(tmp_path)
    ours, theirs = load_exported_program(path), torch.export.load(str(path))
    assert ours.graph_module.code == theirs.graph_module.code
    assert str(ours.graph_signature) == str(theirs.graph_signature)
    assert torch.equal(ours.module()(*inputs), theirs.module()(*inputs))
    assert torch.equal(ours.module()(*inputs), _Small()(*inputs))


def test_hints_are_resolved_once_per_class_and_the_module_is_put_back(tmp_path, monkeypatch):
    path, _ = _saved(tmp_path)
    calls = _counting_hints(monkeypatch)
    torch.export.load(str(path))
    plain = len(calls)
    calls.clear()
    load_exported_program(path)
    load_exported_program(path)
    assert len(calls) == len(set(calls)) and len(calls) < plain / 5, (len(calls), plain)
    assert serialize.typing is typing
