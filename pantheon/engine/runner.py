"""ModelRunner: prefill chunks and batched decode steps through the graph registry.

Owns the device arrays of one model (params, KV cache, sampler state); it must only be called
from the thread that owns the device. Shapes are bucketed so the set of executables is small and
known: batch in DECODE_BUCKETS, prefill chunk in CHUNK_BUCKETS (engine/chunks.py), attended cache length a power of two."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from functools import partial, wraps
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pantheon.config import full_step_enabled
from pantheon.faults import FAULTS, InjectedFault
from pantheon.engine.chunks import CHUNK_BUCKETS, bucket_for, chunk_length, padding_is_free
from pantheon.engine.graphs import GraphKey, GraphRegistry, abstract
from pantheon.engine.memory import release_free_memory
from pantheon.engine.residency import AttentionResidency
from pantheon.engine.sampler import (PromptScores, SampleOutput, SamplingBatch, SamplingParams, allocate_sampler_state,
                                     bias_arrays, prng_key_for, prompt_scores, reset_slot, sample)
from pantheon.model.family import family_of
from pantheon.model.numerics import Numerics
from pantheon.model.sharding import KV_CACHE
from pantheon.model.spec import ModelSpec
from pantheon.model.state import export_rows, export_slot, import_slot, positional, slot_layout
from pantheon.model.step import StepInputs, full_step

DECODE_BUCKETS = (1, 2, 4, 8)
RELEASE_AFTER_PROMPT = 1024  # tokens: a prompt this long returns its transient memory when done
MIN_KV_BUCKET = 128


def graph_class(kind: str, program: str, batch: int) -> str:
    """The contract's residency class of one compiled program call."""
    if program in ("embed", "head", "sample"):
        return "segment"
    if kind != "decode":
        return "prefill"
    if program == "ssm_block":
        return "batched_ssm" if batch > 1 else "single_ssm"
    return "batched_attn"


@partial(jax.jit, static_argnames=("forward", "spec", "numerics", "kv_len", "want_top"),
         donate_argnames=("state", "sampler_state"))
def full_step_and_sample(params, state, inputs: StepInputs, sampler_state, batch, *, forward, spec, numerics,
                         kv_len: int, want_top: bool):
    """The full decode step (model/step.py) with the sampler inlined: one program from token ids to
    sampled ids (the logits never leave it). Returns (SampleOutput, state, sampler_state)."""
    logits, state = full_step(params, state, inputs, forward=forward, spec=spec, numerics=numerics, kv_len=kv_len)
    out, sampler_state = sample(logits, sampler_state, batch, want_top=want_top)
    return out, state, sampler_state


@dataclass
class PrefillWork:
    """One chunk of one prompt. `sampling` is set on the prompt's last chunk: its last token's
    logits are sampled in the same step."""

    slot: int
    tokens: list[int]
    start: int
    sampling: "SlotSampling | None" = None
    forced: int = -1
    mask: np.ndarray | None = None  # int32 [words] grammar bitmask row
    # A scored prompt's chunk: the prompt tokens after each of the chunk's (the last chunk has one
    # fewer), whose log-probabilities, with `top` alternatives, come back in StepOutput.scores
    targets: list[int] | None = None
    top: int = 0


@dataclass
class DecodeWork:
    """One token for each decoding slot, then one batched sampling call."""

    slots: list[int]
    tokens: list[int]
    positions: list[int]
    sampling: list["SlotSampling"]
    forced: list[int] | None = None
    mask: np.ndarray | None = None  # int32 [rows, words]


@dataclass
class StepWork:
    """What one scheduler step asks of the device: at most one prefill chunk and the decode rows."""

    prefill: PrefillWork | None = None
    decode: DecodeWork | None = None


@dataclass
class StepOutput:
    prefill: SampleOutput | None = None  # one row, when the chunk ended its prompt
    decode: SampleOutput | None = None
    scores: PromptScores | None = None  # a scored prompt's chunk (PrefillWork.targets)


