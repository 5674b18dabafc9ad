#!/usr/bin/env python3
"""Run every Pallas kernel compiled (no interpret) on a CUDA device at production-like shapes,
check it against its jnp reference and time both.

Shapes follow Qwen3.5-35B-A3B: hidden 2048, 16 query / 2 kv heads, head_dim 256 (and 128),
256 experts with 8 used, expert FFN 512; decode batch 8 over a 4k-context slot cache; prefill
chunks of 512 tokens at the end of a 4k context; Gated DeltaNet with 32 value heads,
Dk = Dv = 128 (a 4k-token prompt as 8 chunks of 512 carrying the state, and 16 decode steps of 8
slots against the in-place state cache; float32, like the model's recurrent path). Activations and caches are bfloat16 (the MoE is
also checked once with float32 activations, where the kernel's dots are exact IEEE float32).

    python3 profiles/gpu_kernels.py [--runs 20] [--budget-s 420] [--json out.json] [--only attn,moe,deltanet]

Prints one table row per case: max error vs the reference (and the tolerance), then the median
time of --runs calls after warm-up for the kernel and for the reference. Without a GPU it says so
and exits 0. Cases left when --budget-s seconds have passed are skipped (listed as such), so a
run fits its device lease. Needs jax >= 0.10.2 (tested API surface: public jax, jax.experimental.
pallas) and the `gguf` package (pure Python; carry its wheel to a machine that lacks it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HIDDEN, N_HEAD, N_KV, EXPERTS, TOP_K, FFN, SLOTS, CTX, CHUNK = 2048, 16, 2, 256, 8, 512, 8, 4096, 512
DN_HEADS, DN_DIM, DN_STEPS = 32, 128, 16  # DeltaNet value heads, Dk = Dv, decode steps per timed call
DENSE_HIDDEN, DENSE_FFN = 4096, 14336  # Llama-3-8B, for the dense quantized products (a Q4_K_M file's types)
MOE3_EXPERTS, MOE3_FFN = 128, 768  # Qwen3-30B-A3B's routed experts (hidden 2048, top 8), Q4_K
INTERPRET = False  # --cpu-smoke: tiny shapes through the Pallas interpreter, to check this script


def _smoke_shapes():
    global HIDDEN, EXPERTS, FFN, SLOTS, CTX, CHUNK, INTERPRET, DN_HEADS, DN_DIM, DN_STEPS
    global DENSE_HIDDEN, DENSE_FFN, MOE3_EXPERTS, MOE3_FFN
    HIDDEN, EXPERTS, FFN, SLOTS, CTX, CHUNK, INTERPRET = 256, 16, 256, 2, 128, 32, True
    DENSE_HIDDEN, DENSE_FFN, MOE3_EXPERTS, MOE3_FFN = 256, 512, 8, 256
    DN_HEADS, DN_DIM, DN_STEPS = 4, 32, 2


def _gpu_backend() -> str | None:
    try:
        backend = jax.default_backend()
    except RuntimeError:
        return None
    return backend if backend in ("gpu", "cuda", "rocm") else None


def timed(fn, args, runs: int) -> float:
    """Median wall time (ms) of fn(*args) over `runs` calls after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_err(a, b, relative: bool) -> float:
    if isinstance(a, (tuple, list)):  # several outputs (e.g. DeltaNet's out and state): the worst
        return max(max_err(x, y, relative) for x, y in zip(a, b))
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.isfinite(a).all():
        return float("nan")
    err = float(np.abs(a - b).max())
    return err / max(float(np.abs(b).max()), 1e-30) if relative else err


