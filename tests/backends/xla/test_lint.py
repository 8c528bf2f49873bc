"""The Neuron-variant lint: clean modules pass, and each forbidden construct is caught and named."""

from __future__ import annotations

import pytest
from jax._src.lib import xla_client

from graphc.backends.xla.lint import LintError, check_neuron_module, lint_neuron_module
from graphc.topology import Topology

TOPOLOGY = Topology(cp=4, ep=2)

CLEAN = """HloModule step, input_output_alias={ {0}: (0, {}, may-alias) }

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

less {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  i = s32[] parameter(2)
  j = s32[] parameter(3)
  ROOT lt = pred[] compare(x, y), direction=LT
}

set_s32 {
  old = s32[] parameter(0)
  ROOT new = s32[] parameter(1)
}

ENTRY main {
  pool = f32[4,8]{1,0} parameter(0)
  ids = s32[4]{0} parameter(1)
  summed = f32[4,8]{1,0} all-reduce(pool), replica_groups={{0,1},{2,3}}, to_apply=add
  gathered = f32[16,8]{1,0} all-gather(summed), replica_groups={{0,1,2,3}}, dimensions={0}
  iota = s32[4,8]{1,0} iota(), iota_dimension=1
  sorted = (f32[4,8]{1,0}, s32[4,8]{1,0}) sort(summed, iota), dimensions={1}, is_stable=true, to_apply=less
  values = f32[4,8]{1,0} get-tuple-element(sorted), index=0
  topk = (f32[4,2]{1,0}, u32[4,2]{1,0}) custom-call(values), custom_call_target="AwsNeuronTopK", backend_config="2"
  pos = s32[4,1]{1,0} iota(), iota_dimension=0
  written = s32[4]{0} scatter(ids, pos, ids), update_window_dims={}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=set_s32
  rows = f32[4,8]{1,0} gather(summed, pos), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
  ROOT out = (f32[4,8]{1,0}, f32[16,8]{1,0}) tuple(values, gathered)
}
"""


def _proto(text: str) -> bytes:
    return xla_client._xla.hlo_module_from_text(text).as_serialized_hlo_module_proto()


def test_a_clean_module_passes():
    assert lint_neuron_module(_proto(CLEAN), TOPOLOGY, pool_parameter=0) == []
    check_neuron_module(_proto(CLEAN), TOPOLOGY, 0)


