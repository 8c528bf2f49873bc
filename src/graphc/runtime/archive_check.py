"""Refuse a torch.export archive (`.pt2`) that loading could turn into code execution.

`torch.export.load` (torch 2.13) unpickles, with `weights_only=False`: any weight or constant
whose payload config says `use_pickle`, constants that are custom objects, legacy `.pt` weight
and constant files, and (as a fallback) sample inputs. graphc's programs hold none of these:
their weights are graph inputs and their constants plain tensors stored raw, and capture drops
the example inputs. So an archive is loaded only if every entry is one that JSON parsing or the
raw-tensor reader handles (or the empty sample-inputs entry torch writes when there are none),
and no payload asks for pickle. The check reads the zip directory and
the small JSON configs; nothing is deserialised by torch before it passes.

AOTInductor packages are native code by design: no check on their content can make them safe to
run; signed artifacts (the docs' trust model, docs/security.md) are how to trust them across hosts.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

from graphc.artifacts.manifest import ArtifactError

ALLOWED_ENTRY = re.compile(
    r"^[0-9A-Za-z_.-]+/(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/[0-9A-Za-z_.-]+\.json|data/weights/[0-9A-Za-z_]+_weights_config\.json"
    r"|data/constants/[0-9A-Za-z_]+_constants_config\.json|data/constants/tensor_\d+)$"
)
"""Every entry a graphc program's archive may hold (the first path component is the archive's name)."""
EMPTY_ENTRY = re.compile(r"^[0-9A-Za-z_.-]+/data/sample_inputs/[0-9A-Za-z_]+\.pt$")
"""Entries allowed only empty: torch writes the sample inputs even when there are none."""


def check_export_archive(path: Path) -> None:
    """Raise ArtifactError unless the archive at `path` loads without unpickling anything."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            for entry in archive.infolist():
                name = entry.filename
                if not (ALLOWED_ENTRY.match(name) or (EMPTY_ENTRY.match(name) and entry.file_size == 0)):
                    raise ArtifactError(f"{path}: archive entry {name!r} is not a graph, a payload config or a raw "
                                        "tensor; graphc refuses archives whose loading could unpickle data")
            for name in names:
                if name.endswith("_config.json"):
                    _check_payload_config(path, name, archive.read(name))
    except zipfile.BadZipFile as e:
        raise ArtifactError(f"{path}: not a torch.export archive ({e})") from None


def _check_payload_config(path: Path, name: str, raw: bytes) -> None:
    """Weights configs must be empty (weights are inputs); constants must be raw tensors."""
    try:
        payloads = json.loads(raw).get("config")
    except (ValueError, AttributeError):
        raise ArtifactError(f"{path}: {name} is not a payload config") from None
    if not isinstance(payloads, dict):
        raise ArtifactError(f"{path}: {name} is not a payload config")
    if payloads and "_weights_config" in name:
        raise ArtifactError(f"{path}: {name} stores weights in the graph; graphc's graphs take them as inputs")
    for fqn, payload in payloads.items():
        if not isinstance(payload, dict) or payload.get("use_pickle") is not False \
                or not re.fullmatch(r"tensor_\d+", str(payload.get("path_name"))):
            raise ArtifactError(f"{path}: {name}: constant {fqn!r} is not a raw tensor (pickled or a custom "
                                "object); graphc refuses archives whose loading could unpickle data")
