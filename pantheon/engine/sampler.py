"""Token sampling on the device, for every batch row in one jitted call.

Per-row parameters arrive as arrays, so one compiled function serves any mix of greedy and
sampled requests. Per-slot state (generated-token counts for the penalties, the prompt's tokens for
the repetition penalty, the dense logit-bias row) lives on the device beside the KV cache and is
indexed by slot."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 1e4  # past this every distribution is already uniform in float32
REPETITION_RANGE = (0.01, 10.0)  # a repetition penalty is clamped here (1: off)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, already defaulted and clamped (see web layer)."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0  # alternatives per token; clamped to [0, 20]
    logprobs: bool = False
    min_p: float = 0.0  # drop candidates less likely than min_p x the likeliest (0: off)
    # a prompt or generated token's logit divided by this when positive, multiplied when not (1: off)
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def sanitized(self, n_vocab: int) -> "SamplingParams":
        """Every field inside the range the sampler's device arrays hold, whatever a caller passed:
        one request's parameters must never fail the batch it shares (an int32 overflow, a NaN)."""
        def num(x, lo, hi, default):
            x = float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else default
            return default if x != x else min(max(x, lo), hi)  # NaN -> default

        top_k = int(num(self.top_k, 0, n_vocab, 0))  # <= 0 (or past the vocabulary): no top-k cut
        return replace(self, temperature=num(self.temperature, 0.0, MAX_TEMPERATURE, 0.7),
                       top_p=num(self.top_p, 0.0, 1.0, 1.0), top_k=top_k,
                       presence_penalty=num(self.presence_penalty, -2.0, 2.0, 0.0),
                       frequency_penalty=num(self.frequency_penalty, -2.0, 2.0, 0.0),
                       top_logprobs=int(num(self.top_logprobs, 0, MAX_TOP_LOGPROBS, 0)),
                       min_p=num(self.min_p, 0.0, 1.0, 0.0),
                       repetition_penalty=num(self.repetition_penalty, *REPETITION_RANGE, 1.0),
                       logit_bias=tuple((int(i), num(b, -100.0, 100.0, 0.0)) for i, b in self.logit_bias
                                        if isinstance(i, int) and 0 <= i < n_vocab))


def prng_key_for(seed: int | None) -> np.ndarray:
    """Raw uint32[2] key data: from the seed when given (reproducible), else from the OS."""
    seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed & 0xFFFF_FFFF_FFFF_FFFF
    return np.array([seed >> 32, seed & 0xFFFF_FFFF], dtype=np.uint32)  # threefry key data


@jax.tree_util.register_dataclass
@dataclass
class SamplerState:
    counts: jax.Array  # int32 [slots + 1, V]: tokens generated so far per slot (penalties)
    bias: jax.Array  # float32 [slots + 1, V]: the request's logit_bias as a dense row
    prompt: jax.Array  # bool [slots + 1, V]: the request's prompt tokens (the repetition penalty)


def allocate_sampler_state(n_slots: int, n_vocab: int) -> SamplerState:
    return SamplerState(jnp.zeros((n_slots + 1, n_vocab), jnp.int32), jnp.zeros((n_slots + 1, n_vocab), jnp.float32),
                        jnp.zeros((n_slots + 1, n_vocab), jnp.bool_))


@partial(jax.jit, donate_argnames=("state",))
def reset_slot(state: SamplerState, slot, bias_ids, bias_values, prompt_row) -> SamplerState:
    """Start a new request in `slot`: zero its counts, install its logit bias (padded id entries =
    -1) and its prompt's tokens (bool [V], all false without a repetition penalty)."""
    row = jnp.zeros(state.bias.shape[1], jnp.float32).at[bias_ids].set(bias_values, mode="drop")
    return SamplerState(state.counts.at[slot].set(0), state.bias.at[slot].set(row), state.prompt.at[slot].set(prompt_row))