# ---- cases ---------------------------------------------------------------------------------------------
def attention_cases(rng):
    from pantheon.pallas.attention import (attention_reference, decode_attention, decode_attention_reference,
                                           flash_attention)
    bf = jnp.bfloat16
    for d in (128, 256):
        def make_prefill(d=d):
            q = jnp.asarray(rng.standard_normal((1, CHUNK, N_HEAD, d)), bf)
            k = jnp.asarray(rng.standard_normal((1, CTX, N_KV, d)), bf)
            v = jnp.asarray(rng.standard_normal((1, CTX, N_KV, d)), bf)
            pos = jnp.asarray((CTX - CHUNK + np.arange(CHUNK))[None], jnp.int32)  # last chunk of 4k
            return (q, k, v, pos)
        yield dict(name=f"flash prefill T{CHUNK} S{CTX} D{d} bf16", make=make_prefill,
                   kernel=jax.jit(partial(flash_attention, interpret=INTERPRET)), reference=jax.jit(attention_reference),
                   tol=2e-2, relative=False)

        def make_decode(d=d):
            q = jnp.asarray(rng.standard_normal((SLOTS, N_HEAD, d)), bf)
            kc = jnp.asarray(rng.standard_normal((SLOTS + 1, CTX, N_KV, d)), bf)
            vc = jnp.asarray(rng.standard_normal((SLOTS + 1, CTX, N_KV, d)), bf)
            slots = jnp.asarray(rng.permutation(SLOTS).astype(np.int32))
            lengths = rng.integers(1, CTX + 1, size=SLOTS).astype(np.int32)
            lengths[0] = CTX
            return (q, kc, vc, slots, jnp.asarray(lengths))
        yield dict(name=f"decode B{SLOTS} C{CTX} D{d} bf16 ragged", make=make_decode,
                   kernel=jax.jit(partial(decode_attention, interpret=INTERPRET)), reference=jax.jit(decode_attention_reference),
                   tol=2e-2, relative=False)


def random_planes(rng, e, n, k):
    """Random Q3_K weights as device planes: every bit pattern of qs/hm/scales is a valid Q3_K
    block, d is a small positive fp16 (so the weights are ~N(0, 0.02^2)-sized)."""
    from pantheon.pallas.moe_q3k import Q3KPlanes
    nb = k // 256
    sc = rng.integers(0, 256, size=(e, n, nb, 16), dtype=np.uint8)
    sc[..., 12:] = 0
    d = rng.uniform(2e-4, 1e-3, size=(e, n, nb)).astype(np.float16)
    planes = Q3KPlanes(qs=rng.integers(0, 256, size=(e, n, nb * 64), dtype=np.uint8),
                       hm=rng.integers(0, 256, size=(e, n, nb * 32), dtype=np.uint8),
                       sc=sc.reshape(e, n, nb * 16), d=d)
    return jax.device_put(planes)


