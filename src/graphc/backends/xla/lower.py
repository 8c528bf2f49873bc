"""Lower a rewritten step program (torch.export) to an XLA `HloModuleProto`, through jax.

The program is decomposed to core ATen (`run_decompositions`), then interpreted node by node with
the rules of `aten.py` and `graphc_ops.py` under `jax.jit`, lowered to StableHLO and converted to
an HLO module: the input neuronx-cc documents (`--framework XLA`), and one XLA:CPU runs here. The
StableHLO is kept too, as a portable artifact (`LoweredModule.stablehlo`): the module the HLO was
converted from, serialized at a version some weeks older than this jaxlib's
(`STABLEHLO_COMPATIBILITY`), for toolchains that take StableHLO.

The module's signature (`neuron_archive.ProgramSignature`, recorded beside it): the weights, then
the step inputs (`graphc.step.STEP_INPUTS`), then `noise` [B, V] fp32 when the program samples
(the host draws it from each row's seed; [B, 1 + k, V] in a speculative step, every rank's program
drawing its verdict: position j's from the seed + j); int64 inputs as int32 (the programs run without jax's
x64 mode). Outputs: the written KV pool (aliased to the pool input: donated, updated in place),
the tokens and the logits. The pool's block count is fixed at compile time: what the capture
recorded (`kv_cache.num_blocks`), whose last block is the scratch slot of padding tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.lib import _jax, xla_client
from jaxlib.mlir.dialects import stablehlo
from jax.interpreters import mlir
from jax._src.lib.mlir import ir
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from graphc.backends.neuron_archive import NOISE, OUTPUTS, ProgramSignature, parameter_names
from graphc.backends.xla import aten as aten_rules
from graphc.backends.xla import graphc_ops
from graphc.backends.xla.aten import Out
from graphc.backends.xla.variants import Variant
from graphc.errors import GraphcError
from graphc.step import STEP_INPUTS
from graphc.topology import Topology

JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
              torch.int64: jnp.int32, torch.int32: jnp.int32, torch.bool: jnp.bool_,
              torch.float8_e4m3fn: aten_rules.FP8_BITS}
"""torch dtype -> the dtype its values take in the lowered program (no int64: see the module doc;
float8_e4m3fn as its bits: see `aten.FP8_BITS`)."""
STABLEHLO_COMPATIBILITY = stablehlo.StablehloCompatibilityRequirement.WEEK_12
"""How old a StableHLO consumer may be and still read the artifact: the Neuron SDK ships on its own
cadence, some releases behind the jaxlib pinned here; twelve weeks is the widest window StableHLO
names short of its oldest version (which would refuse ops newer than it)."""


@dataclass(frozen=True)
class LoweredModule:
    """One variant of a program: the serialized `HloModuleProto`, and the StableHLO portable
    artifact it was converted from (at `stablehlo_version`)."""

    hlo: bytes
    stablehlo: bytes
    stablehlo_version: str


@dataclass
class Lowering:
    """What rules see besides their arguments."""

    topology: Topology
    variant: Variant
    noise: jax.Array | None = None
    _groups: dict = field(default_factory=dict)

    def groups(self, group: str) -> tuple[tuple[int, ...], ...]:
        """Every replica group of semantic `group` (an HLO instruction names them all)."""
        if group not in self._groups:
            world = self.topology.world
            self._groups[group] = tuple(sorted({tuple(self.topology.group_ranks(group, rank)) for rank in range(world)}))
        return self._groups[group]


def _static(size, num_blocks: int) -> int:
    """A size with the pool's block count (the one symbol any size has) set to `num_blocks`."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    return int(expr.xreplace({symbol: num_blocks for symbol in expr.free_symbols}))


def _out(value, num_blocks: int) -> Out | tuple | None:
    if isinstance(value, torch.Tensor):
        return Out(tuple(_static(size, num_blocks) for size in value.shape), JAX_DTYPES[value.dtype])
    if isinstance(value, (tuple, list)):
        return tuple(_out(v, num_blocks) for v in value)
    return None


def _cast(result, out):
    if isinstance(out, Out) and result is not None:
        return jnp.asarray(result).astype(out.dtype)
    if isinstance(out, tuple) and isinstance(result, (tuple, list)):
        return tuple(_cast(r, o) for r, o in zip(result, out))
    return result


def _num_blocks(program: ExportedProgram) -> int:
    """The pool's block count the program was captured with (its one symbolic dim's hint)."""
    pool = [n for n in program.graph.nodes if n.op == "placeholder"][-len(STEP_INPUTS) + STEP_INPUTS.index("kv_pool")]
    size = pool.meta["val"].shape[1]
    return size if isinstance(size, int) else int(size.node.shape_env.size_hint(size.node.expr))


