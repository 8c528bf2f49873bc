"""Shared fixtures: tiny checkpoints (graphc's own and transformers-written), built once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphc.models.tiny import PRESETS, make_tiny_checkpoint, preset_config

# Lines the tests want a reader of the CI log to see (agreement rates, margins, noise floors).
_REPORT: list[str] = []


@pytest.fixture(scope="session")
def report():
    return _REPORT.append


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("graphc measurements")
        for line in _REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """graphc `make-tiny` output for every preset."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_checkpoint(root / name, preset=name, seed=0) for name in PRESETS}


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """For every preset, a model initialised *by transformers* and written by its `save_pretrained`."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in PRESETS:
        config = preset_config(name)
        # A wider init than transformers' default 0.02 keeps tiny-model logits decisive.
        config = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype")}
        torch.manual_seed(1)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**config, initializer_range=0.15))
        with torch.no_grad():  # transformers initialises the correction bias to zeros; make it matter
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def checkpoint_sources(tiny_checkpoints, hf_checkpoints):
    return {"graphc": tiny_checkpoints, "transformers": hf_checkpoints}
