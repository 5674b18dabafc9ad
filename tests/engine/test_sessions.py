"""SlotTable: conversations under one id, the host tier (spill/fill), capacity without lock-out,
anonymous requests that never destroy a session's KV, restore. A fake device stands in for the
runner: each slot's "KV" row holds the token ids it was computed from, so every turn can check that
the cached prefix it is served really is its prompt's."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.engine.host_budget import HostBudget
from pantheon.engine.sessions import CapacityError, Parked, SlotTable

CTX = 256
TOKEN_BYTES = 8  # one int64 per position in the fake cache


class FakeDevice:
    def __init__(self, n_slots: int):
        self.kv = np.full((n_slots, CTX), -1, np.int64)
        self.spills = self.fills = 0

    def spill(self, slot: int, n_tok: int) -> dict:
        self.spills += 1
        return {"k.0": self.kv[slot, :n_tok].copy()}

    def fill(self, slot: int, arrays: dict) -> None:
        self.fills += 1
        row = arrays["k.0"]
        self.kv[slot, :len(row)] = row


def table(n_slots=4, max_sessions=4, host_bytes=1 << 20, tier=True, can_truncate=True, **kw):
    dev = FakeDevice(n_slots)
    t = SlotTable(n_slots, max_sessions, can_truncate=can_truncate, host=HostBudget(host_bytes),
                  spill=dev.spill if tier else None, fill=dev.fill if tier else None,
                  spill_bytes=lambda n: n * TOKEN_BYTES, **kw)
    return t, dev


def turn(t: SlotTable, dev: FakeDevice, sid, prompt, gen=(900, 901)):
    """One request: acquire, check the served prefix, "compute" the rest, release. Returns
    (cached, history)."""
    got = t.acquire(sid, list(prompt))
    assert got is not None, "no slot"
    slot, cached = got
    assert list(dev.kv[slot.index, :cached]) == list(prompt[:cached]), "served a wrong prefix"
    history = list(prompt) + list(gen)
    dev.kv[slot.index, cached:len(history)] = history[cached:]
    t.release_slot(slot, history)
    return cached, history


TEMPLATE = [1, 2, 3, 4, 5, 6]  # a shared chat-template prefix


def test_two_conversations_under_one_id_each_resume_from_their_own_cache():
    t, dev = table()
    c_a, hist_a = turn(t, dev, "oc", TEMPLATE + [10, 11, 12])
    c_b, hist_b = turn(t, dev, "oc", TEMPLATE + [20, 21])  # the title request
    assert c_b == len(TEMPLATE)  # copy-on-diverge: seeded with the shared prefix, A untouched
    c_a2, _ = turn(t, dev, "oc", hist_a + [13, 14])
    c_b2, _ = turn(t, dev, "oc", hist_b + [22])
    assert c_a2 == len(hist_a) and c_b2 == len(hist_b)
    assert not t.take_conflict("oc")
    assert len(t.sessions) == 1 and t.tiers()["on_device"] == 1


def test_two_conversations_in_one_slot_take_turns_through_the_host_tier():
    t, dev = table(n_slots=1, max_sessions=1)
    _, hist_a = turn(t, dev, "oc", TEMPLATE + [10, 11, 12])
    c_b, hist_b = turn(t, dev, "oc", TEMPLATE + [20, 21])
    assert c_b == len(TEMPLATE)  # A was parked; B reuses the shared prefix in place
    for _ in range(2):
        c_a, hist_a = turn(t, dev, "oc", hist_a + [13])
        c_b, hist_b = turn(t, dev, "oc", hist_b + [23])
        assert c_a == len(hist_a) - 3 and c_b == len(hist_b) - 3  # everything but the new token + 2 generated
    assert not t.take_conflict("oc")
    assert t.spills >= 4 and t.fills >= 4


def test_without_a_host_tier_a_second_conversation_in_one_slot_is_a_conflict():
    t, dev = table(n_slots=1, max_sessions=1, tier=False)
    _, hist_a = turn(t, dev, "oc", TEMPLATE + [10, 11, 12])
    assert not t.take_conflict("oc")
    turn(t, dev, "oc", TEMPLATE + [20, 21])
    assert t.take_conflict("oc") and not t.take_conflict("oc")  # reported once
    c_a, _ = turn(t, dev, "oc", hist_a + [13])
    assert c_a == len(TEMPLATE)


def test_a_retried_prompt_starts_a_new_conversation_seeded_from_the_old_one():
    t, dev = table()
    prompt = TEMPLATE + [10, 11, 12]
    _, hist = turn(t, dev, "s", prompt)
    cached, _ = turn(t, dev, "s", prompt)  # the same first turn again (a retry / regenerate)
    assert cached == len(prompt) - 1
    c_again, _ = turn(t, dev, "s", hist + [5])  # the first answer's conversation is still whole
    assert c_again == len(hist)


def test_a_fifth_id_with_four_idle_is_served_and_the_moved_session_resumes_in_full():
    t, dev = table(n_slots=4, max_sessions=4)
    hist = {}
    for i in range(4):
        _, hist[i] = turn(t, dev, f"s{i}", TEMPLATE + [30 + i] * 5)
    cached, _ = turn(t, dev, "s4", TEMPLATE + [40] * 5)  # s0 (least recently used) moves to the host
    assert cached == len(TEMPLATE)  # reuses the template prefix left in s0's slot
    tiers = t.tiers()
    assert tiers["on_device"] == 4 and tiers["on_host"] == 1 and tiers["host_bytes"] == len(hist[0]) * TOKEN_BYTES
    assert isinstance(t.latest("s0"), Parked)  # still exportable
    cached, _ = turn(t, dev, "s0", hist[0] + [7])
    assert cached == len(hist[0])
    assert t.tiers()["on_host"] == 1 and isinstance(t.latest("s1"), Parked)  # s1 made way in turn


def test_a_new_id_is_refused_only_while_every_session_on_the_device_is_busy_or_watched():
    t, dev = table(n_slots=2, max_sessions=2)
    turn(t, dev, "a", [1, 2, 3])
    busy, _ = t.acquire("b", [4, 5, 6])
    assert t.watch("a")
    with pytest.raises(CapacityError):
        t.acquire("c", [7, 8, 9])
    assert "c" not in t.sessions
    t.unwatch("a")
    got = t.acquire("c", [7, 8, 9])  # "a" is idle and unwatched again: it moves to the host
    assert got is not None and isinstance(t.latest("a"), Parked)
    t.release_slot(busy, [4, 5, 6, 0])


def test_a_session_on_the_host_waits_for_a_busy_one_rather_than_429():
    t, dev = table(n_slots=1, max_sessions=1)
    _, hist_a = turn(t, dev, "a", [1, 2, 3])
    slot, _ = t.acquire("b", [4, 5, 6])  # "a" parked; "b" busy
    assert t.acquire("a", hist_a + [1]) is None  # a live id waits, it is not refused
    with pytest.raises(CapacityError):
        t.acquire("c", [9, 9])  # a new id is
    t.release_slot(slot, [4, 5, 6, 7])
    cached, _ = turn(t, dev, "a", hist_a + [1])
    assert cached == len(hist_a)


def test_an_anonymous_request_never_destroys_a_session_kv():
    t, dev = table(n_slots=2, max_sessions=2)
    _, h1 = turn(t, dev, "s1", TEMPLATE + [10])
    _, h2 = turn(t, dev, "s2", TEMPLATE + [20])
    turn(t, dev, None, TEMPLATE + [30])  # s1 moves to the host first
    assert isinstance(t.latest("s1"), Parked) and t.latest("s2") is not None
    assert turn(t, dev, "s1", h1 + [11])[0] == len(h1)
    assert turn(t, dev, "s2", h2 + [21])[0] == len(h2)


def test_an_anonymous_request_waits_when_no_session_can_move():
    t, dev = table(n_slots=2, max_sessions=2)
    turn(t, dev, "s1", [1, 2])
    busy, _ = t.acquire("s2", [3, 4])
    t.watch("s1")
    assert t.acquire(None, [5, 6]) is None  # s1 watched, s2 busy
    t, dev = table(n_slots=1, max_sessions=1, tier=False)
    _, h = turn(t, dev, "s1", [1, 2])
    assert t.acquire(None, [5, 6]) is None  # no host tier: it cannot move, so it is not taken
    assert turn(t, dev, "s1", h + [3])[0] == len(h)


def test_the_host_tier_bound_drops_the_least_recently_used_parked_conversation():
    # one slot; a parked 5-token conversation costs 40 bytes: room for two of them
    t, dev = table(n_slots=1, max_sessions=1, host_bytes=110)
    hist = {}
    for sid in ("a", "b", "c", "d"):
        _, hist[sid] = turn(t, dev, sid, [ord(sid)] * 3)
    tiers = t.tiers()
    assert tiers["host_dropped"] == 1 and tiers["host_bytes"] == 80 and tiers["on_host"] == 2
    assert t.latest("a") is None and "a" in t.sessions  # dropped: still a live id, nothing cached
    assert isinstance(t.latest("b"), Parked) and isinstance(t.latest("c"), Parked)
    assert turn(t, dev, "a", hist["a"] + [1])[0] == 0  # re-prefills
    assert turn(t, dev, "c", hist["c"] + [1])[0] == len(hist["c"])  # "b" was older: "c" survived both drops


def test_a_conversation_bigger_than_the_host_tier_stays_on_the_device():
    t, dev = table(n_slots=1, max_sessions=1, host_bytes=16)
    _, h = turn(t, dev, "big", list(range(10)))
    with pytest.raises(CapacityError):
        t.acquire("other", [1, 2])
    assert dev.spills == 0  # refused from the size estimate, before copying anything
    assert turn(t, dev, "big", h + [1])[0] == len(h)


def test_recurrent_state_moves_whole_and_resumes_only_a_continued_history():
    t, dev = table(n_slots=1, max_sessions=1, can_truncate=False)
    _, h_a = turn(t, dev, "a", [1, 2, 3, 4])
    assert turn(t, dev, "b", [1, 2, 9])[0] == 0  # no partial reuse of a recurrent state
    assert turn(t, dev, "a", h_a + [5])[0] == len(h_a)
    assert turn(t, dev, "a", [1, 2, 3, 8])[0] == 0  # diverges: a new conversation from scratch


def test_release_and_reap_free_the_host_bytes():
    t, dev = table(n_slots=1, max_sessions=1, idle_ttl_s=0.0)
    turn(t, dev, "a", [1, 2, 3])
    turn(t, dev, "b", [4, 5, 6])
    assert t.host_bytes > 0 and t.host.used == t.host_bytes
    t.release("a")
    assert t.host_bytes == 0 == t.host.used
    assert t.reap() == ["b"] and not t.sessions


def test_restore_replaces_the_conversation_its_tokens_continue_and_falls_back_to_the_host():
    t, dev = table(n_slots=1, max_sessions=1)
    _, h = turn(t, dev, "s", [1, 2, 3])
    assert t.restore("s", h + [7, 8], {"k.0": np.array(h + [7, 8])}) == "device"
    assert [s.tokens for s in t.slots] == [h + [7, 8]] and not t.sessions["s"].host
    busy, _ = t.acquire("s", h + [7, 8, 9])
    assert t.restore("r", [4, 4, 4], {"k.0": np.array([4, 4, 4])}) == "host"  # no slot: parked
    t.release_slot(busy, h + [7, 8, 9, 0])
    assert turn(t, dev, "r", [4, 4, 4, 5])[0] == 3
    t2, _ = table(n_slots=1, max_sessions=1, host_bytes=0)
    t2.acquire("busy", [1, 2])
    with pytest.raises(CapacityError):
        t2.restore("r", [4, 4], {"k.0": np.array([4, 4])})


def test_invalidate_forgets_a_slots_contents():
    t, dev = table(n_slots=1, max_sessions=1)
    _, h = turn(t, dev, "s", [1, 2, 3])
    t.invalidate(t.slots[0])
    assert turn(t, dev, "s", h + [4])[0] == 0


# ---- restored KV is private to the id that restored it ----------------------------------------------
def restored(t: SlotTable, sid: str, tokens: list[int]) -> str:
    return t.restore(sid, tokens, {"k.0": np.array(tokens, np.int64)})


def test_a_released_restored_conversation_seeds_no_anonymous_request_or_other_id():
    t, dev = table(n_slots=2, max_sessions=2)
    forged = [1, 2, 3, 4, 5, 6]
    assert restored(t, "forger", forged) == "device"
    assert turn(t, dev, None, forged + [7])[0] == 0  # anonymous, while the forger's session lives
    t, dev = table(n_slots=2, max_sessions=2)
    restored(t, "forger", forged)
    assert turn(t, dev, "victim", forged + [7])[0] == 0  # another id
    t.release("forger")
    assert all(s.tokens != forged for s in t.slots)  # forgotten, not left as a reusable prefix
    assert turn(t, dev, None, forged + [7])[0] == 0


def test_the_restoring_id_resumes_its_restored_conversation_and_what_grew_from_it_stays_private():
    t, dev = table(n_slots=2, max_sessions=2)
    restored(t, "r", [1, 2, 3, 4])
    cached, history = turn(t, dev, "r", [1, 2, 3, 4, 5])
    assert cached == 4
    cached, history2 = turn(t, dev, "r", history + [6])  # grown from restored KV: still private
    assert cached == len(history)
    t.release("r")
    assert turn(t, dev, None, history2 + [8])[0] == 0


def test_a_restored_conversation_moved_to_the_host_leaves_no_prefix_behind_and_comes_back_private():
    t, dev = table(n_slots=1, max_sessions=1)
    restored(t, "r", [1, 2, 3, 4])
    turn(t, dev, "other", [9, 9, 9])  # one slot: "r" moves to the host tier
    assert t.sessions["r"].host and t.sessions["r"].host[0].private
    cached, _ = turn(t, dev, "r", [1, 2, 3, 4, 5])  # back from the host, for its own id
    assert cached == 4 and t.slots[0].private
    t.release("r")
    assert turn(t, dev, None, [1, 2, 3, 4, 5, 6])[0] == 0


def test_a_restore_parked_on_the_host_is_private_and_a_fresh_prefill_clears_the_mark():
    t, dev = table(n_slots=1, max_sessions=2)
    t.acquire("busy", [5, 5])
    assert restored(t, "r", [1, 2, 3]) == "host"
    assert t.sessions["r"].host[0].private
    t.release("busy")
    t.slots[0].busy = False
    cached, _ = turn(t, dev, None, [7, 7, 7])  # overwritten from position 0: an ordinary prefix now
    assert cached == 0 and not t.slots[0].private


# ---- through a real engine: the runner's export_slot / import_slot as spill / fill ------------------
@pytest.fixture(scope="module", params=["dense", "hybrid", "sliding rings", "dense q8_0 KV"])
def one_slot_engine(request, tmp_path_factory):
    from pantheon.config import ModelConfig
    from pantheon.engine.engine import Engine
    from tests.fixtures.tiny_models import write_tiny_llama

    ctx = 2048 if request.param == "sliding rings" else 128
    if request.param == "hybrid":
        path = request.getfixturevalue("qwen35moe_f32_gguf")
    else:  # "sliding rings": gemma3 with a window of 8, its sliding layers' KV in rings (model/state.py)
        sliding = dict(arch="gemma3", qk_norm=True, extra_metadata={
            "gemma3.attention.sliding_window": 8, "gemma3.context_length": ctx}) if request.param != "dense" else {}
        if request.param == "dense q8_0 KV":  # ggml's 8-bit blocks, heads of 32 values
            sliding = dict(n_embd=128)
        path = write_tiny_llama(tmp_path_factory.mktemp("tier") / "tiny.gguf", seed=5, **sliding)
    config = ModelConfig(str(path), ctx_cap=ctx, max_sessions=1, max_concurrent=1,
                         kv_dtype="q8_0" if request.param == "dense q8_0 KV" else "auto")
    engine = Engine(config, host_budget=HostBudget(1 << 30))
    rings = engine.runner.positional() != {f"{n}.{i}" for n in "kv" for i in range(len(engine.runner.cache.k))}
    assert rings == (request.param == "sliding rings")  # a ring exports its whole row
    return engine


def test_a_session_moved_to_the_host_exports_the_same_bytes_and_resumes_token_identically(one_slot_engine):
    from tests.engine.test_hybrid_engine import generate

    engine = one_slot_engine
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    first, _ = generate(engine, prompt, 6, session="a")
    on_device = engine.export_session("a")
    generate(engine, [20, 21, 22], 4, session="b")  # one slot: "a" moves to the host tier
    assert engine.table.tiers()["on_host"] == 1 and engine.table.spills == 1
    on_host = engine.export_session("a")
    assert on_host["blob"] == on_device["blob"] and on_host["tokens"] == on_device["tokens"]
    turn2 = on_device["tokens"] + [first[-1], 30, 31]
    warm, end = generate(engine, turn2, 6, session="a")  # back on the device, "b" to the host
    assert end.cached_tokens == on_device["n_tok"] and engine.table.fills == 1
    cold, _ = generate(engine, turn2, 6)
    assert warm == cold
    for sid in ("a", "b"):
        engine.table.release(sid)


def test_a_q8_0_blob_with_a_non_finite_scale_is_refused(tmp_path):
    """A q8_0 cache's blocks carry fp16 scales: a NaN or infinite one, even sealed with the server's
    key, is refused like a non-finite float cache value (tests/web/test_session_security.py), as it
    would poison every later token."""
    from pantheon.config import ModelConfig
    from pantheon.engine import blob as session_blob
    from pantheon.engine.engine import Engine, SessionError
    from tests.engine.test_hybrid_engine import generate
    from tests.fixtures.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny.gguf", n_embd=128)  # heads of 32: q8_0's blocks
    engine = Engine(ModelConfig(str(path), ctx_cap=128, max_sessions=2, kv_dtype="q8_0"))
    generate(engine, [5, 6, 7, 8], 3, session="scale")
    exported = engine.export_session("scale")
    header, arrays = session_blob.unpack(exported["blob"], engine.blob_key)
    header = {k: v for k, v in header.items() if k != "arrays"}
    for bits in (0x7E00, 0x7C00):  # fp16 NaN, +inf
        poisoned = {k: a.copy() for k, a in arrays.items()}
        first = next(k for k, a in poisoned.items() if a.dtype == np.uint8)
        poisoned[first].reshape(-1, 34)[0, :2] = np.array([bits], np.uint16).view(np.uint8)
        with pytest.raises(SessionError, match="non-finite"):
            engine.restore_session("scale2", session_blob.pack(header, poisoned, engine.blob_key), exported["tokens"])
    assert engine.restore_session("scale2", exported["blob"], exported["tokens"])["restored"]
    engine.stop()


def test_parking_a_session_takes_the_host_budget_from_marks_first():
    """Marks (SlotTable.mark) draw on the host tier's budget, but a parked conversation is worth
    more: when one needs the room, the least recently used slot's marks go first."""
    t, dev = table(n_slots=1, max_sessions=1, host_bytes=85 * TOKEN_BYTES)
    _, hist = turn(t, dev, "a", TEMPLATE + [10, 11])
    t.mark(t.slots[0], hist[:4], {"rows": np.zeros(80 * TOKEN_BYTES, np.uint8)})
    assert t.host.used == 80 * TOKEN_BYTES
    turn(t, dev, "b", TEMPLATE + [30])  # a new id at the bound parks "a": 10 tokens' bytes, past what is left
    assert t.tiers()["on_host"] == 1 and t.host.used == 10 * TOKEN_BYTES and t.dropped == 0
