"""Lower a rewritten step program (torch.export) to an XLA `HloModuleProto`, through jax.

The program is interpreted node by node (`interpret.py`: the rules of `aten.py` and `graphc_ops.py`,
core-ATen decompositions of ops without one) under `jax.jit`, lowered to StableHLO (its nested
calls inlined: `inline_calls`) and converted to an HLO module: the input neuronx-cc documents
(`--framework XLA`), and one XLA:CPU runs here. The StableHLO is kept too, as a portable artifact
(`LoweredModule.stablehlo`): the module the HLO was converted from, serialized at a version some weeks older than this jaxlib's
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
from jax._src.lib import _jax, jax_mlir_ext, xla_client
from jaxlib.mlir.dialects import stablehlo
from jax.interpreters import mlir
from jax._src.lib.mlir import ir, passmanager
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from graphc.backends.neuron_archive import NOISE, ProgramSignature, parameter_names, program_outputs
from graphc.backends.xla import aten as aten_rules
from graphc.backends.xla import graphc_ops
from graphc.backends.xla.aten import Out
from graphc.backends.xla.interpret import Interpreter, out_of
from graphc.backends.xla.variants import Variant
from graphc.errors import GraphcError
from graphc.step import STEP_INPUTS
from graphc.topology import Topology

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


def _num_blocks(program: ExportedProgram) -> int:
    """The pool's block count the program was captured with (its one symbolic dim's hint)."""
    pool = [n for n in program.graph.nodes if n.op == "placeholder"][-len(STEP_INPUTS) + STEP_INPUTS.index("kv_pool")]
    size = pool.meta["val"].shape[1]
    return size if isinstance(size, int) else int(size.node.shape_env.guarding_hint_or_throw(size.node.expr))


def lower_to_hlo(program: ExportedProgram, topology: Topology,
                 variants: tuple[Variant, ...]) -> tuple[list[LoweredModule], ProgramSignature]:
    """`program`'s module for each of `variants` (in their order), and their signature."""
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
    avals = [out_of(n.meta["val"], num_blocks) for n in user_inputs]
    if samples:
        avals.append(Out(tuple(drawing[0].args[0].meta["val"].shape), jnp.float32))
    lowering = Lowering(topology, variant)
    rules = {**aten_rules.RULES, **{op: (lambda rule: lambda out, *a, **k: rule(lowering, out, *a, **k))(rule)
                                    for op, rule in graphc_ops.RULES.items()}, **variant.rules}
    interpreter = Interpreter(rules, num_blocks)

    def step(*arguments):  # positional, so the module's parameters keep the inputs' order
        inputs = dict(zip(names, arguments))
        lowering.noise = inputs.get(NOISE)
        return interpreter.run_program(program, [inputs[name] for name in names if name != NOISE])

    # The pool is donated: its result aliases its parameter (updated in place on the device).
    lowered = jax.jit(step, donate_argnums=(names.index("kv_pool"),), keep_unused=True).lower(
        *(jax.ShapeDtypeStruct(aval.shape, aval.dtype) for aval in avals))
    module = lowered.compiler_ir("stablehlo")
    with module.context:
        inline_calls(module)
        module.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(32), topology.world)
    bytecode = mlir.module_to_bytecode(module)
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(bytecode, use_tuple_args=False,
                                                                       return_tuple=True)
    version = stablehlo.get_version_from_compatibility_requirement(STABLEHLO_COMPATIBILITY)
    portable = _jax.mlir.serialize_portable_artifact(bytecode, version, False)  # no Shardy: one replica's program
    # The written pool, then the program's own outputs by position: a step's, or a score step's.
    count = 1 + len(program.graph.output_node().args[0])
    outputs = next((list(names) for names in map(program_outputs, ("prefill", "score")) if len(names) == count), None)
    if outputs is None:
        raise GraphcError(f"xla lowering: the program has {count - 1} outputs, not a step's "
                          f"{list(program_outputs('prefill'))[1:]} or a score step's {list(program_outputs('score'))[1:]}")
    signature = ProgramSignature(names, [list(a.shape) for a in avals], [np.dtype(a.dtype).name for a in avals],
                                 outputs, [np.dtype(o.dtype).name for o in jax.tree.leaves(lowered.out_info)], samples)
    return LoweredModule(computation.as_serialized_hlo_module_proto(), portable, version), signature


def inline_calls(module: ir.Module) -> None:
    """Inline every `func.call` of `module` (in place), then drop the functions no longer called.

    jax lowers each nested `jax.jit` (jnp.where, cumsum, silu...) and some primitives' rules to a
    private function and a call, which the HLO keeps as `call` instructions; the Neuron HLO is
    handed over flat, one computation beside the reductions' and sorts' regions (`lint.py` refuses a
    `call`). jaxlib's MLIR has no inliner interface registered for these dialects (the `inline` pass
    leaves the calls), so each call is replaced by its callee's body through jax's own
    `inlined_func_call` (what jax does for the lowering rules that allow it), to a fixpoint:
    inlined bodies may hold calls.
    """
    symbols = ir.SymbolTable(module.operation)
    # Bodies are inlined into an empty scratch block, then moved before their call: finding the new
    # ops at the end of the call's own block costs a walk of that block per call (quadratic).
    holder = ir.Operation.create("func.func", regions=1, loc=ir.Location.unknown(), attributes={
        "sym_name": ir.StringAttr.get("graphc_inline_scratch"),
        "function_type": ir.TypeAttr.get(ir.FunctionType.get([], []))})
    scratch = ir.Block.create_at_start(holder.regions[0], [])
    while True:
        calls = []

        def collect(op):
            if op.name == "func.call":
                calls.append(op)
            return ir.WalkResult.ADVANCE

        module.operation.walk(collect)
        if not calls:
            break
        for call in calls:
            callee = symbols[ir.FlatSymbolRefAttr(call.attributes["callee"]).value]
            with call.location:
                results = jax_mlir_ext.inlined_func_call(callee, list(call.operands), scratch)
            for op in list(scratch.operations):
                op.move_before(call)
            for old, new in zip(call.results, results):
                old.replace_all_uses_with(new)
            call.erase()
    passmanager.PassManager.parse("builtin.module(symbol-dce)").run(module.operation)


NOISE_OPS = (torch.ops.graphc.sample.default, torch.ops.graphc.verify_drafts.default)
"""The ops that draw from the program's `noise` input."""


def _input_kind(program: ExportedProgram, name: str):
    return next(spec.kind for spec in program.graph_signature.input_specs if spec.arg.name == name)
