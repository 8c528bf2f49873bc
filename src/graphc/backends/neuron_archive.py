"""A neuron program's archive (a stored zip: hashed and shipped as one file) and neuronx-cc, which
turns its Neuron HLO into a NEFF.

    program.json     the parameter / result names, shapes and dtypes (`xla.lower.ProgramSignature`),
                     the world size, and the neuronx-cc command that makes (or made) the NEFF
    neuron.hlo.pb    the HloModuleProto for neuronx-cc (`xla.variants.NEURON`)
    cpu.hlo.pb       the same module in the form XLA:CPU runs (`xla.variants.CPU`): what `graphc
                     run` serves here, to validate the graphs token for token
    neuron.neff      where `neuronx-cc` was on PATH at compile time, or after `graphc
                     neuron-finish` on a Neuron host

Light on purpose (no torch, no jax): the compiler, the XLA:CPU runner and `graphc neuron-finish`
share it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from graphc.errors import GraphcError

NEURONX_CC = "neuronx-cc"
NEURON_TARGET = "trn1"
"""The Neuron generation NEFFs are compiled for (`neuronx-cc --target`)."""
PROGRAM_JSON, NEURON_HLO, CPU_HLO, NEFF = "program.json", "neuron.hlo.pb", "cpu.hlo.pb", "neuron.neff"


def neuronx_cc_command(target: str = NEURON_TARGET) -> list[str]:
    """neuronx-cc's documented invocation for an XLA HLO module, run in a folder holding it, with
    numerics kept as compiled (`--auto-cast none`: graphc's dtypes are the model's)."""
    return [NEURONX_CC, "compile", NEURON_HLO, "--framework", "XLA", "--target", target, "--model-type",
            "transformer", "--auto-cast", "none", "-O1", "--output", NEFF]


def manifest_extras(target: str = NEURON_TARGET) -> dict[str, str]:
    """What a neuron manifest records beside its graphs: the hand-off, how each program's HLO
    becomes a NEFF on a Neuron host."""
    return {"neuronx_cc": " ".join(neuronx_cc_command(target))}


def available() -> bool:
    return shutil.which(NEURONX_CC) is not None


def toolchain() -> str:
    """What decides whether a compile makes NEFFs (part of the compile cache's key: an archive
    cached without a NEFF must not be reused where neuronx-cc is installed, nor the reverse)."""
    return f"{NEURONX_CC} at {shutil.which(NEURONX_CC)}"


def neff_of(neuron_hlo: bytes, command: list[str]) -> bytes:
    """neuronx-cc's NEFF of a Neuron-variant module."""
    with tempfile.TemporaryDirectory(prefix="graphc-neuronx-cc-") as scratch:
        (Path(scratch) / NEURON_HLO).write_bytes(neuron_hlo)
        return run_neuronx_cc(Path(scratch), command)


def run_neuronx_cc(folder: Path, command: list[str]) -> bytes:
    """Run neuronx-cc in `folder` (which holds the HLO); the NEFF, or an error naming the reason."""
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if done.returncode != 0 or not (folder / NEFF).is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise GraphcError(f"{' '.join(command)} failed (exit {done.returncode}): " + " | ".join(tail))
    return (folder / NEFF).read_bytes()


def write_archive(out: Path, description: dict, files: dict[str, bytes]) -> None:
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(PROGRAM_JSON, json.dumps(description, indent=1))
        for name, data in files.items():
            archive.writestr(name, data)


def read_archive(path: Path) -> tuple[dict, dict[str, bytes]]:
    """(program.json, the other files by name)."""
    with zipfile.ZipFile(path) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    return json.loads(files.pop(PROGRAM_JSON)), files
