"""profiles/gpu_check.py, the prepared GPU check, on the CPU: `--lower-only` lowers both models'
programs for CUDA (the whole batch-8 decode step with its DeltaNet, attention and grouped Q3_K MoE
Triton kernels; the 512-token prefill layer programs) from abstract Qwen3.5-35B-A3B and SmolLM2
shapes; `--tiny` runs the model part of the script end to end at scaled-down shapes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "profiles" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Triton kernels each lowered program must hold (a nested layer program appears once per module):
# decode step = in-place decode attention + DeltaNet step + grouped Q3_K gate_up and down;
# prefill = flash attention or the two chunked DeltaNet kernels, + the two grouped matmuls.
EXPECTED = {"qwen35moe-35b-a3b-shaped: decode step": 4, "qwen35moe-35b-a3b-shaped: prefill attn_block": 3,
            "qwen35moe-35b-a3b-shaped: prefill ssm_block": 4, "smollm2-135m-shaped: decode step": 1,
            "smollm2-135m-shaped: prefill block": 1}


def test_lower_only_lowers_every_program_for_cuda(tmp_path):
    assert load_script().main(["--lower-only", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check_lower.json").read_text())
    quantized = [r for r in report["lowered"] if "qmatmul" in r["program"]]
    rows = {r["program"].split(",")[0]: r for r in report["lowered"] if r not in quantized}
    assert set(rows) == set(EXPECTED)
    # the dense quantized products of an 8 B-shape Q4_K_M file (5 types, decode and prefill) and Q4_K experts
    assert len(quantized) == 11 and all(r["status"] == "ok" for r in quantized), quantized
    for name, n in EXPECTED.items():
        assert rows[name]["status"] == "ok"
        assert rows[name]["triton_calls"] is None or rows[name]["triton_calls"] >= n, rows[name]
    assert "| qwen35moe-35b-a3b-shaped: decode step" in (tmp_path / "gpu_check_lower.md").read_text()


def test_tiny_model_run_reports_speed_and_residency(tmp_path):
    assert load_script().main(["--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [m["model"] for m in report["models"]] == ["qwen35moe-35b-a3b-shaped", "smollm2-135m-shaped"]
    for m in report["models"]:
        assert m["single"]["tok_s"] > 0 and m["batch8"]["tok_s"] > 0 and m["prefill_tok_s"] > 0
        assert m["graphs"]["failed"] == 0 and m["graphs"]["segment"]["live"] >= 2
        assert m["attention"]["total"] >= 1 and 0 < m["batch8"]["bytes_per_step"]


def test_the_kernel_script_runs_the_quantized_products_interpreted(tmp_path):
    """profiles/gpu_kernels.py's `qmm` group (dense 8 B-shape Q4_K_M products and Q4_K experts,
    timed on a GPU) at its --cpu-smoke shapes: every case runs and matches its reference."""
    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "profiles" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "k.json"
    assert module.main(["--cpu-smoke", "--only", "qmm", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 11 and all(r["status"] == "ok" for r in rows), rows
    assert {r["name"].split()[1] for r in rows if r["name"].startswith("qmatmul ")} == {"Q4_K", "Q6_K", "Q8_0", "Q4_0"}
