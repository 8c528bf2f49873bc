"""The routed experts' three forms: the choice rule, the two ops they add, their numerics against
the dense reference (one rank and expert-parallel shards), and compiled graphs that compute the
form their manifest names."""

from __future__ import annotations

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from graphc.artifacts.directory import read_manifest
from graphc.compiler.pipeline import CompileOptions, compile
from graphc.config import load_config
from graphc.weights.checkpoint import load_model
from graphc.models.moe_forms import (BLOCK_SIZES, MOE_FORMS, contributes_shared_partial, expert_blocks, grouped_block,
                                      local_rows_bound, moe_form_for, shared_experts_reduced_with_routed, step_moe_form)
from graphc.weights.tiny import PRESETS
from graphc.ops.moe import expert_routes, expert_routes_reference, grouped_mm
from graphc.runtime.paged import BlockAllocator, SequenceBlocks, step_metadata
from support import model_yaml

# --- the rule ---------------------------------------------------------------------------------------


@given(st.integers(1, 4096), st.integers(1, 16), st.integers(1, 512))
def test_the_rule_gathers_while_routes_are_at_most_the_local_experts(rows, per_token, local):
    assert moe_form_for(rows, per_token, local) == ("gather" if rows * per_token <= local else "grouped")
    # Where the gather is not fused into its products (the export backend), only a single row gathers.
    unfused = "gather" if rows == 1 and per_token <= local else "grouped"
    assert moe_form_for(rows, per_token, local, fuses_gather=False) == unfused


def test_a_step_counts_the_rows_that_reach_the_ranks_experts():
    # 8 tokens, 2 experts each, 16 experts over ep = 2: 8 local.
    assert step_moe_form("auto", 4, 2, 16, 2, "static") == "gather"  # 4 rows x 2 <= 8
    for lowering in ("ag_rs", "a2a_even", "a2a_v"):
        assert step_moe_form("auto", 4, 2, 16, 2, lowering) == "grouped"  # dispatched: 8 rows x 2 > 8
    assert step_moe_form("auto", 4, 2, 16, 1, "local") == "gather"  # ep 1 dispatches nothing
    assert step_moe_form("auto", 4, 2, 16, 1, "local", fuses_gather=False) == "grouped"
    for form in MOE_FORMS:  # a fixed choice is kept whatever the size
        assert step_moe_form(form, 1000, 8, 16, 1, "local") == form


# --- the ops ----------------------------------------------------------------------------------------


def test_expert_routes_renumber_this_shards_routes_and_zero_the_others():
    ids = torch.tensor([[0, 3], [4, 7], [2, 5]])
    weights = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    local, local_weights = expert_routes(ids, weights, 8, torch.tensor(1, dtype=torch.int32), 2)  # shard 1 of 2: experts 4..7
    assert local.tolist() == [[4, 4], [0, 3], [4, 1]]  # 4 = E': another shard's expert
    assert torch.equal(local_weights, torch.tensor([[0.0, 0.0], [0.3, 0.4], [0.0, 0.6]]))
    same, same_weights = expert_routes(ids, weights, 8)
    assert torch.equal(same, ids) and torch.equal(same_weights, weights)


