"""Tests run on 8 virtual CPU devices; this must happen before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # see experiments/__init__.py
# Test programs are small: compiling dominates (three quarters of a module's time), and
# LLVM's optimization passes cost more than they save (test_layouts: 93 s instead of
# about 170 s on 2 cores). It sets LLVM's level only: every HLO, collective and memory
# check passes unchanged. XLA:CPU's LLVM IR emitters (--xla_cpu_use_fusion_emitters=false)
# compile its fusions a third faster than the MLIR fusion emitters (the suite: about 12
# instead of 21 min). They fuse and round differently: the equalities of Newton-Schulz
# results hold to its round-off bound (helpers.ns_roundoff), not to a fixed 1e-5.
# A collective waits for every device thread of its program. With two test processes
# on 2 cores (pytest.ini_options: -n 2) a thread can lag past XLA:CPU's 40 s before it
# calls the collective, which aborts the process: the tests wait 5 min instead (a
# deadlock, collectives started in different orders, still ends the process).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_backend_optimization_level=0",
                                    "--xla_cpu_use_fusion_emitters=false",
                                    "--xla_cpu_collective_call_terminate_timeout_seconds=300",
                                    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
                                    ]).strip()

# One compile cache for the whole run, empty at its start: the modules, the two test
# processes and the CLI runs they start compile many of the same programs (a tiny GPT's
# step under a layout), and each is compiled once per run, not once per module (1.5 min
# of the suite's 40 min of CPU). Programs that compile in under a second are not kept
# (JAX's default; keeping those from 0.1 s cost more CPU than it saved). Read back, an
# executable gives the same HLO text, memory and cost analysis (tests/test_hlo.py).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:   # the first process; its children inherit
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jmegatron-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import ast  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402


def _without_collections(parse):
    """``ast.parse`` that holds garbage collection off while it runs (see below)."""
    @functools.wraps(parse)
    def wrapped(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return parse(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return wrapped


# CPython before 3.11.8 keeps the AST constructor's recursion depth in state that all
# threads share (gh-106905). A collection inside ast.parse runs Python code (jax's gc
# callback at every collection, finalizers), where the GIL can pass to another thread;
# if that thread parses too (formatting a traceback does, and so do inspect.getsource
# and inspect.signature), the first parse fails: "SystemError: AST constructor
# recursion depth mismatch". tyro parses the config classes' module at every command
# line it reads (inspect.getsource), and the tests leave orbax and TensorStore threads
# behind: with a thread formatting tracebacks alongside, 7 of 100 parses of the
# trainer's flags failed so. With no collection inside a parse no other thread runs there.
if sys.version_info < (3, 11, 8):
    ast.parse = _without_collections(ast.parse)


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """One small run trained by the CLI (6 steps, checkpoints at 2, 4 and 6), shared by
    the modules that damage, continue or guard copies of it."""
    from cli_runs import RUN, main
    base = tmp_path_factory.mktemp("trained")
    assert main(*RUN, "--out-dir", str(base), "--name", "run") is None
    return base / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run folder, in ``tmp_path/runs/run``."""
    copy = tmp_path / "runs" / "run"
    shutil.copytree(trained, copy)
    return copy