def interpret(program: ExportedProgram, lowering: Lowering, num_blocks: int):
    """A function of the user inputs (flat, in order) returning the program's outputs (the
    mutated pool first), evaluating each node with its rule."""
    graph_signature = program.graph_signature
    kinds = {spec.arg.name: spec for spec in graph_signature.input_specs}
    rules = {**aten_rules.RULES, **{op: (lambda rule: lambda out, *a, **k: rule(lowering, out, *a, **k))(rule)
                                    for op, rule in graphc_ops.RULES.items()},
             **lowering.variant.rules}

    def run(*user_inputs):
        env, inputs = {}, iter(user_inputs)

        def value(arg):
            if isinstance(arg, torch.fx.Node):
                return env[arg]
            if isinstance(arg, (list, tuple)):
                return type(arg)(value(a) for a in arg)
            if isinstance(arg, dict):
                return {key: value(a) for key, a in arg.items()}
            return arg

        for node in program.graph.nodes:
            if node.op == "placeholder":
                spec = kinds[node.name]
                if spec.kind == InputKind.USER_INPUT:
                    env[node] = next(inputs)
                elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.BUFFER):
                    constant = program.constants.get(spec.target, program.state_dict.get(spec.target))
                    env[node] = jnp.asarray(constant.detach().numpy(), dtype=JAX_DTYPES[constant.dtype])
                else:
                    raise GraphcError(f"xla lowering: input {node.name} of kind {spec.kind.name} is not supported")
            elif node.op == "call_function":
                if node.target in aten_rules.IGNORED:
                    continue
                if node.target is torch.ops.higher_order.auto_functionalized_v2:
                    env[node] = _auto_functionalized(node, value, rules)
                    continue
                rule = rules.get(node.target)
                if rule is None:
                    raise GraphcError(f"xla lowering: no rule for {node.target} (node {node.name}); "
                                      "add one to graphc/backends/xla")
                out = _out(node.meta.get("val"), num_blocks)
                env[node] = _cast(rule(out, *value(node.args), **value(node.kwargs)), out)
            elif node.op == "output":
                return tuple(value(a) for a in node.args[0])
        raise GraphcError("xla lowering: the program has no output")

    return run


def _auto_functionalized(node, value, rules):
    """torch.export's functional form of a mutating op: (the op's result, every mutated base
    after the op). Only graphc::kv_write mutates, and only its pool."""
    op, kwargs = node.args[0], dict(node.kwargs)
    if op is not torch.ops.graphc.kv_write.default:
        raise GraphcError(f"xla lowering: mutating op {op} is not supported")
    bases = value(kwargs.pop("_all_bases"))
    kwargs.pop("_kv_pool_base_index")
    return rules[op](None, bases[0], **value(kwargs))


def lower_to_hlo(program: ExportedProgram, topology: Topology,
                 variants: tuple[Variant, ...]) -> tuple[list[LoweredModule], ProgramSignature]:
    """`program`'s module for each of `variants` (in their order), and their signature. The program is decomposed once for them all: a decomposition retraces the
    whole program through AOT autograd, which at DeepSeek-V3's 61 layers takes minutes."""
    program = program.run_decompositions()
    lowered = [_lower_variant(program, topology, variant) for variant in variants]
    return [module for module, _ in lowered], lowered[0][1]


def _lower_variant(program: ExportedProgram, topology: Topology,
                   variant: Variant) -> tuple[LoweredModule, ProgramSignature]:
    num_blocks = _num_blocks(program)
    user_inputs = [n for n in program.graph.nodes if n.op == "placeholder"
                   and _input_kind(program, n.name) == InputKind.USER_INPUT]
    # The noise input is shaped as the logits a sampling op draws from: [B, V], or a speculative
    # step's [B, 1 + k, V].
    drawing = [n for n in program.graph.nodes if n.target in NOISE_OPS]
    samples = bool(drawing)
    # Weights are one list input and the step inputs follow it.
    names = parameter_names(len(user_inputs) - len(STEP_INPUTS), samples)
    avals = [_out(n.meta["val"], num_blocks) for n in user_inputs]
    if samples:
        avals.append(Out(tuple(drawing[0].args[0].meta["val"].shape), jnp.float32))
    lowering = Lowering(topology, variant)
    body = interpret(program, lowering, num_blocks)

    def step(*arguments):  # positional, so the module's parameters keep the inputs' order
        inputs = dict(zip(names, arguments))
        lowering.noise = inputs.get(NOISE)
        return body(*(inputs[name] for name in names if name != NOISE))

    # The pool is donated: its result aliases its parameter (updated in place on the device).
    lowered = jax.jit(step, donate_argnums=(names.index("kv_pool"),), keep_unused=True).lower(
        *(jax.ShapeDtypeStruct(aval.shape, aval.dtype) for aval in avals))
    module = lowered.compiler_ir("stablehlo")
    with module.context:
        module.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(32), topology.world)
    bytecode = mlir.module_to_bytecode(module)
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(bytecode, use_tuple_args=False,
                                                                       return_tuple=True)
    version = stablehlo.get_version_from_compatibility_requirement(STABLEHLO_COMPATIBILITY)
    portable = _jax.mlir.serialize_portable_artifact(bytecode, version, False)  # no Shardy: one replica's program
    outputs = _output_names(program)
    if outputs != list(OUTPUTS):
        raise GraphcError(f"xla lowering: the program's outputs are {outputs}, not a step's {list(OUTPUTS)}")
    signature = ProgramSignature(names, [list(a.shape) for a in avals], [np.dtype(a.dtype).name for a in avals],
                                 outputs, [np.dtype(o.dtype).name for o in jax.tree.leaves(lowered.out_info)], samples)
    return LoweredModule(computation.as_serialized_hlo_module_proto(), portable, version), signature


NOISE_OPS = (torch.ops.graphc.sample.default, torch.ops.graphc.verify_drafts.default)
"""The ops that draw from the program's `noise` input."""


def _input_kind(program: ExportedProgram, name: str):
    return next(spec.kind for spec in program.graph_signature.input_specs if spec.arg.name == name)


def _output_names(program: ExportedProgram) -> list[str]:
    """The pool mutation by the input it writes, then the user outputs by position."""
    specs = program.graph_signature.output_specs
    mutated = [s.target for s in specs if s.kind == OutputKind.USER_INPUT_MUTATION]
    return mutated + list(OUTPUTS[len(mutated):])[: sum(s.kind == OutputKind.USER_OUTPUT for s in specs)]
