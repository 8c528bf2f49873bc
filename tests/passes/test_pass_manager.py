"""The pass manager: order, logging, stamping, verification between passes, failures, dumps."""

from __future__ import annotations

import pytest
import torch

from graphc.buckets.selection import Bucket
from graphc.errors import GraphcError
from graphc.passes.manager import GraphInvariantError, PassFailure, PassManager, PassResult
from graphc.passes.registry import PIPELINE, check_pass_names
from graphc.passes.verifier import verify

SPECIALISE = [(entry.name, entry.run) for entry in PIPELINE if entry.run is not None]
"""Every rewrite of the pipeline, whatever the backend."""
from support import GENERIC_MOE, captured
from passes_support import context

BUCKET = Bucket("decode", 1)


def _add_unused_neg(gm, ctx):
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(first):
        gm.graph.call_function(torch.ops.aten.neg.default, (first,))
    return PassResult(gm, True)


def _fail(gm, ctx):
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    raise GraphInvariantError("deliberate", node)


def _break_shapes(gm, ctx):
    # A symbolic size not derived from the pool's block count: the verifier must catch it.
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    fake_mode = next(n for n in gm.graph.nodes if n.name == "kv_pool").meta["val"].fake_mode
    with fake_mode:
        node.meta["val"] = torch.empty(fake_mode.shape_env.create_unbacked_symint(), 3)
    return PassResult(gm, True)


def test_runs_the_pipeline_logs_op_count_changes_and_stamps_new_nodes(tiny_checkpoints):
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    passes = [("add_neg", _add_unused_neg), *SPECIALISE]
    log = PassManager(passes, verify).run(program.graph_module, context(BUCKET))
    assert [name for name, *_ in log.entries] == ["add_neg", *(n for n, _ in SPECIALISE)]
    changes = dict(line.split(": ", 1) for line in log.changes())
    assert changes["add_neg"] == "aten::neg +1"
    assert changes["verify_bucket_shapes"] == "no change"
    assert changes["lower_trivial_collectives"] == (
        "graphc::attention_combine -3, graphc::moe_combine -2, graphc::moe_dispatch -2")
    # It also sweeps getitems nobody reads (e.g. the attention's unused log-sum-exp).
    assert changes["dead_code_elimination"].startswith("aten::neg -1, getitem -")


def test_new_nodes_carry_the_name_of_the_pass_that_made_them(tiny_checkpoints):
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    PassManager([("add_neg", _add_unused_neg)], verify).run(program.graph_module, context(BUCKET))
    neg = next(n for n in program.graph_module.graph.nodes if n.target == torch.ops.aten.neg.default)
    assert neg.meta["graphc_pass"] == "add_neg"


def test_a_failing_pass_is_named_with_the_passes_before_it_and_the_node(tiny_checkpoints):
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    manager = PassManager([SPECIALISE[0], ("explode", _fail)], verify)
    with pytest.raises(PassFailure, match=r"pass explode failed \(after verify_bucket_shapes; decode-1\): "
                                          r"deliberate \(node unbind: "):
        manager.run(program.graph_module, context(BUCKET))


def test_the_verifier_runs_between_passes(tiny_checkpoints):
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    with pytest.raises(PassFailure, match=r"pass break_shapes the graph it produced fails verification .*not derived from the kv_pool"):
        PassManager([("break_shapes", _break_shapes)], verify).run(program.graph_module, context(BUCKET))
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    PassManager([("break_shapes", _break_shapes)], verify, verify=False).run(program.graph_module, context(BUCKET))


def test_disabled_passes_are_skipped_and_unknown_names_refused(tiny_checkpoints):
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    log = PassManager(SPECIALISE, verify, disabled=frozenset({"lower_trivial_collectives"})).run(
        program.graph_module, context(BUCKET))
    assert "lower_trivial_collectives" not in [name for name, *_ in log.entries]
    with pytest.raises(GraphcError, match=r"--disable-pass nope: no such pass; passes: static_moe, verify_bucket_shapes, "):
        check_pass_names({"nope"})
    check_pass_names({"static_moe", "lower_matvecs"})  # capture choices and backend-specific passes are names too


def test_dumps_the_graph_before_and_after_every_pass(tiny_checkpoints, tmp_path):
    _, program = captured(tiny_checkpoints["lora-groups"], BUCKET, GENERIC_MOE)
    PassManager(SPECIALISE, verify, dump_dir=tmp_path).run(program.graph_module, context(BUCKET))
    dumped = sorted(p.name for p in (tmp_path / "decode-1").iterdir())
    assert dumped == ["00-capture.py"] + [f"{i:02d}-{name}.py" for i, (name, _) in enumerate(SPECIALISE, start=1)]
    assert "moe_dispatch" in (tmp_path / "decode-1" / "00-capture.py").read_text()
    assert "moe_dispatch" not in (tmp_path / "decode-1" / dumped[-1]).read_text()