BREAKS = {
    "64-bit integer value": ("ids = s32[4]{0} parameter(1)", "ids = s64[4]{0} parameter(1)"),
    "f8e4m3fn value": ("ids = s32[4]{0} parameter(1)", "ids = s32[4]{0} parameter(1)\n  w = f8e4m3fn[4,8]{1,0} parameter(2)"),
    "variadic reduce": ("ROOT out = ", "m = f32[] constant(0)\n  z = s32[] constant(0)\n"
                        "  r = (f32[4]{0}, s32[4]{0}) reduce(values, iota, m, z), dimensions={1}, to_apply=pick\n"
                        "  ROOT out = "),
    "forbidden instruction while": ("ROOT out = ", "z = s32[] constant(0)\n  w = s32[] while(z), condition=cond, body=body\n"
                                    "  ROOT out = "),
    "forbidden instruction rng": ("ROOT out = ", "lo = f32[] constant(0)\n  hi = f32[] constant(1)\n"
                                  "  noise = f32[4,8]{1,0} rng(lo, hi), distribution=rng_uniform\n  ROOT out = "),
    "forbidden instruction conditional": ("ROOT out = ", "p = pred[] constant(true)\n  z = f32[] constant(0)\n"
                                          "  c = f32[] conditional(p, z, z), true_computation=neg, false_computation=neg\n"
                                          "  ROOT out = "),
    "forbidden instruction call": ("ROOT out = ", "n = f32[4,8]{1,0} call(values), to_apply=neg48\n  ROOT out = "),
    "integer scatter with a combiner (NCC_EVRF060)": ("to_apply=set_s32", "to_apply=add_s32"),
    "integer dot (NCC_EVRF035)": ("ROOT out = ", "m = s32[4,8]{1,0} convert(values)\n"
                                  "  d = s32[4,4]{1,0} dot(m, m), lhs_contracting_dims={1}, rhs_contracting_dims={1}\n"
                                  "  ROOT out = "),
    "integer all-reduce (NCC_EVRF061)": ("ROOT out = ", "isum = s32[4]{0} all-reduce(ids), replica_groups={{0,1},{2,3}}, "
                                         "to_apply=add_s32\n  ROOT out = "),
    "integer reduce-scatter (NCC_EVRF061)": ("ROOT out = ", "rs = s32[2]{0} reduce-scatter(ids), replica_groups={{0,1},{2,3}}, "
                                             "dimensions={0}, to_apply=add_s32\n  ROOT out = "),
    "shift-right-arithmetic on other than 32-bit values (NCC_EVRF022)": (
        "ROOT out = ", "h = s16[4]{0} convert(ids)\n  sh = s16[4]{0} shift-right-arithmetic(h, h)\n  ROOT out = "),
    "beyond the operand's dimension of 4 (NCC_EVRF031)": ("pos = s32[4,1]{1,0} iota(), iota_dimension=0\n",
                                                          "pos = s32[4,1]{1,0} iota(), iota_dimension=0\n"
                                                          "  far = s32[10]{0} iota(), iota_dimension=0\n"
                                                          "  farther = s32[10,1]{1,0} reshape(far)\n"
                                                          "  g = f32[10,8]{1,0} gather(summed, farther), offset_dims={1}, "
                                                          "collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, "
                                                          "slice_sizes={1,8}\n"),
    "custom-call target not recognised": ('custom_call_target="AwsNeuronTopK"', 'custom_call_target="Sharding"'),
    "sort comparator not an LT/LE/GT/GE compare": ("direction=LT", "direction=NE"),
    "dynamic shape": ("ids = s32[4]{0} parameter(1)", "ids = s32[<=4]{0} parameter(1)"),
    "is not aliased": ("input_output_alias={ {0}: (0, {}, may-alias) }", "input_output_alias={ {0}: (1, {}, may-alias) }"),
    "replica groups are not the topology's": ("replica_groups={{0,1},{2,3}}", "replica_groups={{0,2},{1,3}}"),
}
NEGATE = """
neg {
  a = f32[] parameter(0)
  ROOT n = f32[] negate(a)
}

neg48 {
  a = f32[4,8]{1,0} parameter(0)
  ROOT n = f32[4,8]{1,0} negate(a)
}
"""
ADD_S32 = """
add_s32 {
  a = s32[] parameter(0)
  b = s32[] parameter(1)
  ROOT s = s32[] add(a, b)
}
"""
EXTRA_COMPUTATIONS = {
    "forbidden instruction conditional": NEGATE,
    "forbidden instruction call": NEGATE,
    "integer scatter with a combiner (NCC_EVRF060)": ADD_S32,
    "integer all-reduce (NCC_EVRF061)": ADD_S32,
    "integer reduce-scatter (NCC_EVRF061)": ADD_S32,
    "variadic reduce": """
pick {
  a = f32[] parameter(0)
  i = s32[] parameter(1)
  b = f32[] parameter(2)
  j = s32[] parameter(3)
  gt = pred[] compare(a, b), direction=GT
  v = f32[] select(gt, a, b)
  k = s32[] select(gt, i, j)
  ROOT t = (f32[], s32[]) tuple(v, k)
}
""",
    "forbidden instruction while": """
cond {
  c = s32[] parameter(0)
  limit = s32[] constant(3)
  ROOT lt = pred[] compare(c, limit), direction=LT
}

body {
  c = s32[] parameter(0)
  one = s32[] constant(1)
  ROOT n = s32[] add(c, one)
}
""",
}


