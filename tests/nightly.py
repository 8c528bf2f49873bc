"""Tests that run in the nightly tier only (marked `slow` at collection, `conftest.py`): variants of
paths the per-commit tier keeps, each listed with the per-commit test that still covers its path.
Chosen from a clean clone's `--durations` (the first round each took 15 s or more; the second, from
eadb498's run, 2 s or more, counting a compile no per-commit test needs any longer): a 4-rank case
where a 2-rank one stays, a second family or backend where one stays, a second lowering or bucket
set, sampling mode, client run or parameter of the same path. Every id must name a collected test
(`check_listed`), so the list cannot rot."""

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
        "test_one_rank_reuses_cached_prefixes_with_caching_offs_tokens[v4], "
        "test_v4_ranks_give_single_rank_logits_and_tokens[2-2-static]",
    "tests/runtime/test_parallel_serve.py::test_export_ranks_serve_the_single_rank_tokens[2-2-True]":
        "test_export_ranks_serve_the_single_rank_tokens[2-2-False]",
    # Serving against transformers: lora-groups stays; V3.2 through test_v32's compiled tokens, V4 through
    # its compiled tokens against eager (FP4 experts as stored) and its eager tokens against transformers.
    "tests/runtime/test_serve_vs_transformers.py::test_served_tokens_equal_transformers_generate[export-v32]":
        "test_compiled_sparse_model_gives_the_eager_tokens[export]",
    "tests/runtime/test_serve_vs_transformers.py::test_served_tokens_equal_transformers_generate[export-v4]":
        "test_artifacts_store_the_fp8_weights_and_serve_the_eager_tokens[v4-fp4-experts-export], "
        "test_greedy_tokens_match_transformers_generate[v4-graphc], "
        "test_one_rank_reuses_cached_prefixes_with_caching_offs_tokens[v4]",
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
    "tests/runtime/test_logprobs.py::test_cp2_ep2_gives_the_references_logprobs":
        "test_one_rank_gives_the_references_logprobs_greedy_and_sampled, "
        "test_parallel_ranks_give_the_references_prompt_logprobs[cp2-ep2]",
    # The stand-in's executing runs: greedy at one rank stays; sampled, through graphc serve at one rank
    # and at two ranks.
    "tests/runtime/test_neuron_binding.py::test_executing_the_neffs_gives_the_xla_cpu_runners_tokens[sampled]":
        "test_executing_the_neffs_gives_the_xla_cpu_runners_tokens[greedy], "
        "test_graphc_serve_on_the_device_path_gives_graphc_runs_tokens_to_the_openai_client",
    # Clients: GuideLLM at a constant rate stays (the same server, data and assertions, requests overlapping).
    "tests/server/test_clients.py::test_guidellm_benchmarks_with_no_failed_request[kind=synchronous]":
        "test_guidellm_benchmarks_with_no_failed_request[kind=constant,rate=4]",
    # Structured outputs with drafts: a row the leader samples never drafts (Request.needs_logits), held per
    # commit with penalties and with logprobs; the hundred schema outputs stay.
    "tests/runtime/test_constraints.py::test_with_mtp_drafts_a_constrained_row_gives_the_tokens_without_drafts":
        "test_with_mtp_drafts_a_penalised_row_gives_the_tokens_without_drafts, "
        "test_with_mtp_drafts_a_row_asking_for_logprobs_gives_the_tokens_without_drafts",
    # The plan against compiled graphs: cp 2 x ep 2 (ep 1 returns before the MoE), cp with tp, 2 ranks,
    # drafts at cp 2 and the all-to-all at dp 2 stay.
    "tests/tools/test_plan.py::test_collectives_per_step_are_those_of_the_compiled_graphs[wide-16e-1-2-1-local-1]":
        "test_collectives_per_step_are_those_of_the_compiled_graphs[wide-16e-1-2-2-static-1]",
    "tests/tools/test_plan.py::test_collectives_per_step_are_those_of_the_compiled_graphs[wide-16e-1-4-4-static-1]":
        "test_collectives_per_step_are_those_of_the_compiled_graphs[wide-16e-1-2-2-static-1]",
    "tests/tools/test_plan.py::test_collectives_per_step_are_those_of_the_compiled_graphs[v32-sparse-1-2-2-static-1]":
        "test_collectives_per_step_are_those_of_the_compiled_graphs[v32-sparse-1-2-4-static-2]",
    "tests/tools/test_plan.py::test_a_speculative_steps_collectives_are_those_of_the_compiled_graphs[trained-dp-2-1-1-a2a_even]":
        "test_a_speculative_steps_collectives_are_those_of_the_compiled_graphs[trained-prompt_as_decode_small-1-2-1-static], "
        "test_collectives_per_step_are_those_of_the_compiled_graphs[lora-groups-2-1-2-a2a_even-1]",
    "tests/runtime/test_parallel_serve.py::test_graph_structure_and_one_program_per_bucket[4-4-True]":
        "test_graph_structure_and_one_program_per_bucket[2-2-True]",
    "tests/tools/test_device_plan.py::test_a_speculative_step_reads_the_mtp_layer_and_the_head_again_for_each_draft[1]":
        "test_a_speculative_step_reads_the_mtp_layer_and_the_head_again_for_each_draft[2]",
    # Eager ranks: cp 2 x ep 2 holds every collective cp 2 x ep 1 would; Engram's tables over 2 shards.
    "tests/ops/test_parallel_eager.py::test_ranks_give_single_rank_logits_and_tokens[2-1-local]":
        "test_ranks_give_single_rank_logits_and_tokens[2-2-static]",
    "tests/ops/test_parallel_eager.py::test_v4_ranks_give_single_rank_logits_and_tokens[2-1-local]":
        "test_v4_ranks_give_single_rank_logits_and_tokens[2-2-static]",
    "tests/models/deepseek_v41/test_engram.py::test_sharded_tables_equal_one_table_bit_for_bit[1]":
        "test_sharded_tables_equal_one_table_bit_for_bit[2], test_export_serves_the_reference_tokens[1-1]",
    # A second preset of a family: V3.2's sparse preset, V3's lora-groups, direct-q's dense capture stay.
    "tests/models/test_bf16.py::test_bf16_disagreements_are_inside_the_reference_noise_floor[v32]":
        "test_bf16_disagreements_are_inside_the_reference_noise_floor[v32-sparse]",
    "tests/models/test_bf16.py::test_bf16_disagreements_are_inside_the_reference_noise_floor[wide-16e]":
        "test_bf16_disagreements_are_inside_the_reference_noise_floor[lora-groups]",
    "tests/compiler/test_capture.py::test_export_keeps_graphc_ops_as_single_nodes_and_matches_eager[grouped-direct-q-yarn]":
        "test_export_keeps_graphc_ops_as_single_nodes_and_matches_eager[grouped-lora-groups], "
        "test_export_keeps_graphc_ops_as_single_nodes_and_matches_eager[dense-direct-q-yarn]",
    "tests/compiler/test_capture.py::test_export_keeps_graphc_ops_as_single_nodes_and_matches_eager[gather-direct-q-yarn]":
        "test_export_keeps_graphc_ops_as_single_nodes_and_matches_eager[gather-lora-groups], "
        "test_export_keeps_graphc_ops_as_single_nodes_and_matches_eager[dense-direct-q-yarn]",
    # The docs site: .ci/run builds it strictly on every commit; the generated references are checked here.
    "tests/test_docs.py::test_the_site_builds_strictly_with_both_references":
        ".ci/run's mkdocs build --strict, test_the_model_yaml_reference_documents_every_key, "
        "test_the_cli_reference_documents_every_command_and_option, test_the_reference_pages_hold_their_markers",
}
"""Node id -> the per-commit test (or file) that keeps its path."""


def check_listed(collected: set[str]) -> None:
    """Every listed id names a test of a whole-suite collection (a renamed test, or a parameter
    changed, must be listed anew)."""
    missing = sorted(set(NIGHTLY) - collected)
    if missing:
        raise AssertionError(f"tests/nightly.py lists tests that do not exist: {missing}")
