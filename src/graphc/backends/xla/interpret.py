"""Evaluate a step program's graph with jax values, node by node, as torch.export captured it.

The program is not decomposed to core ATen first: `ExportedProgram.run_decompositions()` retraces
the whole program through AOT autograd, which was 55-60 % of a tiny program's lowering and takes
minutes at DeepSeek-V3's 61 layers. Instead each node's rule (`aten.py`, `graphc_ops.py`) is
looked up, and a node whose op has none is decomposed alone (`make_fx` over storage-less tensors of
its arguments' static shapes, with torch's core-ATen decompositions), the small graph evaluated the
same way and kept for every node of the same signature (a trace costs ~50 ms: the ops step
programs hold have rules of their own, which a test keeps so).

The captured graph is not functional: `graphc::kv_write` writes the `kv_pool` input in place, and
the layers read the pool through views taken after their write. Here a write rebinds the pool to
its new value, so a view taken later reads it; a read through a view taken *before* a later write
would see the old value where torch sees the new one, so such a graph is refused, as is any other
op that writes its input (`check_writes`). The written pool is the program's first output (donated,
updated in place).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from torch._decomp import core_aten_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.proxy_tensor import make_fx

from graphc.backends.xla import aten as aten_rules
from graphc.backends.xla.aten import IGNORED, Out
from graphc.errors import GraphcError

JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
              torch.int64: jnp.int32, torch.int32: jnp.int32, torch.bool: jnp.bool_,
              torch.float8_e4m3fn: aten_rules.FP8_BITS, torch.int8: jnp.int8}
"""torch dtype -> the dtype its values take in the lowered program (no int64: the programs run
without jax's x64 mode and neuronx-cc wants int32 indices; float8_e4m3fn as its bits: see
`aten.FP8_BITS`; int8 the bytes of an FP4 weight, `weights/fp4.py`)."""

KV_WRITE = torch.ops.graphc.kv_write.default
"""The one op that writes an input: the KV pool, in place."""
_DECOMPOSITIONS = core_aten_decompositions()


def static_size(size, num_blocks: int) -> int:
    """A size with the pool's block count (the one symbol any size has) set to `num_blocks`."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    return int(expr.xreplace({symbol: num_blocks for symbol in expr.free_symbols}))


def out_of(value, num_blocks: int) -> Out | tuple | None:
    """A node's `Out` (or a tuple of them) from its fake value, sizes static."""
    if isinstance(value, torch.Tensor):
        return Out(tuple(static_size(size, num_blocks) for size in value.shape), JAX_DTYPES[value.dtype])
    if isinstance(value, (tuple, list)):
        return tuple(out_of(v, num_blocks) for v in value)
    return None


def _cast(result, out):
    if isinstance(out, Out) and result is not None:
        return jnp.asarray(result).astype(out.dtype)
    if isinstance(out, tuple) and isinstance(result, (tuple, list)):
        return tuple(_cast(r, o) for r, o in zip(result, out))
    return result