def moe_cases(rng):
    from pantheon.pallas.moe import moe_ffn, route
    from pantheon.pallas.moe_q3k import dequantize_planes, grouped_matmul_q3k, grouped_matmul_q3k_reference
    weights = {}

    def planes(name, n, k):
        if name not in weights:
            weights[name] = random_planes(rng, EXPERTS, n, k)
        return weights[name]

    def routed_rows(t, k_in, dtype):
        """x rows sorted by expert for t tokens routed top-8 of 256 by random logits."""
        _, idx = route(jnp.asarray(rng.standard_normal((t, EXPERTS)), jnp.float32), TOP_K)
        sizes = jnp.zeros((EXPERTS,), jnp.int32).at[idx.reshape(-1)].add(1)
        x = jnp.asarray(rng.standard_normal((t * TOP_K, k_in)), dtype)
        return x, sizes

    def bf16_dense_ragged(x, sizes, w_t):  # best case for XLA: weights pre-dequantised to bf16
        return jax.lax.ragged_dot(x, w_t, sizes, preferred_element_type=jnp.float32).astype(x.dtype)

    def predequantised(x, sizes, p):
        return (x, sizes, jax.jit(lambda p: jnp.swapaxes(dequantize_planes(p), 1, 2).astype(jnp.bfloat16))(p))

    for t, label in ((SLOTS, "decode"), (CHUNK, "prefill")):
        for wname, n, k in (("gate", FFN, HIDDEN), ("down", HIDDEN, FFN)):
            def make(t=t, wname=wname, n=n, k=k):
                x, sizes = routed_rows(t, k, jnp.bfloat16)
                return (x, sizes, planes(wname, n, k))
            yield dict(name=f"gmm_q3k {label} M{t * TOP_K} {wname} N{n} K{k} bf16", make=make,
                       kernel=jax.jit(partial(grouped_matmul_q3k, interpret=INTERPRET)), reference=jax.jit(grouped_matmul_q3k_reference),
                       tol=2e-2, relative=True,
                       extra=("ragged_dot, bf16 weights pre-dequantised", predequantised, bf16_dense_ragged))

    def make_f32():
        x, sizes = routed_rows(SLOTS, HIDDEN, jnp.float32)
        return (x, sizes, planes("gate", FFN, HIDDEN))
    yield dict(name=f"gmm_q3k decode M{SLOTS * TOP_K} gate f32 (IEEE dots)", make=make_f32,
               kernel=jax.jit(partial(grouped_matmul_q3k, interpret=INTERPRET)), reference=jax.jit(grouped_matmul_q3k_reference),
               tol=1e-5, relative=True)

    for t, label in ((SLOTS, "decode"), (CHUNK, "prefill")):
        def make_moe(t=t):
            x = jnp.asarray(rng.standard_normal((t, HIDDEN)), jnp.bfloat16)
            logits = jnp.asarray(rng.standard_normal((t, EXPERTS)), jnp.float32)
            return (x, logits, planes("gate", FFN, HIDDEN), planes("up", FFN, HIDDEN), planes("down", HIDDEN, FFN))
        yield dict(name=f"moe_ffn {label} T{t} E{EXPERTS} top{TOP_K} bf16", make=make_moe,
                   kernel=jax.jit(lambda x, r, g, u, d: moe_ffn(x, r, TOP_K, g, u, d, impl="interpret" if INTERPRET else "pallas")),
                   reference=jax.jit(lambda x, r, g, u, d: moe_ffn(x, r, TOP_K, g, u, d, impl="reference")),
                   tol=3e-2, relative=True)


def random_qplanes(rng, qtype, e, n, k):
    """Random weights of a GGUF type as device planes (pantheon.pallas.qmatmul): random code bytes,
    small positive fp16 scales (d, and dmin where the type has one), random 6-bit/int8 sub-scales."""
    from pantheon.pallas.qmatmul import LAYOUT, QPlanes
    from gguf.constants import GGML_QUANT_SIZES
    weights, _ = GGML_QUANT_SIZES[qtype]
    planes = []
    for name, width, dtype in LAYOUT[qtype]:
        items = k // weights * (width // np.dtype(dtype).itemsize)
        if np.dtype(dtype) == np.float16:
            planes.append(rng.uniform(2e-4, 1e-3, size=(e, n, items)).astype(np.float16))
        else:
            planes.append(rng.integers(0, 256, size=(e, n, items), dtype=np.uint8).view(dtype))
    return jax.device_put(QPlanes(tuple(planes), int(qtype), k))


