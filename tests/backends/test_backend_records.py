"""The backend registry: every backend is one record, its hooks import where they say, the runtime's
hooks stay runtime-side, its topology limits refuse with their messages, and no module outside
`graphc/backends/` tells backends apart by name."""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import graphc
from graphc.backends import BACKENDS
from graphc.models.moe_forms import MOE_LOWERINGS, moe_exchange
from graphc.topology import Topology

SOURCE = Path(graphc.__file__).parent
HOOKS = ("compiler", "loader", "toolchain", "manifest_extras", "linter")
"""The record's fields naming a `module:function`."""
HOOKED = [(name, hook) for name, record in BACKENDS.items() for hook in HOOKS if getattr(record, hook)]

_NAME = "[\"'](?:" + "|".join(BACKENDS) + ")[\"']"
NAME_TESTS = re.compile(rf"[=!]=\s*{_NAME}|{_NAME}\s*[=!]=|\bin\s*[(\[{{][^)\]}}]*{_NAME}|\bcase\s+{_NAME}")
"""A backend's name compared: `== "neuron"`, `"neuron" !=`, `in ("export", ...)`, `case "inductor"`."""

def test_no_module_outside_the_backends_compares_a_backend_name():
    found = [f"{path.relative_to(SOURCE)}:{number}: {line.strip()}"
             for path in sorted(SOURCE.rglob("*.py")) if SOURCE / "backends" not in path.parents
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if NAME_TESTS.search(line)]
    assert not found, "ask the backend's record (graphc/backends/__init__.py) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("name, hook", HOOKED)
def test_every_hook_names_a_function_that_imports(name, hook):
    module, function = getattr(BACKENDS[name], hook).split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_the_loaders_import_no_compiler():
    modules = sorted({record.loader.split(":")[0] for record in BACKENDS.values()})
    assert all(module.startswith("graphc.runtime.") for module in modules), modules
    code = (f"import importlib, sys\n"
            f"for module in {modules!r}: importlib.import_module(module)\n"
            "heavy = [m for m in sys.modules if m.startswith(('graphc.passes', 'graphc.compiler', 'graphc.tools',"
            " 'graphc.backends.', 'networkx'))]\n"
            "print(heavy)\n"
            "sys.exit(1 if heavy else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_backends_without_hooks_add_nothing():
    for record in BACKENDS.values():
        if record.toolchain is None and record.manifest_extras is None and record.linter is None:
            assert (record.cache_toolchain(), record.extras(), record.lint(Path("unused"), None)) == ("", {}, [])


@pytest.mark.parametrize("name", [name for name, record in BACKENDS.items() if record.lowerings is None])
def test_the_cpu_backends_compile_every_exchange_as_chosen(name):
    for choice in MOE_LOWERINGS:
        assert BACKENDS[name].exchange(choice, Topology(cp=1, ep=2, dp=2)) == (choice, None)


def test_neuron_compiles_the_even_all_to_all_in_a2a_vs_place_and_says_so():
    neuron, topology = BACKENDS["neuron"], Topology(cp=2, ep=4, dp=2)
    for choice in ("ag_rs", "a2a_even"):
        assert neuron.exchange(choice, topology) == (choice, None)
    assert neuron.exchange("a2a_v", topology) == ("a2a_even", (
        "model.moe_lowering: a2a_v is compiled as a2a_even on neuron (the padded even form: a2a_v's variable-size "
        "exchange, XLA's ragged-all-to-all, does not run on XLA:CPU, so it could not be checked here)"))
    # No exchange to stand in for: one EP rank, or tokens replicated over the EP group.
    assert neuron.exchange("a2a_v", Topology(cp=2, ep=1)) == ("local", None)
    assert neuron.exchange("a2a_v", Topology(cp=2, ep=2)) == ("static", None)
    # `auto` pads where the variable form would be the choice (groups of 4 and 8) but is not lowered.
    assert [moe_exchange("auto", ep, False, lowerings=neuron.lowerings) for ep in (2, 4, 8)] == ["a2a_even"] * 3
    assert [moe_exchange("auto", ep, False) for ep in (2, 4, 8)] == ["a2a_even", "a2a_v", "a2a_v"]


@pytest.mark.parametrize("stand_ins, named", [({}, "lowerings \\['a2a_v'\\] have no stand-in"),
                                              ({"a2a_v": ("a2a_v", "")}, "stand-ins \\['a2a_v'\\] are not among")])
def test_a_backend_record_whose_lowering_cannot_compile_is_refused(stand_ins, named):
    with pytest.raises(ValueError, match=named):
        dataclasses.replace(BACKENDS["neuron"], stand_ins=stand_ins)


RAGGED_ALL_TO_ALL = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
def exchange(data, out, in_offsets, send_sizes, out_offsets, recv_sizes):
    return jax.lax.ragged_all_to_all(data[0], out[0], in_offsets[0], send_sizes[0], out_offsets[0], recv_sizes[0],
                                     axis_name="x")[None]
sizes = jnp.ones((2, 2), jnp.int32)
offsets = jnp.array([[0, 1], [0, 1]], jnp.int32)
step = jax.jit(jax.shard_map(exchange, mesh=Mesh(jax.devices(), ("x",)), in_specs=(P("x"),) * 6, out_specs=P("x")))
print(step(jnp.ones((2, 2, 1)), jnp.zeros((2, 2, 1)), offsets, sizes, offsets, sizes).sum())
"""


def test_xla_cpu_does_not_run_ragged_all_to_all_which_is_why_neuron_stands_in_for_a2a_v():
    """The reason the neuron backend gives for compiling a2a_even in a2a_v's place, as the pinned jaxlib has it: when
    this fails, XLA:CPU runs the variable-size exchange and a2a_v can be lowered and checked here."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", RAGGED_ALL_TO_ALL], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                              "JAX_PLATFORMS": "cpu"})
    assert run.returncode != 0
    assert "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU" in run.stderr
