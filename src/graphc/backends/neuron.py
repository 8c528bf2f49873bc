"""`neuron` backend: NEFFs for AWS Trainium / Inferentia through torch-neuronx.

The Neuron SDK is imported lazily and only here; where it is absent, compiling for Neuron is a
clear error rather than an import failure at start-up.
"""

from __future__ import annotations

from pathlib import Path

from graphc.errors import GraphcError


def compile_program(program: Path, out: Path) -> None:
    try:
        import torch_neuronx  # noqa: F401
    except ImportError:
        raise GraphcError(
            "backend 'neuron' needs the AWS Neuron SDK (torch-neuronx, neuronx-cc), which is not installed; "
            "install it on a Neuron host, or use backend 'export' or 'inductor'"
        ) from None
    raise GraphcError("backend 'neuron': lowering graphc ops to Neuron is not implemented yet")