@dataclass
class SlotSampling:
    """What the sampler needs for one active slot."""

    params: SamplingParams
    key: np.ndarray  # uint32[2]
    step: int = 0


def _mirrored(method):
    """A call that changes device state: with a StepChannel (`mirror`, one model over several
    processes, engine/distributed.py) it is broadcast first, so every process replays it in order."""
    @wraps(method)
    def call(self, *args, _replay: bool = False):
        if self.mirror is not None and not _replay:
            self.mirror.send((method.__name__, args))
        return method(self, *args)
    return call


class ModelRunner:
    def __init__(self, spec: ModelSpec, numerics: Numerics, params, n_slots: int, ctx: int,
                 registry: GraphRegistry | None = None, device=None, dtype=jnp.float32):
        self.spec, self.numerics, self.params, self.n_slots, self.ctx = spec, numerics, params, n_slots, ctx
        self.kv_dtype = dtype  # the KV cache's (model/dtypes.py); host-fallback KV is f32
        self.registry = registry or GraphRegistry()
        self.family = family_of(spec)
        if isinstance(device, Mesh):  # several dies: KV heads split, sampler state replicated
            state_sharding, sampler_sharding = NamedSharding(device, KV_CACHE), NamedSharding(device, PartitionSpec())
        else:
            state_sharding = sampler_sharding = (jax.sharding.SingleDeviceSharding(device)
                                                 if device is not None else None)
        self.cache = self.family.allocate_state(spec, n_slots, ctx, dtype=dtype, sharding=state_sharding)
        self.state_sharding = state_sharding
        self.attention = AttentionResidency(self)
        self.sampler_state = jax.device_put(allocate_sampler_state(n_slots, spec.n_vocab), sampler_sharding)
        self.scratch = n_slots  # the extra cache slot padded rows write to
        # Decode through one full-step program per batch bucket (PANTHEON_FULL_STEP=0: per-layer only)
        self.full_step = full_step_enabled()
        self.padding_free = padding_is_free(spec, params)  # chunk_length's
        self.mirror = None  # process 0 of a multi-process model: its StepChannel (engine/distributed.py)

    def keepalive(self) -> None:
        """An idle multi-process model still talks now and then, so the followers' pending receive
        never waits on the collectives' timeout."""
        from pantheon.engine.distributed import KEEPALIVE_S

        if self.mirror is not None and time.monotonic() - self.mirror.last > KEEPALIVE_S:
            self.mirror.send(("noop", ()))

    def kv_bucket(self, needed: int) -> int:
        b = MIN_KV_BUCKET
        while b < needed:
            b *= 2
        return min(b, self.ctx)

    def _program_key(self, kind: str, name: str, layer: int, batch: int, chunk: int, static: dict) -> GraphKey:
        # Key each program by what it is compiled for — the head by all_logits, attention blocks
        # by the kv_len they are traced with (the cache length where they read it in place, see
        # kernels.program_kv_len) — so no identical executable is built twice.
        bucket = (batch, chunk) + ((static["all_logits"], static.get("hidden", False)) if name == "head" else
                                   (static["kv_len"],) if "kv_len" in static else ())
        return GraphKey(kind, graph_class(kind, name, batch), bucket, layer, name)

    def _forward(self, kind: str, inputs: StepInputs, kv_len: int, all_logits=False, hidden=False):
        batch, chunk = inputs.tokens.shape
        # An injected `step` fault fails this forward at its second layer, after the first layer
        # has already donated and replaced its buffers: the case the failure handling must survive.
        faulted = FAULTS.take("step")

        def call(name, layer, fn, args, static):
            if faulted and layer == 1:
                raise InjectedFault(f"injected device step failure ({kind}, layer program {name!r})")
            key = self._program_key(kind, name, layer, batch, chunk, static)
            return self.registry.call(key, fn, args, static)

        logits, self.cache = self.family.forward(self.params, self.cache, inputs,
                                                 spec=self.spec, numerics=self.numerics, kv_len=kv_len,
                                                 all_logits=all_logits, hidden=hidden, call=call)
        return logits

    def warm_up(self, progress: Callable[[str], None] = lambda phase: None) -> float:
        """Compile, from abstract shapes, what serving calls on first use: every prefill chunk
        bucket's programs and the sampler after it, and the full decode step with the sampler
        inlined for every batch bucket. Otherwise the first prompt of each new length, and the
        first step at each new concurrency, would wait for a compile (0.1-1 s each on the CPU,
        even from the persistent cache): the TTFT spikes of the first requests. Nothing runs and
        no state changes. `progress(phase)` is told each phase as it starts. Returns the seconds spent."""
        t0 = time.perf_counter()
        shapes = lambda tree: jax.tree_util.tree_map(abstract, tree)  # noqa: E731
        cache = shapes(self.cache)  # fresh lists: the forward's in-place layer updates stay here
        # Each phase drops jax's traces of the last one (graphs.forget_traces): freed while the next
        # compiles, their pages are reused, where dropped once at the end they stay fragmented in
        # the allocator (Gemma 3 270M: 835 -> 728 MB of RSS after warm-up, against 789 dropped once).
        self.registry.forget_traces = True

        for chunk in CHUNK_BUCKETS:
            if chunk > self.ctx:
                break
            progress(f"prefill chunk {chunk}")

            def call(name, layer, fn, args, static, chunk=chunk):
                key = self._program_key("prefill", name, layer, 1, chunk, static)
                self.registry.precompile(key, fn, args, static)
                return jax.eval_shape(lambda *a: fn(*a, **static), *args)

            i32 = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
            one = jax.ShapeDtypeStruct((1,), jnp.int32)
            self.family.forward(shapes(self.params), cache, StepInputs(i32, i32, one, one), spec=self.spec,
                                numerics=self.numerics, kv_len=self.kv_bucket(chunk), all_logits=False, call=call)
        progress("sampler")
        sampling = SlotSampling(SamplingParams(), np.zeros(2, np.uint32))
        logits = jax.ShapeDtypeStruct((1, self.spec.n_vocab), jnp.float32)
        key, args, static = self._sample_program(logits, [self.scratch], [sampling], None, None, advance=False)
        self.registry.precompile(key, sample, shapes(args), static)
        if self.full_step:
            for b in (b for b in DECODE_BUCKETS if b <= bucket_for(self.n_slots, DECODE_BUCKETS)):
                progress(f"decode step, batch {b}")
                key, args, static = self._step_sample_program(DecodeWork([self.scratch] * b, [0] * b, [0] * b,
                                                                         [sampling] * b))
                self.registry.precompile(key, full_step_and_sample, shapes(args), static)
        # Tracing and compiling leave garbage cycles and freed pages the allocator keeps: collected
        # and handed back, the served RSS drops by ~50-70 MB (1 B, Gemma 3 270M).
        gc.collect()
        release_free_memory()
        return time.perf_counter() - t0

    def prefill(self, slot: int, tokens: list[int], start: int, all_logits: bool = False,
                hidden: bool = False) -> jax.Array:
        """Write `tokens` at positions start.. of `slot`, in chunks. Returns the logits of the last
        token [V] (or of every token [n, V] with all_logits, for tests and teacher forcing; or the
        final-normed hidden states of every token [n, E] with hidden, for embeddings)."""
        if start + len(tokens) > self.ctx:
            raise ValueError(f"prefill of {len(tokens)} tokens at {start} exceeds the cache ({self.ctx})")
        outs = []
        pos = start
        i = 0
        while i < len(tokens):
            chunk = tokens[i:i + chunk_length(len(tokens) - i, CHUNK_BUCKETS[-1], self.padding_free)]
            n = len(chunk)
            i += n
            t = bucket_for(n, CHUNK_BUCKETS)
            ids = np.zeros((1, t), np.int32)
            ids[0, :n] = chunk
            positions = (pos + np.arange(t, dtype=np.int32))[None]
            inputs = StepInputs(ids, positions, np.array([slot], np.int32), np.array([n - 1], np.int32))
            logits = self._forward("prefill", inputs, self.kv_bucket(pos + n), all_logits, hidden)
            outs.append(logits[0, :n] if all_logits or hidden else logits[0])
            pos += n
        return jnp.concatenate(outs) if all_logits or hidden else outs[-1]

    def hidden_states(self, tokens: list[int]) -> np.ndarray:
        """The final-normed hidden states [n, E] of a sequence run from position 0 in the scratch slot
        (what padding rows write to; no request's KV lives there): the embeddings API's forward."""
        return np.asarray(self.prefill(self.scratch, tokens, 0, hidden=True))

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> jax.Array:
        """One token for each active slot. Returns logits [bucket, V]; rows past len(slots) are padding.

        Runs the full-step program of the batch bucket (the `segment` class) where it is available,
        else the per-layer programs: while a layer's KV is on the host, when the compile failed (it
        is retried on the registry's backoff), or for a step an injected `step` fault targets."""
        inputs = self._decode_inputs(slots, tokens, positions)
        if self._full_step_ok(mask=None):
            args = (self.params, self.cache, inputs)
            key = GraphKey("decode", "segment", (len(inputs.slots),), program="step")
            step = self._full_step_executable(key, full_step, args, self._step_static())
            if step is not None:
                logits, self.cache = step(*args)
                return logits
        return self._forward("decode", inputs, self.kv_bucket(max(positions) + 1))

    def _decode_inputs(self, slots, tokens, positions) -> StepInputs:
        """One token a row (ids and positions [b, 1], rows [b], logit_index [b]), padded to the batch bucket."""
        n = len(slots)
        b = bucket_for(n, DECODE_BUCKETS)
        ids = np.zeros((b, 1), np.int32)
        pos = np.zeros((b, 1), np.int32)
        rows = np.full(b, self.scratch, np.int32)
        ids[:n, 0], pos[:n, 0], rows[:n] = tokens, positions, slots
        return StepInputs(ids, pos, rows, np.zeros(b, np.int32))

    def _full_step_ok(self, mask) -> bool:
        """Whether this step may run a full-step program: not while a layer's KV is on the host, a
        `step` fault is pending, or (with the sampler inlined) a row is grammar-masked."""
        return mask is None and not self.attention.host_layers() and not FAULTS.pending("step")

    def _full_step_executable(self, key: GraphKey, fn, args, static):
        """The full-step program's executable, or None: failed, or gated out by PANTHEON_FULL_STEP=0
        — then its slot counts `ineligible` (this serve never compiles it: not a fault)."""
        if not self.full_step:
            self.registry.mark_ineligible(key)
            return None
        return self.registry.executable(key, fn, args, static)

    def _step_static(self) -> dict:
        # Decode attention reads each row's slot in place up to its position (kernels.py), so one
        # program per batch bucket serves every attended length: it is traced at the cache length.
        return dict(forward=self.family.forward, spec=self.spec, numerics=self.numerics, kv_len=self.ctx)

    def decode_and_sample(self, d: "DecodeWork") -> SampleOutput:
        """A decode step and its sampling as one program (the full step with the sampler inlined),
        where the full step is available and no row is grammar-constrained; otherwise `decode`
        then `sample`. Same tokens either way."""
        if self._full_step_ok(d.mask):
            key, args, static = self._step_sample_program(d)
            step = self._full_step_executable(key, full_step_and_sample, args, static)
            if step is not None:
                for s in d.sampling:
                    s.step += 1
                out, self.cache, self.sampler_state = step(*args)
                return jax.tree_util.tree_map(np.asarray, out)
        return self.sample(self.decode(d.slots, d.tokens, d.positions), d.slots, d.sampling, d.forced, d.mask)

    def _step_sample_program(self, d: "DecodeWork") -> tuple[GraphKey, tuple, dict]:
        """(key, args, static) of the full step with the sampler inlined for d's rows (no mask)."""
        inputs = self._decode_inputs(d.slots, d.tokens, d.positions)
        batch, want_top = self._sampling_batch(len(inputs.slots), d.slots, d.sampling, d.forced, None, advance=False)
        args = (self.params, self.cache, inputs, self.sampler_state, batch)
        key = GraphKey("decode", "segment", (len(inputs.slots), want_top), program="step_sample")
        return key, args, dict(self._step_static(), want_top=want_top)

    def sync(self) -> None:
        """Wait until every dispatched step has written the cache (JAX dispatches asynchronously:
        a prefill chunk with nothing sampled after it returns before it is computed). Local to
        this process: nothing to replay."""
        jax.block_until_ready(self.cache)

    @_mirrored
    def run(self, work: StepWork) -> StepOutput:
        """Execute one scheduler step: the prefill chunk, then the decode rows, each followed by
        its sampling call. Any exception leaves `self.cache` holding every live buffer (the
        forwards update it layer by layer); `repair` then replaces what a failure consumed."""
        out = StepOutput()
        p = work.prefill
        if p is not None:
            with jax.profiler.TraceAnnotation("prefill_chunk", slot=p.slot, tokens=len(p.tokens)):
                if p.targets is None:
                    logits = self.prefill(p.slot, p.tokens, p.start)
                else:  # every position's logits, scored on the host (sampler.prompt_scores)
                    every = self.prefill(p.slot, p.tokens, p.start, all_logits=True)
                    logits = every[-1]
                    out.scores = prompt_scores(np.asarray(every), p.targets, p.top)
            if p.sampling is not None:
                mask = None if p.mask is None else p.mask[None]
                out.prefill = self.sample(logits[None], [p.slot], [p.sampling], [p.forced], mask)
                if p.start + len(p.tokens) >= RELEASE_AFTER_PROMPT:
                    # its chunks' transient matrices (dequantized per chunk on the CPU) are freed,
                    # but the allocator keeps the pages: hand them back (1 B Q4_K_M: ~500 MB)
                    release_free_memory()
        d = work.decode
        if d is not None:
            with jax.profiler.TraceAnnotation("decode_step", batch=len(d.slots)):
                out.decode = self.decode_and_sample(d)
        return out

    @_mirrored
    def repair(self) -> bool:
        """After a failed step: replace any state buffer that the failure deleted (donated into a
        program that never returned) with a fresh one. Returns True when the KV/recurrent state
        lost a buffer, i.e. every slot's contents are now unknown."""
        def fresh(a):
            return jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding)

        lost = False
        for name in ("k", "v", "conv", "ssm"):
            buffers = getattr(self.cache, name, None) or []
            for i, a in enumerate(buffers):
                if isinstance(a, jax.Array) and a.is_deleted():
                    buffers[i], lost = fresh(a), True
        if any(a.is_deleted() for a in jax.tree_util.tree_leaves(self.sampler_state)):
            self.sampler_state = jax.tree_util.tree_map(
                lambda a: fresh(a) if a.is_deleted() else a, self.sampler_state)
        return lost

    def begin(self, slot: int, cached: int) -> None:
        """A sequence starts in `slot`, reusing its first `cached` positions. No reset is needed:
        attention positions past `cached` are overwritten before they are attended, and a recurrent
        state restarts from zero whenever a row's first position is 0 (the slot table only reuses a
        recurrent slot's full history)."""

    # ---- session state ------------------------------------------------------------------------------
    def export_slot(self, slot: int, n_tok: int) -> dict:
        return export_slot(self.cache, slot, n_tok)

    def import_slot(self, slot: int, arrays: dict) -> None:
        self.cache = import_slot(self.cache, slot, arrays)

    def export_rows(self, slot: int) -> dict:
        return export_rows(self.cache, slot)

    def slot_layout(self, n_tok: int) -> dict:
        return slot_layout(self.cache, n_tok)

    def positional(self) -> frozenset[str]:
        """The exported arrays that hold positions 0..n_tok-1 (a ring or a recurrent state: whole rows)."""
        return positional(self.cache)

    # ---- sampling --------------------------------------------------------------------------------
    @_mirrored
    def start_sampling(self, slot: int, params: SamplingParams, prompt: list[int] = ()) -> SlotSampling:
        """A request's sampling in `slot`: its bias, and the prompt's tokens for a repetition penalty."""
        params = params.sanitized(self.spec.n_vocab)
        ids, vals = bias_arrays(params, self.spec.n_vocab)
        seen = np.zeros(self.spec.n_vocab, np.bool_)
        if params.repetition_penalty != 1 and len(prompt):
            at = np.asarray(prompt, np.int64)
            seen[at[(at >= 0) & (at < self.spec.n_vocab)]] = True
        self.sampler_state = reset_slot(self.sampler_state, np.int32(slot), ids, vals, seen)
        return SlotSampling(params, prng_key_for(params.seed))

    def sample(self, logits: jax.Array, slots: list[int], sampling: list[SlotSampling],
               forced: list[int] | None = None, mask: np.ndarray | None = None) -> SampleOutput:
        """Sample one token per row of `logits` (rows past len(slots) are padding). Returns numpy.
        `forced[i] >= 0` replaces row i's choice (teacher forcing, e.g. closing a think block);
        its logprob is still the model's. `mask`: int32 [len(slots), words] grammar bitmask rows."""
        key, args, static = self._sample_program(logits, slots, sampling, forced, mask)
        with jax.profiler.TraceAnnotation("sample", batch=len(slots)):
            out, self.sampler_state = self.registry.call(key, sample, args, static)
            return jax.tree_util.tree_map(np.asarray, out)

    def _sample_program(self, logits, slots, sampling, forced, mask, advance: bool = True):
        """(key, args, static) of the sampler call on `logits` [b, V] (arrays or their shapes)."""
        b = logits.shape[0]
        batch, want_top = self._sampling_batch(b, slots, sampling, forced, mask, advance)
        key = GraphKey("sample", "segment", (b, want_top, mask is not None), program="sample")
        return key, (logits, self.sampler_state, batch), dict(want_top=want_top)

    def _sampling_batch(self, b: int, slots, sampling, forced, mask,
                        advance: bool = True) -> tuple[SamplingBatch, bool]:
        """`sample`'s rows padded to b (the padding samples into the scratch slot), and want_top.
        advance: count this step in each row's PRNG step (the caller does it when it runs)."""
        n = len(slots)
        rows = np.full(b, self.scratch, np.int32)
        rows[:n] = slots
        temp, top_p, min_p, presence, frequency = (np.zeros(b, np.float32) for _ in range(5))
        repetition = np.ones(b, np.float32)
        top_k, steps = np.zeros(b, np.int32), np.zeros(b, np.int32)
        keys = np.zeros((b, 2), np.uint32)
        force = np.full(b, -1, np.int32)
        if forced:
            force[:len(forced)] = forced
        for i, s in enumerate(sampling):
            p = s.params
            temp[i], top_p[i], top_k[i], min_p[i] = p.temperature, p.top_p, p.top_k, p.min_p
            presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            keys[i], steps[i] = s.key, s.step
            if advance:
                s.step += 1
        want_top = any(s.params.logprobs for s in sampling)  # the chosen token's log-probability too
        full = None
        if mask is not None:
            full = np.full((b, mask.shape[1]), -1, np.int32)
            full[:n] = mask
        return (SamplingBatch(rows, temp, top_k, top_p, min_p, presence, frequency, repetition, keys, steps, force, full),
                want_top)
