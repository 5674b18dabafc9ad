#!/usr/bin/env python3
"""The one prepared GPU check: Pantheon's kernels and a Qwen3.5-35B-A3B-shaped model on one GPU.

    python3 profiles/gpu_check.py [--out profiles/out] [--budget-s 420]   # on the GPU (<= 8 min on an H200)
    python3 profiles/gpu_check.py --lower-only                            # on any CPU (CI)

On a GPU it writes `gpu_check.json` and `gpu_check.md` under --out:
1. kernels: every Pallas kernel compiled at Qwen3.5-35B-A3B's shapes against its jnp reference,
   max error and times (profiles/gpu_kernels.py, bounded by a share of --budget-s);
2. models: a random-weight Qwen3.5-35B-A3B-shaped model (40 layers, Q3_K experts in blocks, bf16
   elsewhere: pantheon/model/synthetic.py, built in device memory — no 15 GB file) and a
   SmolLM2-135M-shaped one, each decoding through the real runner (ModelRunner, its graph registry
   and full-step programs): prefill tok/s of a 4k prompt, single-stream and batch-8 decode tok/s,
   host time per step (the Python side enqueuing a step, measured apart from the device wait), and
   the fraction of the HBM floor (the bytes a step must read / --hbm-tbps, against the measured
   step time);
3. the `graphs` and `attention` residency objects after the run — `failed` and `host` should be 0.

`--lower-only` is the CPU part: with every kernel chosen as on CUDA (dispatch.lowering_for), it
lowers the programs the GPU would compile — the whole decode step of both models (batch 8: every
layer, the Gated DeltaNet, attention and grouped Q3_K MoE kernels inside them, the head) and their
512-token prefill layer programs — from abstract shapes, and counts the Triton kernels in each; and
the quantized-weight products (pantheon/pallas/qmatmul.py) at an 8 B-shape Q4_K_M file's matrices
and Qwen3-30B-A3B's Q4_K experts.
It needs no GPU and no memory for the weights; tests/test_gpu_check.py runs it in CI.
`--tiny` runs part 2 on whatever backend is present with scaled-down shapes (a check of the
script itself; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pantheon.engine.graphs import GraphRegistry  # noqa: E402
from pantheon.engine.runner import ModelRunner  # noqa: E402
from pantheon.model.step import StepInputs, full_step  # noqa: E402
from pantheon.model import kernels as kern  # noqa: E402
from pantheon.model import llama, qwen35moe, synthetic  # noqa: E402
from pantheon.model.family import family_of  # noqa: E402
from pantheon.model.numerics import Numerics  # noqa: E402
from pantheon.model.spec import HybridSpec  # noqa: E402
from pantheon.pallas import dispatch  # noqa: E402
from pantheon.pallas.lowering import lower_for_cuda, triton_calls  # noqa: E402

EXACT = Numerics("exact")
BATCH, PREFILL_CHUNK, CTX, LONG_PROMPT = 8, 512, 4096, 4096


def models(tiny: bool) -> dict:
    """name -> (spec, params builder(dtype))."""
    big, small = synthetic.qwen35_35b_a3b(), synthetic.smollm2_135m()
    if tiny:
        big, small = synthetic.scaled_down(big), synthetic.scaled_down(small)
    return {"qwen35moe-35b-a3b-shaped": (big, lambda dt: synthetic.hybrid_params(big, dt)),
            "smollm2-135m-shaped": (small, lambda dt: synthetic.dense_params(small, dt))}


# ---- --lower-only ---------------------------------------------------------------------------------------
def _lower(name: str, fn, *args) -> dict:
    t0 = time.perf_counter()
    try:
        text = lower_for_cuda(fn, *args)
    except Exception as e:  # noqa: BLE001 - reported per program
        return dict(program=name, status=f"error: {type(e).__name__}: {e}"[:1500], seconds=time.perf_counter() - t0)
    n = triton_calls(text)
    return dict(program=name, status="ok" if n != 0 else "no Triton kernel", triton_calls=n,
                seconds=round(time.perf_counter() - t0, 1))


def lower_model(name: str, spec, build) -> list[dict]:
    """Lower the decode step (batch 8) and the prefill layer programs (one 512-token chunk) of a
    model for CUDA, with every kernel as the GPU would choose it, from abstract shapes."""
    dtype = jnp.bfloat16
    fam = family_of(spec)
    params = jax.eval_shape(lambda: build(dtype))
    state = jax.eval_shape(lambda: fam.allocate_state(spec, BATCH, CTX, dtype=dtype))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    rows = []
    with dispatch.lowering_for("cuda"):
        rows.append(_lower(f"{name}: decode step, batch {BATCH} (segment)", lambda p, s, *a: full_step(
            p, s, StepInputs(*a), forward=fam.forward, spec=spec, numerics=EXACT, kv_len=CTX),
            params, state, i32(BATCH, 1), i32(BATCH, 1), i32(BATCH), i32(BATCH)))
        x = jax.ShapeDtypeStruct((1, PREFILL_CHUNK, spec.n_embd), jnp.float32)
        pos, slots = i32(1, PREFILL_CHUNK), i32(1)
        if isinstance(spec, HybridSpec):
            kernels = qwen35moe.layer_kernels(spec, params, state, PREFILL_CHUNK)
            attn_w = params["layers"][spec.attention_layers[0]]
            ssm_w = params["layers"][spec.recurrent_layers[0]]
            rows.append(_lower(f"{name}: prefill attn_block, {PREFILL_CHUNK} tokens", lambda *a: qwen35moe.attn_block(
                *a, spec=spec, numerics=EXACT, kv_len=CTX, kernels=kernels["attn_block"]),
                attn_w, state.k[0], state.v[0], x, pos, slots))
            rows.append(_lower(f"{name}: prefill ssm_block, {PREFILL_CHUNK} tokens", lambda *a: qwen35moe.ssm_block(
                *a, spec=spec, numerics=EXACT, kernels=kernels["ssm_block"]),
                ssm_w, state.conv[0], state.ssm[0], x, pos, slots, i32(1)))
        else:
            kernels = llama.block_kernels(spec, state, PREFILL_CHUNK)
            rows.append(_lower(f"{name}: prefill block, {PREFILL_CHUNK} tokens", lambda w, k, v, *a: llama.block(
                w, (k, v), *a, spec=spec, numerics=EXACT, kv_len=CTX, kernels=kernels),
                params["layers"][0], state.k[0], state.v[0], x, pos, slots, i32(1)))
    return rows


def lower_quantized_products() -> list[dict]:
    """Lower the quantized-weight kernels (pantheon/pallas/qmatmul.py) for CUDA at an 8 B-shape
    Q4_K_M file's dense matrices (decode and a 512-token prefill) and Qwen3-30B-A3B's Q4_K experts."""
    from gguf.constants import GGMLQuantizationType as T
    from pantheon.pallas.qmatmul import LAYOUT, QPlanes, grouped_qmatmul, qmatmul
    from gguf.constants import GGML_QUANT_SIZES

    def planes(qtype, e, n, k):
        weights, _ = GGML_QUANT_SIZES[qtype]
        return QPlanes(tuple(jax.ShapeDtypeStruct((e, n, k // weights * (width // np.dtype(dt).itemsize)), dt)
                             for _, width, dt in LAYOUT[qtype]), int(qtype), k)

    rows = []
    for qtype, n, k in ((T.Q4_K, 14336, 4096), (T.Q6_K, 4096, 14336), (T.Q5_K, 4096, 4096), (T.Q8_0, 14336, 4096),
                        (T.Q4_0, 14336, 4096)):
        for m, bm in ((1, 16), (PREFILL_CHUNK, 64)):
            rows.append(_lower(f"qmatmul {qtype.name} [{n}, {k}], {m} rows", lambda x, p, bm=bm: qmatmul(x, p, block_m=bm),
                               jax.ShapeDtypeStruct((m, k), jnp.bfloat16), planes(qtype, 1, n, k)))
    rows.append(_lower("grouped_qmatmul Q4_K, 128 experts [768, 2048], 64 rows", grouped_qmatmul,
                       jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((128,), jnp.int32),
                       planes(T.Q4_K, 128, 768, 2048)))
    return rows


# ---- on the device ---------------------------------------------------------------------------------------
def _stream_bytes(params, spec, batch: int, positions: int, kv_itemsize: int) -> float:
    """Bytes one decode step must read from HBM: every weight but the embedding table and the
    routed experts, the experts the batch routes to (the expected distinct count of `batch` x
    n_expert_used uniform picks), and the KV of the attended positions."""
    dense = experts = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = jax.tree_util.keystr(path)
        if keys.startswith("['embed']"):
            continue  # only the step's rows are read
        if "'exp_" in keys:
            experts += leaf.nbytes
        else:
            dense += leaf.nbytes
    if isinstance(spec, HybridSpec):
        used = spec.n_expert * (1 - (1 - spec.n_expert_used / spec.n_expert) ** batch)
        experts *= used / spec.n_expert
        n_attn = len(spec.attention_layers)
    else:
        n_attn = spec.n_layer
    kv = 2 * n_attn * batch * positions * spec.n_head_kv * spec.head_dim * kv_itemsize
    return dense + experts + kv


def run_model(name: str, spec, build, dtype, long_prompt: int, steps: int, hbm_tbps: float) -> dict:
    t0 = time.perf_counter()
    params = jax.block_until_ready(build(dtype))
    out = dict(model=name, build_s=round(time.perf_counter() - t0, 1))
    ctx = max(long_prompt + steps + 8, 256)
    registry = GraphRegistry()
    runner = ModelRunner(spec, EXACT, params, n_slots=BATCH, ctx=ctx, registry=registry,
                         device=jax.devices()[0], dtype=dtype)
    rng = np.random.default_rng(0)
    prompt = lambda n: [int(t) for t in rng.integers(1, spec.n_vocab, n)]  # noqa: E731

    t0 = time.perf_counter()  # warm-up: compiles the prefill chunk programs and the batch-1 step
    jax.block_until_ready(runner.prefill(1, prompt(min(PREFILL_CHUNK, long_prompt)), 0))
    out["warmup_compile_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    last = jax.block_until_ready(runner.prefill(0, prompt(long_prompt), 0))
    out["prefill_tokens"] = long_prompt
    out["prefill_tok_s"] = round(long_prompt / (time.perf_counter() - t0), 1)

    def decode(slots, tokens, start, n):
        """n greedy steps (the argmax comes back to the host each step, as serving does)."""
        enqueue, wall = [], []
        for i in range(n):
            t = time.perf_counter()
            logits = runner.decode(slots, tokens, [start[j] + i for j in range(len(slots))])
            enqueue.append(time.perf_counter() - t)
            tokens = [int(v) for v in np.asarray(jnp.argmax(logits[:len(slots)], -1))]
            wall.append(time.perf_counter() - t)
        return statistics.median(enqueue), statistics.median(wall)

    token = int(np.asarray(jnp.argmax(last)))
    decode([0], [token], [long_prompt], 3)  # compile
    host1, step1 = decode([0], [token], [long_prompt + 3], steps)
    out["single"] = dict(tok_s=round(1 / step1, 1), step_ms=round(step1 * 1e3, 2), host_ms=round(host1 * 1e3, 3))
    short = 64
    for s in range(1, BATCH):
        runner.prefill(s, prompt(short), 0)
    slots, starts = list(range(BATCH)), [long_prompt + 3 + steps] + [short] * (BATCH - 1)
    decode(slots, [token] * BATCH, starts, 3)
    hostb, stepb = decode(slots, [token] * BATCH, [p + 3 for p in starts], steps)
    out["batch8"] = dict(tok_s=round(BATCH / stepb, 1), step_ms=round(stepb * 1e3, 2), host_ms=round(hostb * 1e3, 3))
    itemsize = jnp.dtype(dtype).itemsize
    for key, b, step, pos in (("single", 1, step1, long_prompt), ("batch8", BATCH, stepb, (long_prompt + 7 * short) // 8)):
        need = _stream_bytes(params, spec, b, pos, itemsize)
        out[key]["bytes_per_step"] = int(need)
        out[key]["hbm_floor_fraction"] = round(need / (hbm_tbps * 1e12) / step, 3)
    out["graphs"] = dict(registry.counters(), captures=registry.captures, capture_failures=registry.capture_failures,
                         **{c: registry.counters(c) for c in registry.classes()})
    out["attention"] = runner.attention.counters(operator=True)
    out["kernels"] = dict(kern.choose({k: True for k in dispatch.KERNELS}, dtype))
    out["compile_s"] = round(registry.compile_seconds(), 1)
    return out


# ---- report -------------------------------------------------------------------------------------------------
def table(report: dict) -> str:
    lines = [f"# GPU check — {report['device']} (jax {report['jax']})", ""]
    if report.get("lowered"):
        lines += ["| program lowered for CUDA | status | Triton calls | s |", "|---|---|---|---|"]
        lines += [f"| {r['program']} | {r['status'][:120]} | {r.get('triton_calls', '')} | {r['seconds']} |"
                  for r in report["lowered"]]
        lines.append("")
    for m in report.get("models", []):
        if "error" in m:
            lines += [f"## {m['model']}: ERROR {m['error'][:300]}", ""]
            continue
        lines += [f"## {m['model']}", "",
                  f"prefill {m['prefill_tokens']} tokens: **{m['prefill_tok_s']} tok/s**; "
                  f"build {m['build_s']} s, first compile {m['warmup_compile_s']} s, compiles {m['compile_s']} s", "",
                  "| decode | tok/s | step ms | host ms/step | bytes/step | HBM floor fraction |",
                  "|---|---|---|---|---|---|"]
        for key in ("single", "batch8"):
            r = m[key]
            lines.append(f"| {key} | {r['tok_s']} | {r['step_ms']} | {r['host_ms']} | {r['bytes_per_step'] / 1e9:.2f} GB"
                         f" | {r['hbm_floor_fraction']} |")
        lines += ["", f"graphs: `{json.dumps(m['graphs'])}`", "", f"attention: `{json.dumps(m['attention'])}`", ""]
    if report.get("kernels"):
        lines += ["## kernels vs reference (profiles/gpu_kernels.py)", "",
                  "| case | status | max err | kernel ms | ref ms |", "|---|---|---|---|---|"]
        for r in report["kernels"]:
            lines.append(f"| {r['name']} | {r.get('status', '')[:80]} | {r.get('max_err', '')} | "
                         f"{r.get('kernel_ms', '')} | {r.get('reference_ms', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lower-only", action="store_true", help="lower every program for CUDA on this CPU and stop")
    ap.add_argument("--tiny", action="store_true", help="run the model part at scaled-down shapes on any backend")
    ap.add_argument("--out", type=Path, default=ROOT / "profiles" / "out")
    ap.add_argument("--budget-s", type=float, default=420.0, help="total time to aim for (kernels get a third)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="the device's HBM bandwidth (H200: 4.8 TB/s)")
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(jax=jax.__version__, device=str(jax.devices()[0]), backend=jax.default_backend())
    failed = 0
    specs = models(args.tiny)
    if args.lower_only:
        report["lowered"] = [r for name, (spec, build) in specs.items() for r in lower_model(name, spec, build)]
        report["lowered"] += lower_quantized_products()
        failed = sum(r["status"] != "ok" for r in report["lowered"])
    else:
        gpu = jax.default_backend() in dispatch.GPU_BACKENDS
        if not gpu and not args.tiny:
            print("no GPU: use --lower-only (CPU lowering) or --tiny (a check of this script)")
            return 0
        start = time.perf_counter()
        if gpu and not args.skip_kernels:
            sys.path.insert(0, str(ROOT / "profiles"))
            import gpu_kernels

            failed += gpu_kernels.main(["--json", str(args.out / "gpu_kernels.json"), "--budget-s",
                                        str(args.budget_s / 3), "--runs", "10"])
            report["kernels"] = json.loads((args.out / "gpu_kernels.json").read_text())["rows"]
        report["models"] = []
        dtype = jnp.bfloat16 if gpu else jnp.float32
        for name, (spec, build) in specs.items():
            print(f"{name}: building and running ({time.perf_counter() - start:.0f} s in)", flush=True)
            try:
                m = run_model(name, spec, build, dtype, 64 if args.tiny else LONG_PROMPT,
                              4 if args.tiny else args.steps, args.hbm_tbps)
                failed += m["graphs"]["failed"] + m["attention"]["host"] * gpu
            except Exception as e:  # noqa: BLE001 - reported, then the next model
                m = dict(model=name, error=f"{type(e).__name__}: {e}"[:3000])
                failed += 1
            report["models"].append(m)
            jax.clear_caches()
    name = "gpu_check_lower" if args.lower_only else "gpu_check"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{name}.md").write_text(table(report))
    print(table(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