def qmatmul_cases(rng):
    """Dense products against an 8 B-shape Q4_K_M file's matrices (Q4_K, Q6_K; Q8_0 and Q4_0 too)
    read as blocks, at decode (1 and 8 rows) and prefill (512) sizes, against the reference and
    against today's GPU path (the weight dequantized to bf16 at load, one XLA dot); and Qwen3-30B-
    A3B's Q4_K experts through the grouped kernel."""
    from gguf.constants import GGMLQuantizationType as T
    from pantheon.pallas.moe import route
    from pantheon.pallas.qmatmul import (dequantize_planes, grouped_qmatmul, grouped_qmatmul_reference, qmatmul,
                                         qmatmul_reference)

    def bf16_dot(x, w):
        return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)

    def predequantised(x, p):
        return (x, jax.jit(lambda p: dequantize_planes(p)[0].astype(jnp.bfloat16))(p))

    for qtype, n, k, role in ((T.Q4_K, DENSE_FFN, DENSE_HIDDEN, "gate"), (T.Q6_K, DENSE_HIDDEN, DENSE_FFN, "down"),
                              (T.Q8_0, DENSE_FFN, DENSE_HIDDEN, "gate"), (T.Q4_0, DENSE_FFN, DENSE_HIDDEN, "gate")):
        for m in (1, 8, CHUNK):
            if m == CHUNK and qtype in (T.Q8_0, T.Q4_0):
                continue

            def make(qtype=qtype, n=n, k=k, m=m):
                return (jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), random_qplanes(rng, qtype, 1, n, k))
            bm = 16 if m <= 16 else 64
            yield dict(name=f"qmatmul {qtype.name} {role} M{m} N{n} K{k} bf16", make=make,
                       kernel=jax.jit(partial(qmatmul, block_m=bm, interpret=INTERPRET)), reference=qmatmul_reference,
                       tol=2e-2, relative=True, extra=("bf16 weights pre-dequantised, XLA dot", predequantised, bf16_dot))

    def make_moe3():
        _, idx = route(jnp.asarray(rng.standard_normal((SLOTS, MOE3_EXPERTS)), jnp.float32), TOP_K)
        sizes = jnp.zeros((MOE3_EXPERTS,), jnp.int32).at[idx.reshape(-1)].add(1)
        x = jnp.asarray(rng.standard_normal((SLOTS * TOP_K, HIDDEN)), jnp.bfloat16)
        return (x, sizes, random_qplanes(rng, T.Q4_K, MOE3_EXPERTS, MOE3_FFN, HIDDEN))
    yield dict(name=f"grouped_qmatmul Q4_K decode M{SLOTS * TOP_K} E{MOE3_EXPERTS} N{MOE3_FFN} K{HIDDEN} bf16",
               make=make_moe3, kernel=jax.jit(partial(grouped_qmatmul, interpret=INTERPRET)),
               reference=grouped_qmatmul_reference, tol=2e-2, relative=True)


def deltanet_cases(rng):
    from pantheon.pallas.deltanet import (gated_delta_rule, gated_delta_rule_reference, gated_delta_rule_step,
                                          gated_delta_rule_step_reference)
    h, d = DN_HEADS, DN_DIM
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)

    def tokens(lead):
        q = jnp.asarray(unit(rng.standard_normal((*lead, h, d))) / np.sqrt(d), jnp.float32)
        k = jnp.asarray(unit(rng.standard_normal((*lead, h, d))), jnp.float32)
        v = jnp.asarray(rng.standard_normal((*lead, h, d)), jnp.float32)
        g = jnp.asarray(-rng.uniform(0.0, 0.5, (*lead, h)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0.0, 1.0, (*lead, h)), jnp.float32)
        return q, k, v, g, beta

    def make_prefill():  # a CTX-token prompt, fed as CTX / CHUNK chunks of CHUNK tokens
        return (*tokens((1, CTX)), jnp.zeros((1, h, d, d), jnp.float32))

    def chunked_prompt(fn):
        def run(q, k, v, g, beta, state):
            outs = []
            for c0 in range(0, CTX, CHUNK):
                part = (a[:, c0:c0 + CHUNK] for a in (q, k, v, g, beta))
                o, state = fn(*part, state, jnp.full((1,), CHUNK, jnp.int32))
                outs.append(o)
            return jnp.concatenate(outs, axis=1), state
        return jax.jit(run)

    ref_prefill = chunked_prompt(gated_delta_rule_reference)
    # (chunk, block_v, num_warps): the sequential loop and chunked variants, to pick defaults on the GPU
    for chunk, bv, warps in ((1, None, None), (1, 16, 4), (64, None, None), (64, 64, 8), (32, 32, 4)):
        kernel = partial(gated_delta_rule, chunk=chunk, block_v=bv, num_warps=warps, interpret=INTERPRET)
        yield dict(name=f"deltanet prefill {CTX} tok in T{CHUNK} chunk={chunk} bv={bv or 'dflt'} w={warps or 'dflt'}",
                   make=make_prefill, kernel=chunked_prompt(kernel), reference=ref_prefill, tol=2e-4, relative=False)

    def make_decode():
        cache = jnp.asarray(rng.standard_normal((SLOTS + 1, h, d, d)) * 0.3, jnp.float32)
        return (*tokens((SLOTS,)), cache, jnp.asarray(rng.permutation(SLOTS).astype(np.int32)))

    def decode_loop(fn):  # DN_STEPS steps with the cache as the loop carry (updated in place)
        def run(q, k, v, g, beta, cache, slots):
            def body(i, carry):
                return fn(q, k, v, g, beta, carry[1], slots)
            out0 = jnp.zeros((SLOTS, h, d), jnp.float32)
            return jax.lax.fori_loop(0, DN_STEPS, body, (out0, cache))
        return jax.jit(run)

    yield dict(name=f"deltanet decode B{SLOTS} x{DN_STEPS} steps H{h} D{d} (time/{DN_STEPS} = 1 step)",
               make=make_decode, kernel=decode_loop(partial(gated_delta_rule_step, interpret=INTERPRET)),
               reference=decode_loop(gated_delta_rule_step_reference), tol=1e-4, relative=False)