@pytest.mark.parametrize("dtype, width", [(torch.float32, 8), (torch.float32, 5), (torch.float64, 8)])
def test_grouped_mm_multiplies_each_row_by_its_experts_matrix_and_zeroes_unheld_routes(dtype, width):
    """fp32 with 16-byte-multiple widths runs ATen's kernel; float64 or a width of 5 the loop."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(4, 8, width, generator=generator, dtype=dtype)  # [E', D, F]
    expert_of_row = [0, 0, 2, 2, 2, 3]  # expert 1 has no rows; two rows belong to no local expert
    rows = torch.randn(8, 8, generator=generator, dtype=dtype)
    offsets = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    out = grouped_mm(rows, weights, offsets)
    expected = torch.stack([rows[i] @ weights[e] for i, e in enumerate(expert_of_row)])
    torch.testing.assert_close(out[:6], expected)
    assert torch.equal(out[6:], torch.zeros(2, width, dtype=dtype))  # ATen leaves them uninitialised


# --- numerics against the dense form ----------------------------------------------------------------


def _prefill_and_decode(model, moe_form, prompt_length=20):
    """Logits of a 20-token prefill then one decode step of a 4-row batch (three padding rows)."""
    allocator = BlockAllocator(16)
    seq = SequenceBlocks(8)
    seq.reserve(prompt_length + 1, allocator)
    pool = model.new_kv_pool(16, 8)
    prompt = [(5 * i + 7) % (model.args.vocab_size - 2) + 2 for i in range(prompt_length)]
    with torch.no_grad():
        ids, positions, table, slots, last = step_metadata([(seq, prompt, 0)], width=prompt_length, blocks_per_row=4)
        prefill = model(ids, positions, table, slots, pool, last, moe_form=moe_form)
        token = int(prefill.argmax(-1))
        ids, positions, table, slots, last = step_metadata([(seq, [token], prompt_length)], width=1, blocks_per_row=4,
                                                           total_rows=4)
        decode = model(ids, positions, table, slots, pool, last, moe_form=moe_form)
    return prefill, decode[:1]


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "v32"])  # v41: weighed before the down projection
@pytest.mark.parametrize("moe_form", ["gather", "grouped"])
def test_sparse_forms_give_the_dense_forms_logits(preset, moe_form, tiny_checkpoints):
    model = load_model(tiny_checkpoints[preset])
    for sparse, dense in zip(_prefill_and_decode(model, moe_form), _prefill_and_decode(model, "dense")):
        assert ((sparse - dense).abs().max() / dense.abs().max()).item() < 1e-5


@pytest.mark.parametrize("moe_form", MOE_FORMS)
def test_expert_parallel_shards_sum_to_the_whole(moe_form, tiny_checkpoints):
    """wide-16e's 16 experts over 4 ranks: each rank computes its own routes only; the shards'
    outputs add up to one rank's (what the all-reduce or reduce-scatter does)."""
    path = tiny_checkpoints["wide-16e"]
    whole = load_model(path).model.layers[0].mlp
    tokens = torch.randn(6, whole.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    weights, ids = whole.gate(tokens)
    with torch.no_grad():
        expected = whole.experts(tokens, weights, ids, "dense")
        shards = [load_model(path, experts=range(4 * r, 4 * r + 4)).model.layers[0].mlp.experts(
            tokens, *reversed(expert_routes_reference(ids, weights, 16, r, 4)), moe_form) for r in range(4)]
    assert all(s.abs().max() > 0 for s in shards)  # every rank holds some of the routes
    torch.testing.assert_close(sum(shards), expected, rtol=1e-5, atol=1e-6)


# --- compiled graphs compute the form their manifest names ------------------------------------------


def _routed_form_of(program, weight_names: list[str]) -> str:
    """The form a compiled graph computes, read from what consumes the first MoE layer's fused
    expert weights (graph inputs in `weight_names` order): gathered by id, grouped-multiplied,
    or multiplied whole."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    weight = placeholders[program.graph_signature.user_inputs[weight_names.index("model.layers.1.mlp.experts.gate_up_proj")]]
    reached, frontier = set(), list(weight.users)
    while frontier:  # through views (transpose, reshape) to the op that reads the values
        node = frontier.pop()
        reached.add(node.target)
        if node.target in (torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.view.default,
                           torch.ops.aten.reshape.default, torch.ops.aten.expand.default):
            frontier += node.users
    if torch.ops.aten.index.Tensor in reached:
        return "gather"
    return "grouped" if torch.ops.graphc.grouped_mm.default in reached else "dense"


@pytest.mark.compiles
@pytest.mark.parametrize("choice", ["auto", "dense"])
def test_each_bucket_runs_the_form_its_manifest_names(choice, tmp_path, tiny_checkpoints):
    config = model_yaml(tiny_checkpoints["lora-groups"], {"prefill": [8], "decode": [1, 4, 8], "prompt_as_decode": 0,
                                                          "context_limit": 64})
    config["model"]["moe_form"] = choice
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "artifacts"
    compile(load_config(tmp_path / "model.yaml"), out, CompileOptions(show_progress=False, workers=1))
    rank = read_manifest(out).ranks[0]
    graphs = rank.graphs
    named = {f"{g.kind}-{g.size}": g.moe_form for g in graphs}
    # 8 experts, 2 per token: gather while rows x 2 <= 8 where the gather fuses; the export backend's
    # does not, so only the one-row step gathers.
    expected = {"prefill-8": "grouped", "decode-1": "gather", "decode-4": "grouped", "decode-8": "grouped"}
    assert named == (expected if choice == "auto" else dict.fromkeys(expected, "dense"))
    for g in graphs:
        assert _routed_form_of(torch.export.load(str(out / g.file)), rank.weight_names) == g.moe_form, g


def test_the_grouped_gemms_form_is_the_cheaper_by_the_step_models_cost():
    """Blocks of B rows: ceil(L / B) + E' - 1 of them bound every split of L rows over E' experts;
    memory-bound calls read as few matrices as blocks allow, compute-bound ones pad the fewest rows."""
    for counts in ([7, 0, 0, 0], [1, 1, 1, 4], [2, 2, 2, 1], [0, 0, 0, 0]):
        for block in BLOCK_SIZES[:4]:
            assert sum(-(-c // block) for c in counts) <= expert_blocks(7, 4, block)
    matrix, row = 7168 * 4096 * 2, 2 * 7168 * 4096
    # Decode, 1 token of K = 8 at E' = 4 (memory-bound): 4 blocks of 4, today's 4 reads at half the rows.
    assert grouped_block(local_rows_bound(1, 8, 4), 8, 4, matrix, row, 725e9, 166.75e12) == 4
    # Batch 64 at E' = 4: the cheapest of every form (here blocks of 256: 4 reads, 1024 rows, where
    # expert-major computes 4 x 512 and blocks of 128 read 5 matrices).
    local = local_rows_bound(64, 8, 4)
    block = grouped_block(local, 512, 4, matrix, row, 725e9, 166.75e12)
    priced = {b: max(expert_blocks(local, 4, b) * matrix / 725e9, expert_blocks(local, 4, b) * b * row / 166.75e12)
              for b in BLOCK_SIZES}
    assert block == 256 and priced[block] == min(priced.values()) < max(4 * matrix / 725e9, 4 * 512 * row / 166.75e12)
    # Two experts, every row possibly local: blocks read no fewer matrices nor compute fewer rows;
    # on a tie expert-major (no gathered matrices) is kept.
    assert grouped_block(64, 64, 2, matrix, row, 1e9, 1e18) == 0


def test_one_cp_coordinate_of_each_ep_group_adds_the_shared_experts():
    """ep = 4 over tp = 2 (cp coordinates 0-1 and 2-3 form the groups): coordinates 0 and 2."""
    assert [bool(contributes_shared_partial(c, 4, 2)) for c in range(4)] == [True, False, True, False]
    assert all(contributes_shared_partial(c, 2, 2) for c in range(4))  # ep = tp: every rank adds its own slice
    assert shared_experts_reduced_with_routed("static", 4, 2) and not shared_experts_reduced_with_routed("static", 2, 4)
    assert not shared_experts_reduced_with_routed("ag_rs", 4, 2) and not shared_experts_reduced_with_routed("static", 4, 1)
