"""Tests that run in the nightly tier only (marked `slow` at collection, `conftest.py`): variants of
paths the per-commit tier keeps, each listed with the per-commit test that still covers its path.
Chosen from a clean clone's `--durations` (each of these took 15 s or more): a 4-rank case where a
2-rank one stays, a second family or backend where one stays, a second lowering or bucket set of
the same path. Every id must name a collected test (`check_listed`), so the list cannot rot."""

from __future__ import annotations

NIGHTLY: dict[str, str] = {
    # neuron on XLA:CPU: wide-16e at 2x2 against export, and the stand-in's executing runs, stay.
    "tests/backends/test_neuron_backend.py::test_neuron_artifacts_serve_the_export_tokens[v41-1-1-1]":
        "test_neuron_artifacts_serve_the_export_tokens[wide-16e-2-2-1]",
    "tests/backends/test_neuron_backend.py::test_inspect_memory_and_the_device_plan_read_each_programs_buffer_assignment":
        "tests/tools/test_device_plan.py",
    "tests/runtime/test_speculative.py::test_neuron_gives_the_tokens_without_drafts_and_the_sampled_tokens_of_export":
        "test_greedy_tokens_are_the_tokens_without_drafts_and_most_drafts_are_accepted (export)",
    # The stand-in's recording runs: the executing runs assert the same contract.
    "tests/runtime/test_neuron_binding.py::test_one_rank_keeps_the_runtime_contract":
        "test_executing_the_neffs_gives_the_xla_cpu_runners_tokens",
    "tests/runtime/test_neuron_binding.py::test_two_ranks_under_the_launcher_each_take_one_core_as_vnc_0_with_the_root_named":
        "test_executing_two_ranks_with_collectives_gives_the_xla_cpu_runners_tokens",
    "tests/runtime/test_neuron_binding.py::test_a_rank_stuck_loading_names_itself_and_the_job_stops":
        "test_a_runtime_error_status_reaches_the_user_in_one_line_naming_rank_call_and_status",
    # AOTInductor over ranks: the one-rank inductor tests stay.
    "tests/runtime/test_parallel_serve.py::test_inductor_ranks_serve_the_single_rank_tokens[2-2-True-1]":
        "test_export_ranks_serve_the_single_rank_tokens[2-2-False]",
    # Speculative decoding: export MTP at one rank stays (greedy, prefix cache, server).
    "tests/runtime/test_speculative.py::test_v41_drafting_with_dspark_gives_the_tokens_without_drafts":
        "tests/models/deepseek_v41/test_dspark.py",
    "tests/runtime/test_speculative.py::test_two_data_parallel_replicas_give_the_one_rank_tokens_without_drafts":
        "test_greedy_tokens_are_the_tokens_without_drafts_and_most_drafts_are_accepted",
    "tests/runtime/test_speculative.py::test_sampled_tokens_are_distributed_as_without_drafts":
        "test_sampled_tokens_after_a_prefix_cached_by_another_continuation_are_those_without_caching[20]",
    "tests/runtime/test_speculative.py::test_two_by_two_ranks_give_the_one_rank_tokens_without_drafts":
        "test_greedy_tokens_are_the_tokens_without_drafts_and_most_drafts_are_accepted",
    "tests/runtime/test_speculative.py::test_v4_gives_the_tokens_without_drafts":
        "test_greedy_tokens_are_the_tokens_without_drafts_and_most_drafts_are_accepted",
    # V4 / V4.1 over ranks: their one-rank serves and eager 2x2 ranks stay.
    "tests/runtime/test_v41_serve.py::test_export_serves_the_reference_tokens[2-2]":
        "test_export_serves_the_reference_tokens[1-1], test_eager_paged_ranks_equal_the_reference[2-2]",
    "tests/runtime/test_parallel_serve.py::test_v4_export_ranks_serve_the_single_rank_tokens[2-2]":
        "test_served_tokens_equal_transformers_generate[export-v4], test_ranks_give_single_rank_logits_and_tokens",
    "tests/runtime/test_parallel_serve.py::test_export_ranks_serve_the_single_rank_tokens[2-2-True]":
        "test_export_ranks_serve_the_single_rank_tokens[2-2-False]",
    # Serving against transformers: lora-groups and V4 stay; V3.2 through test_v32's compiled tokens.
    "tests/runtime/test_serve_vs_transformers.py::test_served_tokens_equal_transformers_generate[export-v32]":
        "test_compiled_sparse_model_gives_the_eager_tokens[export]",
    "tests/runtime/test_serve_vs_transformers.py::test_served_tokens_equal_transformers_generate[export-direct-q-yarn]":
        "test_served_tokens_equal_transformers_generate[export-lora-groups]",
    "tests/runtime/test_serve_vs_transformers.py::test_served_tokens_equal_transformers_generate[export-wide-16e]":
        "test_served_tokens_equal_transformers_generate[export-lora-groups]",
    "tests/runtime/test_serve_vs_transformers.py::test_served_tokens_equal_transformers_generate[export-yarn-mscale]":
        "test_served_tokens_equal_transformers_generate[export-lora-groups]",
    # The multi-rank launcher: export 2x2 serves, dead ranks, refusals and interrupts stay.
    "tests/runtime/test_multirank_runtime.py::test_kv_pool_override_on_the_launcher_reaches_every_rank":
        "test_a_bad_kv_pool_override_is_refused_before_any_rank_starts, test_kv_block_override_sizes_the_pool_and_keeps_tokens",
    "tests/runtime/test_multirank_runtime.py::test_graphc_run_serves_multi_rank_artifacts_like_one_rank":
        "test_export_ranks_serve_the_single_rank_tokens[2-2-False]",
    "tests/runtime/test_multirank_runtime.py::test_two_jobs_on_one_host_do_not_collide":
        "tests/runtime/test_channel.py",
    "tests/runtime/test_multirank_runtime.py::test_a_dead_rank_stops_the_job_names_itself_and_leaves_no_segment[0]":
        "test_a_dead_rank_stops_the_job_names_itself_and_leaves_no_segment[1]",
    # Data-parallel attention: one lowering stays, and the uneven replicas.
    "tests/runtime/test_data_parallel.py::test_replicas_give_one_ranks_tokens_with_every_lowering[2-1-2-ag_rs]":
        "test_replicas_give_one_ranks_tokens_with_every_lowering[2-1-2-a2a_v]",
    "tests/runtime/test_data_parallel.py::test_replicas_give_one_ranks_tokens_with_every_lowering[2-1-2-a2a_even]":
        "test_replicas_give_one_ranks_tokens_with_every_lowering[2-1-2-a2a_v]",
    "tests/runtime/test_data_parallel.py::test_replicas_give_one_ranks_tokens_with_every_lowering[2-2-4-auto]":
        "test_replicas_give_one_ranks_tokens_with_every_lowering[2-1-2-a2a_v]",
    # Eager ranks at 4: their 2-rank cases stay.
    "tests/ops/test_parallel_eager.py::test_ranks_give_single_rank_logits_and_tokens[4-4-static]":
        "test_ranks_give_single_rank_logits_and_tokens[2-2-static]",
    "tests/ops/test_parallel_eager.py::test_ranks_give_single_rank_logits_and_tokens[4-4-ag_rs]":
        "test_ranks_give_single_rank_logits_and_tokens[2-2-ag_rs]",
    "tests/ops/test_parallel_eager.py::test_ranks_give_single_rank_logits_and_tokens[4-2-static]":
        "test_ranks_give_single_rank_logits_and_tokens[2-2-static]",
    "tests/ops/test_parallel_eager.py::test_v4_ranks_give_single_rank_logits_and_tokens[4-4-static]":
        "test_v4_ranks_give_single_rank_logits_and_tokens[2-2-static]",
    "tests/ops/test_parallel_eager.py::test_tensor_parallel_ranks_give_single_rank_logits_and_tokens[2-1-2-4-a2a_v]":
        "test_tensor_parallel_ranks_give_single_rank_logits_and_tokens[1-1-2-2-static]",
    "tests/models/deepseek_v41/test_engram.py::test_sharded_tables_equal_one_table_bit_for_bit[4]":
        "test_sharded_tables_equal_one_table_bit_for_bit[2]",
    "tests/models/deepseek_v3/test_v32.py::test_context_parallel_top_k_and_tokens_equal_one_rank[4-2]":
        "test_context_parallel_top_k_and_tokens_equal_one_rank[2-2]",
    "tests/models/deepseek_v3/test_v32.py::test_compiled_ranks_serve_the_eager_tokens":
        "test_context_parallel_top_k_and_tokens_equal_one_rank[2-2], test_compiled_sparse_model_gives_the_eager_tokens",
    # Jobs across hosts: the 2x1 run, a lost host and refusals stay.
    "tests/runtime/test_multihost.py::test_a_job_over_hosts_gives_one_ranks_tokens[v3-dp2-cp2-ep4-2x2]":
        "test_a_job_over_hosts_gives_one_ranks_tokens[v3-cp2-ep2-2x1]",
    "tests/runtime/test_prefix_cache_serving.py::test_cp_and_ep_ranks_reuse_cached_prefixes_with_caching_offs_tokens[v4]":
        "test_cp_and_ep_ranks_reuse_cached_prefixes_with_caching_offs_tokens[lora-groups]",
    # Weights as stored, numerics floors, shapes-only and the plan: one case of each stays.
    "tests/weights/test_weights_as_stored.py::test_artifacts_store_the_fp8_weights_and_serve_the_eager_tokens[lora-groups-neuron]":
        "test_artifacts_store_the_fp8_weights_and_serve_the_eager_tokens[lora-groups-export]",
    "tests/models/test_bf16.py::test_bf16_disagreements_are_inside_the_reference_noise_floor[v4]":
        "test_bf16_disagreements_are_inside_the_reference_noise_floor[lora-groups]",
    "tests/tools/test_compare.py::test_bf16_tensor_parallel_artifacts_stay_inside_the_floor":
        "test_multi_rank_fp32_artifacts_match_every_golden_token",
    "tests/compiler/test_shapes_only.py::test_a_two_layer_slice_of_the_released_v3_compiles_at_its_real_width[neuron]":
        "test_a_two_layer_slice_of_the_released_v3_compiles_at_its_real_width[export]",
    "tests/tools/test_plan.py::test_collectives_per_step_are_those_of_the_compiled_graphs[v41-1-1-2-static-2]":
        "test_collectives_per_step_are_those_of_the_compiled_graphs[v4-1-1-2-static-2]",
    "tests/tools/test_plan.py::test_collectives_per_step_are_those_of_the_compiled_graphs[v41-1-2-2-ag_rs-1]":
        "test_collectives_per_step_are_those_of_the_compiled_graphs[v4-1-1-2-static-2]",
    "tests/tools/test_sweep.py::test_sweep_passes_and_every_bucket_ran_at_every_topology":
        ".ci/run's sweep of examples/tiny.yaml at 1x1 and 1x1x2x2",
    "tests/models/test_moe_forms.py::test_each_bucket_runs_the_form_its_manifest_names[auto]":
        "test_each_bucket_runs_the_form_its_manifest_names[dense]",
    "tests/passes/test_inline_int64_kernels.py::test_the_ngram_hash_is_inlined_with_the_same_outputs[bucket1]":
        "test_the_ngram_hash_is_inlined_with_the_same_outputs[bucket0]",
    # Prompt scores: export and neuron at one rank, and cp 2 x ep 2, stay.
    "tests/runtime/test_prompt_logprobs.py::test_prompt_logprobs_are_the_references_and_leave_the_tokens_as_they_were[inductor]":
        "test_prompt_logprobs_are_the_references_and_leave_the_tokens_as_they_were[export]",
    "tests/runtime/test_prompt_logprobs.py::test_parallel_ranks_give_the_references_prompt_logprobs[tp2]":
        "test_parallel_ranks_give_the_references_prompt_logprobs[cp2-ep2]",
}
"""Node id -> the per-commit test (or file) that keeps its path."""


def check_listed(collected: set[str]) -> None:
    """Every listed id names a test of a whole-suite collection (a renamed test, or a parameter
    changed, must be listed anew)."""
    missing = sorted(set(NIGHTLY) - collected)
    if missing:
        raise AssertionError(f"tests/nightly.py lists tests that do not exist: {missing}")
