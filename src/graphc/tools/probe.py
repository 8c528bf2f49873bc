"""`graphc probe`: where does the compiled model start to differ from the reference?

One decoder layer is captured on its own (a prefill of the probe prompt, on one rank: collectives
are identities there; what a topology changes is `graphc sweep`'s to check) and run twice, op by
op:

- the **reference**: the captured graph, before any graphc pass, in float64, with every graphc op
  running its reference kernel at reference numerics (sparse attention's P in full precision);
- the **compiled** graph: the same capture after the passes the backend's compile runs, in the
  model's dtype and configured numerics.

Each compiled op is fed the reference's values of its inputs (cast to the dtypes the compiled
graph has there), so its difference from the reference op is its own, not inherited from
earlier ops. Ops are paired by node name (an op a pass inlined is paired through the node it
replaced). The first op whose output differs by more than the tolerance (max |diff| over the
reference's largest magnitude) is reported with where it comes from, and whether it sits at a
known rounding point: bf16 P in sparse attention, bf16 routed-expert partials, a cast to a
narrower float. Layers whose weights the checkpoint stores as FP8 are named too: their
quantisation happened offline and is dequantised exactly on load, so it is in the weights both
sides read, not in any op.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import Tensor

from graphc.buckets.selection import Bucket
from graphc.models.layers import RoutedExperts
from graphc.models.step_model import Parallelism, StepInputs, StepModel
from graphc.passes.graph import graphc_op, op_argument
from graphc.passes.manager import PassContext, PassManager
from graphc.step import POOL_BLOCKS_DIM, ceil_div
from graphc.topology import Topology

REFERENCE_DTYPE = torch.float64
DEFAULT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 4e-3}
"""Per model dtype: a few units of the dtype's rounding, relative to the op's largest magnitude
(fp32 matmuls over small dims drift ~1e-7; one bf16 rounding is up to 2**-8 of the value)."""


class LayerStep(torch.nn.Module):
    """One decoder layer of one prefill step, its weights as an input (as `capture.StepGraph`)."""

    def __init__(self, model: StepModel, layer: int):
        super().__init__()
        self._layer = [model.model.layers[layer]]  # a list: not registered, so weights stay inputs
        self.weight_names = [n for n, _ in self._layer[0].named_parameters()]

    def forward(self, weights: list[Tensor], x, cos, sin, positions, block_table, slot_mapping, kv_pool, input_ids):
        step = StepInputs(positions, block_table, slot_mapping, kv_pool, Parallelism(), input_ids=input_ids)
        return torch.func.functional_call(self._layer[0], dict(zip(self.weight_names, weights)), (x, cos, sin, step))


@dataclass(frozen=True)
class OpDifference:
    node: str
    """The compiled graph's node name."""
    op: str
    """Its target (an ATen overload, or a graphc op)."""
    source: str
    """The model source line that produced it (and the graphc op it was inlined from)."""
    max_abs: float
    """max |compiled - reference| over the output; for integer outputs, entries that differ."""
    relative: float
    """max_abs over the reference's largest magnitude (1 per differing entry for integers)."""
    rounding_point: str | None
    """The known rounding point it sits at, if any."""


@dataclass
class ProbeReport:
    layer: int
    dtype: torch.dtype
    tolerance: float
    tokens: int
    compared: int = 0
    first: OpDifference | None = None
    rounding_points: list[OpDifference] = field(default_factory=list)
    fp8_weights: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"probe: layer {self.layer}, a prefill of {self.tokens} tokens, {str(self.dtype).removeprefix('torch.')}; "
               f"reference: the captured layer in float64 at reference numerics",
               f"compared {self.compared} ops; tolerance {self.tolerance:g} (max |diff| / max |reference|)"]
        if self.first is None:
            out.append("no op differs beyond the tolerance")
        else:
            f = self.first
            out += [f"first op beyond the tolerance: {f.node} ({f.op})",
                    f"  from {f.source}",
                    f"  max |diff| {f.max_abs:.3g}, relative {f.relative:.3g}",
                    f"  known rounding point: {f.rounding_point or 'no'}"]
        by_kind: dict[str, list[OpDifference]] = {}
        for point in self.rounding_points:
            by_kind.setdefault(point.rounding_point, []).append(point)
        for kind, points in by_kind.items():
            worst = max(points, key=lambda p: p.relative)
            out.append(f"known rounding point, {kind}: {len(points)} op(s), largest relative {worst.relative:.3g} "
                       f"({worst.node})")
        if self.fp8_weights:
            out.append(f"FP8 weights (quantised offline, dequantised exactly on load): {', '.join(self.fp8_weights)}")
        return out


