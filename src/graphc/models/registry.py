"""The model families graphc knows, in one list, and how a config.json finds its family.

A new family is a package beside `deepseek_v3/` whose `__init__.py` builds a `family.Family`,
plus one entry in `FAMILIES` (or a `register` call, for a family that lives outside graphc).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphc.errors import CheckpointError
from graphc.models import deepseek_v3, deepseek_v4, deepseek_v41
from graphc.models.family import Family
from graphc.weights.hf_config import architectures, read_hf_config
from graphc.models.step_model import ModelArgs

FAMILIES: list[Family] = [deepseek_v3.FAMILY, deepseek_v4.FAMILY, deepseek_v41.FAMILY]
"""Every family, in the order a config.json is matched against them."""


def register(family: Family) -> None:
    """Add `family` (first in line, so it may claim configs a built-in family would also take)."""
    if any(known.name == family.name for known in FAMILIES):
        raise ValueError(f"a model family named {family.name!r} is already registered")
    FAMILIES.insert(0, family)


def unregister(family: Family) -> None:
    FAMILIES.remove(family)


def family_of_config(config: dict[str, Any]) -> Family:
    """The family config.json describes, or a `CheckpointError` listing the supported architectures."""
    for family in FAMILIES:
        if family.recognises(config):
            return family
    named = ", ".join(architectures(config)) or f"model_type {config.get('model_type')!r}"
    supported = ", ".join(a for family in FAMILIES for a in family.architectures)
    raise CheckpointError(f"config.json: architecture {named} is not supported; supported: {supported}")


def family_of(args: ModelArgs) -> Family:
    """The family whose translator made `args`."""
    for family in FAMILIES:
        if args.architecture in family.architectures:
            return family
    raise ValueError(f"no registered family has architecture {args.architecture!r}")


def model_args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """Translate an HF `config.json` into its family's args, refusing other architectures."""
    return family_of_config(config).args_from_hf_config(config)


def load_model_args(checkpoint_dir: str | Path) -> ModelArgs:
    return model_args_from_hf_config(read_hf_config(Path(checkpoint_dir)))
