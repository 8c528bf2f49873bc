"""verify_bucket_shapes: accepts the captured bucket, names the input that does not match."""

from __future__ import annotations

import pytest

from graphc.buckets.selection import Bucket
from graphc.passes.manager import GraphInvariantError, op_counts
from graphc.passes.verify_bucket_shapes import verify_bucket_shapes
from support import captured
from passes_support import context


def test_accepts_the_bucket_it_was_captured_for_and_changes_nothing(tiny_checkpoints):
    bucket = Bucket("decode", 4)
    _, program = captured(tiny_checkpoints["lora-groups"], bucket)
    counts, code = op_counts(program.graph_module), program.graph_module.code
    result = verify_bucket_shapes(program.graph_module, context(bucket))
    assert not result.modified
    assert op_counts(result.graph_module) == counts and result.graph_module.code == code


@pytest.mark.parametrize("claimed, message", [
    (Bucket("decode", 2), r"input_ids has shape \(4, 1\), bucket decode-2 needs \(2, 1\)"),
    (Bucket("prefill", 4), r"input_ids has shape \(4, 1\), bucket prefill-4 needs \(1, 4\)"),
])
def test_rejects_a_graph_captured_for_another_bucket(tiny_checkpoints, claimed, message):
    _, program = captured(tiny_checkpoints["lora-groups"], Bucket("decode", 4))
    with pytest.raises(GraphInvariantError, match=message):
        verify_bucket_shapes(program.graph_module, context(claimed))
