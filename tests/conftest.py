"""Shared fixtures: the default model file, llama.cpp's reference data (tests/data, see its README)
and the tiny qwen35moe GGUFs that data was computed from, regenerated once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Models load without the compile warm-up (runner.warm_up: ~4 s warm, ~20 s cold per model) unless
# a test asks for it: the suite loads dozens of models, and inherits this into its live servers.
os.environ.setdefault("PANTHEON_WARMUP", "0")

REPO = Path(__file__).resolve().parents[1]
# llama.cpp's recorded outputs; PANTHEON_REFERENCE_DIR may point at another copy with the same layout.
REFERENCE = Path(os.environ.get("PANTHEON_REFERENCE_DIR") or REPO / "tests" / "data")


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    assert REFERENCE.is_dir(), f"reference data not found at {REFERENCE} (set PANTHEON_REFERENCE_DIR)"
    return REFERENCE


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from pantheon.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma 3 270M base, Q4_K_M, from PyPI's chunk wheels (sha256-checked, cached)."""
    from pantheon.default_model import gemma3_270m_path

    return gemma3_270m_path()


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path):
    from pantheon.gguf import open_gguf

    return open_gguf(smollm2_path)


# ---- the tiny qwen35moe reference models (tests/fixtures/reference_qwen35moe.py) ----------------------
@pytest.fixture(scope="session")
def _qwen35moe_models(tmp_path_factory):
    """Writes a reference model into one session folder on first request; returns its path."""
    from tests.fixtures import reference_qwen35moe as ref

    folder = tmp_path_factory.mktemp("qwen35moe_reference")
    weights = []

    def get(name: str) -> Path:
        path = folder / name
        if not path.exists():
            if not weights:
                weights.append(ref.make_weights())
            ref.WRITERS[name](path, weights[0])
        return path

    return get


@pytest.fixture(scope="session")
def qwen35moe_f32_gguf(_qwen35moe_models) -> Path:
    """tiny_qwen35moe_f32.gguf: the F32 file llama.cpp's qwen35moe logits in tests/data come from."""
    from tests.fixtures.reference_qwen35moe import F32_NAME

    return _qwen35moe_models(F32_NAME)


@pytest.fixture(scope="session")
def qwen35moe_q3k_experts_gguf(_qwen35moe_models) -> Path:
    """tiny_qwen35moe_q3k_experts.gguf: its experts Q3_K as llama.cpp's quantizer wrote them."""
    from tests.fixtures.reference_qwen35moe import Q3K_EXPERTS_NAME

    return _qwen35moe_models(Q3K_EXPERTS_NAME)


@pytest.fixture(scope="session")
def qwen35moe_q3_k_m_gguf(_qwen35moe_models) -> Path:
    """tiny_qwen35moe_q3_k_m.gguf: llama.cpp's stock Q3_K_M file of the model."""
    from tests.fixtures.reference_qwen35moe import Q3_K_M_NAME

    return _qwen35moe_models(Q3_K_M_NAME)