@pytest.mark.parametrize("rule", list(BREAKS))
def test_each_forbidden_construct_is_caught_and_named(rule):
    old, new = BREAKS[rule]
    text = CLEAN.replace(old, new).replace("\nENTRY main", EXTRA_COMPUTATIONS.get(rule, "") + "\nENTRY main")
    problems = lint_neuron_module(_proto(text), TOPOLOGY, pool_parameter=0)
    assert len(problems) == 1 and rule in problems[0], problems
    with pytest.raises(LintError, match="breaks 1 rule"):
        check_neuron_module(_proto(text), TOPOLOGY, 0)


def test_tensor_parallel_groups_are_the_topologys_and_cp_groups_stride_over_them():
    """At cp = tp = 2 the tp groups are consecutive ranks and the cp groups every other one: both
    pass, and groups of neither kind are caught."""
    topology = Topology(cp=2, ep=4, dp=1, tp=2)
    tp_groups = CLEAN  # {{0,1},{2,3}}: the tp groups
    cp_groups = CLEAN.replace("replica_groups={{0,1},{2,3}}", "replica_groups={{0,2},{1,3}}")
    assert lint_neuron_module(_proto(tp_groups), topology, pool_parameter=0) == []
    assert lint_neuron_module(_proto(cp_groups), topology, pool_parameter=0) == []
    neither = CLEAN.replace("replica_groups={{0,1},{2,3}}", "replica_groups={{0,3},{1,2}}")
    [problem] = lint_neuron_module(_proto(neither), topology, pool_parameter=0)
    assert "replica groups are not the topology's" in problem


def test_nested_jax_calls_are_inlined():
    """jnp.where and cumsum lower to a function and a call each (cumsum's with a call of its own
    inside): `inline_calls` leaves one flat computation (the values: the neuron backend's tokens,
    test_neuron_backend.py)."""
    import jax
    import jax.numpy as jnp
    from jax.interpreters import mlir

    from graphc.backends.xla.lower import inline_calls

    def f(x, y):
        return jnp.where(x > 0, jnp.cumsum(y), x)

    x, y = jnp.array([1, -2, 3, -4], jnp.int32), jnp.array([5, 6, 7, 8], jnp.int32)
    module = jax.jit(f).lower(x, y).compiler_ir("stablehlo")
    with module.context:
        inline_calls(module)
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(mlir.module_to_bytecode(module),
                                                                        use_tuple_args=False, return_tuple=True)
    text = computation.as_hlo_text()
    assert " call(" not in text and "func.call" not in str(module) and " reduce-window(" in text
    [problem] = lint_neuron_module(computation.as_serialized_hlo_module_proto(), TOPOLOGY, 0)
    assert problem.startswith("the KV pool")  # this toy module has no pool: nothing else breaks a rule


@pytest.mark.compiles
@pytest.mark.parametrize("preset, buckets, cp, ep", [
    ("lora-groups", "prompt_as_decode_small", 1, 1),  # every bucket kind; the MoE's grouped form counts routes
    pytest.param("wide-16e", "small", 2, 2, marks=pytest.mark.multirank),  # the collectives, the experts over ep
    ("v41", "small", 1, 1),  # V4.1: hash routing, Engram's 64-bit hash in 32-bit halves
])
def test_the_tiny_presets_neuron_programs_pass_the_lint(preset, buckets, cp, ep, compiled):
    """Every rule holds of real programs: no nested `call` (inlined before serialization), the
    MoE's per-expert counts no integer scatter-add (NCC_EVRF060), no other documented rejection."""
    import zipfile

    from graphc.artifacts.directory import read_manifest
    from graphc.backends.xla.lint import lint_archives, module_text

    artifacts = compiled(preset, "neuron", buckets, cp, ep)
    manifest = read_manifest(artifacts)
    assert lint_archives(artifacts, manifest) == []
    for graph in manifest.ranks[0].graphs:
        with zipfile.ZipFile(artifacts / graph.file) as archive:
            text = module_text(archive.read("neuron.hlo.pb"))
        assert " call(" not in text and " conditional(" not in text, graph.bucket.name
