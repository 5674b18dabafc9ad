"""A scored prompt: /v1/completions with `echo` and `logprobs` gives each prompt token's
log-probability given the tokens before it (OpenAI's legacy API, vLLM's prompt logprobs: what
lm-evaluation-harness reads for log-likelihoods), checked against the model's own logits; the
scheduler's chunks, the prefix cache and streaming do not change them; `max_tokens: 0` with `echo`
returns the prompt alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pantheon.engine import chunks as chunks_module
from pantheon.engine.sampler import prompt_scores
from tests.web.inprocess import tiny_app

IDS = [1, 7, 42, 3, 99, 12, 5, 61, 8, 30, 2, 77, 19]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "prompt-logprobs")
    yield server
    server.close()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))


def reference(app, ids: list[int]) -> np.ndarray:
    """log_softmax of the model's logits at every position of ids, run alone from position 0 in the
    scratch slot (as the embeddings route runs its forward)."""
    engine = app.engine("tiny")
    runner = engine.runner
    logits = app.run(engine.call(lambda: np.asarray(runner.prefill(runner.scratch, ids, 0, all_logits=True))))
    return log_softmax(logits)


def score(app, ids, **body) -> tuple[int, dict]:
    status, reply, _ = app.post("/v1/completions", {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 3,
                                                    "temperature": 0, **body})
    return status, reply


def test_prompt_scores_against_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, (70, 300)).astype(np.float32)
    targets = rng.integers(0, 300, 69).tolist()
    ref = log_softmax(logits)
    for k in (0, 1, 5, 300):
        got = prompt_scores(logits, targets, k)
        np.testing.assert_allclose(got.logprob, ref[np.arange(69), targets], atol=2e-5)
        assert got.top_ids.shape == (69, k)
        if k:
            expect = np.argsort(-ref[:69], axis=1, kind="stable")[:, :k]
            np.testing.assert_array_equal(got.top_ids, expect)
            np.testing.assert_allclose(got.top_logprobs, np.take_along_axis(ref[:69], expect, axis=1), atol=2e-5)


def test_echo_with_logprobs_scores_the_prompt(app):
    ref = reference(app, IDS)
    status, reply = score(app, IDS, max_tokens=0)
    assert status == 200, reply
    (choice,) = reply["choices"]
    tok = app.engine("tiny").tokenizer
    assert choice["text"] == tok.decode(IDS) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(IDS) and lp["tokens"][1] == tok.token_bytes(IDS[1]).decode("utf-8", "replace")
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing before the first token
    want = [ref[i, IDS[i + 1]] for i in range(len(IDS) - 1)]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-4)
    for i, top in enumerate(lp["top_logprobs"][1:]):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(ref[i].max(), abs=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert reply["usage"] == {**reply["usage"], "prompt_tokens": len(IDS), "completion_tokens": 0}


def test_the_prompt_scores_come_before_the_completions(app):
    """With tokens to generate, the prompt's entries come first, then the completion's: the same as a
    plain request's logprobs. A repeat of the prompt (cached) is scored the same."""
    plain = app.post("/v1/completions", {"model": "tiny", "prompt": IDS, "max_tokens": 3, "logprobs": 2,
                                         "temperature": 0})[1]["choices"][0]
    for _ in range(2):
        status, reply = score(app, IDS, max_tokens=3, logprobs=2)
        assert status == 200
        choice = reply["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].endswith(plain["text"]) and len(lp["tokens"]) == len(IDS) + 3
        assert lp["tokens"][len(IDS):] == plain["logprobs"]["tokens"]
        # (the plain request found its prompt cached: its first token came from a decode row, other
        # kernels than a prefill chunk's, other summation orders)
        np.testing.assert_allclose(lp["token_logprobs"][len(IDS):], plain["logprobs"]["token_logprobs"], atol=5e-3)
        if _ == 0:
            first = lp["token_logprobs"]
        else:
            assert lp["token_logprobs"] == first


def test_scores_are_the_same_in_small_chunks(app, monkeypatch):
    """A prompt scored over several chunks (a 16-row bound on the logits a chunk may hold) gives the
    one-chunk scores: each chunk's first target is the token after it (an off-by-one would move every
    score by whole nats)."""
    whole = score(app, IDS * 3, max_tokens=0)[1]["choices"][0]["logprobs"]["token_logprobs"]
    monkeypatch.setattr(chunks_module, "SCORED_LOGITS", 16 * app.engine("tiny").spec.n_vocab)
    assert chunks_module.chunk_budget(0, alone=True, scored_vocab=app.engine("tiny").spec.n_vocab) == 16
    chunked = score(app, IDS * 3, max_tokens=0)[1]["choices"][0]["logprobs"]["token_logprobs"]
    assert whole[0] is None and chunked[0] is None and len(chunked) == len(IDS) * 3
    # (chunks of other sizes take other attention paths: other summation orders)
    np.testing.assert_allclose(chunked[1:], whole[1:], atol=1e-3)


def test_streamed_echo_carries_the_prompts_scores(app):
    status, events = app.stream("/v1/completions", {"model": "tiny", "prompt": IDS, "echo": True, "logprobs": 1,
                                                    "max_tokens": 2, "temperature": 0})
    assert status == 200 and events[-1] == "[DONE]"
    first = events[0]["choices"][0]
    assert first["text"] == app.engine("tiny").tokenizer.decode(IDS)
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == len(IDS)
    later = [e["choices"][0] for e in events[1:-1] if e["choices"] and e["choices"][0]["logprobs"]]
    assert sum(len(c["logprobs"]["tokens"]) for c in later) == 2  # then the two generated tokens
    status, events = app.stream("/v1/completions", {"model": "tiny", "prompt": IDS, "echo": True, "logprobs": 1,
                                                    "max_tokens": 0, "temperature": 0})
    texts = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
    assert "".join(texts) == app.engine("tiny").tokenizer.decode(IDS)  # the prompt alone
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_one_token_prompt_has_nothing_to_score(app):
    status, reply = score(app, [IDS[0]], max_tokens=0)
    assert status == 200
    lp = reply["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None] and lp["top_logprobs"] == [None] and len(lp["tokens"]) == 1


def test_scores_do_not_depend_on_what_else_runs(app):
    """A scored prompt takes the same chunks alone or while another request decodes (where an
    unscored prompt's chunks shrink to share the steps), so its scores are the same to the bit."""
    ids = (IDS * 16)[:140]  # chunked as an unscored prompt's, one chunk alone and 128 + 12 beside a stream
    body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0}
    alone = app.post("/v1/completions", body)[1]["choices"][0]["logprobs"]
    eos = app.engine("tiny").tokenizer.eog_ids

    async def beside():
        # a stream decoding before the scored request comes and after it is answered
        async with app.client.request("/v1/completions", method="POST",
                                      headers={"Content-Type": "application/json"}) as stream:
            await stream.send(json.dumps({"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 250, "stream": True,
                                          "temperature": 4.0, "top_k": 0, "top_p": 1.0, "seed": 3,
                                          "logit_bias": {str(t): -100 for t in eos}}).encode())
            await stream.send_complete()
            await stream.receive()  # its first tokens: decoding
            scored = await (await app.client.post("/v1/completions", json=body)).get_json()
            rest = b""
            while b"[DONE]" not in rest:
                rest += await stream.receive()
        return scored, rest.decode()

    scored, rest = app.run(beside())
    assert rest.count('"text"') > 10  # the stream went on decoding after the scored prompt was answered
    got = scored["choices"][0]["logprobs"]
    assert got["token_logprobs"] == alone["token_logprobs"] and got["top_logprobs"] == alone["top_logprobs"]


def test_every_choice_carries_the_prompts_scores(app):
    """n choices share one prompt: its first choice scores it, every choice carries the entries,
    each followed by its own tokens'."""
    status, reply = score(app, IDS, max_tokens=2, n=2, temperature=1.0, seed=5)
    assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1]
    first, second = (c["logprobs"] for c in reply["choices"])
    assert len(first["tokens"]) == len(second["tokens"]) == len(IDS) + 2
    assert first["token_logprobs"][:len(IDS)] == second["token_logprobs"][:len(IDS)]
    assert first["token_logprobs"][0] is None and all(v is not None for v in first["token_logprobs"][1:])