def capture_layer(model: StepModel, layer: int, tokens: list[int], block_size: int) -> tuple:
    """Export layer `layer` for a prefill of `tokens` from position 0, and the inputs it sees.

    Returns:
        (ExportedProgram, its flat user inputs) with the layer's input hidden states computed by
        the eager model's embedding and earlier layers.
    """
    width = len(tokens)
    blocks = ceil_div(width, block_size)
    ids = torch.tensor([tokens])
    positions = torch.arange(width)[None]
    block_table = torch.arange(blocks)[None]
    slot_mapping = torch.arange(width)[None]
    kv_pool = model.new_kv_pool(blocks + 1, block_size)  # one spare block: the pool's size is symbolic
    with torch.no_grad():
        x = model.embed(ids)
        step = StepInputs(positions, block_table, slot_mapping, kv_pool, Parallelism(), input_ids=ids)
        for index, earlier in enumerate(model.model.layers[:layer]):
            x = earlier(x, *model.layer_rope(index, positions, x.dtype), step)
        cos, sin = model.layer_rope(layer, positions, x.dtype)
        wrapper = LayerStep(model, layer)
        weights = [dict(model.model.layers[layer].named_parameters())[n] for n in wrapper.weight_names]
        inputs = (weights, x, cos, sin, positions, block_table, slot_mapping, kv_pool.clone(), ids)
        dynamic = [[None] * len(weights), None, None, None, None, None, None, {POOL_BLOCKS_DIM: torch.export.Dim("n", min=2)},
                   None]
        program = torch.export.export(wrapper, inputs, dynamic_shapes=dynamic)
    return program, [*weights, *inputs[1:]]


def compile_layer(program, passes, bucket: Bucket, blocks_per_row: int):
    """A copy of `program` after the backend's passes that apply to a layer, as `graphc compile`
    runs them (`passes`: `graphc.passes.registry.layer_passes` of the backend)."""
    from graphc.compiler.pipeline import copy_program

    compiled = copy_program(program)
    manager = PassManager(passes, verifier=lambda gm, ctx: None)
    manager.run(compiled.graph_module, PassContext(Topology(1, 1), bucket, blocks_per_row))
    return compiled


def _placeholder_values(program, user_inputs: list) -> list:
    values, user = [], iter(user_inputs)
    for spec in program.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            values.append(next(user))
        elif spec.kind.name in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
            values.append(program.constants[spec.target])
        else:
            values.append(program.state_dict[spec.target])
    return values


def _to_reference(value):
    """float64 for floating tensors and dtypes; everything else as it is."""
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.to(REFERENCE_DTYPE)
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return REFERENCE_DTYPE
    if isinstance(value, (list, tuple)):
        return type(value)(_to_reference(v) for v in value)
    return value


def _reference_arguments(node: torch.fx.Node, env: dict) -> tuple[tuple, dict]:
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
    args, kwargs = _to_reference(args), {k: _to_reference(v) for k, v in kwargs.items()}
    if graphc_op(node) == "graphc::sparse_mla_attention":  # the reference's numerics: P in fp32
        index = [a.name for a in node.target._schema.arguments].index("bf16_probabilities")
        if index < len(args):
            args = (*args[:index], False, *args[index + 1:])
        else:
            kwargs["bf16_probabilities"] = False
    return args, kwargs


def run_reference(program, inputs: list) -> dict:
    """Every node's value, the captured graph evaluated in float64 (name -> value)."""
    env = {}
    for node, value in zip((n for n in program.graph.nodes if n.op == "placeholder"), _placeholder_values(program, inputs)):
        env[node.name] = _to_reference(value.clone() if isinstance(value, Tensor) else value)
    for node in program.graph.nodes:
        if node.op == "call_function":
            args, kwargs = _reference_arguments(node, env)
            env[node.name] = node.target(*args, **kwargs)
    return env


@functools.cache
def _source_lines(function) -> tuple[str, range]:
    """The file and line numbers of `function`'s source (read once)."""
    lines, start = inspect.getsourcelines(function)
    return inspect.getsourcefile(function), range(start, start + len(lines))


def _within(node: torch.fx.Node, function) -> bool:
    """Whether the model source line that produced `node` lies in `function`."""
    file, lines = _source_lines(function)
    trace = node.meta.get("stack_trace") or ""
    return any(f'File "{file}", line {n},' in trace for n in lines)


def _rounding_point(node: torch.fx.Node, reference_nodes: dict, dtype: torch.dtype) -> str | None:
    partner = reference_nodes.get(node.meta.get("graphc_replaces", node.name))
    if partner is not None and partner.target is operator.getitem:
        op = partner.args[0]
        if graphc_op(op) == "graphc::sparse_mla_attention" and op_argument(op, "bf16_probabilities"):
            return "bf16 P in sparse attention"
    if dtype != torch.float32 and _within(node, RoutedExperts.forward):
        return f"{str(dtype).removeprefix('torch.')} routed-expert partials"
    value = node.meta.get("val")
    if node.target in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and isinstance(value, Tensor) \
            and value.dtype in (torch.bfloat16, torch.float16):
        return f"cast to {str(value.dtype).removeprefix('torch.')}"
    return None


FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n\s*(?P<code>.*)')