class Interpreter:
    """Evaluates graphs with `rules` (op -> rule(out, *args, **kwargs)), decomposing ops that
    have none; `num_blocks` fixes the pool's symbolic block count."""

    def __init__(self, rules: dict, num_blocks: int):
        self.rules, self.num_blocks = rules, num_blocks
        self._decomposed: dict[tuple, torch.fx.GraphModule] = {}

    def run_program(self, program: ExportedProgram, user_inputs) -> tuple:
        """`program`'s outputs for its user inputs (flat, in order): the written pool first, then
        the program's own outputs."""
        inputs, env = iter(user_inputs), {}
        kinds = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
        pools = {node.args[0] for node in program.graph.nodes if node.target is KV_WRITE}
        if len(pools) != 1:
            raise GraphcError(f"xla lowering: a step writes one KV pool; this program writes {len(pools)}")
        [pool] = pools
        for node in program.graph.nodes:
            if node.op != "placeholder":
                continue
            spec = kinds[node.name]
            if spec.kind == InputKind.USER_INPUT:
                env[node] = next(inputs)
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.BUFFER):
                constant = program.constants.get(spec.target, program.state_dict.get(spec.target))
                env[node] = jnp.asarray(constant.detach().numpy(), dtype=JAX_DTYPES[constant.dtype])
            else:
                raise GraphcError(f"xla lowering: input {node.name} of kind {spec.kind.name} is not supported")
        check_writes(program.graph, pool)
        outputs = self.run_graph(program.graph, env)
        return (env[pool], *outputs)

    def run_graph(self, graph: torch.fx.Graph, env: dict):
        """Evaluate `graph`'s call_function nodes into `env` (placeholders already bound); its output."""
        for node in graph.nodes:
            if node.op == "call_function":
                self._evaluate(node, env)
            elif node.op == "output":
                return _value(node.args[0], env)
        raise GraphcError("xla lowering: the graph has no output")

    def _evaluate(self, node: torch.fx.Node, env: dict) -> None:
        if node.target in IGNORED:
            return
        args, kwargs = _value(node.args, env), _value(node.kwargs, env)
        if node.target is KV_WRITE:  # in place: later readers of the pool see the written one
            _, env[node.args[0]] = self.rules[KV_WRITE](None, *args, **kwargs)
            env[node] = None
            return
        out = out_of(node.meta.get("val"), self.num_blocks)
        rule = self.rules.get(node.target)
        result = rule(out, *args, **kwargs) if rule is not None else self._run_decomposed(node, env)
        env[node] = _cast(result, out)

    def _run_decomposed(self, node: torch.fx.Node, env: dict):
        """`node`'s op traced into core ATen on storage-less tensors of its arguments' shapes, then evaluated."""
        if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "aten":
            raise GraphcError(f"xla lowering: no rule for {node.target} (node {node.name}); "
                              "add one to graphc/backends/xla")
        inputs = node.all_input_nodes
        tensors = [n for n in inputs if isinstance(n.meta.get("val"), torch.Tensor)]
        fixed = {n: env[n] for n in inputs if n not in tensors}  # sizes: plain ints here
        with FakeTensorMode():  # CPU tensors with no storage: ops that copy trace as they would run
            fakes = [torch.empty(tuple(static_size(s, self.num_blocks) for s in t.meta["val"].shape),
                                 dtype=t.meta["val"].dtype) for t in tensors]
        named = {**fixed, **{t: f"<tensor {i}>" for i, t in enumerate(tensors)}}
        key = (node.target, tuple((f.shape, f.dtype) for f in fakes), repr(_value(node.args, named)),
               repr(_value(node.kwargs, named)))
        if key not in self._decomposed:
            def call(*placeholders):
                bound = {**fixed, **dict(zip(tensors, placeholders))}
                return node.target(*_value(node.args, bound), **_value(node.kwargs, bound))

            traced = make_fx(call, decomposition_table=_DECOMPOSITIONS, tracing_mode="fake")(*fakes)
            if any(n.op == "call_function" and n.target is node.target for n in traced.graph.nodes):
                raise GraphcError(f"xla lowering: no rule for {node.target} (node {node.name}) and no core-ATen "
                                  "decomposition; add one to graphc/backends/xla")
            self._decomposed[key] = traced
        traced = self._decomposed[key]
        placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        return self.run_graph(traced.graph, {p: env[t] for p, t in zip(placeholders, tensors)})


def _value(arg, env: dict):
    if isinstance(arg, torch.fx.Node):
        return env[arg]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_value(a, env) for a in arg)
    if isinstance(arg, dict):
        return {key: _value(a, env) for key, a in arg.items()}
    return arg


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


METADATA_WRITES = frozenset({torch.ops.aten.detach_.default})
"""In-place ops that change no value (a constant's `detach_`): evaluated as their input."""


def check_writes(graph: torch.fx.Graph, pool: torch.fx.Node) -> None:
    """Refuse a graph that writes anything but the pool, or reads the pool through a view taken
    before a later write of it (see the module docstring): each read must see what torch sees."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.target not in (KV_WRITE, *METADATA_WRITES) and schema is not None and schema.is_mutable:
            raise GraphcError(f"xla lowering: {node.name} ({node.target}) writes its input in place; only "
                              "graphc::kv_write may")
    order = {node: index for index, node in enumerate(graph.nodes)}
    writes = sorted(order[user] for user in pool.users if user.target is KV_WRITE)
    for view in (user for user in pool.users if user.target is not KV_WRITE):
        taken, pending = order[view], [view]
        while pending:
            current = pending.pop()
            for user in current.users:
                if _is_view(user):
                    pending.append(user)
                elif any(taken < write < order[user] for write in writes):
                    raise GraphcError(f"xla lowering: {user.name} reads the KV pool through {view.name}, taken "
                                      "before a later write of the pool; take the view after the write")
