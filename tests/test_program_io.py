"""`load_exported_program` / `save_exported_program`: torch.export.load's program and
torch.export.save's archive, without the work torch 2.13 repeats (each schema class's type hints
resolved per object) or throws away (a canonicalized deep copy, made only as a check)."""

from __future__ import annotations

import typing

import torch
from torch._export.serde import serialize

from graphc.program_io import load_exported_program, save_exported_program


class _Small(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            x = torch.relu(x @ y) + x.sum(-1, keepdim=True)
        return x


INPUTS = (torch.randn(4, 4), torch.randn(4, 4))


def _program() -> torch.export.ExportedProgram:
    return torch.export.export(_Small(), INPUTS)


def _counting(monkeypatch, module, name: str) -> list:
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_the_same_program_as_torch_export_load(tmp_path):
    path = tmp_path / "small.pt2"
    torch.export.save(_program(), str(path))
    ours, theirs = load_exported_program(path), torch.export.load(str(path))
    assert ours.graph_module.code == theirs.graph_module.code
    assert str(ours.graph_signature) == str(theirs.graph_signature)
    assert torch.equal(ours.module()(*INPUTS), theirs.module()(*INPUTS))
    assert torch.equal(ours.module()(*INPUTS), _Small()(*INPUTS))


def test_hints_are_resolved_once_per_class_and_the_module_is_put_back(tmp_path, monkeypatch):
    path = tmp_path / "small.pt2"
    torch.export.save(_program(), str(path))
    calls = _counting(monkeypatch, typing, "get_type_hints")
    torch.export.load(str(path))
    plain = len(calls)
    calls.clear()
    load_exported_program(path)
    load_exported_program(path)
    assert len(calls) == len(set(calls)) and len(calls) < plain / 5, (len(calls), plain)
    assert serialize.typing is typing


def test_the_same_archive_as_torch_export_save_without_the_canonical_copy(tmp_path, monkeypatch):
    program = _program()
    (tmp_path / "ours").mkdir()
    (tmp_path / "torch").mkdir()
    canonicalized = _counting(monkeypatch, serialize, "canonicalize")
    torch.export.save(program, str(tmp_path / "torch" / "program.pt2"))
    assert len(canonicalized) == 1  # torch's save makes the check this skips
    save_exported_program(program, tmp_path / "ours" / "program.pt2")
    assert len(canonicalized) == 1 and serialize.canonicalize.__name__ == "counted"  # skipped, then put back
    assert (tmp_path / "ours" / "program.pt2").read_bytes() == (tmp_path / "torch" / "program.pt2").read_bytes()
    assert torch.equal(load_exported_program(tmp_path / "ours" / "program.pt2").module()(*INPUTS), _Small()(*INPUTS))
