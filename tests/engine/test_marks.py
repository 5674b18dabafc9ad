"""A slot marks its sliding rings and recurrent states at the end of each prompt and where its
last user turn starts (SlotTable.mark, llama.cpp's context checkpoints): a later prompt that shares
that much but not what followed resumes there, with the rows put back, where the history alone
cannot be rewound that far. The recurrent case (qwen35moe) is tested in test_hybrid_engine.py;
here, sliding rings."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.config import ModelConfig
from pantheon.engine.engine import Engine
from pantheon.engine.events import Delta, GenerationRequest, RequestEnd
from pantheon.engine.sampler import SamplingParams
from pantheon.engine import sessions
from pantheon.engine.sessions import Mark, SlotTable
from pantheon.model.state import rewind
from tests.fixtures.tiny_models import write_tiny_llama

WINDOW, CTX = 256, 2048  # a ring of 1280 positions: a slot rewinds at most 512 past its history's end


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("marks") / "g.gguf", n_layer=2, seed=5, arch="gemma3",
                            qk_norm=True, extra_metadata={"gemma3.attention.sliding_window": WINDOW,
                                                          "gemma3.attention.sliding_window_pattern": 2,
                                                          "gemma3.context_length": CTX})
    return Engine(ModelConfig(str(path), ctx_cap=CTX, max_sessions=2, max_concurrent=2))


def generate(engine, prompt, n, session=None, mark_at=None):
    eog = engine.tokenizer.eog_ids  # banned: n tokens, unless the text loops (a tiny model's does)
    params = SamplingParams(temperature=0.0, logit_bias=tuple((t, -100.0) for t in eog))
    tokens, end = [], []

    def emit(ev):
        if isinstance(ev, Delta):
            tokens.extend(t.token for t in ev.tokens)
        elif isinstance(ev, RequestEnd):
            end.append(ev)

    engine.run_sync(GenerationRequest(list(prompt), [params], n, session_id=session, mark_at=mark_at), emit)
    return tokens, end[0]


def test_a_prompt_past_the_rings_rewind_resumes_from_its_mark(gemma, monkeypatch):
    assert rewind(gemma.spec, CTX) == 512
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 60, 300)]
    turn2 = prompt + [5, 6, 7, 42, 43]  # the first turn's reply rendered otherwise, then a new turn
    cold, end_cold = generate(gemma, turn2, 8)
    assert end_cold.cached_tokens == 0
    # 530 tokens past the prompt, past the rewind: the tiny model's text loops, and a loop would end it
    from pantheon.engine.sequence import Sequence

    with monkeypatch.context() as m:
        m.setattr(Sequence, "compelled", property(lambda self: True))  # as under a grammar: no loop stop
        _, first = generate(gemma, prompt, 530, session="g-mark")
    assert first.completion_tokens == 530
    resumes = gemma.table.resumes
    warm, end = generate(gemma, turn2, 8, session="g-mark")
    assert end.cached_tokens == len(prompt) and gemma.table.resumes == resumes + 1
    assert warm == cold


def test_a_mark_serves_only_the_tokens_it_stands_on():
    from pantheon.engine.host_budget import HostBudget

    filled, budget = [], HostBudget(10_000)
    table = SlotTable(1, 1, fill=lambda i, arrays: filled.append(arrays), host=budget)
    slot = table.slots[0]
    table.rewind = 2
    slot.tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    table.mark(slot, [1, 2, 3, 4], {"rows": np.zeros(100, np.uint8)})
    assert budget.used == 100  # a mark's bytes come from the host tier's budget
    assert table.reusable(slot, [1, 2, 3, 4, 9]) == 4  # history alone: 8 - 4 > rewind 2
    assert table.reusable(slot, [1, 2, 3, 9]) == 0  # the prompt leaves the mark's tokens
    assert table.reusable(slot, [1, 2, 3, 4]) == 3 - 3  # nothing left to prefill past the mark: no reuse from it
    slot.tokens = [1, 2, 3, 0, 5, 6, 7, 8]  # the slot now holds other tokens under the mark
    assert table.reusable(slot, [1, 2, 3, 4, 9]) == 0
    slot.tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    got, cached = table.acquire(None, [1, 2, 3, 4, 9])
    assert got is slot and cached == 4 and len(filled) == 1 and slot.tokens == [1, 2, 3, 4]
    table.release_slot(slot, [1, 2, 3, 4, 9, 10])
    got, cached = table.acquire(None, [1, 2, 7])  # a prefill from before the mark overwrites it
    assert cached == 0 and slot.marks == [] and budget.used == 0
    table.release_slot(slot, [1, 2, 7, 8])
    for n in (1, 2, 3, 4):  # at most MAX_MARKS; the one nearest the start stays
        table.mark(slot, [1, 2, 7, 8][:n], {"rows": np.zeros(1000, np.uint8)})
    assert [m.n for m in slot.marks] == [1, 3, 4] and sessions.MAX_MARKS == 3 and budget.used == 3000
    table.mark(slot, [1, 2, 7, 8, 9], {"rows": np.zeros(9000, np.uint8)})  # past the budget: no mark
    assert [m.n for m in slot.marks] == [1, 3, 4] and budget.used == 3000
    table.drop_marks()  # the model unloads
    assert slot.marks == [] and budget.used == 0


def test_a_short_prompt_is_not_marked(gemma):
    assert sessions.MARK_MIN_TOKENS == 256
    assert gemma.mark_rows(0, 100) == {}
    rows = gemma.mark_rows(0, 300)
    assert rows and set(rows) == set(gemma.runner.slot_layout(1)) - gemma.runner.positional()


def test_a_conversation_sharing_only_the_system_prompt_resumes_where_its_user_turn_starts(gemma, monkeypatch):
    """Two conversations with the same long system prompt (two Claude Code sessions: ~20k tokens of
    instructions and tools) and different user turns: once the first has run on past the ring's
    rewind, the second resumes at the mark where its user turn starts, not from 0."""
    from pantheon.engine.chat import plan_chat
    from pantheon.engine.sequence import Sequence
    from pantheon.web.chat_request import parse_chat_request

    system = " ".join(f"rule {i}: be exact." for i in range(60))  # ~1100 tokens of the tiny vocabulary
    chat = lambda question: parse_chat_request({"messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": question}]})
    first, second = plan_chat(gemma, chat("What is 2 + 2?")).request, plan_chat(gemma, chat("Name a colour.")).request
    at = first.mark_at  # where the user turn starts: the system prompt's tokens before it
    assert at is not None and at == second.mark_at > 1000 and first.prompt_ids[:at] == second.prompt_ids[:at]
    assert first.prompt_ids != second.prompt_ids
    cold, end = generate(gemma, second.prompt_ids, 8, mark_at=at)
    with monkeypatch.context() as m:  # the first conversation runs 600 tokens on: its ring moves past the rewind
        m.setattr(Sequence, "compelled", property(lambda self: True))
        _, end = generate(gemma, first.prompt_ids, 600, mark_at=at)
    assert end.completion_tokens == 600
    resumes = gemma.table.resumes
    warm, end = generate(gemma, second.prompt_ids, 8, mark_at=at)
    assert end.cached_tokens == at and gemma.table.resumes == resumes + 1
    assert warm == cold


def test_a_system_prompt_inside_the_first_user_turn_is_marked_where_the_users_text_starts(gemma, monkeypatch):
    """Gemma's template has no system turn: the system prompt opens the first user turn, so no
    rendering of the conversation before that turn is a prefix of the prompt. The mark then goes
    where the user's own text starts, and a second conversation with the same system prompt
    resumes there."""
    from pantheon.engine.chat import plan_chat
    from pantheon.engine.sequence import Sequence
    from pantheon.web.chat_request import parse_chat_request

    engine = Engine(ModelConfig(str(gemma.path), ctx_cap=CTX, max_sessions=2, max_concurrent=2, chat_template="gemma"))
    try:
        system = " ".join(f"rule {i}: be exact." for i in range(60))
        chat = lambda question: parse_chat_request({"messages": [{"role": "system", "content": system},
                                                                {"role": "user", "content": question}]})
        first, second = (plan_chat(engine, chat(q)) for q in ("What is 2 + 2?", "Name a colour."))
        first, second = first.request, second.request
        at = first.mark_at
        assert at is not None and at == second.mark_at > 1000 and first.prompt_ids[:at] == second.prompt_ids[:at]
        text = engine.tokenizer.decode(first.prompt_ids[:at])
        assert text.startswith("<start_of_turn>user\n" + system) and not text.endswith("What")
        assert engine.tokenizer.decode(first.prompt_ids).startswith(text + "What is 2 + 2?")
        cold, _ = generate(engine, second.prompt_ids, 8, mark_at=at)
        with monkeypatch.context() as m:
            m.setattr(Sequence, "compelled", property(lambda self: True))
            _, end = generate(engine, first.prompt_ids, 600, mark_at=at)
        resumes = engine.table.resumes
        warm, end = generate(engine, second.prompt_ids, 8, mark_at=at)
        assert end.cached_tokens == at and engine.table.resumes == resumes + 1 and warm == cold
    finally:
        engine.stop()