# ---- the fast lane ---------------------------------------------------------------------------------------
SLOW_FIXTURES = {"smol_server", "gemma3_path"}  # a real server process; the real Gemma 3 file
# Tests of 1.5 s or more on 2 cores (measured with --durations: ~220 s of the lane's ~370): the full
# suite, which CI and the README run, keeps them; the fast lane leaves them out.
HEAVY = frozenset({
    "tests/engine/test_full_step.py::test_a_kernel_that_cannot_be_lowered_falls_back_to_the_reference[llama]",
    "tests/engine/test_full_step.py::test_full_step_equals_per_layer_programs[llama]",
    "tests/engine/test_scheduler.py::test_a_short_prompt_is_answered_before_a_long_prompt_ahead_of_it_finishes_prefilling",
    "tests/gguf/test_quants.py::test_integer_parts_of_ggml_quantized_samples",
    "tests/model/test_bf16.py::test_qwen35moe_q3k_bf16_within_tolerance_of_f32",
    "tests/model/test_kernel_paths.py::test_planes_path_equals_float32_path",
    "tests/pallas/test_cached_attention.py::test_blocked_matches_the_reference_on_the_rows_slots[1-300-64-64-256-4-2]",
    "tests/test_cli.py::test_generate_refuses_a_model_past_the_host_budget_in_one_line",
    "tests/test_cli.py::test_serve_whose_every_model_fails_to_load_exits_1_with_the_reason",
    "tests/test_cli.py::test_serve_with_a_missing_model_file_exits_2_with_the_path",
    "tests/test_gpu_check.py::test_lower_only_lowers_every_program_for_cuda",
    "tests/web/test_request_limits.py::test_planning_runs_off_the_event_loop",
    "tests/engine/test_admission.py::test_the_estimate_is_what_the_loader_places[qwen35moe-q3_k_m]",
    "tests/engine/test_full_step.py::test_a_kernel_that_cannot_be_lowered_falls_back_to_the_reference[qwen35moe]",
    "tests/engine/test_full_step.py::test_failed_full_step_compile_falls_back_then_heals[qwen35moe]",
    "tests/engine/test_full_step.py::test_full_step_equals_per_layer_programs[qwen35moe]",
    "tests/engine/test_full_step.py::test_sampling_inlined_in_the_full_step_gives_the_same_tokens[llama]",
    "tests/engine/test_full_step.py::test_sampling_inlined_in_the_full_step_gives_the_same_tokens[qwen35moe]",
    "tests/engine/test_full_step.py::test_step_fault_and_host_kv_use_the_per_layer_programs[qwen35moe]",
    "tests/engine/test_hybrid_engine.py::test_scheduler_greedy_reproduces_llamacpp_continuation[s33]",
    "tests/engine/test_hybrid_engine.py::test_scheduler_greedy_reproduces_llamacpp_continuation[s5]",
    "tests/engine/test_profile.py::test_profile_trace_has_prefill_decode_and_sample_spans",
    "tests/engine/test_scheduler.py::test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_prefills",
    "tests/engine/test_sessions.py::test_a_session_moved_to_the_host_exports_the_same_bytes_and_resumes_token_identically[hybrid]",
    "tests/engine/test_warm_up.py::test_warm_up_compiles_what_serving_needs[llama]",
    "tests/engine/test_warm_up.py::test_warm_up_compiles_what_serving_needs[qwen35moe]",
    "tests/engine/test_warm_up.py::test_the_warm_up_hands_what_compiling_freed_back_to_the_os[llama]",
    "tests/engine/test_warm_up.py::test_the_warm_up_hands_what_compiling_freed_back_to_the_os[qwen35moe]",
    "tests/gguf/test_corrupt_files.py::test_corrupt_file_is_refused_with_one_line[template-loops]",
    "tests/gguf/test_corrupt_files.py::test_generate_subprocess_looping_template",
    "tests/model/test_bf16.py::test_qwen35moe_interpreted_kernels_take_bf16_operands",
    "tests/model/test_bf16.py::test_smollm2_bf16_within_tolerance_of_f32",
    "tests/model/test_kernel_paths.py::test_tiny_llama_interpreted_kernels_equal_reference",
    "tests/model/test_kernel_paths.py::test_tiny_qwen35moe_q3k_interpreted_kernels_equal_reference",
    "tests/model/test_llama_vs_llamacpp.py::test_teacher_forced_top1_agrees_on_98_percent_of_all_steps",
    "tests/model/test_llama_vs_llamacpp.py::test_teacher_forced_top1_and_top10_agree_with_llamacpp",
    "tests/model/test_qwen35moe.py::test_q3_k_m_through_the_grouped_q3k_kernel_matches_llamacpp",
    "tests/model/test_synthetic.py::test_real_shaped_specs_and_a_scaled_down_decode",
    "tests/pallas/test_moe_q3k.py::test_moe_ffn_matches_dense_reference[7-512-256-6-3-True-schemes1]",
    "tests/test_cli.py::test_generate_json_greedy_first_token_equals_llamacpp",
    "tests/test_cli.py::test_generate_on_q3k_experts_follows_llamacpp_loosely",
    "tests/test_cli.py::test_generate_tokens_reproduces_llamacpp_greedy_on_the_qwen35moe_references",
    "tests/test_cli.py::test_tokenize_with_and_without_special",
    "tests/test_gpu_check.py::test_tiny_model_run_reports_speed_and_residency",
    "tests/web/test_load_cycles.py::test_load_chat_unload_cycles_leave_resident_memory_flat",
    "tests/web/test_load_cycles.py::test_loads_refused_after_the_weights_were_placed_leave_no_memory_behind",
    "tests/web/test_no_models.py::test_no_models_loaded_is_503_and_health_says_which_load_failed",
    "tests/web/test_request_limits.py::test_a_trickling_body_gets_408_after_the_total_limit",
    "tests/native/test_isa.py::test_the_avx2_build_passes_the_kernel_tests",
    "tests/model/test_gpu_blocks.py::test_dense_matrices_stay_blocks_and_answer_as_the_cpu_path",
    "tests/model/test_gpu_blocks.py::test_routed_q4k_experts_go_through_the_grouped_kernel",
    "tests/model/test_gpu_blocks.py::test_an_untied_head_and_embedding_stay_blocks",
    "tests/model/test_gpu_blocks.py::test_phi3_fused_projections_split_into_blocks",
    "tests/test_gpu_check.py::test_the_kernel_script_runs_the_quantized_products_interpreted",
    "tests/pallas/test_qmatmul.py::test_dense_kernel_matches_the_reference[Q4_0]",
    "tests/pallas/test_qmatmul.py::test_dense_kernel_matches_the_reference[Q5_K]",
})


GPU_MODULES = {"test_lowering.py", "test_gpu_check.py"}  # CUDA lowering and the GPU check's script


def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that starts a real server (through these fixtures or ServerProcess in
    its module), reads a real model, or takes 1.5 s or more (HEAVY): `pytest -m "not slow"` runs the
    rest, in process. `server` marks the ones with a real server process, `gpu` the GPU path's
    (Pallas kernels lowered for CUDA, the GPU check; they run on the CPU)."""
    starts_servers: dict = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in starts_servers:
            starts_servers[path] = "ServerProcess(" in path.read_text(errors="replace")
        fixtures = set(getattr(item, "fixturenames", ()))
        server = starts_servers[path] or "smol_server" in fixtures
        if server:
            item.add_marker(pytest.mark.server)
        if path.name in GPU_MODULES or "lower" in item.name:
            item.add_marker(pytest.mark.gpu)
        if server or SLOW_FIXTURES & fixtures or item.nodeid in HEAVY:
            item.add_marker(pytest.mark.slow)