# The quick tier (``python -m pytest -m quick``, under 3 minutes on 2 cores): for the
# edit-test loop, a fast representative test of each module; one equality with one
# device per layout, one float64 reference per optimizer, one CLI run, the docs'
# parse. Names as pytest prints them after the module's "::". Every module has one
# but test_optimizer_comparison, whose one test trains three optimizers (a minute).
QUICK = {
    "test_auto_layout.py": ["test_auto_skips_what_a_layout_refuses_and_says_why"],
    "test_checkpoint.py": ["test_restore_onto_another_mesh_or_layout[fsdp_to_replicated]"],
    "test_combinations.py": ["test_every_pair_trains_in_a_run_or_is_listed_with_its_refusal"],
    "test_compute_model.py": ["test_wave_efficiency_by_hand"],
    "test_context.py": ["test_attention_over_a_split_sequence_equals_one_device[ring-4-zigzag]"],
    "test_context_parallel.py": ["test_a_split_sequence_equals_one_device[ring-zigzag-dense-tensor]"],
    "test_data.py": ["test_user_corpora"],
    "test_dion2.py": ["test_equals_the_reference_in_float64[muon_quintic]"],
    "test_docs.py": ["test_commands_parse[README.md]", "test_links_resolve[README.md]"],
    "test_docstrings.py": ["test_public_api_documents_every_argument"],
    "test_family_layouts.py": [
        "test_three_steps_equal_one_device_with_tensor_parallelism[muon_family-layerwise]"],
    "test_gpt.py": ["test_param_count_matches_the_model"],
    "test_hf.py": ["test_a_bfloat16_checkpoint_loads"],
    "test_hlo.py": ["test_every_kind_is_found_with_its_axes"],
    "test_import.py": ["test_the_quick_tier_names_a_test_of_every_module_that_exists"],
    "test_inputs.py": ["test_export_replace_reads_the_checkpoint_before_deleting"],
    "test_layouts.py": [f"test_three_steps_equal_one_device[tensor2-{name}]"
                        for name in ("replicated", "layerwise", "fsdp", "owner")],
    "test_loss.py": ["test_vocab_parallel_equals_dense[mesh_config2]"],
    "test_mesh.py": ["test_minus_one_takes_the_rest"],
    "test_moe.py": ["test_router_output_and_losses_equal_the_reference[option0]"],
    "test_multihost.py": ["test_an_unreachable_coordinator_is_one_clear_error_in_bound"],
    "test_muon.py": ["test_update_equations_by_hand"],
    "test_muon_bp.py": ["test_three_steps_equal_the_float64_reference[fsdp8]"],
    "test_muon_family.py": ["test_equals_its_equations_in_float64[mop_spectral_nesterov]"],
    "test_newton_schulz.py": ["test_ns_flops_matches_xla_cost_analysis[64-256-5]"],
    "test_nordion2.py": ["test_equals_the_reference_in_float64"],
    "test_optax_baseline.py": ["test_first_step_matches_jmegatron_muon[shape-simple]"],
    "test_optim_args.py": ["test_a_non_float_matrix_leaf_is_refused_at_init[int32-soap]"],
    "test_pipeline.py": ["test_three_steps_equal_one_device[stage4_data2_replicated]"],
    "test_plan.py": ["test_user_chain_is_placed_stepped_and_checkpointed[multi_transform-fsdp]"],
    "test_prefetch.py": ["test_prefetched_gradients_equal_one_device[4]"],
    "test_products.py": ["test_the_weight_gradient_is_the_fp32_product[einsum]"],
    "test_project_scale.py": ["test_pipeline_settings_selection"],
    "test_qk_clip.py": ["test_the_gqa_rule_by_hand"],
    "test_rekls.py": ["test_equals_the_equations_step_by_step[one-sided-wide]"],
    "test_reliability.py": ["test_the_stop_message_gives_the_command_that_continues"],
    "test_rules.py": ["test_check_divisible_names_the_numbers"],
    "test_run_folder.py": ["test_run_names_stay_inside_the_out_dir[a/b]"],
    "test_soap.py": ["test_equals_the_papers_algorithm_step_by_step[one-sided-tall]"],
    "test_syrk.py": ["test_close_on_random_inputs[float32]"],
    "test_tensor_parallel.py": ["test_vocab_parallel_embedding_is_one_all_reduce"],
    "test_tensor_parallel_ns.py": ["test_blockwise_is_newton_schulz_of_each_block[out]"],
    "test_train.py": ["test_cli_runs_three_steps_and_writes_every_output"],
    "test_wire_dtype.py": ["test_layerwise_keeps_a_bf16_models_masters_on_their_owners[bfloat16]"],
}


# The modules that take longest, longest first (seconds on 2 cores at 48c3117): the two
# test processes take a module at a time (pytest.ini_options: --dist loadfile, with
# --no-loadscope-reorder, which would order the modules by their count of tests), so
# starting with these ends the two within a short module of each other (the run ended
# 31 s after half its total work; 61 s in the order by count).
LONGEST_FIRST = ("test_pipeline.py",       # 540
                 "test_docs.py",           # 480
                 "test_checkpoint.py",     # 165
                 "test_layouts.py",        # 160
                 "test_gpu_scripts.py",    # 125
                 "test_moe.py", "test_reliability.py", "test_plan.py")   # 85-95 each


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("::", 1)[-1] in QUICK.get(item.path.name, ()):
            item.add_marker(pytest.mark.quick)
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))   # stable