def _source(node: torch.fx.Node) -> str:
    """`file:line (function): code` of the innermost model frame (the file relative to the graphc
    package: every family has a `model.py`), and the op it was inlined from."""
    frames = list(FRAME.finditer(node.meta.get("stack_trace") or ""))
    if frames:
        f = frames[-1]
        where = f"{f['file'].rsplit('/graphc/', 1)[-1]}:{f['line']} ({f['function']}): {f['code'].strip()}"
    else:
        where = "(no source recorded)"
    inlined = node.meta.get("graphc_inlined_from")
    return where + (f" [inlined from {inlined}]" if inlined else "")


def _difference(compiled: Tensor, reference: Tensor) -> tuple[float, float]:
    if not compiled.is_floating_point():
        differing = int((compiled != reference).sum())
        return float(differing), float(differing)
    compiled = compiled.to(REFERENCE_DTYPE)
    # Equal infinities (masked scores) differ by nothing; a NaN either side differs infinitely.
    diff = torch.where(compiled == reference, 0.0, (compiled - reference).abs()).nan_to_num(nan=float("inf"))
    finite = reference[reference.isfinite()].abs()
    scale = finite.max().item() if finite.numel() else 0.0
    worst = diff.max().item() if diff.numel() else 0.0
    return worst, worst / scale if scale > 0 else worst


def compare(compiled_program, reference_program, reference_env: dict, inputs: list,
            report: ProbeReport) -> ProbeReport:
    """Run `compiled_program` op by op on the reference's inputs; fill `report` (its dtype and
    tolerance say what the compiled side runs in and what counts)."""
    reference_nodes = {n.name: n for n in reference_program.graph.nodes}
    own: dict = {}
    placeholders = [n for n in compiled_program.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, _placeholder_values(compiled_program, inputs)):
        own[node.name] = value.clone() if isinstance(value, Tensor) else value

    def value_of(n: torch.fx.Node):
        partner = n.meta.get("graphc_replaces", n.name)
        if partner in reference_env and n.op != "placeholder":
            reference = reference_env[partner]
            want = n.meta.get("val")
            if isinstance(reference, Tensor) and isinstance(want, Tensor):
                return reference.to(want.dtype)
        return own[n.name]

    for node in compiled_program.graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value_of)
        own[node.name] = out = node.target(*args, **kwargs)
        partner = node.meta.get("graphc_replaces", node.name)
        reference = reference_env.get(partner)
        if not isinstance(out, Tensor) or not isinstance(reference, Tensor):
            continue  # tuples (their getitems are compared), and ops that return nothing
        report.compared += 1
        max_abs, relative = _difference(out, reference)
        point = _rounding_point(node, reference_nodes, report.dtype)
        found = OpDifference(node.name, str(node.target), _source(node), max_abs, relative, point)
        if point and relative > 0:
            report.rounding_points.append(found)
        if relative > report.tolerance and report.first is None:
            report.first = found
    return report


def probe_prompt(length: int, vocab_size: int) -> list[int]:
    """A deterministic prompt of `length` token ids spread over the vocabulary."""
    return [(7 * i + 3) % (vocab_size - 2) + 2 for i in range(length)]


def probe(config, layer: int, tokens: int | None = None, tolerance: float | None = None) -> ProbeReport:
    """Probe decoder layer `layer` of the model `config` describes, on its backend's passes.

    Args:
        config: a loaded `GraphcConfig`.
        layer: which decoder layer, 0-based.
        tokens: the probe prefill's length; default the largest prefill bucket.
        tolerance: relative difference that counts; default per model dtype (DEFAULT_TOLERANCE).

    Raises:
        GraphcError: `layer` or `tokens` out of range.
    """
    from graphc.errors import GraphcError
    from graphc.weights.checkpoint import fp8_tensors, load_model
    from graphc.passes.registry import layer_passes

    if config.family.support.probe_refusal is not None:
        raise GraphcError(config.family.support.probe_refusal)
    dtype = getattr(torch, config.model.dtype)
    model = load_model(config.model.checkpoint, dtype=dtype, sparse_probabilities=config.model.sparse_probabilities)
    layers = model.args.num_hidden_layers
    if not 0 <= layer < layers:
        raise GraphcError(f"--layer {layer}: the model has {layers} decoder layers; choose 0..{layers - 1}")
    length = tokens or max(config.buckets.prefill)
    if not 1 <= length <= config.buckets.context_limit:
        raise GraphcError(f"--tokens {length}: must be in 1..buckets.context_limit ({config.buckets.context_limit})")
    block_size = config.kv_cache.block_size
    program, inputs = capture_layer(model, layer, probe_prompt(length, model.args.vocab_size), block_size)
    compiled = compile_layer(program, layer_passes(config.backend), Bucket("prefill", length), ceil_div(length, block_size))
    prefix = f"model.layers.{layer}."
    report = ProbeReport(layer, dtype, tolerance if tolerance is not None else DEFAULT_TOLERANCE[dtype], length,
                         fp8_weights=[n.removeprefix(prefix) for n in fp8_tensors(config.model.checkpoint)
                                      if n.startswith(prefix)])
    return compare(compiled, program, run_reference(program, inputs), inputs, report)