# ---- main ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="timed calls per measurement (median reported)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip cases once this much time has passed")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--only", default="attn,moe,deltanet,qmm",
                    help="comma list of groups: attn, moe, deltanet, qmm (quantized dense and grouped products)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check this script without a GPU: tiny shapes, kernels interpreted (timings meaningless)")
    args = ap.parse_args(argv)

    backend = _gpu_backend()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    if args.cpu_smoke:
        _smoke_shapes()
        args.runs = min(args.runs, 2)
    elif backend is None:
        print("no GPU: nothing to profile (the Pallas kernels are tested in interpret mode on CPU)")
        return 0

    start = time.perf_counter()
    rng = np.random.default_rng()
    groups = [g.strip() for g in args.only.split(",") if g.strip()]
    cases = [c for g, fn in (("attn", attention_cases), ("moe", moe_cases), ("deltanet", deltanet_cases),
                                         ("qmm", qmatmul_cases))
             if g in groups for c in fn(rng)]
    rows, failed = [], 0
    header = f"{'case':58s} {'max err':>10s} {'tol':>7s} {'kernel ms':>10s} {'ref ms':>9s} {'speed-up':>8s}  note"
    print(header)
    print("-" * len(header))
    for case in cases:
        row = dict(name=case["name"], tol=case["tol"], relative=case["relative"])
        if time.perf_counter() - start > args.budget_s:
            row["status"] = "skipped (budget)"
            print(f"{case['name']:58s} skipped: --budget-s {args.budget_s:.0f} s passed")
            rows.append(row)
            continue
        try:
            inputs = case["make"]()
            t0 = time.perf_counter()
            out = jax.block_until_ready(case["kernel"](*inputs))
            row["first_call_s"] = time.perf_counter() - t0  # compile + run
            ref = jax.block_until_ready(case["reference"](*inputs))
            row["max_err"] = max_err(out, ref, case["relative"])
            row["kernel_ms"] = timed(case["kernel"], inputs, args.runs)
            row["reference_ms"] = timed(case["reference"], inputs, args.runs)
            note = ""
            if "extra" in case:
                label, prep, fn = case["extra"]
                row["extra"] = {label: timed(jax.jit(fn), prep(*inputs), args.runs)}
                note = f"{label}: {row['extra'][label]:.3f} ms"
            ok = row["max_err"] <= case["tol"]
            row["status"] = "ok" if ok else "WRONG"
            failed += not ok
            print(f"{case['name']:58s} {row['max_err']:10.2e} {case['tol']:7.0e} {row['kernel_ms']:10.3f} "
                  f"{row['reference_ms']:9.3f} {row['reference_ms'] / row['kernel_ms']:7.2f}x  "
                  f"{'' if ok else 'WRONG '}{note} (first call {row['first_call_s']:.1f} s)")
        except Exception as e:  # noqa: BLE001 - report and go on with the next case
            failed += 1
            row["status"] = f"error: {type(e).__name__}: {e}"[:2000]
            print(f"{case['name']:58s} ERROR {type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc(limit=3)
        rows.append(row)
        sys.stdout.flush()
    print(f"{len(rows)} cases, {failed} failed or wrong, {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
