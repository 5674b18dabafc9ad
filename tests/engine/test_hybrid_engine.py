"""The hybrid qwen35moe model through the engine: the scheduler's greedy decode reproduces
llama.cpp's greedy continuations; a session resumes from its recurrent state (prefix cache); an
exported session restores and continues token-identically."""

from __future__ import annotations

import json

import pytest

from pantheon.config import ModelConfig
from pantheon.engine.engine import Engine
from pantheon.engine.events import ChoiceEnd, Delta, GenerationRequest, RequestEnd
from pantheon.engine.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0.0, logprobs=True)


@pytest.fixture(scope="module")
def engine(qwen35moe_f32_gguf):
    return Engine(ModelConfig(str(qwen35moe_f32_gguf), ctx_cap=256, max_sessions=2, max_concurrent=2))


@pytest.fixture(scope="module")
def greedy_ref(reference_dir):
    return json.loads((reference_dir / "qwen35moe" / "ref" / "greedy.json").read_text())["f32"]


def generate(engine, prompt, n, session=None):
    tokens, end = [], {}

    def emit(ev):
        if isinstance(ev, Delta):
            tokens.extend(t.token for t in ev.tokens)
        elif isinstance(ev, (RequestEnd, ChoiceEnd)):
            end[type(ev).__name__] = ev

    engine.run_sync(GenerationRequest(list(prompt), [GREEDY], n, session_id=session), emit)
    return tokens, end["RequestEnd"]


@pytest.mark.parametrize("seq", ["s5", "s33"])
def test_scheduler_greedy_reproduces_llamacpp_continuation(engine, greedy_ref, seq):
    tokens, end = generate(engine, greedy_ref["prompt"][seq], 24)
    assert tokens == greedy_ref["generated"][seq]
    assert end.completion_tokens == 24


def test_second_turn_resumes_from_the_recurrent_state(engine, greedy_ref):
    prompt = greedy_ref["prompt"]["s33"]
    first, end1 = generate(engine, prompt, 6, session="h-1")
    history = prompt + first  # the last generated token was sampled, not fed: it is part of turn 2's prompt
    turn2 = history + [42, 43, 44]
    cold, _ = generate(engine, turn2, 8)
    warm, end2 = generate(engine, turn2, 8, session="h-1")
    assert end2.cached_tokens == len(prompt) + len(first) - 1
    assert warm == cold
    # a prompt that diverges inside the history cannot rewind a recurrent state: cold prefill
    _, end3 = generate(engine, prompt[:10] + [7, 7, 7], 2, session="h-1")
    assert end3.cached_tokens == 0


def test_export_restore_continues_token_identically(engine, greedy_ref):
    prompt = greedy_ref["prompt"]["s5"]
    first, _ = generate(engine, prompt, 5, session="h-exp")
    out = engine.export_session("h-exp")
    assert out["n_tok"] == len(prompt) + 4 and any(k.startswith("ssm.") for k in engine.runner.slot_layout(1))
    engine.table.release("h-exp")
    restored = engine.restore_session("h-new", out["blob"], out["tokens"])
    assert restored["n_tok"] == out["n_tok"]
    turn2 = out["tokens"] + [first[-1], 11, 12]
    warm, end = generate(engine, turn2, 6, session="h-new")
    cold, _ = generate(engine, turn2, 6)
    assert end.cached_tokens == out["n_tok"] and warm == cold


def test_a_failed_step_leaves_the_hybrid_model_serving_llamacpp_tokens(engine, greedy_ref):
    """A step fault mid-forward has already updated some layers' recurrent state in place: the slot
    is forgotten (the turn re-prefills), and the next requests still give llama.cpp's tokens."""
    from pantheon.faults import FAULTS
    from pantheon.engine.events import RequestError

    prompt = greedy_ref["prompt"]["s33"]
    first, _ = generate(engine, prompt, 4, session="h-fail")
    errors = []
    FAULTS.set("step", 1)
    engine.run_sync(GenerationRequest(prompt + first + [5, 6], [GREEDY], 4, session_id="h-fail"),
                    lambda ev: isinstance(ev, RequestError) and errors.append(ev))
    assert errors and errors[0].type == "server_error"
    _, end = generate(engine, prompt + first + [5, 6], 2, session="h-fail")
    assert end.cached_tokens == 0  # the state of the failed turn's slot was unknown: re-prefilled
    tokens, _ = generate(engine, greedy_ref["prompt"]["s5"], 24)
    assert tokens == greedy_ref["generated"]["s5"]


def test_a_turn_that_rewrites_the_reply_resumes_from_the_prompts_mark(engine, greedy_ref, monkeypatch):
    """A recurrent state cannot be rewound, so a turn whose history is not a prefix of its prompt
    (the client re-rendered the reply: a think block stripped, arguments re-serialised) used to
    re-prefill everything. The slot marks its rows at the end of each prompt (llama.cpp's context
    checkpoint): such a turn resumes there, token-identical to a cold prefill."""
    from pantheon.engine import sessions

    monkeypatch.setattr(sessions, "MARK_MIN_TOKENS", 1)  # the fixture's prompts are short
    prompt = greedy_ref["prompt"]["s33"]
    turn2 = prompt + [5, 6, 7, 42, 43]  # the reply as the client renders it, then the next user turn
    cold, end_cold = generate(engine, turn2, 8)
    assert end_cold.cached_tokens == 0
    first, _ = generate(engine, prompt, 6, session="h-mark")
    assert first[:3] != [5, 6, 7]  # the history is no prefix of turn 2
    resumes = engine.table.resumes
    warm, end2 = generate(engine, turn2, 8, session="h-mark")
    assert end2.cached_tokens == len(prompt) and engine.table.resumes == resumes + 1
    assert warm == cold
