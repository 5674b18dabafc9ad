"""A slot marks its sliding rings and recurrent states at the end of each prompt (SlotTable.mark,
llama.cpp's context checkpoint): a later prompt that shares that prompt but not what followed it
resumes there, with the rows put back, where the history alone cannot be rewound that far. The
recurrent case (qwen35moe) is tested in test_hybrid_engine.py; here, sliding rings."""

from __future__ import annotations

import numpy as np
import pytest

import pantheon.engine.engine as engine_module
from pantheon.config import ModelConfig
from pantheon.engine.engine import Engine
from pantheon.engine.events import Delta, GenerationRequest, RequestEnd
from pantheon.engine.sampler import SamplingParams
from pantheon.engine.sessions import Mark, Slot, SlotTable
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


def generate(engine, prompt, n, session=None):
    eog = engine.tokenizer.eog_ids  # banned: n tokens, unless the text loops (a tiny model's does)
    params = SamplingParams(temperature=0.0, logit_bias=tuple((t, -100.0) for t in eog))
    tokens, end = [], []

    def emit(ev):
        if isinstance(ev, Delta):
            tokens.extend(t.token for t in ev.tokens)
        elif isinstance(ev, RequestEnd):
            end.append(ev)

    engine.run_sync(GenerationRequest(list(prompt), [params], n, session_id=session), emit)
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
    filled = []
    table = SlotTable(1, 1, fill=lambda i, arrays: filled.append(arrays))
    slot = table.slots[0]
    table.rewind = 2
    slot.tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    slot.mark = Mark([1, 2, 3, 4], {"rows": 0})
    assert table.reusable(slot, [1, 2, 3, 4, 9]) == 4  # history alone: 8 - 4 > rewind 2
    assert table.reusable(slot, [1, 2, 3, 9]) == 0  # the prompt leaves the mark's tokens
    assert table.reusable(slot, [1, 2, 3, 4]) == 3 - 3  # nothing left to prefill past the mark: no reuse from it
    slot.tokens = [1, 2, 3, 0, 5, 6, 7, 8]  # the slot now holds other tokens under the mark
    assert table.reusable(slot, [1, 2, 3, 4, 9]) == 0
    slot.tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    got, cached = table.acquire(None, [1, 2, 3, 4, 9])
    assert got is slot and cached == 4 and filled == [{"rows": 0}] and slot.tokens == [1, 2, 3, 4]
    table.release_slot(slot, [1, 2, 3, 4, 9, 10])
    got, cached = table.acquire(None, [1, 2, 7])  # a prefill from before the mark overwrites it
    assert cached == 0 and slot.mark is None


def test_a_short_prompt_is_not_marked(gemma):
    assert engine_module.MARK_MIN_TOKENS == 256
    assert gemma.mark_rows(0, 100) == {}
    rows = gemma.mark_rows(0, 300)
    assert rows and set(rows) == set(gemma.runner.slot_layout(1)) - gemma.runner.positional()
