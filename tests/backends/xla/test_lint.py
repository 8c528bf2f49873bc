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

ENTRY main {
  pool = f32[4,8]{1,0} parameter(0)
  ids = s32[4]{0} parameter(1)
  summed = f32[4,8]{1,0} all-reduce(pool), replica_groups={{0,1},{2,3}}, to_apply=add
  gathered = f32[16,8]{1,0} all-gather(summed), replica_groups={{0,1,2,3}}, dimensions={0}
  iota = s32[4,8]{1,0} iota(), iota_dimension=1
  sorted = (f32[4,8]{1,0}, s32[4,8]{1,0}) sort(summed, iota), dimensions={1}, is_stable=true, to_apply=less
  values = f32[4,8]{1,0} get-tuple-element(sorted), index=0
  topk = (f32[4,2]{1,0}, u32[4,2]{1,0}) custom-call(values), custom_call_target="AwsNeuronTopK", backend_config="2"
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
    "custom-call target not recognised": ('custom_call_target="AwsNeuronTopK"', 'custom_call_target="Sharding"'),
    "sort comparator not an LT/LE/GT/GE compare": ("direction=LT", "direction=NE"),
    "dynamic shape": ("ids = s32[4]{0} parameter(1)", "ids = s32[<=4]{0} parameter(1)"),
    "is not aliased": ("input_output_alias={ {0}: (0, {}, may-alias) }", "input_output_alias={ {0}: (1, {}, may-alias) }"),
    "replica groups are not the topology's": ("replica_groups={{0,1},{2,3}}", "replica_groups={{0,2},{1,3}}"),
}
EXTRA_COMPUTATIONS = {
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