def bias_arrays(params: SamplingParams, n_vocab: int, width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """logit_bias as fixed-width (ids, values); out-of-vocab ids are dropped here."""
    items = [(i, b) for i, b in params.logit_bias if 0 <= i < n_vocab]
    width = max(width, 1 << max(0, len(items) - 1).bit_length())
    ids = np.full(width, -1, np.int32)
    vals = np.zeros(width, np.float32)
    for j, (i, b) in enumerate(items):
        ids[j], vals[j] = i, b
    ids[ids < 0] = n_vocab  # out of range -> dropped by the scatter
    return ids, vals


@jax.tree_util.register_dataclass
@dataclass
class SampleOutput:
    tokens: jax.Array  # int32 [B]
    logprob: jax.Array  # float32 [B]: log-probability of the chosen token under the model
    top_ids: jax.Array  # int32 [B, 20]
    top_logprobs: jax.Array  # float32 [B, 20]
    # the sampler's own distribution, after bias, penalties, grammar, temperature, top-k and top-p
    # (llama-server's post_sampling_probs): the chosen token's probability in it, and its 20
    # likeliest candidates with theirs (a greedy row: the argmax, with 1); zeros without want_top
    post_prob: jax.Array  # float32 [B]
    post_ids: jax.Array  # int32 [B, 20]
    post_probs: jax.Array  # float32 [B, 20]


@dataclass
class PromptScores:
    """A scored prompt chunk (GenerationRequest.prompt_logprobs): for each position, the
    log-probability of the prompt's next token, and the likeliest tokens with theirs."""

    logprob: np.ndarray  # float32 [n]
    top_ids: np.ndarray  # int32 [n, k]
    top_logprobs: np.ndarray  # float32 [n, k]


SCORE_ROWS = 32  # rows of logits taken at once: the temporaries stay ~3 x 32 x V floats


def prompt_scores(logits: np.ndarray, targets: list[int], k: int) -> PromptScores:
    """Under log_softmax of each row of logits [>= n, V]: targets[i]'s value (n = len(targets)), and
    the k largest, likeliest first (ties by id). On the host: prompts come in every length, and a
    compiled program per length would cost more than the arithmetic."""
    n = len(targets)
    out = PromptScores(np.empty(n, np.float32), np.empty((n, k), np.int32), np.empty((n, k), np.float32))
    for r0 in range(0, n, SCORE_ROWS):
        x = np.asarray(logits[r0:min(n, r0 + SCORE_ROWS)], np.float32)
        peak = x.max(axis=1, keepdims=True)
        lse = peak[:, 0] + np.log(np.exp(x - peak).sum(axis=1, dtype=np.float64)).astype(np.float32)
        rows = np.arange(len(x))
        out.logprob[r0:r0 + len(x)] = x[rows, np.asarray(targets[r0:r0 + len(x)])] - lse
        if not k:
            continue
        if k == 1:  # the common ask (is the prompt's token the greedy one?): an argmax, ~100x argpartition
            ids = x.argmax(axis=1)[:, None]
        else:
            part = np.argpartition(-x, k - 1, axis=1)[:, :k] if k < x.shape[1] else np.tile(np.arange(x.shape[1]), (len(x), 1))
            ids = np.take_along_axis(part, np.lexsort((part, -np.take_along_axis(x, part, axis=1)), axis=1), axis=1)
        out.top_ids[r0:r0 + len(x)] = ids
        out.top_logprobs[r0:r0 + len(x)] = np.take_along_axis(x, ids, axis=1) - lse[:, None]
    return out


CANDIDATES = 128  # rows whose top_k fits here sample from a partial top-k, not a full-vocab sort


def _rank_noise(key, width: int):
    """Gumbel noise per candidate rank. The first CANDIDATES ranks draw the same numbers at any
    width, so a row samples the same token on the partial and the full-sort path: a row's result
    never depends on which path its batch-mates needed."""
    head = jax.random.gumbel(jax.random.fold_in(key, 0), (min(width, CANDIDATES),))
    if width <= CANDIDATES:
        return head
    return jnp.concatenate([head, jax.random.gumbel(jax.random.fold_in(key, 1), (width - CANDIDATES,))])


def first_argmax(x):
    """jnp.argmax over the last axis (the first index of the maximum; of the first NaN if any) as
    two vectorised reductions: XLA:CPU runs argmax's (value, index) reduce one element at a time,
    1.24 ms over Gemma 3's 262k-token vocabulary against 0.45 for this (~9 % of its decode step)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


GROUP = 64  # elements per group of top_candidates' first pass


def top_candidates(x, width: int):
    """jax.lax.top_k(x, width) over the last axis (the same values and ids, ties to the lower id),
    in two passes where the vocabulary is large: the maximum of each group of GROUP entries, the
    `width` best groups (ties to the lower group), then top-k over those groups' entries, gathered
    in id order. Every entry of the top `width` lies in one of those groups (there are >= width
    entries at least as large as the width-th best group maximum), and groups are ranges of ids,
    so ties resolve as in one pass. Gemma 3's 262k vocabulary: 0.42 -> ~0.1 ms a row on the CPU."""
    v = x.shape[-1]
    if v < 4 * width * GROUP:  # a pass over few groups gains nothing
        return jax.lax.top_k(x, width)
    n_groups = -(-v // GROUP)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n_groups * GROUP - v)], constant_values=-jnp.inf)
    grouped = padded.reshape(*x.shape[:-1], n_groups, GROUP)
    _, best = jax.lax.top_k(jnp.max(grouped, axis=-1), width)  # [..., width] group ids
    best = jnp.sort(best, axis=-1)  # id order, so that ties among candidates go to the lower id
    entries = jnp.take_along_axis(grouped, best[..., None], axis=-2).reshape(*x.shape[:-1], width * GROUP)
    ids = (best[..., None] * GROUP + jnp.arange(GROUP)).reshape(*x.shape[:-1], width * GROUP)
    vals, at = jax.lax.top_k(entries, width)
    return vals, jnp.take_along_axis(ids, at, axis=-1)


def _sample_sorted(x, temperature, top_k, top_p, min_p, row_keys, width: int):
    """logits -> (sampled ids, the chosen one's probability among the kept candidates, the first
    MAX_TOP_LOGPROBS candidates' ids and probabilities), restricted to the `width` best candidates.
    Only the candidates are divided by the temperature (dividing every logit was a pass over the
    vocabulary each step: 0.06 ms of Gemma 3's 262k)."""
    vals, ids = top_candidates(x, width)  # descending
    vals = vals / jnp.maximum(temperature, 1e-6)[:, None]
    k = jnp.where(top_k <= 0, width, jnp.minimum(top_k, width))
    keep = jnp.arange(width)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (mass_before < top_p[:, None])  # the top token is always kept
    # min-p: p / p_max >= min_p (written on the probabilities: the same test on the logits,
    # vals >= vals_max + log(min_p), made this call 7-12x slower on XLA:CPU, measured)
    keep = keep & (probs >= min_p[:, None] * probs[:, :1])
    noise = jax.vmap(lambda key: _rank_noise(key, width))(row_keys)
    choice = first_argmax(jnp.where(keep, vals + noise, -jnp.inf))  # Gumbel-max = categorical
    kept = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)  # what the choice was drawn from
    n = min(MAX_TOP_LOGPROBS, width)
    post = jnp.pad(kept[:, :n], ((0, 0), (0, MAX_TOP_LOGPROBS - n)))
    post_ids = jnp.pad(ids[:, :n], ((0, 0), (0, MAX_TOP_LOGPROBS - n)))
    return (jnp.take_along_axis(ids, choice[:, None], axis=1)[:, 0],
            jnp.take_along_axis(kept, choice[:, None], axis=1)[:, 0], post_ids.astype(jnp.int32), post)


def unpack_bitmask(mask, n_vocab: int):
    """int32 [B, ceil(V/32)] grammar bitmask (bit j of word i = token 32i + j) -> bool [B, V]."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :n_vocab].astype(bool)


@partial(jax.tree_util.register_dataclass, meta_fields=(),
         data_fields=("slots", "temperature", "top_k", "top_p", "min_p", "presence", "frequency", "repetition", "keys",
                      "steps", "forced", "mask"))
@dataclass(frozen=True)
class SamplingBatch:
    """One sampling call's per-row arguments, B rows (a pytree: one argument of the compiled
    programs, not ten)."""

    slots: Any  # int32 [B]: each row's sampler-state slot
    temperature: Any  # f32 [B]
    top_k: Any  # int32 [B]
    top_p: Any  # f32 [B]
    min_p: Any  # f32 [B]
    presence: Any  # f32 [B]
    frequency: Any  # f32 [B]
    repetition: Any  # f32 [B]
    keys: Any  # uint32 [B, 2]: the rows' PRNG keys
    steps: Any  # int32 [B]: folded into the keys
    forced: Any  # int32 [B]: a token that replaces the row's choice when >= 0
    mask: Any = None  # int32 [B, ceil(V/32)] grammar bitmask (all ones for unconstrained rows), or None


@partial(jax.jit, static_argnames=("want_top",), donate_argnames=("state",))
def sample(logits, state: SamplerState, batch: SamplingBatch, want_top: bool = False):
    """logits: f32 [B, V]; batch: the rows' parameters (SamplingBatch).

    Order: logit bias, the repetition penalty (prompt and generated tokens, as vLLM and
    transformers apply it), presence and frequency penalties (generated tokens, OpenAI's), then
    greedy argmax or temperature -> top-k -> top-p -> min-p -> categorical. Logprobs are of the
    unmodified model distribution, computed only with want_top (a row asked for logprobs: the
    chosen token's, and its likeliest alternatives); without it `logprob` and the top arrays are zeros.
    A batch that is all greedy skips sampling; one whose top_k all fit CANDIDATES skips the sort."""
    n_vocab = logits.shape[-1]
    b = batch
    slots, temperature, top_k, top_p, keys, steps = b.slots, b.temperature, b.top_k, b.top_p, b.keys, b.steps
    x = logits + state.bias[slots]
    # penalties only where a row has one: the counts' [B, V] gather and arithmetic are skipped
    def penalised():
        counts = state.counts[slots]
        r = b.repetition[:, None]
        seen = (r != 1) & ((counts > 0) | state.prompt[slots])
        y = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
        return y - b.presence[:, None] * (counts > 0) - b.frequency[:, None] * counts

    x = jax.lax.cond(jnp.any((b.presence != 0) | (b.frequency != 0) | (b.repetition != 1)), penalised, lambda: x)
    if b.mask is not None:
        x = jnp.where(unpack_bitmask(b.mask, n_vocab), x, -jnp.inf)
    # the argmax over the vocabulary only where a row is greedy
    greedy_ids = jax.lax.cond(jnp.all(temperature > 0), lambda: jnp.zeros(x.shape[0], jnp.int32),
                              lambda: first_argmax(x).astype(jnp.int32))

    sampled_rows = temperature > 0
    row_keys = jax.vmap(lambda kd, s: jax.random.fold_in(jax.random.wrap_key_data(kd), s))(keys, steps)
    needs_full = jnp.any(sampled_rows & ((top_k <= 0) | (top_k > CANDIDATES)))
    width = min(CANDIDATES, n_vocab)
    rows = x.shape[0]
    none_sampled = lambda: (greedy_ids, jnp.zeros(rows, jnp.float32),  # noqa: E731
                            jnp.zeros((rows, MAX_TOP_LOGPROBS), jnp.int32), jnp.zeros((rows, MAX_TOP_LOGPROBS)))
    sample_any = lambda: jax.lax.cond(  # noqa: E731
        needs_full, lambda: _sample_sorted(x, temperature, top_k, top_p, b.min_p, row_keys, n_vocab),
        lambda: _sample_sorted(x, temperature, top_k, top_p, b.min_p, row_keys, width))
    sampled, sampled_prob, sampled_post_ids, sampled_post = jax.lax.cond(jnp.any(sampled_rows), sample_any,
                                                                         none_sampled)
    tokens = jnp.where(sampled_rows, sampled, greedy_ids).astype(jnp.int32)
    tokens = jnp.where(b.forced >= 0, b.forced, tokens)

    if want_top:
        # log-probabilities as jax.nn.log_softmax computes them, (logit - max) - log(sum(exp(logits - max))),
        # for the entries wanted only: the full [B, V] array is never written (two passes over the
        # vocabulary, skipped where no row asked: 0.2 ms of Gemma 3's step)
        top = jnp.max(logits, axis=-1, keepdims=True)
        log_sum = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
        chosen_lp = ((jnp.take_along_axis(logits, tokens[:, None], axis=1) - top) - log_sum)[:, 0]
        top_lp, top_ids = top_candidates(logits, MAX_TOP_LOGPROBS)
        top_lp = (top_lp - top) - log_sum
        # a greedy row's sampler keeps its argmax alone: probability 1 (top_candidates' first is
        # first_argmax's choice: ties to the lower id in both)
        _, greedy_post_ids = top_candidates(x, MAX_TOP_LOGPROBS)
        one_hot = (jnp.arange(MAX_TOP_LOGPROBS) == 0).astype(jnp.float32)
        post_ids = jnp.where(sampled_rows[:, None], sampled_post_ids, greedy_post_ids).astype(jnp.int32)
        post_probs = jnp.where(sampled_rows[:, None], sampled_post, one_hot[None, :])
        post_prob = jnp.where(sampled_rows, sampled_prob, 1.0)
        forced_prob = jnp.sum(jnp.where(post_ids == tokens[:, None], post_probs, 0.0), axis=-1)
        post_prob = jnp.where(b.forced >= 0, forced_prob, post_prob)  # a forced token: as the sampler saw it
    else:
        chosen_lp = jnp.zeros(rows, jnp.float32)
        top_lp = jnp.zeros((rows, MAX_TOP_LOGPROBS), jnp.float32)
        top_ids = jnp.zeros((rows, MAX_TOP_LOGPROBS), jnp.int32)
        post_ids, post_probs, post_prob = top_ids, top_lp, jnp.zeros(rows, jnp.float32)
    new_state = SamplerState(state.counts.at[slots, tokens].add(1), state.bias, state.prompt)
    return SampleOutput(tokens, chosen_lp, top_ids.astype(jnp.int32), top_lp, post_prob, post_ids, post_probs), \
        new_state
